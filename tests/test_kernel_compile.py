"""Every CuTe kernel variant compiles for sm_90a on a machine without a GPU, and its PTX holds the
instructions the design depends on. Also the disk cache of compiled kernels and the tile schedule."""
import dataclasses
import random
import re

import pytest
import torch

interface = pytest.importorskip("cute_deform.hopper.interface")
if not interface.available():
    pytest.skip("nvidia-cutlass-dsl is not importable", allow_module_level=True)

from cute_deform.hopper import compile_cache, kernel, launch_rules, tile_scheduler  # noqa: E402
from cute_deform.hopper.config import ITEMSIZE, STAGE_BOX_PIXELS, KernelConfig, round_up  # noqa: E402
from cute_deform.hopper.generic import GenericConfig  # noqa: E402
from cute_deform.hopper.order import OrderConfig, order_grid  # noqa: E402
from msda_testing import raster_cells  # noqa: E402  (it puts scripts/ on sys.path)

import compare  # noqa: E402
import tune  # noqa: E402

TUNING = launch_rules.TUNING


def tiled(value, loc, attn, M, L, P, D, **kw):
    return KernelConfig(value, loc, attn, M, L, P, D, **{**TUNING, **kw})


# (name, config): the code paths of the kernels. fine_gather picks how unstaged levels are read (ldg =
# 16-byte loads through L1, tma = one 2x2xD TMA box per sample), cluster_size=2 adds TMA multicast of
# the staged levels, stage_bytes=0 stages nothing, fused reads reference points, offsets and logits;
# dtypes and head dims change the vector widths and the threads per query (D=48: 6 threads a query,
# 21 queries a tile, 2 idle threads); the generic kernel takes every other shape.
VARIANTS = [
    ("default", tiled("float16", "float32", "float32", 8, 4, 4, 32)),
    ("cluster1-p8", tiled("float16", "float32", "float32", 8, 4, 8, 32, cluster_size=1)),
    ("nostage-bf16-d64", tiled("bfloat16", "bfloat16", "bfloat16", 8, 4, 4, 64, stage_bytes=0, cluster_size=1)),
    ("boxes", tiled("float16", "float32", "float32", 8, 4, 4, 32, fine_gather="tma", num_groups=3, num_stages=4)),
    ("boxes-cluster2-fp32", tiled("float32", "float16", "float32", 4, 3, 2, 32, fine_gather="tma", num_groups=2,
                                  num_stages=4)),
    ("fp32-d64-l1p1", tiled("float32", "float32", "float32", 1, 1, 1, 64)),
    ("d48-idle-threads", tiled("float16", "float32", "float32", 8, 4, 4, 48)),
    ("inputs-from-global", tiled("float16", "float32", "float32", 8, 3, 3, 32)),
    ("fused-xy", tiled("float16", "float32", "float32", 8, 4, 4, 32, fused=True, ref_dims=2)),
    ("fused-boxes-bf16", tiled("bfloat16", "bfloat16", "bfloat16", 8, 4, 4, 32, fused=True, ref_dims=4)),
    # permuted: the tiles' queries through the order table (a bulk copy per row; D=16 in fp16: 64 queries a
    # tile, two warps' worth of table reads).
    ("permuted-d16", tiled("float16", "float32", "float32", 8, 4, 4, 16, permuted=True)),
    ("permuted-fused", tiled("float16", "float16", "float16", 8, 4, 4, 32, fused=True, permuted=True)),
    # ... and where the rows are not whole 16-byte vectors: consumers read them through the table.
    ("permuted-inputs-from-global", tiled("float16", "float32", "float32", 8, 3, 3, 32, permuted=True)),
    # One producer warp feeds every group's ring: single CTAs of seven groups (encoders), and CTA pairs
    # that gather the L1 levels first (decoders).
    ("one-producer-7-groups", tiled("float16", "float32", "float32", 8, 4, 4, 32, cluster_size=1, num_groups=7,
                                    producers=1)),
    ("one-producer-l1-first", tiled("float16", "float32", "float32", 8, 4, 4, 32, l1_first=True, producers=1)),
    ("no-split-setup", tiled("float16", "float32", "float32", 8, 4, 4, 32, split_setup=False)),
    # The encoders' launch: L1 gathers ask L2 for whole 128-byte lines, and keep the levels other than
    # the finest in L2 (evict-last); the output rows are stored evict-first, and the staged corners select their
    # byte addresses.
    ("line-prefetch", tiled("float16", "float32", "float32", 8, 4, 4, 32, cluster_size=1, num_groups=7,
                            producers=1, split_setup=False, line_prefetch=True, coarse_evict_last=True,
                            segment_cost=4, output_evict_first=True, staged_addresses=True)),
    # Several samples' loads issued before any is summed: the decoders' launch (the finest level's lines
    # evicted from L1 first, the first tiles' inputs issued before the prologue), and without the split.
    ("gather-batch-4", tiled("float16", "float32", "float32", 8, 4, 4, 32, l1_first=True, producers=1,
                             gather_batch=4, finest_evict_first=True, early_inputs=True)),
    # ... and in single CTAs (decoder-b16's launch).
    ("early-inputs-single-cta", tiled("float16", "float32", "float32", 8, 4, 4, 32, cluster_size=1, l1_first=True,
                                      producers=1, gather_batch=4, finest_evict_first=True, early_inputs=True,
                                      l1_first_tile=True, launch_bound=True)),
    ("gather-batch-3-no-split", tiled("bfloat16", "float32", "float32", 8, 4, 8, 32, split_setup=False,
                                      gather_batch=3)),
    # 8-byte vectors: the launch of CTA pairs over whole segments (detr-decoder), and a single-CTA bf16 D=64.
    ("half-vectors", tiled("float16", "float32", "float32", 8, 4, 4, 32, l1_first=True, producers=1, gather_batch=4,
                           finest_evict_first=True, early_inputs=True, vector_bytes=8)),
    # ... with the mid-size levels prefetched to L2 at each segment, the output rows stored evict-first and the
    # tiles dealt to the pair's CTAs in turn (detr-decoder's launch).
    ("half-vectors-prefetch", tiled("float16", "float32", "float32", 8, 4, 4, 32, l1_first=True, producers=1,
                                    gather_batch=4, finest_evict_first=True, early_inputs=True, vector_bytes=8,
                                    prefetch_levels=True, output_evict_first=True, interleave_ranks=True)),
    ("half-vectors-single-cta-bf16-d64", tiled("bfloat16", "float32", "float32", 8, 4, 4, 64, cluster_size=1,
                                               vector_bytes=8)),
    # Launches through the order table: each sample's weight folded into its corner weights, several samples'
    # corner sums added in packed half arithmetic before one fp32 add (seed-b48's launch); and with the setup
    # split, whose records then leave the weight out.
    ("table-half-sums", tiled("float16", "float32", "float32", 8, 4, 8, 32, permuted=True, gather_batch=2,
                              line_prefetch=True, half_sums=8)),
    ("half-sums-bf16-split", tiled("bfloat16", "float32", "float32", 8, 4, 4, 32, permuted=True, half_sums=2)),
    ("half-sums-fused", tiled("bfloat16", "bfloat16", "bfloat16", 8, 4, 8, 32, fused=True, permuted=True,
                              half_sums=4)),
    # ... and two samples' loads at once at three levels (Mask2Former's pixel decoder).
    ("two-samples-three-levels", tiled("float16", "float32", "float32", 8, 3, 4, 32, cluster_size=1, num_groups=7,
                                       producers=1, split_setup=False, line_prefetch=True, coarse_evict_last=True,
                                       segment_cost=4, gather_batch=2, output_evict_first=True,
                                       staged_addresses=True)),
    # ... with the first level's tiles in column strips (Mask2Former's launch: two copies of the tile loop).
    ("strips-three-levels", tiled("float16", "float32", "float32", 8, 3, 4, 32, cluster_size=1, num_groups=7,
                                  producers=1, split_setup=False, line_prefetch=True, coarse_evict_last=True,
                                  segment_cost=4, gather_batch=2, output_evict_first=True, staged_addresses=True,
                                  strips=True)),
    # The fused kernel's encoder launch (fp16 offsets and logits): six groups, the output rows stored evict-first,
    # the staged corners' addresses selected.
    ("fused-encoder", tiled("float16", "float16", "float16", 8, 4, 4, 32, fused=True, cluster_size=1, num_groups=6,
                            producers=1, split_setup=False, output_evict_first=True, staged_addresses=True)),
    # ... and at eight points a level.
    ("fused-encoder-p8", tiled("bfloat16", "bfloat16", "bfloat16", 8, 4, 8, 32, fused=True, cluster_size=1,
                               num_groups=6, producers=1, split_setup=False, staged_addresses=True)),
    # Half-precision inputs at 12 points a head (an fp16 Mask2Former's pixel decoder): a head's row of weights is 24
    # bytes, so each tile's weights come in a box over the heads' rows of its queries (the encoders' launch).
    ("half-weights-three-levels", tiled("float16", "float16", "float16", 8, 3, 4, 32, cluster_size=1, num_groups=7,
                                        producers=1, split_setup=False, line_prefetch=True, coarse_evict_last=True,
                                        segment_cost=4, gather_batch=2, output_evict_first=True,
                                        staged_addresses=True)),
    ("generic-d30", GenericConfig("float16", "float32", "float32", 8, 4, 4, 30)),
    ("generic-d3-fused", GenericConfig("float32", "float32", "float16", 2, 6, 3, 3, fused=True, ref_dims=4)),
]


@pytest.fixture(scope="module")
def ptx_of(tmp_path_factory):
    """Compile each variant once, with its PTX dumped to its own folder."""
    texts = {}
    root = tmp_path_factory.mktemp("ptx")
    for name, cfg in VARIANTS:
        folder = root / name
        folder.mkdir()
        compile_cache.compile_kernel(cfg, f"--keep-ptx --dump-dir={folder}")
        files = list(folder.glob("*.sm_90a.ptx"))
        assert len(files) == 1, f"{name}: expected one sm_90a PTX file, found {files}"
        texts[name] = files[0].read_text()
    return texts


def evict_first_copies(ptx):
    """Bulk copies whose L2 cache-hint operand holds the inputs' evict-first policy."""
    constants = dict(re.findall(r"mov\.b64\s+(%rd\d+), (\d+);", ptx))
    hints = re.findall(r"^\s*cp\.async\.bulk\.\S*L2::cache_hint .*, (%rd\d+);", ptx, re.M)
    return sum(constants.get(reg) == str(kernel.L2_EVICT_FIRST) for reg in hints)


def configs_of(name):
    return dict(VARIANTS)[name]


@pytest.mark.parametrize("name", [n for n, cfg in VARIANTS if isinstance(cfg, KernelConfig)])
def test_tiled_variant_compiles_for_sm90a_with_tma_and_mbarriers(ptx_of, name):
    check_tiled_ptx(ptx_of[name], configs_of(name))


def check_tiled_ptx(ptx, cfg):
    """What the design depends on, in the PTX of a tiled kernel of configuration cfg."""
    assert re.search(r"^\.target sm_90a", ptx, re.M), "not compiled for sm_90a"
    # Staged levels (and prefetched inputs) arrive by TMA on mbarriers; consumers wait on them.
    assert re.search(r"cp\.async\.bulk\.tensor\.[34]d", ptx) and "mbarrier::complete_tx::bytes" in ptx
    assert "mbarrier.try_wait" in ptx
    # The block: four consumer warps a group and the producer warps.
    assert re.search(rf"^\.reqntid {cfg.threads}, 1, 1", ptx, re.M)
    # A staging load per level, and two for each tile's inputs when they are prefetched (4-D boxes over
    # (channels, head, pixel or query, image); 3-D where one head leaves that mode out), once for each
    # group a producer warp feeds (unrolled); with the order table each lane copies rows of its queries
    # with plain bulk copies (two per 32 queries of a tile).
    # early_inputs: each group's copies once more, in a loop over its first tiles before the prologue.
    served = cfg.num_groups // cfg.producer_warps
    early = cfg.early_inputs and cfg.prefetch_inputs
    served *= 2 if early else 1
    loads = len(re.findall(r"^\s*cp\.async\.bulk\.tensor\.[34]d", ptx, re.M))
    assert loads == cfg.num_levels + (2 * served if cfg.prefetch_inputs and not cfg.permuted else 0)
    rows = len(re.findall(r"^\s*cp\.async\.bulk\.shared::cluster\.global", ptx, re.M))
    assert rows == (2 * -(-cfg.queries_per_tile // 32) * served if cfg.permuted and cfg.prefetch_inputs else 0)
    if early:
        # Issued after one CTA barrier (the rings' barriers initialised), before the prologue's barrier.
        head = ptx[:ptx.index("cp.async.bulk.tensor")]
        assert head.count("bar.sync") == 1 and "barrier.cluster" not in head
    multicast = ".multicast::cluster" in ptx
    assert multicast == (cfg.cluster_size > 1)
    # prefetch_levels: one L2 prefetch of a box a level (unrolled), each in a loop over the level's boxes,
    # issued by one elected lane.
    prefetches = re.findall(r"^\s*cp\.async\.bulk\.prefetch\.tensor\.4d\.L2\.global", ptx, re.M)
    assert len(prefetches) == (cfg.num_levels if cfg.prefetch_levels else 0)
    if cfg.prefetch_levels:
        for part in ptx.split("cp.async.bulk.prefetch.tensor")[:-1]:
            assert "elect.sync" in part[-600:]
    # 2x2xD footprint boxes, through tensor maps patched on the device, only in the box variant; the doubled last
    # level's boxes are 5-D too (D, 2 copies, head, pixels, image), one copy a box.
    boxes = cfg.fine_gather == "tma"
    five_d = len(re.findall(r"^\s*cp\.async\.bulk\.tensor\.5d", ptx, re.M))
    assert (five_d > 0) == (boxes or cfg.doubles_coarsest)
    if cfg.doubles_coarsest and not boxes:
        assert five_d == 1
    assert ("tensormap.replace.tile.global_dim" in ptx) == boxes
    # L1 gathers load one vector of cfg.vector_bytes a corner (v4 / v2 of 32-bit words), and no wider.
    vec = {16: ".v4", 8: ".v2"}[cfg.vector_bytes]
    if cfg.fine_gather == "ldg":
        assert re.search(rf"ld\.global(\.nc)?(\.L1::evict_first)?(\.L2::128B)?{vec}\.b32", ptx), \
            f"L1 gathers should be {cfg.vector_bytes}-byte vector loads"
        # No 16-byte gathers under 8-byte vectors (fp32 box reference points, 16 bytes a row, load as one such vector).
        ref_vector = cfg.fused and cfg.ref_dims * ITEMSIZE[cfg.ref_dtype] == 16
        if cfg.vector_bytes < 16 and not ref_vector:
            assert not re.search(r"ld\.global(\.nc)?(\.L1::evict_first)?(\.L2::128B)?\.v4\.b32", ptx)
    assert bool(re.search(rf"ld\.global(\.L2::cache_hint)?\.L2::128B{vec}", ptx)) == cfg.line_prefetch
    # strips: two copies of the consumers' tile loop, one with the strips' map and one without, chosen once.
    copies = 2 if cfg.strips else 1
    # One copy of each level's L1 gathers (a tile loop's) with the L2 evict-last policy, taken where the level is not
    # the finest.
    evict_last = str(kernel.L2_EVICT_LAST)
    constants = dict(re.findall(r"mov\.b64\s+(%rd\d+), (\d+);", ptx))
    hinted = re.findall(rf"ld\.global\.L2::cache_hint(?:\.L2::128B)?{vec}\.\w+ \{{[^}}]*\}}, \[[^\]]*\], (%rd\d+);", ptx)
    assert [constants.get(reg) for reg in hinted] == (
        [evict_last] * (copies * cfg.num_levels * cfg.num_points * 4) if cfg.coarse_evict_last else [])
    # One copy of each level's L1 gathers with the evict-first hint, taken where the level is the finest.
    assert len(re.findall(rf"ld\.global\.L1::evict_first{vec}\.b32", ptx)) == (
        copies * cfg.num_levels * cfg.num_points * 4 if cfg.finest_evict_first else 0)
    # Each tile's inputs are read once: their copies carry an L2 cache policy (evict first); the staging
    # loads of value do not.
    assert evict_first_copies(ptx) == loads - cfg.num_levels + rows
    # The output rows: one store a thread and tile (in each tile loop), with the evict-first policy where
    # output_evict_first.
    stores = re.findall(r"^\s*st\.global(\.L2::cache_hint)?(?:\.v\d)?\.\w+\s+\[[^\]]*\],\s*[^;]*?(?:\},\s*(%rd\d+))?;", ptx, re.M)
    assert len(stores) == copies, stores
    for hinted, policy in stores:
        assert bool(hinted) == cfg.output_evict_first
        if hinted:
            assert constants.get(policy) == str(kernel.L2_EVICT_FIRST)
    # Staged pixels (and boxes) are read as vectors of cfg.vector_bytes.
    assert f"ld.shared{vec}.b32" in ptx
    # staged_addresses: each staged sample's two corners of the next column load at their first column's
    # address plus one pixel (an immediate offset), in the one copy of every level's staged reads (none where nothing
    # is staged: the fused one-level launch keeps the knob with no buffer).
    pixel_bytes = cfg.head_dim * cfg.itemsize
    next_column = re.findall(rf"ld\.shared{vec}\.b32\s+\{{[^}}]*\}}, \[%r\d+\+{pixel_bytes}\];", ptx)
    staged_reads = cfg.staged_addresses and cfg.stage_pixels > 0
    assert len(next_column) == (copies * 2 * cfg.num_levels * cfg.num_points if staged_reads else 0)
    # fp16 / bf16 value: the four-corner sums in packed half arithmetic.
    if cfg.value_dtype == "float16":
        assert re.search(r"\b(fma|mul)(\.rn)?\.f16x2", ptx)
    if cfg.value_dtype == "bfloat16":
        assert re.search(r"\b(fma|mul)(\.rn)?\.bf16x2", ptx)
    # The fused kernel computes the softmax: exponentials on the device.
    assert ("ex2.approx" in ptx) == cfg.fused
    # Where a query's threads split the per-sample setup they pass records by shuffles over segments of
    # T lanes (and the fused softmax's maximum and sum by butterflies).
    segment = ((32 - cfg.threads_per_query) << 8) | 31
    shuffles = len(re.findall(rf"shfl\.sync\.idx\.b32\s+%r\d+, %r\d+, \d+, {segment}, -1;", ptx))
    assert (shuffles > 0) == cfg.splits_setup
    assert ("shfl.sync.bfly" in ptx) == (cfg.splits_setup and cfg.fused)


# compare.py's presets and model shapes, as tune.py builds them.
PRESET_SHAPES = tune.shapes_of(list(compare.PRESETS) + list(compare.MODEL_PRESETS))


def unfused_preset_launches():
    """(shape, value dtype, location dtype, base configuration, [its launch with the level table on the device, and
    on the host]) for every preset and model shape of compare.py, in fp32, fp16 and bf16 value with fp32 locations and
    locations in value's dtype."""
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for loc_dt in (torch.float32, dt):
            for shape, tuning, cfg in tune._variant_configs(PRESET_SHAPES, [{}], dt, loc_dt):
                yield shape, dt, loc_dt, cfg, [launch_rules.launched_config(cfg, shape.N, shape.Lq, shape.S, tuning,
                                                                            levels=levels)
                                               for levels in (None, shape.levels)]


def preset_launches():
    """The distinct configurations that launches of compare.py's presets and model shapes run (unfused_preset_launches;
    and the fused op's, with offsets, logits and (x, y) or box reference points in value's dtype, the level table on
    the device and on the host), with a short name each."""
    named = {}
    for shape, _, _, _, launched in unfused_preset_launches():
        for one, table in zip(launched, ("", "-host-table")):
            named.setdefault(one, f"{shape.name}-{one.value_dtype}-{one.loc_dtype}{table}")
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for shape in PRESET_SHAPES:
            for ref_dims in (2, 4):
                M, L, P = shape.M, shape.L, shape.P
                value, offsets = torch.empty(1, 1, M, shape.D, dtype=dt), torch.empty(1, 1, M, L, P, 2, dtype=dt)
                logits, ref = torch.empty(1, 1, M, L, P, dtype=dt), torch.empty(1, 1, L, ref_dims, dtype=dt)
                cfg = interface.config_for(value, offsets, logits, ref)
                for levels in (None, shape.levels):
                    one = launch_rules.launched_config(cfg, shape.N, shape.Lq, shape.S, {}, levels=levels)
                    named.setdefault(one, f"{shape.name}-{one.value_dtype}-fused-ref{ref_dims}"
                                          f"{'-host-table' if levels else ''}")
    return sorted(((name, cfg) for cfg, name in named.items()), key=lambda item: item[0])


PRESET_LAUNCHES = preset_launches()


@pytest.fixture(scope="module")
def launch_ptx(tmp_path_factory):
    """The PTX of every configuration in PRESET_LAUNCHES, compiled once."""
    root = tmp_path_factory.mktemp("launch-ptx")
    texts = {}
    for index, (name, cfg) in enumerate(PRESET_LAUNCHES):
        folder = root / str(index)
        folder.mkdir()
        compile_cache.compile_kernel(cfg, f"--keep-ptx --dump-dir={folder}")
        (file,) = folder.glob("*.sm_90a.ptx")
        texts[name] = file.read_text()
    return texts


@pytest.mark.parametrize("name,cfg", PRESET_LAUNCHES, ids=[name for name, _ in PRESET_LAUNCHES])
def test_every_launch_of_the_presets_compiles_with_what_its_design_needs(launch_ptx, name, cfg):
    """Every configuration the presets' and model shapes' launches pick compiles for sm_90a on the CPU, and its PTX
    passes the variants' checks (the copies, the hints, the vector widths, the tile loops)."""
    assert isinstance(cfg, KernelConfig)
    check_tiled_ptx(launch_ptx[name], cfg)


@pytest.mark.parametrize("name", [n for n, cfg in VARIANTS if isinstance(cfg, GenericConfig)])
def test_generic_variant_compiles_without_tma(ptx_of, name):
    ptx = ptx_of[name]
    cfg = configs_of(name)
    assert re.search(r"^\.target sm_90a", ptx, re.M)
    assert "cp.async.bulk" not in ptx
    assert ("ex2.approx" in ptx) == cfg.fused


@pytest.mark.parametrize("D,dtype,tiled_kernel", [
    (32, "float16", True), (48, "float16", True), (96, "float32", True), (256, "float16", True), (8, "float16", True),
    (1024, "float16", True), (1025, "float16", False), (30, "float16", False), (3, "float32", False),
    (2, "float32", False), (4, "bfloat16", False), (2048, "float16", False)])
def test_head_dims_go_to_the_kernel_that_takes_them(D, dtype, tiled_kernel):
    from cute_deform.hopper.config import tiled_kernel_fits

    assert tiled_kernel_fits(ITEMSIZE[dtype], D, 4, 4) == tiled_kernel
    if tiled_kernel:
        cfg = tiled(dtype, "float32", "float32", 8, 4, 4, D)
        assert cfg.threads_per_query * cfg.queries_per_tile <= 128
        assert cfg.queries_per_tile >= 1
    else:
        cfg = GenericConfig(dtype, "float32", "float32", 8, 4, 4, D)
        assert D % cfg.channels_per_thread == 0 and cfg.channels_per_thread * cfg.itemsize <= 16


def test_more_levels_or_points_go_to_the_generic_kernel():
    from cute_deform.hopper.config import tiled_kernel_fits

    assert tiled_kernel_fits(2, 32, 5, 16)
    assert not tiled_kernel_fits(2, 32, 6, 4)
    assert not tiled_kernel_fits(2, 32, 4, 17)


def test_cache_key_depends_only_on_static_parameters():
    a = tiled("float16", "float32", "float32", 8, 4, 4, 32)
    assert compile_cache.cache_key(a) == compile_cache.cache_key(tiled("float16", "float32", "float32", 8, 4, 4, 32))
    assert compile_cache.cache_key(a) != compile_cache.cache_key(tiled("float16", "float32", "float32", 8, 4, 8, 32))
    assert compile_cache.cache_key(a) != compile_cache.cache_key(dataclasses.replace(a, fused=True))
    fields = {f.name for f in dataclasses.fields(KernelConfig)} | {f.name for f in dataclasses.fields(GenericConfig)}
    assert not fields & {"batch", "num_queries", "num_keys", "height", "width", "rounds"}


def test_cache_key_covers_the_kernel_sources_and_not_the_host_modules(monkeypatch):
    """A compiled kernel's key hashes every module that builds kernels; the host-only modules (launch rules, torch glue,
    the cache itself) are left out, so a change to a launch rule keeps the cache, and they hold no kernel code."""
    from pathlib import Path

    hopper = Path(compile_cache.__file__).parent
    for name in compile_cache.HOST_MODULES:
        text = (hopper / name).read_text()
        assert "@cute.kernel" not in text and "@cute.jit" not in text, name
    kernel_modules = {p.name for p in hopper.glob("*.py")} - compile_cache.HOST_MODULES
    assert {"config.py", "kernel.py", "pipeline.py", "inputs.py", "sampling.py", "tile_scheduler.py", "generic.py",
            "order.py"} <= kernel_modules

    def digest_with(changed: str) -> bytes:
        real = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda self: real(self) + (b"#" if self.name == changed else b""))
        monkeypatch.setattr(compile_cache, "_SOURCE_DIGEST", None)
        try:
            return compile_cache._source_digest()
        finally:
            monkeypatch.setattr(Path, "read_bytes", real)
            monkeypatch.setattr(compile_cache, "_SOURCE_DIGEST", None)

    base = digest_with("")
    assert digest_with("launch_rules.py") == base and digest_with("interface.py") == base
    assert digest_with("kernel.py") != base and digest_with("sampling.py") != base


def test_disk_cache_stores_loads_and_rebuilds_a_corrupt_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DEFORM_CACHE_DIR", str(tmp_path))
    cfg = GenericConfig("float16", "float16", "float16", 2, 1, 1, 16)
    monkeypatch.setattr(compile_cache, "_compiled", {})
    compiled = compile_cache.kernel_for(cfg)
    entry = tmp_path / f"msda_{compile_cache.cache_key(cfg)}.o"
    assert entry.is_file() and entry.stat().st_size > 10_000
    assert not list(tmp_path.glob(".tmp-*")), "temporary files must be renamed or removed"

    monkeypatch.setattr(compile_cache, "_compiled", {})
    monkeypatch.setattr(compile_cache, "compile_kernel", lambda *a, **k: pytest.fail("should load from disk"))
    loaded = compile_cache.kernel_for(cfg)
    assert callable(loaded) and loaded is not compiled

    entry.write_bytes(b"not an object file")
    monkeypatch.undo()
    monkeypatch.setenv("CUTE_DEFORM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_compiled", {})
    rebuilt = compile_cache.kernel_for(cfg)
    assert callable(rebuilt)
    assert entry.stat().st_size > 10_000, "the corrupt entry was replaced by a good one"


def test_cache_can_be_moved_or_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DEFORM_CACHE_DIR", str(tmp_path / "here"))
    assert compile_cache.cache_dir() == tmp_path / "here"
    monkeypatch.setenv("CUTE_DEFORM_CACHE_DIR", "off")
    assert compile_cache.cache_dir() is None
    monkeypatch.delenv("CUTE_DEFORM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.cache_dir() == tmp_path / "cute_deform"


def test_precompile_covers_the_variants_the_launch_may_pick():
    cfg = tiled("float16", "float32", "float32", 8, 4, 4, 32)
    variants = launch_rules.launch_variants(cfg)
    whole = dict(l1_first=True, producers=1, gather_batch=4, finest_evict_first=True, early_inputs=True)
    encoder = dataclasses.replace(cfg, cluster_size=1, num_groups=7, producers=1, split_setup=False, line_prefetch=True,
                                  coarse_evict_last=True, segment_cost=4, output_evict_first=True, staged_addresses=True,
                                  stagger_locations=True, doubled_coarsest=True,
                                  stage_bytes=launch_rules.DOUBLED_STAGE_BYTES)
    assert variants == [cfg, dataclasses.replace(cfg, **whole), dataclasses.replace(cfg, vector_bytes=8, **whole),
                        dataclasses.replace(cfg, vector_bytes=8, output_evict_first=True, interleave_ranks=True,
                                            **whole),
                        dataclasses.replace(cfg, vector_bytes=8, prefetch_levels=True, output_evict_first=True,
                                            interleave_ranks=True, **whole),
                        dataclasses.replace(cfg, cluster_size=1, l1_first_tile=True, launch_bound=True, **whole),
                        dataclasses.replace(cfg, cluster_size=1, l1_first_tile=True, launch_bound=True, **whole,
                                            stage_bytes=launch_rules.WIDE_STAGE_BYTES),  # ... a level more staged
                        dataclasses.replace(cfg, cluster_size=1, **launch_rules.SHORT_RANGES, coarse_evict_last=True,
                                            segment_cost=4),
                        encoder,
                        dataclasses.replace(encoder, coarse_evict_last=False),  # ... on fast DRAM, without the hint
                        dataclasses.replace(cfg, cluster_size=1, num_groups=7, producers=1, split_setup=False,
                                            line_prefetch=True),
                        dataclasses.replace(cfg, cluster_size=1, num_groups=7, producers=1, split_setup=False,
                                            line_prefetch=True, stagger_locations=True),
                        dataclasses.replace(cfg, permuted=True, gather_batch=2, line_prefetch=True)]
    # At 8 points a level the table's launch sums samples in packed half arithmetic (bf16: fewer a sum).
    for value, sums in (("float16", 8), ("bfloat16", 4)):
        eight = tiled(value, "float32", "float32", 8, 4, 8, 32)
        assert launch_rules.launch_variants(eight)[-1] == dataclasses.replace(
            eight, permuted=True, gather_batch=2, line_prefetch=True, half_sums=sums)
    fp32 = tiled("float32", "float32", "float32", 8, 4, 8, 32)
    assert launch_rules.launch_variants(fp32)[-1].half_sums == 0
    fused = tiled("float16", "float16", "float16", 8, 4, 8, 32, fused=True)
    assert launch_rules.launch_variants(fused)[-1] == dataclasses.replace(fused, permuted=True, line_prefetch=True,
                                                                       half_sums=4)
    boxes = tiled("float16", "float32", "float32", 8, 4, 4, 32, fine_gather="tma")
    assert launch_rules.launch_variants(boxes) == [boxes]
    # Rows of locations that TMA cannot load (L*P*2*2 bytes a head, and the two heads' rows together, not multiples
    # of 16): the consumers read them, through the order table too.
    odd = tiled("float16", "float16", "float16", 2, 1, 3, 32, cluster_size=1)
    assert not odd.prefetch_inputs and odd.producer_warps == 1
    assert launch_rules.launch_variants(odd) == [
        odd, dataclasses.replace(odd, l1_first=True, gather_batch=4),  # no producer warp feeds them: producers stays
        dataclasses.replace(odd, permuted=True, gather_batch=2, line_prefetch=True)]


def test_precompile_covers_every_launch_of_the_presets_and_model_shapes():
    """Every configuration a launch of compare.py's presets and model shapes picks (fp32, fp16 and bf16 value; fp32
    locations and locations in value's dtype; the level table on the device or on the host) is one of launch_variants'
    of its base configuration, so scripts/precompile.py leaves no kernel to compile at a first call."""
    for shape, dt, loc_dt, cfg, launched in unfused_preset_launches():
        for one in launched:
            assert one in launch_rules.launch_variants(cfg), (shape.name, dt, loc_dt, one)
        # The host's table changes one launch of these: rtdetr-decoder's staging (WIDE_STAGE_BYTES, fp16/bf16).
        wide = shape.name == "rtdetr-decoder" and dt != torch.float32
        assert (launched[0] != launched[1]) == wide, (shape.name, dt, loc_dt)


H100 = dict(sms=132, l2_bytes=50 << 20)


def launch_of(cfg, N, Lq, S, reorder="auto", fixed=frozenset(), window=None):
    changes, grid, schedule = launch_rules.choose_launch(cfg, N, Lq, S, H100["sms"], H100["l2_bytes"], window,
                                                      reorder, frozenset(fixed))
    return changes, grid, schedule


@pytest.mark.parametrize("preset,N,Lq,S,P,expected", [
    # encoders: one round of long ranges -> single CTAs and one producer warp: seven groups, each thread
    # its own setup, up to 16 samples a query; four groups and the setup split beyond; whole-line L2 fetches,
    # the levels other than the finest evict-last in L2; up to 16 samples a query, a segment's start counts
    # for four tiles, the output rows are stored evict-first in L2, (at up to four points a level) staged
    # corners select their byte addresses, and (rows of 128 bytes) each slot reads its locations staggered and the
    # last level doubled, in a larger staging buffer
    ("detr-encoder", 2, 22223, 22223, 4, dict(cluster_size=1, num_groups=7, producers=1, split_setup=False,
                                              line_prefetch=True, coarse_evict_last=True, segment_cost=4,
                                              output_evict_first=True, staged_addresses=True,
                                              stagger_locations=True, doubled_coarsest=True,
                                              stage_bytes=launch_rules.DOUBLED_STAGE_BYTES)),
    ("dcnv4-test", 1, 15200, 20197, 8, dict(cluster_size=1, num_groups=4, producers=1, split_setup=True,
                                            line_prefetch=True, coarse_evict_last=True)),
    # decoders: whole segments -> L1 levels first, one producer warp and four samples' loads at once,
    # the finest level's lines evicted from L1 first; CTA pairs split each of 64 segments (with 8-byte
    # vectors, the mid-size levels prefetched to L2, the output rows stored evict-first and the tiles dealt to the
    # pair's CTAs in turn), single CTAs take one each of 128
    ("detr-decoder", 8, 900, 22223, 4, dict(l1_first=True, producers=1, gather_batch=4, finest_evict_first=True,
                                            early_inputs=True, vector_bytes=8, prefetch_levels=True,
                                            output_evict_first=True, interleave_ranks=True)),
    ("decoder-b16", 16, 300, 22223, 4, dict(cluster_size=1, l1_first=True, producers=1, gather_batch=4,
                                            finest_evict_first=True, early_inputs=True, l1_first_tile=True,
                                            launch_bound=True)),
    # a large batch: the order table (two samples' loads at once, whole-line L2 fetches), CTA pairs, rounds of
    # about a segment a range
    ("seed-b48", 48, 15422, 19560, 8, dict(permuted=True, gather_batch=2, line_prefetch=True, half_sums=8)),
])
def test_launch_choices_of_the_presets(preset, N, Lq, S, P, expected):
    cfg = tiled("float16", "float32", "float32", 8, 4, P, 32)
    changes, grid, schedule = launch_of(cfg, N, Lq, S)
    assert changes == expected, preset
    assert grid % dataclasses.replace(cfg, **changes).cluster_size == 0 and grid <= H100["sms"]
    if preset == "seed-b48":
        # 384 segments on 66 pairs: 6 rounds, 396 ranges; a caller's window still sets the rounds (all of L2: 10)
        assert (schedule.rounds, schedule.whole) == (6, False)
        assert launch_of(cfg, N, Lq, S, window=1.0)[2].rounds == 10


DETR = [(100, 167), (50, 84), (25, 42), (13, 21)]
RTDETR = [(80, 80), (40, 40), (20, 20)]


@pytest.mark.parametrize("levels,N,Lq", [(DETR, 1, 300), (DETR, 4, 300), (DETR, 2, 900), (DETR, 4, 900),
                                         (RTDETR, 1, 300), (RTDETR, 4, 300), (RTDETR, 4, 900)])
def test_short_ranges_take_the_small_decoders_knobs(levels, N, Lq):
    """One round of single CTAs over up to SHORT_RANGE_TILES tiles a CTA (decoders of one to four images) takes
    launch_rules.SHORT_RANGES in one round, without whole-line fetches; the single-CTA launch's encoder rules for a
    segment's start and the coarse levels stay."""
    S = sum(h * w for h, w in levels)
    cfg = tiled("float16", "float32", "float32", 8, len(levels), 4, 32)
    changes, grid, schedule = launch_of(cfg, N, Lq, S)
    assert N * 8 * -(-Lq // 32) <= launch_rules.SHORT_RANGE_TILES * grid
    assert changes == dict(cluster_size=1, **launch_rules.SHORT_RANGES, coarse_evict_last=True, segment_cost=4)
    assert (schedule.rounds, schedule.whole) == (1, False)
    assert dataclasses.replace(cfg, **changes) in launch_rules.launch_variants(cfg)
    # A caller's window or groups stay: the window turns the rule off, the groups keep the rest of it.
    assert launch_of(cfg, N, Lq, S, window=0.5)[0].get("vector_bytes", 16) == 16
    fixed = launch_of(dataclasses.replace(cfg, num_groups=5), N, Lq, S, fixed={"num_groups"})[0]
    assert "num_groups" not in fixed and fixed["vector_bytes"] == 8 and "split_setup" not in fixed


@pytest.mark.parametrize("levels,N", [(DETR, 1), (DETR, 4), (RTDETR, 4)])
def test_short_ranges_take_the_small_decoders_knobs_with_fp32_value(levels, N):
    """fp32 value (128-byte rows, 32 channels) takes SHORT_RANGES too, without the cache-hint rules of fp16/bf16."""
    S = sum(h * w for h, w in levels)
    cfg = tiled("float32", "float32", "float32", 8, len(levels), 4, 32)
    changes, _, schedule = launch_of(cfg, N, 300, S)
    assert changes == dict(cluster_size=1, **launch_rules.SHORT_RANGES) and schedule.rounds == 1
    assert dataclasses.replace(cfg, **changes) in launch_rules.launch_variants(cfg)


@pytest.mark.parametrize("value", ["float16", "float32"])
@pytest.mark.parametrize("levels,N", [(DETR, 1), (DETR, 2), (RTDETR, 4)])
def test_short_ranges_take_the_small_decoders_knobs_in_the_fused_kernel(value, levels, N):
    """The fused kernel (the layer's) takes SHORT_RANGES too, with boxes or points as reference."""
    S = sum(h * w for h, w in levels)
    for ref_dims in (2, 4):
        cfg = tiled(value, value, value, 8, len(levels), 4, 32, fused=True, ref_dtype=value, ref_dims=ref_dims)
        changes, _, schedule = launch_of(cfg, N, 300, S)
        assert {k: changes.get(k) for k in launch_rules.SHORT_RANGES} == launch_rules.SHORT_RANGES, changes
        assert schedule.rounds == 1 and changes["cluster_size"] == 1
        assert dataclasses.replace(cfg, **changes) in launch_rules.launch_variants(cfg)


@pytest.mark.parametrize("value,D,fused,levels,N,Lq", [
    ("float16", 32, False, DETR, 2, 22223),  # an encoder: long ranges
    ("float16", 32, False, DETR, 8, 300),  # whole segments (CTA pairs)
    ("float16", 64, False, DETR, 1, 300),  # 128-byte head rows of fp16 value (64 channels)
    ("float16", 32, False, DETR, 16, 300),  # whole segments (single CTAs)
])
def test_short_ranges_rule_stays_where_it_was_not_measured(value, D, fused, levels, N, Lq):
    S = sum(h * w for h, w in levels)
    dt = "float16" if fused else "float32"
    cfg = tiled(value, dt, dt, 8, len(levels), 4, D, fused=fused)
    changes, _, _ = launch_of(cfg, N, Lq, S)
    assert {k: changes.get(k) for k in launch_rules.SHORT_RANGES} != launch_rules.SHORT_RANGES, changes


@pytest.mark.parametrize("value,fused,levels,N,Lq,unstaged", [
    ("float16", False, [(200, 200)], 2, 40000, True),  # a BEV grid: one level, too large to stage
    ("bfloat16", False, [(150, 150)], 2, 22500, True),
    ("float32", False, [(200, 200)], 2, 40000, True),
    ("float16", False, [(200, 200)], 1, 300, True),  # ... and a one-level decoder (short ranges)
    ("float16", False, [(32, 32)], 2, 1024, False),  # one level that fits the stage
    ("float16", False, [(128, 256), (64, 128), (32, 64)], 1, 43008, False),  # several levels: the host cannot tell
    ("float16", True, [(200, 200)], 2, 40000, True),  # the fused kernel too
    ("float16", True, [(32, 32)], 2, 1024, False),
])
def test_one_level_too_large_to_stage_takes_no_staging_buffer(value, fused, levels, N, Lq, unstaged):
    """Single-CTA launches of one level larger than the stage drop the staging buffer (stage_bytes=0: L1 keeps the
    shared memory), with the single-CTA groups, fused or not; a level that fits, several levels or a caller's stage
    keep it."""
    S = sum(h * w for h, w in levels)
    dt = "float16" if fused else "float32"
    cfg = tiled(value, dt, dt, 8, len(levels), 4, 32, fused=fused)
    changes, _, _ = launch_of(cfg, N, Lq, S)
    assert changes["cluster_size"] == 1
    assert (changes.get("stage_bytes") == 0) == unstaged, changes
    if unstaged:
        assert dataclasses.replace(cfg, **changes) in launch_rules.launch_variants(cfg)
        assert "stage_bytes" not in launch_of(cfg, N, Lq, S, fixed={"stage_bytes"})[0]
        if Lq == S:
            assert changes["num_groups"] == (6 if value == "float32" or fused else 7)


@pytest.mark.parametrize("levels,N,batch", [
    ([(128, 128), (64, 64), (32, 32)], 2, 2),  # Mask2Former's pixel decoder at 1024x1024: two samples at once
    ([(100, 167), (50, 84), (25, 42)], 2, 2),
    ([(128, 256), (64, 128), (32, 64)], 1, 2),  # nothing staged
    ([(100, 167), (50, 84)], 2, 2),
    ([(128, 128), (64, 64), (32, 32)], 8, None),  # several rounds: one
    ([(100, 167), (50, 84), (25, 42), (13, 21)], 2, None),  # four levels (detr-encoder): one
    ([(200, 200)], 2, None),  # one level: one
])
def test_single_ctas_at_two_or_three_levels_issue_two_samples_at_once(levels, N, batch):
    """One round of single CTAs over long ranges (encoders) issues two samples' loads at once at two or three levels
    of up to four points in 64-byte head rows (launch_rules._few_levels_batch); over several rounds, at one or four
    levels, at 8 points, in other rows, with fp32 value, fused, or where the caller chose a batch, it does not."""
    S = sum(h * w for h, w in levels)
    Lq = S if len(levels) > 1 else 40000
    cfg = tiled("float16", "float32", "float32", 8, len(levels), 4, 32)
    changes, _, schedule = launch_of(cfg, N, Lq, S)
    assert changes["cluster_size"] == 1 and not schedule.whole
    assert changes.get("gather_batch") == batch
    assert dataclasses.replace(cfg, **changes) in launch_rules.launch_variants(cfg)
    if batch:
        assert "gather_batch" not in launch_of(cfg, N, Lq, S, fixed={"gather_batch"})[0]
        for other in (tiled("float16", "float32", "float32", 8, len(levels), 8, 32),
                      tiled("float32", "float32", "float32", 8, len(levels), 4, 32),
                      tiled("float16", "float32", "float32", 8, len(levels), 4, 64),
                      tiled("float16", "float16", "float16", 8, len(levels), 4, 32, fused=True)):
            assert "gather_batch" not in launch_of(other, N, Lq, S)[0], other


@pytest.mark.parametrize("side,N", [(200, 1), (200, 2), (150, 2), (100, 4)])
def test_single_ctas_at_one_level_take_rounds_over_a_quarter_of_l2(side, N):
    """A one-level launch of single CTAs (BEVFormer-like self-attention) plans its rounds over a quarter of L2, not
    half; a caller's window stays; at three levels, half."""
    S = side * side
    one = tiled("float16", "float32", "float32", 8, 1, 4, 32)
    changes, _, schedule = launch_of(one, N, S, S)
    assert changes["cluster_size"] == 1
    assert schedule == launch_of(one, N, S, S, window=launch_rules.ONE_LEVEL_WINDOW_L2_FRACTION)[2]
    assert schedule.rounds > launch_of(one, N, S, S, window=launch_rules.SINGLE_CTA_WINDOW_L2_FRACTION)[2].rounds
    assert launch_of(one, N, S, S, window=1.0)[2].rounds == 1
    three = tiled("float16", "float32", "float32", 8, 3, 4, 32)
    assert (launch_of(three, 8, 21504, 21504)[2]
            == launch_of(three, 8, 21504, 21504, window=launch_rules.SINGLE_CTA_WINDOW_L2_FRACTION)[2])


def test_table_rounds_follow_the_segments_where_two_heads_share_a_line():
    """Through the order table, fp16/bf16 value in 64-byte head rows (fused or not) takes rounds of about a
    segment a range and whole-line fetches; fp32 value (a head a line) keeps the window's rounds."""
    for fused in (False, True):
        half = tiled("float16", "float16" if fused else "float32", "float16" if fused else "float32", 8, 4, 8, 32,
                     **(dict(fused=True, ref_dtype="float16", ref_dims=2) if fused else {}))
        changes, _, schedule = launch_of(half, 48, 15422, 19560)
        assert changes["permuted"] and changes["line_prefetch"] and schedule == tile_scheduler.Schedule(6, False)
        single = tiled("float32", "float32", "float32", 8, 4, 8, 32,
                       **(dict(fused=True, ref_dtype="float32", ref_dims=2) if fused else {}))
        changes, _, schedule = launch_of(single, 48, 15422, 19560)
        assert changes["permuted"] and "line_prefetch" not in changes
        assert schedule.rounds == launch_of(single, 48, 15422, 19560, window=1.0)[2].rounds == 21


@pytest.mark.parametrize("segments,clusters,rounds", [
    (384, 66, 6),  # seed-b48: 396 ranges, one a segment (k = 1)
    (256, 66, 4), (192, 66, 3), (512, 66, 8), (1024, 66, 16),  # N = 32, 24 (P = 4), 64, 128
    (160, 66, 5),  # N = 20: 3 rounds would give 1.24 ranges a segment, 5 give 2.06 (k = 2)
    (264, 66, 4),  # k divides evenly: every range one segment
    (8, 132, 1),  # one image of many queries: 16.5 ranges a segment in one round
])
def test_table_rounds_give_ranges_of_about_a_kth_of_a_segment(segments, clusters, rounds):
    blocks = 482
    assert tile_scheduler.aligned_rounds(segments, clusters, blocks, 16, 0.1) == rounds
    schedule = tile_scheduler.plan(segments * blocks, blocks, clusters, 1 << 20, 50 << 20, 16, 4, align=0.1)
    assert schedule == tile_scheduler.Schedule(rounds, False)


def test_aligned_rounds_are_the_fewest_within_the_tolerance():
    for segments in range(1, 400, 7):
        for clusters in (33, 66, 132):
            rounds = tile_scheduler.aligned_rounds(segments, clusters, 482, 16, 0.1)
            if rounds is None:  # one round's ranges are already shorter than 16 tiles
                assert 482 * segments < clusters * 16
                continue
            ranges = clusters * rounds
            k = max(1, ranges // segments)
            assert k * segments <= ranges <= 1.1 * k * segments
            # no fewer rounds give any k' ranges a segment within the tolerance
            for fewer in range(1, rounds):
                assert not any(j * segments <= clusters * fewer <= 1.1 * j * segments
                               for j in range(1, k + 1)), (segments, clusters, fewer)
    # ranges shorter than the shortest allowed: the window's rounds instead
    assert tile_scheduler.aligned_rounds(7, 132, 4, 16, 0.1) is None


@pytest.mark.parametrize("N,rounds", [(2, 1), (3, 2), (4, 2), (8, 4)])
def test_batched_encoders_take_single_ctas_over_rounds_of_half_of_l2(N, rounds):
    """fp16 encoders without the order table take single CTAs in any number of rounds, each round's
    (image, head) slices within half of L2 (detr shapes: two images in one round); every round count reads the
    locations staggered, and only one round keeps the coarser levels evict-last in L2, stores the output evict-first
    and stages the last level doubled."""
    cfg = tiled("float16", "float32", "float32", 8, 4, 4, 32)
    changes, grid, schedule = launch_of(cfg, N, 22223, 22223, window=None)
    assert changes == dict(cluster_size=1, num_groups=7, producers=1, split_setup=False, line_prefetch=True,
                           stagger_locations=True,
                           **(dict(coarse_evict_last=True, segment_cost=4, output_evict_first=True,
                                   staged_addresses=True, doubled_coarsest=True,
                                   stage_bytes=launch_rules.DOUBLED_STAGE_BYTES) if rounds == 1 else {}))
    assert (schedule.rounds, schedule.whole, grid) == (rounds, False, H100["sms"])


def test_whole_segments_go_to_single_ctas_only_one_segment_each():
    """Single CTAs take whole segments where each gets one, with no more tiles than a CTA of a pair."""
    cfg = tiled("float16", "float32", "float32", 8, 4, 4, 32)
    for N, Lq, single in ((8, 900, False), (16, 300, True), (16, 900, True), (32, 300, False), (24, 900, False)):
        changes, grid, schedule = launch_of(cfg, N, Lq, 22223)
        assert schedule.whole and (changes.get("cluster_size") == 1) == single, (N, Lq)
    assert "cluster_size" not in launch_of(cfg, 16, 300, 22223, fixed={"cluster_size"})[0]


def test_single_ctas_over_one_segment_name_their_ctas_an_sm_to_ptxas(ptx_of):
    """Single CTAs over one whole segment each (decoder-b16) take the launch bound, fp16/bf16 unfused, unless the
    caller fixed it; CTA pairs (detr-decoder), the order table (seed-b48) and fp32 value do not. Its kernel's PTX names
    one CTA an SM (.minnctapersm 1, what ctas_per_sm plans), and the other variants' name none."""
    for value in ("float16", "bfloat16"):
        cfg = tiled(value, "float32", "float32", 8, 4, 4, 32)
        assert launch_of(cfg, 16, 300, 22223)[0]["launch_bound"]
        assert "launch_bound" not in launch_of(cfg, 16, 300, 22223, fixed={"launch_bound"})[0]
        assert "launch_bound" not in launch_of(cfg, 8, 900, 22223)[0]
    assert "launch_bound" not in launch_of(tiled("float32", "float32", "float32", 8, 4, 4, 32), 16, 300, 22223)[0]
    assert "launch_bound" not in launch_of(tiled("float16", "float32", "float32", 8, 4, 8, 32), 48, 15422, 19560)[0]
    bounded = [name for name, _ in VARIANTS if re.search(r"^\s*\.minnctapersm\s+1\s*$", ptx_of[name], re.M)]
    assert bounded == [name for name, cfg in VARIANTS if getattr(cfg, "launch_bound", False)] == [
        "early-inputs-single-cta"]


@pytest.mark.parametrize("value", ["float16", "bfloat16"])
@pytest.mark.parametrize("levels,N,Lq,wide", [
    (RTDETR, 16, 300, True),  # 40x40 beside 20x20: 2048 pixels, one level more than 96 KB's 1536
    (RTDETR, 16, 900, True),
    ([(80, 80), (40, 40), (20, 20), (10, 10)], 16, 300, False),  # 2112 pixels: no level more fits (it lost)
    (RTDETR, 8, 300, False),  # CTA pairs over one segment each (it lost)
    (RTDETR, 32, 300, False),  # CTA pairs over two segments each (1%, not taken)
    (DETR, 16, 300, False),  # decoder-b16: 50x84 does not fit
])
def test_single_ctas_over_one_segment_take_a_wider_staging_where_it_stages_one_more_level(value, levels, N, Lq, wide):
    """Single CTAs over one whole segment each take WIDE_STAGE_BYTES of staging where that stages one more whole level
    than the default's, which only a level table on the host tells (levels=None: the default stays)."""
    S = sum(h * w for h, w in levels)
    cfg = tiled(value, "float32", "float32", 8, len(levels), 4, 32)
    changes, _, schedule = launch_rules.choose_launch(cfg, N, Lq, S, H100["sms"], H100["l2_bytes"], None, "auto",
                                                      levels=levels)
    assert schedule.whole
    assert changes.get("stage_bytes") == (launch_rules.WIDE_STAGE_BYTES if wide else None)
    launched = dataclasses.replace(cfg, **changes)
    assert launched in launch_rules.launch_variants(cfg)
    if wide:
        assert changes["cluster_size"] == 1
        assert launch_rules.staged_levels(levels, launched.stage_pixels) == len(levels) - 1
        without, _, _ = launch_rules.choose_launch(cfg, N, Lq, S, H100["sms"], H100["l2_bytes"], None, "auto")
        assert without == {k: v for k, v in changes.items() if k != "stage_bytes"}
        fixed, _, _ = launch_rules.choose_launch(cfg, N, Lq, S, H100["sms"], H100["l2_bytes"], None, "auto",
                                                 frozenset({"stage_bytes"}), levels=levels)
        assert "stage_bytes" not in fixed
    # fp32 value and the fused kernel keep theirs (not measured)
    for other in (tiled("float32", "float32", "float32", 8, len(levels), 4, 32),
                  tiled(value, value, value, 8, len(levels), 4, 32, fused=True)):
        assert "stage_bytes" not in launch_rules.choose_launch(other, N, Lq, S, H100["sms"], H100["l2_bytes"], None,
                                                               "auto", levels=levels)[0]


@pytest.mark.parametrize("levels,pixels,count", [
    (RTDETR, 1536, 1), (RTDETR, 2048, 2), (RTDETR, 448, 1), (RTDETR, 447, 0), (RTDETR, 6400 + 2048, 3),
    (DETR, 1536, 2), (DETR, 2560, 2), (DETR, 1408, 2), (DETR, 1407, 1),
    ([(2, 3), (100, 100), (1, 1)], 128, 2),  # a finer level may fit where a coarser one did not
])
def test_staged_levels_counts_whole_levels_from_the_coarsest(levels, pixels, count):
    """launch_rules.staged_levels follows the kernel's staging: whole levels from the coarsest on, each in boxes of
    STAGE_BOX_PIXELS pixels, taken where it still fits."""
    assert launch_rules.staged_levels(levels, pixels) == count


def _wavefronts(addresses, width):
    """Shared-memory wavefronts of one warp's loads of `width` bytes at these byte addresses: the largest
    number of distinct 4-byte words any bank serves (same-word reads broadcast), over the phases a load
    of that width takes (a quarter warp for 16 bytes, a half for 8, the whole warp for 4)."""
    phase = {16: 8, 8: 16, 4: 32}[width]
    total = 0
    for start in range(0, len(addresses), phase):
        banks = {}
        for a in addresses[start:start + phase]:
            for word in range(a // 4, (a + width) // 4):
                banks.setdefault(word % 32, set()).add(word)
        total += max(len(words) for words in banks.values())
    return total


def test_ring_rows_apart_spread_over_the_banks():
    """Ring rows leave a gap of what a query's four threads read at once, through the order table (a bulk
    copy a row) and, with more than 16 samples a query, in TMA boxes wider than a row: thread c of each of
    a warp's eight queries reads its point c's location (8 bytes) and weight (4 bytes) of a level in the
    fewest wavefronts (2 and 1); with rows of 256 and 128 bytes back to back all eight queries hit the same
    banks (8 each). Either launch's shared memory leaves L1 60 KB. With 16 samples a query the TMA rows stay
    dense (the gap lost there)."""
    from cute_deform.hopper.config import SMEM_KEEPING_L1

    cfg = tiled("float16", "float32", "float32", 8, 4, 8, 32)
    seed = dataclasses.replace(cfg, **launch_of(cfg, 48, 15422, 19560)[0])
    boxes = dataclasses.replace(cfg, **launch_of(cfg, 1, 15200, 20267)[0])
    assert seed.permuted and not boxes.permuted and boxes.prefetch_inputs
    for apart in (seed, boxes):
        assert apart.rows_apart and apart.smem_bytes <= SMEM_KEEPING_L1 and apart.stage_pixels >= 240 + 920
        for level in range(4):
            for loc_row, attn_row, want in ((apart.loc_row_elems, apart.attn_row_elems, (2, 1)), (64, 32, (8, 8))):
                loc = [4 * (q * loc_row + 2 * (level * 8 + c)) for q in range(8) for c in range(4)]
                attn = [4 * (q * attn_row + level * 8 + c) for q in range(8) for c in range(4)]
                assert (_wavefronts(loc, 8), _wavefronts(attn, 4)) == want
    # The boxes deliver (and the ring barrier expects) whole rows, gap included.
    assert boxes.input_bytes == boxes.queries_per_tile * 4 * (boxes.loc_row_elems + boxes.attn_row_elems)
    assert seed.input_bytes == seed.queries_per_tile * 4 * 3 * 32
    encoder = tiled("float16", "float32", "float32", 8, 4, 4, 32)
    assert not encoder.rows_apart and (encoder.loc_row_elems, encoder.attn_row_elems) == (32, 16)


def test_half_weights_of_a_short_head_row_come_in_a_box_over_the_heads(ptx_of):
    """A head's row of half-precision weights at 12 or 4 points (24 or 8 bytes) cannot be a TMA stride, so the
    input rings took them only in fp32, and fp16 Mask2Former, BEV and RT-DETR shapes fell back to six groups that
    read their inputs themselves (6-32% slower than with fp32 inputs, H100, docs/performance.md session 57). A box
    over the heads' rows of the tile's queries, from the 16-byte boundary at or before the head's row, loads them:
    its rows are padded for that shift and to 16 bytes. It needs the heads' rows of a query to be a multiple of 16
    bytes, and tensor boxes (not the order table's bulk copies)."""
    mask2former = tiled("float16", "float16", "float16", 8, 3, 4, 32)
    bev = tiled("bfloat16", "bfloat16", "bfloat16", 8, 1, 4, 32)
    for cfg, loc_row, attn_row in ((mask2former, 24, 16), (bev, 8, 8)):
        assert cfg.prefetch_inputs and (cfg.loc_row_elems, cfg.attn_row_elems) == (loc_row, attn_row)
        assert cfg.input_bytes == cfg.queries_per_tile * 2 * (loc_row + attn_row)
    # A box's first coordinate must lie on a 16-byte boundary (TMA faults with an illegal instruction otherwise, as
    # the first form of this did on the H100), so each head's row starts up to 16 bytes into the box: every head's
    # row still fits in a box row, at 12, 4 and 9 points (weights) and 9 (locations).
    odd = tiled("float16", "float16", "float16", 8, 3, 3, 32)
    for cfg, per_query, row in ((mask2former, 12, mask2former.attn_row_elems), (bev, 4, bev.attn_row_elems),
                                (odd, 9, odd.attn_row_elems), (odd, 18, odd.loc_row_elems)):
        assert row * 2 % 16 == 0 and all(m * per_query % 8 + per_query <= row for m in range(8))
    assert not tiled("float16", "float16", "float16", 1, 3, 4, 32).prefetch_inputs  # 24 bytes, one head
    assert not dataclasses.replace(mask2former, permuted=True).prefetch_inputs
    # fp32 inputs keep their rows; so do half-precision ones already of 16-byte multiples.
    assert (tiled("float16", "float32", "float32", 8, 3, 4, 32).attn_row_elems,
            tiled("float16", "float16", "float16", 8, 4, 4, 32).attn_row_elems) == (12, 16)
    # The launch the model shapes take with fp32 inputs, now with fp16 ones: the weights' boxes are 3-D.
    ptx = ptx_of["half-weights-three-levels"]
    cfg = configs_of("half-weights-three-levels")
    assert cfg.prefetch_inputs and cfg.producer_warps == 1
    assert len(re.findall(r"^\s*cp\.async\.bulk\.tensor\.3d", ptx, re.M)) == cfg.num_groups
    assert len(re.findall(r"^\s*cp\.async\.bulk\.tensor\.4d", ptx, re.M)) == cfg.num_groups + cfg.num_levels


def test_staggered_locations_spread_over_the_banks():
    """Where two queries of a quarter-warp read location rows 128 bytes apart (DETR's four levels of four points,
    fp32 locations, dense rows, four threads a query), each level's two 16-byte halves cost 8 wavefronts a warp
    read in place and 4 read where TMA's 128-byte swizzle puts them (row q's chunk k at chunk k ^ (q % 8)). The rule
    takes fp16/bf16 encoders in one round of single CTAs and fp16 ones over several rounds; bf16 over several rounds,
    three levels (rows of 96 bytes: no conflict), eight levels (256-byte rows: wider than the swizzle), the split setup
    and the fused kernel keep the plain reads."""
    cfg = tiled("float16", "float32", "float32", 8, 4, 4, 32)
    encoder = dataclasses.replace(cfg, **launch_of(cfg, 2, 22223, 22223)[0])
    assert encoder.staggers_locations and encoder.threads_per_query == 4 and encoder.loc_row_elems * 4 == 128
    for level in range(4):
        for half in range(2):
            plain = [4 * (slot * encoder.loc_row_elems + 8 * level + 4 * half) for slot in range(8) for _ in range(4)]
            staggered = [4 * (slot * encoder.loc_row_elems + ((8 * level + 4 * half) ^ (4 * (slot & 7))))
                         for slot in range(8) for _ in range(4)]
            assert (_wavefronts(plain, 16), _wavefronts(staggered, 16)) == (8, 4)
    bf16 = tiled("bfloat16", "float32", "float32", 8, 4, 4, 32)
    assert launch_of(bf16, 2, 22223, 22223)[0]["stagger_locations"]
    assert launch_of(cfg, 8, 22223, 22223, window=None)[0]["stagger_locations"]  # several rounds: fp16 only
    assert "stagger_locations" not in launch_of(bf16, 8, 22223, 22223, window=None)[0]
    assert "stagger_locations" not in launch_of(cfg, 2, 22223, 22223, fixed={"stagger_locations"})[0]
    eight = tiled("float16", "float32", "float32", 8, 8, 4, 32)
    assert not dataclasses.replace(eight, stagger_locations=True, split_setup=False, cluster_size=1).staggers_locations
    three = tiled("float16", "float32", "float32", 8, 3, 4, 32)
    assert "stagger_locations" not in launch_of(three, 2, 21504, 21504)[0]
    assert not dataclasses.replace(three, stagger_locations=True).staggers_locations
    assert not dataclasses.replace(cfg, stagger_locations=True, split_setup=True).staggers_locations
    fused = tiled("float16", "float16", "float16", 8, 4, 4, 32, fused=True)
    assert not dataclasses.replace(fused, stagger_locations=True).staggers_locations


@pytest.mark.parametrize("dram,value,dropped", [
    (4_800 * 10**9, "float16", True),  # an H200: the fp16 encoders drop the coarser levels' evict-last hint
    (3_350 * 10**9, "float16", False),  # an H100 keeps it
    (0, "float16", False),  # unknown bandwidth: as an H100
    (4_800 * 10**9, "bfloat16", False),  # bf16 was not measured
])
def test_fast_dram_drops_the_coarse_levels_evict_last_hint_on_the_encoders(dram, value, dropped):
    """On DRAM of at least launch_rules.FAST_DRAM_BYTES_PER_S the fp16 encoders' launch (one round of single CTAs, the
    locations staggered) leaves out coarse_evict_last, and only that; the launch it picks is precompiled
    (launch_variants). The decoders, several rounds, a caller's own knob and a launch without the stagger are
    untouched."""
    cfg = tiled(value, "float32", "float32", 8, 4, 4, 32)

    def launch(N, Lq, dram_bytes, fixed=frozenset()):
        return launch_rules.choose_launch(cfg, N, Lq, 22223, H100["sms"], H100["l2_bytes"], None, "auto",
                                          frozenset(fixed), None, dram_bytes)[0]

    plain, fast = launch(2, 22223, 0), launch(2, 22223, dram)
    assert plain["coarse_evict_last"] and plain["stagger_locations"]
    assert fast == ({k: v for k, v in plain.items() if k != "coarse_evict_last"} if dropped else plain)
    assert dataclasses.replace(cfg, **fast) in launch_rules.launch_variants(cfg)
    for N, Lq in ((8, 900), (16, 300), (8, 22223)):  # the decoders, and an encoder over several rounds
        assert launch(N, Lq, dram) == launch(N, Lq, 0)
    assert launch(2, 22223, dram, {"coarse_evict_last"}) == launch(2, 22223, 0, {"coarse_evict_last"})
    assert launch(2, 22223, dram, {"stagger_locations"})["coarse_evict_last"]  # measured with the stagger only


def test_doubled_coarsest_level_spreads_over_the_banks():
    """A staged corner's eight queries of a warp read 64-byte rows, two queries a quarter warp: where a row's half of
    its 128-byte line is its pixel's parity, the two share a half one time in two (6 wavefronts a warp on average
    over random pixels, up to 8), while with the last level doubled (each row twice, side by side) and each query
    reading the copy in its slot's half, they never do: 4 wavefronts at most, whatever the pixels. The rule takes the
    stagger's encoders in one round of single CTAs (fp16 and bf16), whose larger staging buffer holds DETR's last level
    doubled beside its third level and keeps L1 60 KB; the decoders, several rounds and a fixed knob keep the plain
    layout."""
    gen = random.Random(0)
    row = 64
    plain_total = 0
    for _ in range(200):
        pixels = [gen.randrange(273) for _ in range(8)]
        plain = [p * row + 16 * c for p in pixels for c in range(4)]
        doubled = [p * 2 * row + (slot % 2) * row + 16 * c for slot, p in enumerate(pixels) for c in range(4)]
        assert _wavefronts(doubled, 16) <= 4 <= _wavefronts(plain, 16)
        plain_total += _wavefronts(plain, 16)
    assert 5.7 < plain_total / 200 < 6.3  # a quarter warp's two rows share a half one time in two
    cfg = tiled("float16", "float32", "float32", 8, 4, 4, 32)
    encoder = dataclasses.replace(cfg, **launch_of(cfg, 2, 22223, 22223)[0])
    assert encoder.doubles_coarsest and encoder.stage_bytes == launch_rules.DOUBLED_STAGE_BYTES
    # DETR's last two levels in whole staging boxes, the last doubled
    assert 2 * round_up(13 * 21, STAGE_BOX_PIXELS) + round_up(25 * 42, STAGE_BOX_PIXELS) <= encoder.stage_pixels
    assert encoder.smem_bytes + 1024 <= 196 * 1024  # the carveout that leaves L1 60 KB
    for N, Lq in ((8, 900), (16, 300), (8, 22223)):  # the decoders, and an encoder over several rounds
        assert "doubled_coarsest" not in launch_of(cfg, N, Lq, 22223)[0]
    bf16 = tiled("bfloat16", "float32", "float32", 8, 4, 4, 32)
    assert dataclasses.replace(bf16, **launch_of(bf16, 2, 22223, 22223)[0]).doubles_coarsest
    assert "doubled_coarsest" not in launch_of(cfg, 2, 22223, 22223, fixed={"doubled_coarsest"})[0]
    fixed_stage = launch_of(cfg, 2, 22223, 22223, fixed={"stage_bytes"})[0]
    assert fixed_stage["doubled_coarsest"] and "stage_bytes" not in fixed_stage
    assert not dataclasses.replace(cfg, doubled_coarsest=True, fine_gather="tma").doubles_coarsest
    fp32 = tiled("float32", "float32", "float32", 8, 4, 4, 32, doubled_coarsest=True)
    assert not fp32.doubles_coarsest  # 128-byte rows
    assert encoder in launch_rules.launch_variants(cfg)


def test_p4_launches_alternate_the_level_order():
    """fp16/bf16 P = 4 launches without the order table take the staged levels first or last by group and
    tile in turn (measured faster on the encoders and decoders); P = 8, the order table, the fused kernel,
    fp32 value and TMA boxes keep one order (it lost at P = 8, the others were not measured)."""
    for value in ("float16", "bfloat16"):
        cfg = tiled(value, "float32", "float32", 8, 4, 4, 32)
        for N, Lq in ((2, 22223), (8, 900), (16, 300)):  # the encoder's and the decoders' launches
            assert dataclasses.replace(cfg, **launch_of(cfg, N, Lq, 22223)[0]).alternates
        assert not dataclasses.replace(cfg, permuted=True).alternates
    assert not tiled("float16", "float32", "float32", 8, 4, 8, 32).alternates
    assert not tiled("float16", "float16", "float16", 8, 4, 4, 32, fused=True).alternates
    assert not tiled("float32", "float32", "float32", 8, 4, 4, 32).alternates
    assert not tiled("float16", "float32", "float32", 8, 4, 4, 32, fine_gather="tma", num_groups=3).alternates


def test_the_fused_encoder_launch_takes_six_groups():
    # Seven groups spill in the fused kernel (locations and softmax inside); six with one producer warp do not.
    # fp16/bf16 value in one round: the output rows stored evict-first in L2 too.
    # At four points a level the staged corners select their byte addresses.
    six = dict(cluster_size=1, num_groups=6, producers=1, split_setup=False)
    for value in ("float16", "bfloat16"):
        cfg = tiled(value, value, value, 8, 4, 4, 32, fused=True)
        one_round = dict(six, output_evict_first=True, staged_addresses=True)
        assert launch_of(cfg, 2, 22223, 22223)[0] == one_round
        assert dataclasses.replace(cfg, **one_round) in launch_rules.launch_variants(cfg)
        for knob in ("output_evict_first", "staged_addresses"):
            assert knob not in launch_of(cfg, 2, 22223, 22223, fixed={knob})[0]
        # At eight points a level the fused kernel takes them too (the unfused kernel does not: it lost there).
        eight = tiled(value, value, value, 8, 4, 8, 32, fused=True)
        changes = launch_of(eight, 1, 22223, 22223)[0]
        assert changes["staged_addresses"] and "output_evict_first" not in changes
        assert dataclasses.replace(eight, **changes) in launch_rules.launch_variants(eight)
        assert "staged_addresses" not in launch_of(tiled(value, "float32", "float32", 8, 4, 8, 32), 1, 22223, 22223)[0]
    # fp32 too, in one round (N = 2) or several (N = 4), with plain stores.
    fp32 = tiled("float32", "float32", "float32", 8, 4, 4, 32, fused=True)
    assert launch_of(fp32, 2, 22223, 22223)[0] == six
    changes, _, schedule = launch_of(fp32, 4, 22223, 22223)
    assert changes == six and schedule.rounds > 1


def test_fp32_value_takes_single_ctas_of_six_groups():
    """fp32 value: single CTAs of six groups, one producer, each thread its own setup, in any number of
    rounds and for whole segments; the order table keeps CTA pairs."""
    six = dict(cluster_size=1, num_groups=6, producers=1, split_setup=False)
    cfg = tiled("float32", "float32", "float32", 8, 4, 4, 32)
    assert launch_of(cfg, 2, 22223, 22223)[0] == six
    changes, _, schedule = launch_of(cfg, 4, 22223, 22223)
    assert changes == six and schedule.rounds > 1
    assert launch_of(cfg, 8, 900, 22223)[0] == six
    assert launch_of(cfg, 48, 15422, 19560)[0] == dict(permuted=True)


def test_launch_choices_follow_the_caller():
    cfg = tiled("float16", "float32", "float32", 8, 4, 8, 32)
    # An explicit cluster size stays; reorder_queries forces the table on or off.
    assert launch_of(cfg, 2, 22223, 22223, fixed={"cluster_size"})[0] == {}
    # Through the order table each group keeps its producer warp (six groups in 1024 threads), L2 gives
    # whole lines, and 8 samples sum in packed half arithmetic; a caller's line_prefetch and half_sums stay.
    assert launch_of(cfg, 2, 22223, 22223, reorder=True)[0] == dict(permuted=True, cluster_size=1, num_groups=6,
                                                                  gather_batch=2, line_prefetch=True, half_sums=8)
    assert "line_prefetch" not in launch_of(cfg, 2, 22223, 22223, reorder=True, fixed={"line_prefetch"})[0]
    assert "half_sums" not in launch_of(cfg, 2, 22223, 22223, reorder=True, fixed={"half_sums"})[0]
    hints = dict(line_prefetch=True, coarse_evict_last=True)
    assert launch_of(cfg, 2, 22223, 22223, fixed={"num_groups"})[0] == dict(cluster_size=1, **hints)
    assert launch_of(cfg, 2, 22223, 22223, fixed={"producers"})[0] == dict(cluster_size=1, **hints)
    assert launch_of(cfg, 2, 22223, 22223, fixed={"coarse_evict_last"})[0] == dict(
        cluster_size=1, num_groups=4, producers=1, split_setup=True, line_prefetch=True)
    # (P = 8 here: 32 samples a query, so whole segments keep 16-byte vectors.)
    assert launch_of(cfg, 8, 900, 22223, fixed={"producers"})[0] == dict(l1_first=True, gather_batch=4,
                                                                        finest_evict_first=True, early_inputs=True)
    assert launch_of(cfg, 8, 900, 22223, fixed={"gather_batch"})[0] == dict(l1_first=True, producers=1,
                                                                           finest_evict_first=True, early_inputs=True)
    assert launch_of(cfg, 8, 900, 22223, fixed={"early_inputs"})[0] == dict(l1_first=True, producers=1, gather_batch=4,
                                                                           finest_evict_first=True)
    p4 = tiled("float16", "float32", "float32", 8, 4, 4, 32)
    assert launch_of(p4, 8, 900, 22223)[0]["vector_bytes"] == 8
    assert "vector_bytes" not in launch_of(p4, 8, 900, 22223, fixed={"vector_bytes"})[0]
    # ... and CTA pairs over several whole segments each (a large batch of decoders), without the L2 prefetch.
    changes, grid, schedule = launch_of(p4, 32, 300, 22223)
    assert schedule.whole and changes.get("cluster_size", 2) == 2 and 32 * 8 > grid // 2
    assert changes["vector_bytes"] == 8 and "prefetch_levels" not in changes and "output_evict_first" not in changes
    assert "interleave_ranks" not in changes
    # The output rows evict-first in L2 and the tiles dealt to the pair's CTAs in turn: pairs over one segment each
    # with 8-byte vectors, unless the caller fixed the knob or the vectors.
    for knob in ("output_evict_first", "interleave_ranks"):
        assert launch_of(p4, 8, 600, 22223)[0][knob]
        assert knob not in launch_of(p4, 8, 900, 22223, fixed={knob})[0]
        assert knob not in launch_of(p4, 8, 900, 22223, fixed={"vector_bytes"})[0]
    # The L2 prefetch: pairs over one segment each, where 4 Lq P corner reads come to half of S.
    assert launch_of(p4, 8, 700, 22223)[0]["prefetch_levels"]
    assert "prefetch_levels" not in launch_of(p4, 8, 600, 22223)[0]
    assert "prefetch_levels" not in launch_of(p4, 8, 900, 22223, fixed={"prefetch_levels"})[0]
    assert "prefetch_levels" not in launch_of(p4, 8, 900, 22223, fixed={"vector_bytes"})[0]
    # A caller's vector_bytes=8 stays, and the launch plans with its 16-query tiles.
    p4_vectors8 = tiled("float16", "float32", "float32", 8, 4, 4, 32, vector_bytes=8)
    changes, grid, schedule = launch_of(p4_vectors8, 8, 900, 22223, fixed={"vector_bytes"})
    assert "vector_bytes" not in changes and schedule.whole and grid == H100["sms"] // 2 * 2
    # Without the table a large batch also takes single CTAs, over rounds of half of L2 (seed-b48 sorted:
    # 21 rounds); an explicit window stays.
    changes, _, schedule = launch_of(cfg, 48, 15422, 19560, reorder=False, window=None)
    assert changes == dict(cluster_size=1, num_groups=4, producers=1, split_setup=True, line_prefetch=True)
    assert schedule.rounds > launch_of(cfg, 48, 15422, 19560, reorder=False, window=1.0)[2].rounds
    # Rows the consumers read themselves go through the table too; a single tile of queries does not.
    odd = tiled("float16", "float16", "float16", 8, 1, 3, 32)
    assert launch_of(odd, 4096, 20000, 20000)[0]["permuted"]
    assert "permuted" not in launch_of(cfg, 1 << 20, 16, 20000)[0]


ORDER_SHAPES = torch.tensor([(100, 167), (50, 84), (25, 42), (13, 21)])


def test_query_order_is_a_spatial_permutation():
    gen = torch.Generator().manual_seed(5)
    N, Lq = 3, 500

    def sorted_keys(xy, order):
        return raster_cells(xy.gather(1, order[..., None].expand(N, Lq, 2)), ORDER_SHAPES)

    loc = torch.rand(N, Lq, 8, 4, 2, 2, generator=gen)
    loc[1, 7, 0, 0, 0] = float("nan")
    loc[2, 9, 0, 0, 0] = torch.tensor([-3.0, 7.0])  # outside: the nearest edge cell
    order = interface.query_order(loc, None, ORDER_SHAPES)
    assert order.dtype == torch.int64 and order.shape == (N, Lq)
    for n in range(N):
        assert sorted(order[n].tolist()) == list(range(Lq)), "a permutation of each image's queries"
    assert (sorted_keys(loc[:, :, 0, 0, 0], order).diff() >= 0).all(), "raster order of cells in each image"
    assert order[1, -1] == 7, "a NaN position sorts last"
    # Fused: the reference point of the first level decides.
    ref = torch.rand(N, Lq, 4, 2, generator=gen)
    order = interface.query_order(loc, ref, ORDER_SHAPES)
    assert (sorted_keys(ref[:, :, 0], order).diff() >= 0).all()
    assert all(sorted(order[n].tolist()) == list(range(Lq)) for n in range(N))


@pytest.mark.parametrize("levels, grid", [
    ([(100, 167), (50, 84), (25, 42), (13, 21)], (16, 66)),  # DETR's levels: cells of 6.25 rows x 2.5 pixels
    ([(12, 20), (92, 160), (46, 80)], (15, 64)),  # the finest level need not come first
    ([(5, 3), (7, 2)], (1, 1)),  # small levels: one cell, never none
    ([(4000, 4000)], (666, 49)),  # columns give way to keep 32768 cells at most
])
def test_order_grid_takes_cells_of_the_finest_level(levels, grid):
    bands, columns = order_grid(torch.tensor(levels))
    assert (int(bands), int(columns)) == grid
    assert int(bands) * int(columns) <= 32768


def test_query_order_of_many_images():
    """From 2^16 images the (image, cell) keys of the host sort need 64 bits: each image still gets its own
    queries."""
    N, Lq = 1 << 16, 3
    loc = torch.rand(N, Lq, 1, 1, 1, 2, generator=torch.Generator().manual_seed(6))
    order = interface.query_order(loc, None, ORDER_SHAPES)
    assert torch.equal(order.sort(1).values, torch.arange(Lq).expand(N, Lq))
    y = loc[:, :, 0, 0, 0, 1].gather(1, order)
    assert (torch.floor(y * 16).clamp(max=15).diff() >= 0).all()  # DETR's 16 bands, in order


def test_order_kernel_compiles_for_sm90a(tmp_path):
    """The device order table (order.py) for each position dtype: a counting sort in shared memory, its
    places handed out by shared-memory atomics between three block barriers."""
    for dtype in ("float32", "float16", "bfloat16"):
        folder = tmp_path / dtype
        folder.mkdir()
        compile_cache.compile_kernel(OrderConfig(dtype), f"--keep-ptx --dump-dir={folder}")
        ptx = "".join(p.read_text() for p in folder.rglob("*.ptx"))
        assert ptx.count("atom.shared.cta.add.u32") >= 2
        assert ptx.count("bar.sync") >= 4
        assert "st.global.b64" in ptx or "st.global.u64" in ptx


def _meta_call(N, Lq, levels=((92, 160), (46, 80), (23, 40), (12, 20)), M=8, P=8, D=32):
    shapes = torch.tensor(levels)
    starts = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])
    S, L = int(shapes.prod(1).sum()), len(levels)
    value = torch.empty(N, S, M, D, dtype=torch.float16, device="meta")
    loc = torch.empty(N, Lq, M, L, P, 2, device="meta")
    attn = torch.empty(N, Lq, M, L, P, device="meta")
    return value, shapes, starts, loc, attn


def test_launch_arguments_and_the_per_size_cache(monkeypatch):
    """The host side of a launch on meta tensors, the kernel stubbed: the order table is computed only
    from 2^26 samples, the tensor-map workspace is allocated only for TMA boxes (otherwise one small
    placeholder a device serves every call), and a plan works out each size's launch once."""
    launched = []
    monkeypatch.setattr(interface, "_plans", {})
    monkeypatch.setattr(interface, "_device_props", lambda index: (H100["sms"], H100["l2_bytes"], 0))
    monkeypatch.setattr(interface._LaunchPlan, "fn", property(lambda plan: lambda *a: launched.append((plan.cfg, a))))

    small = _meta_call(2, 900)
    for _ in range(2):
        out = interface._launch(*small, None, {})
    assert out.shape == (2, 900, 256) and len(launched) == 2
    (cfg, first), (_, second) = launched
    order, maps = first[6], first[8]
    assert not cfg.permuted and order.shape == (1, 1) and maps.shape == (1, 1, 16)
    assert second[6] is order and second[8] is maps, "placeholders are reused, not allocated per call"
    plan = next(iter(interface._plans.values()))
    assert len(plan.launches) == 1

    large = _meta_call(48, 15422)  # 48 * 15422 * 8 * 4 * 8 samples >= 2^26: through the order table
    interface._launch(*large, None, {})
    cfg, args = launched[-1]
    assert cfg.permuted and args[6].shape == (48, 15422) and args[6].dtype == torch.int64
    assert len(plan.launches) == 2

    # A caller that compiles the order table in itself gets the table too.
    interface._launch(*small, None, {"permuted": True})
    cfg, args = launched[-1]
    assert cfg.permuted and args[6].shape == (2, 900)

    interface._launch(*small, None, {"fine_gather": "tma", "num_groups": 3, "num_stages": 4})
    cfg, args = launched[-1]
    grid = args[9]
    assert cfg.fine_gather == "tma" and args[8].shape == (grid, cfg.map_slots, 16)

    # A level table the caller holds on the host is part of the key (it decides the strips and the staging): the same
    # size with it is one launch more, planned once.
    host = (small[1].tolist(), small[2].tolist())
    before = len(plan.launches)
    for _ in range(2):
        interface._launch(*small, None, {}, host)
    S = small[0].shape[1]
    assert len(plan.launches) == before + 1
    assert (2, 900, S, None, "auto", (((92, 160), (46, 80), (23, 40), (12, 20)), tuple(host[1]))) in plan.launches


def ranges(num_tiles, blocks, clusters, schedule, segment_cost=0):
    """The tile ranges of the device's TileScheduler.boundary, in exact integers."""
    count = clusters * schedule.rounds
    segments = num_tiles // blocks

    def boundary(i):
        if schedule.whole:
            return i * segments // count * blocks
        span = blocks + segment_cost
        v = i * (num_tiles + segment_cost * segments) // count
        k = v // span
        return min(k * blocks + max(v - k * span - segment_cost, 0), num_tiles)
    return [(boundary(i), boundary(i + 1)) for i in range(count)]


@pytest.mark.parametrize("N,M,blocks,clusters,rounds", [(2, 8, 695, 132, 1), (1, 8, 475, 132, 1), (4, 8, 695, 132, 2),
                                                        (3, 5, 7, 2, 3), (1, 1, 1, 132, 1)])
@pytest.mark.parametrize("cost", [1, 4, 9])
def test_segment_cost_covers_every_tile_once_and_shortens_the_ranges_that_cross_a_segment(N, M, blocks, clusters,
                                                                                         rounds, cost):
    num_tiles = N * M * blocks
    schedule = tile_scheduler.Schedule(rounds, False)
    spans = ranges(num_tiles, blocks, clusters, schedule, cost)
    assert spans[0][0] == 0 and spans[-1][1] == num_tiles
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and all(b <= e for b, e in spans)
    count = clusters * rounds
    share = -(-(num_tiles + cost * N * M) // count)  # the longest range of the longer sequence
    for begin, end in spans:
        # each segment start inside a range takes `cost` of its share
        starts_inside = len([s for s in range(blocks, num_tiles, blocks) if begin < s < end])
        assert end - begin <= share + 1 - cost * starts_inside, (begin, end)
    if cost < num_tiles // count < blocks // 2:  # ranges shorter than half a segment: some cross, most do not
        crossing = [e - b for b, e in spans if b // blocks != (e - 1) // blocks]
        others = [e - b for b, e in spans if b // blocks == (e - 1) // blocks]
        assert crossing and max(crossing) < max(others)


def _conversions_and_shuffles(cfg, folder):
    compile_cache.compile_kernel(cfg, f"--keep-ptx --dump-dir={folder}")
    ptx = next(folder.glob("*.sm_90a.ptx")).read_text()
    half = {"float16": "f16", "bfloat16": "bf16"}[cfg.value_dtype]
    conversions = len(re.findall(rf"^\s*cvt\.f32\.{half}\b", ptx, re.M))
    segment = ((32 - cfg.threads_per_query) << 8) | 31
    shuffles = len(re.findall(rf"shfl\.sync\.idx\.b32\s+%r\d+, %r\d+, \d+, {segment}, -1;", ptx))
    return conversions, shuffles


@pytest.mark.parametrize("value,P,split,sums", [("float16", 8, False, 8), ("bfloat16", 4, True, 2)])
def test_half_sums_convert_once_a_sum_and_pass_no_weight(tmp_path, value, P, split, sums):
    """KernelConfig.half_sums: the packed half corner sums of up to `sums` samples add up before one conversion
    to fp32 (a conversion a channel), not one a sample; with the setup split, the records a query's threads
    pass each other lose the attention weight (it is in the corner weights): four shuffles a sample, not five."""
    base = tiled(value, "float32", "float32", 8, 4, P, 32, permuted=True, split_setup=split)
    folded = dataclasses.replace(base, half_sums=sums)
    (tmp_path / "base").mkdir()
    (tmp_path / "folded").mkdir()
    conversions, shuffles = _conversions_and_shuffles(base, tmp_path / "base")
    fewer, passed = _conversions_and_shuffles(folded, tmp_path / "folded")
    assert conversions > 0 and fewer * sums == conversions, (conversions, fewer)
    assert (shuffles > 0) == split and passed * 5 == shuffles * 4, (shuffles, passed)
    with pytest.raises(ValueError, match="half_sums"):
        tiled("float32", "float32", "float32", 8, 4, 4, 32, half_sums=2)
    with pytest.raises(ValueError, match="half_sums"):
        dataclasses.replace(base, half_sums=17)


def test_the_encoders_segment_cost_stays_within_an_int32():
    cfg = tiled("float16", "float32", "float32", 8, 4, 4, 32, segment_cost=4)
    with pytest.raises(ValueError, match="segment_cost"):
        launch_of(cfg, 2**15, 2**14, 22223, fixed={"segment_cost"})
    cfg = tiled("float16", "float32", "float32", 8, 4, 4, 32)
    assert "segment_cost" in launch_of(cfg, 2, 22223, 22223)[0]
    with pytest.raises(ValueError, match="segment_cost"):
        tiled("float16", "float32", "float32", 8, 4, 4, 32, segment_cost=-1)


@pytest.mark.parametrize("N,M,blocks,clusters", [(48, 8, 482, 66), (8, 8, 29, 66), (1, 8, 475, 66), (2, 8, 695, 66),
                                                 (1, 1, 3, 66), (3, 5, 7, 2)])
def test_schedule_covers_every_tile_once_and_bounds_the_window(N, M, blocks, clusters):
    num_tiles = N * M * blocks
    slice_bytes = 20_000 * 64
    window = 25 << 20
    schedule = tile_scheduler.plan(num_tiles, blocks, clusters, slice_bytes, window, min_range=20, slack=5)
    spans = ranges(num_tiles, blocks, clusters, schedule)
    covered = [t for begin, end in spans for t in range(begin, end)]
    assert sorted(covered) == list(range(num_tiles)), "every tile exactly once"
    if schedule.whole:
        assert all(begin % blocks == 0 for begin, _ in spans)
    if schedule.whole and schedule.rounds == 1:
        return  # few segments: each cluster takes whole ones and reads each slice alone
    # In one round, all clusters work inside one stretch of tiles whose slices fit the window.
    for r in range(schedule.rounds):
        stretch = spans[r * clusters:(r + 1) * clusters]
        first, last = stretch[0][0], stretch[-1][1]
        if last > first:
            slices = (last - 1) // blocks - first // blocks + 1
            assert slices * slice_bytes <= window or last - first <= clusters * 20 + blocks


def test_one_round_without_a_window():
    schedule = tile_scheduler.plan(48 * 8 * 482, 482, 66, 1 << 20, 0, 20, 5)
    assert schedule.rounds == 1


@pytest.mark.parametrize("name", ["boxes", "boxes-cluster2-fp32"])
def test_tma_boxes_are_issued_by_one_lane(ptx_of, name):
    """Each per-sample box copy sits in lane 0's loop over the warp's boxes, fed by shuffles of the lanes'
    coordinates: issued by all 32 lanes at once, boxes landed wrong at random (session 15)."""
    lines = ptx_of[name].splitlines()
    sites = [i for i, line in enumerate(lines) if "cp.async.bulk.tensor.5d" in line]
    assert sites
    for i in sites:
        before = "\n".join(lines[max(0, i - 12):i])
        assert "shfl.sync.idx" in before and "bra" in before, f"{name}: box copy at PTX line {i} not in the loop"


def test_a_kernel_taking_more_shared_memory_than_its_configuration_plans_does_not_compile(monkeypatch):
    # The host sizes grids, staging and L1's carveout by KernelConfig.smem_bytes; the kernel's shared
    # storage is checked against it when it compiles.
    cfg = configs_of("default")
    monkeypatch.setattr(KernelConfig, "smem_bytes", property(lambda self: 1024))
    with pytest.raises(RuntimeError, match="more than its configuration plans"):
        compile_cache.compile_kernel(cfg)


@pytest.mark.parametrize("P", [4, 8])
def test_every_launch_of_fp16_value_is_a_variant_the_precompile_covers(P):
    cfg = tiled("float16", "float32", "float32", 8, 4, P, 32)
    variants = launch_rules.launch_variants(cfg)
    for N, Lq, S in ((1, 15200, 20197), (2, 22223, 22223), (8, 22223, 22223), (8, 900, 22223), (16, 300, 22223),
                     (32, 300, 22223), (48, 15422, 19560), (1, 16, 20000)):
        launched = launch_rules.launched_config(cfg, N, Lq, S, {})
        assert launched in variants, (N, Lq, S, launched)


M2F = [(128, 128), (64, 64), (32, 32)]


@pytest.mark.parametrize("value", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("levels,N", [(M2F, 2), ([(128, 256), (64, 128), (32, 64)], 1), ([(100, 167), (50, 84)], 2)])
def test_encoders_at_up_to_three_levels_take_strips(value, levels, N):
    """One round of single CTAs over long ranges at up to three levels takes the strips (KernelConfig.strips; the
    kernel decides from the level table whether the first level's rows are whole tiles), any value dtype."""
    S = sum(h * w for h, w in levels)
    cfg = tiled(value, "float32", "float32", 8, len(levels), 4, 32)
    changes, _, schedule = launch_of(cfg, N, S, S)
    assert changes.get("strips") is True and schedule.rounds == 1
    assert dataclasses.replace(cfg, **changes) in launch_rules.launch_variants(cfg)


@pytest.mark.parametrize("levels,N,Lq,P,fused", [
    (DETR, 2, 22223, 4, False),  # four levels: the second copy of the tile loop cost detr-encoder 2%
    (DETR[:1] + [(50, 84)], 8, 21000, 4, False),  # several rounds
    (M2F, 8, 21504, 4, False),  # several rounds (lost 9%)
    ([(64, 64), (32, 32), (16, 16)], 2, 5376, 4, False),  # ranges of 20 tiles (lost 2%)
    (M2F, 2, 21504, 4, True),  # the fused kernel: 8-9% faster where on, but the copies cost 10-12% where off
    (DETR, 8, 900, 4, False),  # decoders: whole segments
])
def test_strips_stay_off_where_they_lost_or_were_not_measured(levels, N, Lq, P, fused):
    S = sum(h * w for h, w in levels)
    loc = "float16" if fused else "float32"
    cfg = tiled("float16", loc, loc, 8, len(levels), P, 32, fused=fused)
    changes, _, _ = launch_of(cfg, N, Lq, S)
    assert not changes.get("strips", False)


def strip_blocks(levels, Lq, tile=32):
    """A Python twin of tile_scheduler.strip_plan and TileScheduler.block_of, in float32 as the kernel computes: the
    query block of each place of one segment."""
    import numpy as np
    (H, W), blocks = levels[0], -(-Lq // tile)
    on = W % tile == 0 and W > tile and H > 1 and H * W <= Lq and Lq < 1 << 24
    strip_blocks = H * (W // tile) if on else 0
    place = np.arange(blocks, dtype=np.int64)
    column = ((place.astype(np.float32) + np.float32(0.5)) * (np.float32(1.0) / np.float32(H))).astype(np.int64)
    strip = (place - column * H) * (W // tile) + column
    return np.where(place < strip_blocks, strip, place)


@pytest.mark.parametrize("levels,Lq", [(M2F, 21504), ([(128, 256), (64, 128), (32, 64)], 43008),
                                       ([(96, 160), (48, 80), (24, 40)], 96 * 160), (DETR, 22223),
                                       ([(200, 200)], 40000), ([(64, 64)], 5000)])
def test_strip_map_is_a_bijection_in_column_strips(levels, Lq):
    """The strips take every query block of a segment once; where the first level's rows are whole tiles (and the
    queries cover it) its blocks go column by column, top to bottom, and the rest keep their place."""
    import numpy as np
    blocks = strip_blocks(levels, Lq)
    assert sorted(blocks.tolist()) == list(range(len(blocks)))
    (H, W) = levels[0]
    if W % 32 == 0 and H * W <= Lq:
        row_blocks = W // 32
        expected = [y * row_blocks + x for x in range(row_blocks) for y in range(H)]
        assert blocks[:H * row_blocks].tolist() == expected
        assert (blocks[H * row_blocks:] == np.arange(H * row_blocks, len(blocks))).all()
    else:
        assert (blocks == np.arange(len(blocks))).all()


def test_strip_columns_in_float32_are_exact():
    """block_of's column, (place + 0.5) times the float32 inverse of H truncated, is place // H for every place the
    kernel can meet (under 2^19 blocks: strip_plan takes Lq < 2^24) and any H."""
    import numpy as np
    place = np.arange(1 << 19, dtype=np.int64)
    p32 = place.astype(np.float32) + np.float32(0.5)
    for H in list(range(2, 260)) + [511, 512, 513, 1000, 1023, 1024, 4095, 4096, 10007, 65535]:
        column = (p32 * (np.float32(1.0) / np.float32(H))).astype(np.int64)
        assert (column == place // H).all(), H


@pytest.mark.parametrize("levels,N,hint,expected", [
    (M2F, 2, True, True),  # the host read the level table: the strips are on
    (M2F, 2, None, False),  # a table on the device: the host cannot tell (the copies cost 10-12% where off)
    ([(100, 167), (50, 84), (25, 42)], 2, False, False),
    ([(128, 256), (64, 128), (32, 64)], 1, True, True),
    (DETR[:1] + [(64, 64)], 2, True, True),
])
def test_the_fused_kernel_takes_strips_where_the_host_knows_they_are_on(levels, N, hint, expected):
    S = sum(h * w for h, w in levels)
    cfg = tiled("float16", "float16", "float16", 8, len(levels), 4, 32, fused=True)
    changes, _, _ = launch_rules.choose_launch(cfg, N, S, S, H100["sms"], H100["l2_bytes"], None, "auto",
                                               frozenset(), hint)
    assert changes.get("strips", False) == expected
    assert dataclasses.replace(cfg, **changes) in launch_rules.launch_variants(cfg)


@pytest.mark.parametrize("levels,Lq", [(M2F, 21504), ([(128, 256), (64, 128), (32, 64)], 43008), (DETR, 22223),
                                       ([(96, 160), (48, 80), (24, 40)], 96 * 160), ([(64, 64)], 5000),
                                       ([(32, 64), (16, 32)], 2560)])
def test_strip_rows_on_the_host_agrees_with_the_kernels_map(levels, Lq):
    """launch_rules.strip_rows (the host's reading of a CPU level table) says the strips are on exactly where the
    kernel's map (its twin) moves some block."""
    import numpy as np
    starts = [0]
    for h, w in levels[:-1]:
        starts.append(starts[-1] + h * w)
    moved = (strip_blocks(levels, Lq) != np.arange(-(-Lq // 32))).any()
    assert launch_rules.strip_rows(levels, starts, Lq, 32) == bool(moved)


@pytest.mark.parametrize("D,W,on", [(32, 96, True), (16, 96, False), (16, 128, True), (64, 48, True), (64, 40, False)])
def test_the_hosts_reading_of_the_strips_uses_the_kernels_tile(D, W, on):
    """The fused op's launch reads a host level table at the kernel's own tile (32 queries at D = 32 in fp16, 64 at
    D = 16, 16 at D = 64), so that it takes the strips exactly where the kernel's strip_plan turns them on."""
    from cute_deform.hopper import interface
    cfg = tiled("float16", "float16", "float16", 8, 3, 4, D, fused=True)
    levels = [(64, W), (32, W // 2), (16, W // 4)]
    starts = [0, 64 * W, 64 * W + 32 * (W // 2)]
    S = sum(h * w for h, w in levels)
    assert interface._host_strips(cfg, (levels, starts), S) is on
    assert interface._host_strips(cfg, None, S) is None
