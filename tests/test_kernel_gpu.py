"""The Hopper kernels against the float64 reference over a grid of configurations: value
fp32/fp16/bf16 x locations fp32/fp16, L 1..5, P 1/2/4/8/16, many head dims (whole 16-byte rows or not,
powers of two or not, up to 1025), M 1 and 8, odd level sizes with H or W = 1, locations outside, on
borders and on pixel centres, every variant of the tiled kernel, the generic kernel, and the fused
kernels (reference points, offsets and logits). Outputs are poisoned before every run. Skipped without a
Hopper GPU (tests/conftest.py)."""
import dataclasses
import itertools

import pytest
import torch

from cute_deform import ms_deform_attn_reference
from cute_deform.hopper import compile_cache, interface, launch_rules
from msda_testing import (finite_rel_err, fused_inputs, fused_reference, make_inputs, nonfinite_mismatch,
                          output_on_nan, raster_cells, rel_err, sprinkle_special_locations)

pytestmark = pytest.mark.gpu

# fp32 arithmetic for fp32 value; packed half arithmetic for the four-corner sums of fp16/bf16 value.
BOUND = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# The first level is larger than any staging buffer, so it always takes the unstaged path; the
# others are small, odd, and include H = 1 and W = 1.
LEVELS = [(40, 57), (13, 17), (7, 1), (1, 9), (5, 6)]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Variants of the tiled kernel: the default, per-sample TMA boxes, no multicast, no staging; and the
# generic kernel on shapes the tiled one takes.
VARIANTS = {
    "default": {},
    "boxes": dict(fine_gather="tma", num_groups=3, num_stages=4),
    "nocluster": dict(cluster_size=1),
    "nostage": dict(stage_bytes=0, cluster_size=1),
    "generic": dict(generic=True),
    "reorder": dict(reorder_queries=True),
    # The encoders' launch: single CTAs of seven groups fed by one producer warp (small problems of the grid
    # otherwise run CTA pairs, with one producer warp too: whole segments).
    "single7": dict(cluster_size=1, num_groups=7, producers=1),
    # 8-byte vectors a thread: twice the threads a query, half the queries a tile (the launch rule for CTA
    # pairs over whole segments of 64-byte head rows; here forced on every case's shape).
    "vectors8": dict(vector_bytes=8),
}
# Staged corners' byte addresses selected against the zero pixel's, on the encoders' single-CTA launch (its launch
# rule; here forced on the grid's small, odd levels, H = 1 and W = 1 among them).
VARIANTS["staged_addresses"] = dict(VARIANTS["single7"], staged_addresses=True)
HEAD_DIMS = (1, 2, 3, 8, 24, 30, 48, 71, 96, 256, 1025)
BATCH, QUERIES, FUSED_QUERIES = 2, 77, 53  # every grid case's problem size (with its levels)


def cases():
    out = []
    # Every value dtype x location dtype x head dim of the old grid, with both fine-level gathers.
    for (vname, lname, D), variant in itertools.product(
            itertools.product(("fp32", "fp16", "bf16"), ("fp32", "fp16"), (16, 32, 64)), ("default", "boxes")):
        out.append(dict(value=vname, loc=lname, D=D, L=4, P=4, M=8, variant=variant))
    # Any head dim in any value dtype (the generic kernel where rows are not whole 16-byte vectors).
    for vname, D in itertools.product(("fp32", "fp16", "bf16"), HEAD_DIMS):
        out.append(dict(value=vname, loc="fp32", D=D, L=3, P=2, M=2 if D > 200 else 4, variant="default"))
    # Level and point counts (6 levels and 20 points: the generic kernel).
    for L, P in ((1, 1), (2, 2), (3, 3), (1, 16), (5, 16), (5, 1), (6, 4), (4, 20)):
        out.append(dict(value="fp16", loc="fp32", D=32, L=L, P=P, M=1, variant="default"))
    # The remaining variants.
    for variant in ("nocluster", "nostage", "generic", "reorder"):
        for vname in ("fp32", "fp16", "bf16"):
            out.append(dict(value=vname, loc="fp16", D=32, L=5, P=8, M=8, variant=variant))
    # The order table with 64, 16 and 4 queries a tile (two, one and a partial warp of table reads), and
    # with rows the consumers read themselves (L*P = 9).
    for vname, D in (("fp16", 16), ("fp16", 64), ("fp32", 128)):
        out.append(dict(value=vname, loc="fp32", D=D, L=4, P=4, M=8, variant="reorder"))
    out.append(dict(value="fp16", loc="fp32", D=32, L=3, P=3, M=8, variant="reorder"))
    # Seven groups and one producer warp, with the input rings (P=4) and without (P=8: they do not fit).
    for vname, P in (("fp32", 4), ("fp16", 4), ("bf16", 4), ("fp16", 8)):
        out.append(dict(value=vname, loc="fp32", D=32, L=4, P=P, M=8, variant="single7"))
    # 8-byte vectors (8, 16 or 4 threads a query), packed and fp32.
    for vname, D in (("fp16", 32), ("bf16", 32), ("fp16", 64), ("fp32", 32), ("bf16", 16)):
        out.append(dict(value=vname, loc="fp32", D=D, L=4, P=4, M=8, variant="vectors8"))
    for vname, D, P in (("fp16", 32, 4), ("bf16", 32, 4), ("fp32", 32, 4), ("fp16", 64, 2), ("fp16", 16, 8)):
        out.append(dict(value=vname, loc="fp32", D=D, L=4, P=P, M=8, variant="staged_addresses"))
    # Half-precision inputs whose head's row of weights is not a multiple of 16 bytes (12, 4 and 9 points): a box
    # over the heads' rows of the tile's queries loads them (kernel.input_atom); with one head, the consumers read
    # them themselves.
    for vname, lname, L, P, M, variant in (("fp16", "fp16", 3, 4, 8, "default"), ("fp16", "fp16", 3, 4, 8, "single7"),
                                            ("fp16", "fp16", 3, 4, 8, "vectors8"), ("fp16", "fp16", 3, 4, 8, "reorder"),
                                            ("bf16", "bf16", 1, 4, 8, "default"), ("bf16", "bf16", 1, 4, 8, "single7"),
                                            ("fp32", "fp16", 3, 4, 8, "default"), ("fp16", "fp16", 3, 3, 8, "default"),
                                            ("fp16", "fp16", 3, 4, 1, "default")):
        out.append(dict(value=vname, loc=lname, D=32, L=L, P=P, M=M, variant=variant))
    return out


CASES = cases()


def case_id(c):
    return f"{c['variant']}-v{c['value']}-l{c['loc']}-D{c['D']}-L{c['L']}-P{c['P']}-M{c['M']}"


def fake_inputs(c):
    """Inputs of the case's dtypes and static sizes: what picks the compiled configuration."""
    value, _, _, loc, attn = make_inputs(torch.Generator().manual_seed(0), levels_of(c), batch=1, queries=1,
                                         heads=c["M"], head_dim=c["D"], points=c["P"], dtype=DTYPES[c["value"]],
                                         loc_dtype=DTYPES[c["loc"]], attn_dtype=DTYPES[c["loc"]])
    return value, loc, attn


def pixels(levels):
    return sum(h * w for h, w in levels)


def levels_of(c):
    if c["L"] <= len(LEVELS):
        return LEVELS[:c["L"]]
    return LEVELS + [(3, 4)] * (c["L"] - len(LEVELS))


def launched_config(value, loc, attn, ref, tuning, N, Lq, S):
    """The configuration the launches of a case (N images, Lq queries, S pixels) run: the launch's own choice."""
    cfg = interface.config_for(value, loc, attn, ref, **launch_rules.static_tuning(tuning))
    return launch_rules.launched_config(cfg, N, Lq, S, tuning)


def case_config(c):
    """The configuration a case's launches run."""
    return launched_config(*fake_inputs(c), None, VARIANTS[c["variant"]], BATCH, QUERIES, pixels(levels_of(c)))


def fused_case_config(c):
    dt = DTYPES[c["value"]]
    value = torch.empty(1, 1, 8, c["D"], dtype=dt)
    offsets = torch.empty(1, 1, 8, c["L"], c["P"], 2, dtype=dt)
    logits = torch.empty(1, 1, 8, c["L"], c["P"], dtype=dt)
    ref = torch.empty(1, 1, c["L"], c["ref_dims"])
    return launched_config(value, offsets, logits, ref, VARIANTS[c["variant"]], BATCH, FUSED_QUERIES,
                           pixels(LEVELS[:c["L"]]))


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels(request):
    """Compile the configurations of the selected cases up front, in parallel processes, into the disk
    cache."""
    selected = {item.callspec.id for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    configs = ([case_config(c) for c in CASES if case_id(c) in selected]
               + [fused_case_config(c) for c in FUSED if fused_case_id(c) in selected])
    compile_cache.precompile(configs, variants=False)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_matches_float64_reference(gen, case):
    levels = levels_of(case)
    vdt, ldt = DTYPES[case["value"]], DTYPES[case["loc"]]
    value, shapes, starts, loc, attn = make_inputs(gen, levels, batch=BATCH, queries=QUERIES, heads=case["M"],
                                                   head_dim=case["D"], points=case["P"], dtype=torch.float64)
    loc = sprinkle_special_locations(gen, loc, levels, fraction=0.3)
    value, loc, attn = value.to(vdt).cuda(), loc.to(ldt).cuda(), attn.to(ldt).cuda()
    shapes, starts = shapes.cuda(), starts.cuda()
    ref = ms_deform_attn_reference(value, shapes, starts, loc, attn, out_dtype=torch.float64)
    for _ in range(2):  # two runs on fresh poison: a race shows as a difference
        out = output_on_nan(lambda: interface.msda_forward(value, shapes, starts, loc, attn,
                                                           **VARIANTS[case["variant"]]))
        assert out.dtype == vdt and out.shape == ref.shape
        assert torch.isfinite(out).all(), "output elements left unwritten"
        assert rel_err(out, ref) <= BOUND[vdt]


FUSED = ([dict(value=v, ref_dims=r, D=32, L=4, P=4, variant=var)
          for v, r, var in itertools.product(("fp32", "fp16", "bf16"), (2, 4),
                                            ("default", "generic", "reorder", "single7"))]
         + [dict(value="fp16", ref_dims=r, D=D, L=L, P=P, variant="default")
            for r, (D, L, P) in itertools.product((2, 4), ((48, 3, 3), (30, 2, 5)))]
         # the order table at 8 points a level: the fused launch's half sums (KernelConfig.half_sums)
         + [dict(value=v, ref_dims=2, D=32, L=4, P=8, variant="reorder") for v in ("fp16", "bf16")]
         # the staged corners' addresses selected (the fused encoders' launch rule)
         + [dict(value=v, ref_dims=r, D=32, L=4, P=4, variant="staged_addresses")
            for v, r in (("fp16", 2), ("bf16", 4), ("fp32", 2))]
         + [dict(value="fp16", ref_dims=2, D=32, L=4, P=8, variant="staged_addresses")])


def fused_case_id(c):
    return f"{c['variant']}-v{c['value']}-ref{c['ref_dims']}-D{c['D']}-L{c['L']}-P{c['P']}"


@pytest.mark.parametrize("case", FUSED, ids=fused_case_id)
def test_fused_kernel_matches_float64_reference(gen, case):
    """Locations from reference points and offsets, softmax of the logits, in the kernel."""
    levels = LEVELS[:case["L"]]
    vdt = DTYPES[case["value"]]
    value, shapes, starts, ref_points, offsets, logits = fused_inputs(
        gen, levels, batch=BATCH, queries=FUSED_QUERIES, heads=8, head_dim=case["D"], points=case["P"],
        ref_dims=case["ref_dims"])
    value = value.to(vdt).cuda()
    ref_points, offsets, logits = ref_points.float().cuda(), offsets.to(vdt).cuda(), logits.to(vdt).cuda()
    shapes, starts = shapes.cuda(), starts.cuda()
    expected = fused_reference(value, shapes, starts, ref_points, offsets, logits)
    for _ in range(2):
        out = output_on_nan(lambda: interface.msda_forward_fused(value, shapes, starts, ref_points, offsets, logits,
                                                                 **VARIANTS[case["variant"]]))
        assert torch.isfinite(out).all(), "output elements left unwritten"
        assert rel_err(out, expected) <= BOUND[vdt]


@pytest.mark.parametrize("vname", ["fp16", "bf16"])
def test_half_sums_keep_the_rules_for_nan_and_inf(gen, vname):
    """The order table's launch at 8 points a level folds each attention weight into the corner weights and sums
    samples in half precision (KernelConfig.half_sums): with NaN and inf weights and special locations it is
    non-finite exactly where the same launch adding each sample in fp32 is, NaN wherever a NaN weight reaches a
    sum (a skipped sample adds nothing, even with a NaN weight), and the rest stays within the bound of the float64
    reference. Where only inf weights reach a sum, half arithmetic may give either kind (nonfinite_mismatch).
    (Against the reference itself the pattern can differ where a location sits next to a level's border: the
    reference tests inside in float64, the kernels in fp32, and a NaN weight then makes the difference visible.)"""
    levels = LEVELS[:4]
    vdt = DTYPES[vname]
    value, shapes, starts, loc, attn = make_inputs(gen, levels, batch=BATCH, queries=QUERIES, heads=8, head_dim=32,
                                                   points=8, dtype=torch.float64)
    loc = sprinkle_special_locations(gen, loc, levels, fraction=0.3)
    pick = torch.rand(attn.shape, generator=gen)
    attn = torch.where(pick < 0.01, torch.nan, torch.where(pick > 0.995, torch.inf, attn))
    value, loc, attn = value.to(vdt).cuda(), loc.float().cuda(), attn.float().cuda()
    shapes, starts = shapes.cuda(), starts.cuda()
    tuning = dict(reorder_queries=True)
    cfg = launched_config(value[:1, :1], loc[:1, :1], attn[:1, :1], None, tuning, BATCH, QUERIES, pixels(levels))
    assert cfg.permuted and cfg.half_sums == {"fp16": 8, "bf16": 4}[vname]
    ref = ms_deform_attn_reference(value, shapes, starts, loc, attn, out_dtype=torch.float64)
    per_sample = output_on_nan(lambda: interface.msda_forward(value, shapes, starts, loc, attn, half_sums=0, **tuning))
    out = output_on_nan(lambda: interface.msda_forward(value, shapes, starts, loc, attn, **tuning))
    # Where NaN weights reach a sum, in the kernels' own inside test: the per-sample launch without the inf weights.
    finite_weights = torch.where(torch.isinf(attn), 0.0, attn)
    nan_at = torch.isnan(output_on_nan(lambda: interface.msda_forward(value, shapes, starts, loc, finite_weights,
                                                                      half_sums=0, **tuning)))
    assert torch.isnan(per_sample).any() and torch.isinf(per_sample).any() and torch.isfinite(per_sample).any()
    assert nan_at.any() and not nan_at.all()
    assert nonfinite_mismatch(out, per_sample, same_kinds=False, nan_at=nan_at) is None
    finite = torch.isfinite(per_sample)
    assert finite_rel_err(out[finite], ref[finite]) <= BOUND[vdt]


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_kernel_on_a_large_batch_matches_reference(gen, order):
    """Realistic sizes with several rounds of the schedule: many segments per cluster, partial tiles,
    queries in either order."""
    levels = [(100, 152), (50, 76), (25, 38), (13, 19)]
    value, shapes, starts, loc, attn = make_inputs(gen, levels, batch=6, queries=3001, heads=8, head_dim=32,
                                                   points=8, dtype=torch.float32)
    if order == "shuffled":
        loc = loc[:, torch.randperm(loc.shape[1], generator=gen)]
    value, loc, attn = value.half().cuda(), loc.cuda(), attn.cuda()
    shapes, starts = shapes.cuda(), starts.cuda()
    ref = ms_deform_attn_reference(value[:2], shapes, starts, loc[:2], attn[:2], out_dtype=torch.float64)
    # one round (single CTAs); many rounds; the default; the default through the order table
    for tuning in (dict(window_fraction=0.0), dict(window_fraction=0.01), {}, dict(reorder_queries=True)):
        out = output_on_nan(lambda: interface.msda_forward(value, shapes, starts, loc, attn, **tuning))
        assert rel_err(out[:2], ref) <= BOUND[torch.float16]
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_order_table_on_the_device_is_a_raster_permutation(gen, dtype):
    """order.py's table: each image's queries once each, in raster order of the same cells the host's sort
    uses, NaN positions last and positions outside [0, 1] at the edge; a fused call's reference points
    decide; the table poisoned before each run; no host sync."""
    N, Lq, M, L, P = 3, 5000, 8, 4, 2
    loc = torch.rand(N, Lq, M, L, P, 2, generator=gen).to(dtype)
    loc[1, 17, 0, 0, 0] = float("nan")
    loc[2, 40, 0, 0, 0] = torch.tensor([-3.0, 7.0])
    loc = loc.cuda()
    ref = torch.rand(N, Lq, L, 2, generator=gen).to(dtype).cuda()
    shapes = torch.tensor(DETR_LEVELS)
    loc_cells = raster_cells(loc[:, :, 0, 0, 0], shapes).cpu()
    for positions, cells in ((None, loc_cells), (ref, raster_cells(ref[:, :, 0], shapes).cpu())):
        order = output_on_nan(lambda: interface.query_order(loc, positions, shapes.cuda()))
        host = interface.query_order(loc.cpu(), None if positions is None else positions.cpu(), shapes)
        assert order.dtype == torch.int64 and order.shape == (N, Lq)
        assert torch.equal(order.sort(1).values.cpu(), torch.arange(Lq).expand(N, Lq)), "a permutation of each image"
        assert torch.equal(cells.gather(1, order.cpu()), cells.gather(1, host)), "the host sort's cells, in order"
        assert (cells.gather(1, order.cpu()).diff() >= 0).all()
    # A NaN position sorts into the last cell (with any query at (1, 1), which bf16 rounding can make).
    order = interface.query_order(loc, None, shapes.cuda())[1].cpu()
    place = int((order == 17).nonzero())
    last_cell = 16 * 66 - 1  # DETR's levels: 16 bands of 66 columns
    assert (loc_cells[1, order[place:]] == last_cell).all(), "a NaN position sorts last"
    device_shapes = shapes.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the table is built with no host sync
    try:
        interface.query_order(loc, None, device_shapes)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_order_table_in_a_cuda_graph(gen):
    """A launch through the table, captured in a CUDA graph, builds the table from the inputs of each replay:
    replays with fresh inputs copied in equal eager runs bitwise."""
    levels = LEVELS[:4]

    def fresh():
        value, shapes, starts, loc, attn = make_inputs(gen, levels, batch=2, queries=500, heads=8, head_dim=32,
                                                       points=4, dtype=torch.float32)
        loc = loc[:, torch.randperm(loc.shape[1], generator=gen)]
        return [value.half().cuda(), shapes.cuda(), starts.cuda(), loc.contiguous().cuda(), attn.cuda()]

    static = fresh()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            interface.msda_forward(*static, reorder_queries=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = interface.msda_forward(*static, reorder_queries=True)
    for _ in range(2):
        inputs = fresh()
        for buf, new in zip(static, inputs):
            buf.copy_(new)
        static_out.fill_(float("nan"))
        graph.replay()
        eager = interface.msda_forward(*inputs, reorder_queries=True)
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)
        expected = ms_deform_attn_reference(*inputs, out_dtype=torch.float64)
        assert rel_err(static_out, expected) <= BOUND[torch.float16]


def test_order_table_of_a_large_image_falls_back_to_the_sort(gen):
    """Images of more queries than one CTA takes are sorted on the device by torch (the same cells)."""
    Lq = interface.ORDER_MAX_QUERIES + 5
    loc = torch.rand(1, Lq, 1, 1, 1, 2, generator=gen).cuda()
    order = interface.query_order(loc, None, torch.tensor(DETR_LEVELS).cuda())
    assert torch.equal(order.sort(1).values, torch.arange(Lq, device="cuda").view(1, Lq))
    y = loc[0, :, 0, 0, 0, 1][order[0]]
    assert (torch.floor(y * 16).clamp(max=15).diff() >= 0).all()  # DETR's 16 bands, in order


DETR_LEVELS = [(100, 167), (50, 84), (25, 42), (13, 21)]


def decoder_inputs(gen, levels, batch, queries, value_dtype=torch.float16):
    """A DETR decoder's inputs on the GPU (8 heads, D = 32, 4 points, locations uniform on [0, 1]): fp16 value (or
    value_dtype), fp32 locations and weights."""
    value, shapes, starts, loc, attn = make_inputs(gen, levels, batch=batch, queries=queries, heads=8, head_dim=32,
                                                   points=4, dtype=torch.float32, low=0.0, high=1.0)
    return value.to(value_dtype).cuda(), shapes.cuda(), starts.cuda(), loc.cuda(), attn.cuda()


def within_reference(inputs, tunings):
    """The op's output under each tuning (outputs poisoned first), each finite and within the bound of value's dtype
    of the float64 reference."""
    value, shapes, starts, loc, attn = inputs
    ref = ms_deform_attn_reference(value, shapes, starts, loc, attn, out_dtype=torch.float64)
    outs = []
    for tuning in tunings:
        out = output_on_nan(lambda: interface.msda_forward(value, shapes, starts, loc, attn, **tuning))
        assert torch.isfinite(out).all() and rel_err(out, ref) <= BOUND[value.dtype], tuning
        outs.append(out)
    return outs


def test_decoder_batch_with_several_segments_a_pair(gen):
    """A large batch of DETR decoders (N=32, Lq=300: about four whole segments a CTA pair), which the launch
    runs with 8-byte vectors: every image within the bound of float64, and two runs bitwise equal."""
    value, shapes, starts, loc, attn = decoder_inputs(gen, DETR_LEVELS, batch=32, queries=300)
    cfg = launched_config(value, loc, attn, None, {}, 32, 300, value.shape[1])
    assert cfg.cluster_size == 2 and cfg.vector_bytes == 8
    ref = ms_deform_attn_reference(value, shapes, starts, loc, attn, out_dtype=torch.float64)
    outs = []
    for _ in range(2):
        outs.append(output_on_nan(lambda: interface.msda_forward(value, shapes, starts, loc, attn)))
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], ref) <= BOUND[torch.float16]


def test_encoder_ranges_that_cross_a_segment_take_fewer_tiles(gen):
    """detr-encoder's launch (single CTAs, one round) counts each segment's start as segment_cost tiles, so the
    ranges differ from an even split: every query of every image written (outputs poisoned) and within the
    bound of float64, as with the even split (segment_cost=0). Not bitwise: the launch alternates a tile's
    staged and L1 levels by the tile's turn in its group, so a query's sum order follows the ranges."""
    value, shapes, starts, loc, attn = decoder_inputs(gen, DETR_LEVELS, batch=2, queries=22223)
    S = value.shape[1]
    cfg = launched_config(value, loc, attn, None, {}, 2, 22223, S)
    assert cfg.cluster_size == 1 and cfg.segment_cost > 0
    outs = within_reference((value, shapes, starts, loc, attn), ({}, dict(segment_cost=0)))
    assert rel_err(outs[0], outs[1].double()) <= 1e-3


def hostile_encoder_inputs(gen, value_dtype, levels=DETR_LEVELS):
    """An encoder's inputs on the GPU (detr-encoder's shapes by default) with locations on and past the levels' borders
    (NaN and inf among them) and inf and NaN among value's pixels: (value, shapes, starts, loc, attn), S."""
    S = pixels(levels)
    value, shapes, starts, loc, attn = make_inputs(gen, levels, batch=2, queries=S, heads=8, head_dim=32, points=4,
                                                   dtype=torch.float32)
    loc = sprinkle_special_locations(gen, loc, levels, fraction=0.3)
    pick = torch.rand(value.shape[:2], generator=gen)
    value = torch.where((pick < 2e-4)[..., None, None], torch.inf, torch.where((pick > 1 - 2e-4)[..., None, None],
                                                                               torch.nan, value))
    return (value.to(value_dtype).cuda(), shapes.cuda(), starts.cuda(), loc.cuda(), attn.cuda()), S


def assert_bitwise_the_same_and_within_reference(inputs, tunings, value_dtype):
    """The launches with each tuning (outputs on NaN) give bitwise the same output, NaN and inf among it,
    and the finite rest within the bound of float64."""
    outs = []
    for tuning in tunings:
        outs.append(output_on_nan(lambda: interface.msda_forward(*inputs, **tuning)))
    for out in outs[1:]:
        torch.testing.assert_close(outs[0], out, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(outs[0]).any() and torch.isinf(outs[0]).any()
    ref = ms_deform_attn_reference(*inputs, out_dtype=torch.float64)
    finite = torch.isfinite(outs[0]) & torch.isfinite(ref)
    assert finite.float().mean() > 0.5 and finite_rel_err(outs[0][finite], ref[finite]) <= BOUND[value_dtype]


@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16])
def test_staged_addresses_read_the_same_corners(gen, value_dtype):
    """detr-encoder's launch selects its staged corners' byte addresses (staged_addresses): with locations on and past
    the levels' borders, NaN and inf among them, and inf and NaN among value's pixels, its output is bitwise the
    launch's without it, NaN and inf where that has them, and the finite rest within the bound of float64."""
    inputs, S = hostile_encoder_inputs(gen, value_dtype)
    value, shapes, starts, loc, attn = inputs
    cfg = launched_config(value, loc, attn, None, {}, 2, S, S)
    assert cfg.cluster_size == 1 and cfg.staged_addresses
    assert_bitwise_the_same_and_within_reference(inputs, ({}, dict(staged_addresses=False)), value_dtype)


@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16])
def test_staggered_locations_read_the_same_points(gen, value_dtype):
    """detr-encoder's fp16 and bf16 launches load the location ring with TMA's 128-byte swizzle and read each half
    where it landed (stagger_locations): with locations on and past the levels' borders, NaN and inf among
    them, and inf and NaN among value's pixels, its output is bitwise the launch's without it, and the finite rest
    within the bound of float64."""
    inputs, S = hostile_encoder_inputs(gen, value_dtype)
    value, shapes, starts, loc, attn = inputs
    cfg = launched_config(value, loc, attn, None, {}, 2, S, S)
    assert cfg.staggers_locations
    assert_bitwise_the_same_and_within_reference(inputs, ({}, dict(stagger_locations=False)), value_dtype)


def test_staggered_locations_over_rounds_read_the_same_points(gen):
    """Over several rounds (a caller's window of a quarter of L2: two rounds at detr-encoder's shapes) the fp16 launch
    reads its locations staggered too, and stages the last level single: on hostile inputs its output is bitwise the
    launch's without the stagger, and the finite rest within the bound of float64."""
    inputs, S = hostile_encoder_inputs(gen, torch.float16)
    value, shapes, starts, loc, attn = inputs
    window = dict(window_fraction=0.25)
    cfg = launched_config(value, loc, attn, None, window, 2, S, S)
    assert cfg.staggers_locations and not cfg.doubles_coarsest and not cfg.staged_addresses  # not one round
    assert_bitwise_the_same_and_within_reference(inputs, (window, dict(window, stagger_locations=False)), torch.float16)


@pytest.mark.parametrize("value_dtype,levels", [
    (torch.float16, DETR_LEVELS),
    (torch.bfloat16, DETR_LEVELS),
    (torch.float16, [(128, 168), (64, 84), (32, 42), (16, 21)]),  # the last two fit the buffer single, not doubled
])
def test_doubled_coarsest_level_reads_the_same_points(gen, value_dtype, levels):
    """detr-encoder's fp16 and bf16 launches stage the last level with each pixel row twice and read the copy in each
    query slot's half (doubled_coarsest; forced for levels where the doubled level would leave the next one out, which
    the kernel then stages single). With locations on and past the levels' borders, NaN and inf among them, and inf
    and NaN among value's pixels, the output is bitwise the launch's without it, and the finite rest within the bound
    of float64."""
    inputs, S = hostile_encoder_inputs(gen, value_dtype, levels)
    value, shapes, starts, loc, attn = inputs
    forced = dict(doubled_coarsest=True, stage_bytes=launch_rules.DOUBLED_STAGE_BYTES)
    on = {} if levels == DETR_LEVELS else forced
    cfg = launched_config(value, loc, attn, None, on, 2, S, S)
    assert cfg.doubles_coarsest and cfg.stage_bytes == launch_rules.DOUBLED_STAGE_BYTES
    off = dict(doubled_coarsest=False, stage_bytes=launch_rules.DOUBLED_STAGE_BYTES)
    assert_bitwise_the_same_and_within_reference(inputs, (on, off), value_dtype)


def test_fast_dram_encoder_launch_reads_the_same_points(gen):
    """On DRAM of 4 TB/s or more (an H200) detr-encoder's fp16 launch leaves out the coarser levels' evict-last hint
    (v59). That launch, forced on any Hopper GPU, with locations on and past the levels' borders (NaN and inf among them)
    and inf and NaN among value's pixels: bitwise the output of the launch with the hint, and the finite rest within
    the bound of float64."""
    inputs, S = hostile_encoder_inputs(gen, torch.float16)
    value, shapes, starts, loc, attn = inputs
    fast, hinted = dict(coarse_evict_last=False), dict(coarse_evict_last=True)
    cfg = launched_config(value, loc, attn, None, fast, 2, S, S)
    assert cfg.staggers_locations and cfg.doubles_coarsest and not cfg.coarse_evict_last
    assert launched_config(value, loc, attn, None, hinted, 2, S, S) == dataclasses.replace(cfg, coarse_evict_last=True)
    assert_bitwise_the_same_and_within_reference(inputs, (fast, hinted), torch.float16)


@pytest.mark.parametrize("levels", [[(64, 64), (32, 32), (16, 16)], [(100, 167), (50, 84)]])
def test_encoder_at_few_levels_issues_two_samples_at_once(gen, levels):
    """An encoder of two or three levels (Mask2Former's pixel decoder has three) runs single CTAs that issue two
    samples' loads at once: every image within the bound of float64, outputs poisoned, as with one at a time."""
    S = pixels(levels)
    value, shapes, starts, loc, attn = decoder_inputs(gen, levels, batch=2, queries=S)
    cfg = launched_config(value, loc, attn, None, {}, 2, S, S)
    assert cfg.cluster_size == 1 and cfg.gather_batch == 2
    within_reference((value, shapes, starts, loc, attn), ({}, dict(gather_batch=1)))


@pytest.mark.parametrize("levels,queries,value_dtype,tuning", [
    ([(128, 128), (64, 64), (32, 32)], None, torch.float16, {}),  # Mask2Former at 1024x1024: the launch takes strips
    ([(64, 256), (32, 128), (16, 64)], None, torch.bfloat16, {}),  # wide rows, eight tiles a row
    ([(96, 160), (48, 80), (24, 40)], 96 * 160, torch.float32, dict(strips=True)),  # the finest level's queries only
    ([(100, 167), (50, 84), (25, 42)], None, torch.float16, {}),  # rows not whole tiles: the copy without the map
])
def test_encoder_takes_its_first_level_in_column_strips(gen, levels, queries, value_dtype, tuning):
    """An encoder at up to three levels takes its tiles in column strips where the first level's rows are whole
    tiles (KernelConfig.strips): every query of every image written once (outputs poisoned) and within the bound of
    float64, as without the strips."""
    S = pixels(levels)
    Lq = queries or S
    value, shapes, starts, loc, attn = decoder_inputs(gen, levels, batch=2, queries=Lq, value_dtype=value_dtype)
    cfg = launched_config(value, loc, attn, None, tuning, 2, Lq, S)
    assert cfg.cluster_size == 1 and cfg.strips
    within_reference((value, shapes, starts, loc, attn), (tuning, dict(strips=False)))


def test_one_level_over_rounds_of_a_quarter_of_l2(gen):
    """A one-level BEV-like launch (200x200, N=2, a query a pixel) runs single CTAs over rounds of a quarter of L2:
    every image within the bound of float64, outputs poisoned, as in one round (the caller's window of all L2)."""
    levels = [(200, 200)]
    S = pixels(levels)
    value, shapes, starts, loc, attn = decoder_inputs(gen, levels, batch=2, queries=S)
    cfg = interface.config_for(value, loc, attn)
    assert launch_rules.choose_launch(cfg, 2, S, S, 132, 50 << 20, None, "auto")[2].rounds > 1
    within_reference((value, shapes, starts, loc, attn), ({}, dict(window_fraction=1.0)))


@pytest.mark.parametrize("value_dtype", [torch.float16, torch.float32])
def test_one_level_too_large_to_stage_runs_without_a_staging_buffer(gen, value_dtype):
    """A BEV-like launch (one 200x200 level, N=2, a query a pixel) runs without a staging buffer: every image within
    the bound of float64, outputs poisoned, as with the 96 KB stage the caller may ask for."""
    levels = [(200, 200)]
    S = pixels(levels)
    value, shapes, starts, loc, attn = decoder_inputs(gen, levels, batch=2, queries=S, value_dtype=value_dtype)
    assert launched_config(value, loc, attn, None, {}, 2, S, S).stage_bytes == 0
    within_reference((value, shapes, starts, loc, attn), ({}, dict(stage_bytes=96 * 1024)))


@pytest.mark.parametrize("levels,batch,queries,value_dtype", [
    (DETR_LEVELS, 1, 300, torch.float16), ([(80, 80), (40, 40), (20, 20)], 4, 300, torch.float16),
    ([(32, 32), (16, 16), (8, 8)], 1, None, torch.float16), (DETR_LEVELS, 4, 300, torch.float32)])
def test_short_ranges_take_the_small_decoders_launch(gen, levels, batch, queries, value_dtype):
    """Small decoders (Deformable DETR's 300 queries at N=1, RT-DETR's levels at N=4) and a small encoder run single
    CTAs over short ranges with 8-byte vectors, four groups and the setup split (launch_rules.SHORT_RANGES): every image
    within the bound of float64, outputs poisoned, as with the single-CTA launch's knobs (a caller's window)."""
    S = pixels(levels)
    queries = queries or S
    value, shapes, starts, loc, attn = decoder_inputs(gen, levels, batch=batch, queries=queries, value_dtype=value_dtype)
    cfg = launched_config(value, loc, attn, None, {}, batch, queries, S)
    assert cfg.cluster_size == 1 and cfg.vector_bytes == 8 and cfg.num_groups == 4 and cfg.splits_setup
    other = launched_config(value, loc, attn, None, dict(window_fraction=0.5), batch, queries, S)
    assert other.cluster_size == 1 and other.vector_bytes == 16
    within_reference((value, shapes, starts, loc, attn), ({}, dict(window_fraction=0.5)))


def test_decoder_batch_in_single_ctas_takes_its_first_tiles_l1_first(gen):
    """decoder-b16's launch (single CTAs over one whole segment each) starts every group's first tile on the L1
    levels and names its CTAs an SM to ptxas: every image within the bound of float64, outputs poisoned, as without
    either (the first tile's level order differs, so not bitwise)."""
    value, shapes, starts, loc, attn = decoder_inputs(gen, DETR_LEVELS, batch=16, queries=300)
    cfg = launched_config(value, loc, attn, None, {}, 16, 300, value.shape[1])
    assert cfg.cluster_size == 1 and cfg.l1_first_tile and cfg.alternates and cfg.launch_bound
    within_reference((value, shapes, starts, loc, attn), ({}, dict(l1_first_tile=False), dict(launch_bound=False)))


@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("queries", [300, 900])
def test_decoder_batch_stages_a_level_more_where_the_host_holds_the_level_table(gen, value_dtype, queries):
    """RT-DETR's levels at N=16 (single CTAs over one whole segment each) with the level table on the host, as
    transformers' models pass it: the op's launch stages the 40x40 level beside the 20x20 one in a wider buffer
    (launch_rules.WIDE_STAGE_BYTES). Every image within the bound of float64, outputs poisoned, through the op with
    the table on the host and as the launch with the default buffer (the table on the device)."""
    levels = [(80, 80), (40, 40), (20, 20)]
    value, shapes, starts, loc, attn = decoder_inputs(gen, levels, batch=16, queries=queries, value_dtype=value_dtype)
    cfg = interface.config_for(value, loc, attn)
    S = value.shape[1]
    wide = launch_rules.launched_config(cfg, 16, queries, S, {}, levels=levels)
    assert wide.stage_bytes == launch_rules.WIDE_STAGE_BYTES and wide.cluster_size == 1
    assert launch_rules.staged_levels(levels, wide.stage_pixels) == 2
    assert launch_rules.launched_config(cfg, 16, queries, S, {}).stage_bytes < launch_rules.WIDE_STAGE_BYTES
    ref = ms_deform_attn_reference(value, shapes, starts, loc, attn, out_dtype=torch.float64)
    host_shapes, host_starts = shapes.cpu(), starts.cpu()
    for run in (lambda: torch.ops.cute_deform.forward(value, host_shapes, host_starts, loc, attn),
                lambda: interface.msda_forward(value, shapes, starts, loc, attn)):
        out = output_on_nan(run)
        assert torch.isfinite(out).all() and rel_err(out, ref) <= BOUND[value_dtype]


@pytest.mark.parametrize("levels", [DETR_LEVELS,
                                    # the prefetched level last in value: its last box runs past S
                                    [(100, 167), (25, 42), (13, 21), (50, 84)]])
def test_decoder_with_a_level_prefetched_to_l2(gen, levels):
    """detr-decoder's launch (CTA pairs over one whole segment each) prefetches the mid-size level to L2 at
    each segment, stores its output rows evict-first and deals the tiles to the pair's CTAs in turn: every image
    within the bound of float64; bitwise equal to the launch without the prefetch or the policy, and within the
    bound with the tiles dealt in runs (not bitwise: a tile's group and turn decide its levels' order)."""
    value, shapes, starts, loc, attn = decoder_inputs(gen, levels, batch=8, queries=900)
    cfg = launched_config(value, loc, attn, None, {}, 8, 900, value.shape[1])
    assert cfg.cluster_size == 2 and cfg.prefetch_levels and cfg.output_evict_first and cfg.interleave_ranks
    outs = within_reference((value, shapes, starts, loc, attn),
                            ({}, dict(prefetch_levels=False), dict(output_evict_first=False),
                             dict(interleave_ranks=False)))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("cluster_size", [1, 2])
def test_tma_boxes_are_deterministic_at_decoder_scale(gen, cluster_size):
    """Per-sample TMA boxes on a DETR decoder's shapes (enough tiles a CTA for the rings to turn over many
    times): every run bitwise equal and within the bound. With the boxes issued by all 32 lanes of the
    producer warp at once, this failed every run in CTA pairs (session 15)."""
    value, shapes, starts, loc, attn = decoder_inputs(gen, DETR_LEVELS, batch=8, queries=900)
    ref = ms_deform_attn_reference(value[:1], shapes, starts, loc[:1], attn[:1], out_dtype=torch.float64)
    outs = []
    for _ in range(4):
        outs.append(output_on_nan(lambda: interface.msda_forward(value, shapes, starts, loc, attn, fine_gather="tma",
                                                                 cluster_size=cluster_size)))
    assert all(torch.isfinite(o).all() for o in outs)
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "runs differ: a race"
    assert rel_err(outs[0][:1], ref) <= BOUND[torch.float16]
