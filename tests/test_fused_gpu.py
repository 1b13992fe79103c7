"""On an sm_90 GPU: torch.ops.cute_deform.forward_fused (the Hopper kernel once
cute_deform.hopper.interface is installed, else its torch fallback) against the float64 fused
reference, hostile values, no host sync, CUDA graph capture, torch.compile; MSDeformAttn and a patched
transformers model on the GPU. Skipped on machines without a CUDA device of capability 9.0."""
import itertools
import math
import warnings

import pytest
import torch

from cute_deform import SlowPathWarning, fused, fused_reference, op
from cute_deform.nn import MSDeformAttn
from msda_testing import (finite_rel_err, level_tensors, make_fused_inputs, nonfinite_mismatch, output_on_nan,
                          rel_err)

pytestmark = pytest.mark.gpu

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: torch.finfo(torch.float16).eps,
             torch.bfloat16: torch.finfo(torch.bfloat16).eps}
LEVELS = [(50, 84), (25, 42), (13, 21), (7, 11)]
SIZES = dict(batch=2, queries=300, heads=8, head_dim=32, points=4)


def logit_dtype_for(input_dtype):
    """The logits' dtype beside reference points and offsets in input_dtype: fp32 where those are not, bf16 where
    they are, so that mixes are covered too."""
    return torch.float32 if input_dtype != torch.float32 else torch.bfloat16


def on_cuda(args):
    return [t.cuda() for t in args]


def run_fused(args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        return torch.ops.cute_deform.forward_fused(*args)


def hopper_fused_available() -> bool:
    return op.kernel_unavailable_reason(torch.cuda.current_device()) is None and (
        fused._hopper_fused_unavailable_reason() is None)


@pytest.mark.parametrize("value_dtype,input_dtype", list(itertools.product(FLOATS, repeat=2)), ids=str)
@pytest.mark.parametrize("ref_dim", [2, 4])
def test_fused_op_matches_float64_reference(gen, value_dtype, input_dtype, ref_dim):
    """reference_points and offsets in input_dtype, logits in logit_dtype_for(input_dtype)."""
    args = on_cuda(make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=ref_dim, dtype=value_dtype, ref_dtype=input_dtype,
                                     offset_dtype=input_dtype, logit_dtype=logit_dtype_for(input_dtype)))
    out = output_on_nan(lambda: run_fused(args))
    ref = fused_reference(*args, out_dtype=torch.float64)
    assert out.dtype == value_dtype and out.shape == ref.shape and out.is_cuda
    assert torch.isfinite(out).all(), "output elements left unwritten (poisoned with NaN)"
    assert rel_err(out, ref) < TOLERANCE[value_dtype]


@pytest.mark.parametrize("ref_dim", [2, 4])
def test_hostile_values(gen, ref_dim):
    """NaN / inf / huge offsets and reference points, NaN and +-inf logits: NaN where the reference has
    NaN (a sample's NaN weight may meet its corners differently: inf may come back as NaN)."""
    args = make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=ref_dim, dtype=torch.float32)
    args = list(args)
    for index, pool, fraction in ((3, [math.nan, math.inf, -5.0], 0.01), (4, [1e30, -1e10, math.inf, math.nan], 0.05),
                                  (5, [math.nan, math.inf, -math.inf, 1e30], 0.005)):
        pick = torch.tensor(pool, dtype=torch.float64)[torch.randint(len(pool), args[index].shape, generator=gen)]
        use = torch.rand(args[index].shape, generator=gen) < fraction
        args[index] = torch.where(use, pick.to(args[index].dtype), args[index])
    args = on_cuda(args)
    out = run_fused(args)
    ref = fused_reference(*args, out_dtype=torch.float64)
    assert nonfinite_mismatch(out, ref, same_kinds=False) is None
    assert finite_rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("tables_on", ["cuda", "cpu"])
def test_no_host_sync(gen, tables_on):
    """No call synchronizes with the GPU: level tables on the GPU are never read; tables on the CPU are
    read on the host and copied once (the first call, before the check)."""
    args = on_cuda(make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=4, dtype=torch.float16, ref_dtype=torch.float32))
    if tables_on == "cpu":
        args[1], args[2] = args[1].cpu(), args[2].cpu()
    run_fused(args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_fused(args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("tables_on", ["cuda", "cpu"])
def test_cuda_graph_capture_and_replay(gen, tables_on):
    args = on_cuda(make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=2, dtype=torch.float16, ref_dtype=torch.float32))
    if tables_on == "cpu":
        args[1], args[2] = args[1].cpu(), args[2].cpu()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture (kernel compile, level table copy)
            run_fused(args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_fused(args)
    fresh = on_cuda(make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=2, dtype=torch.float16, ref_dtype=torch.float32))
    for static, new in zip(args, fresh):
        if static.is_floating_point():
            static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run_fused(args))
    assert rel_err(out, fused_reference(*args, out_dtype=torch.float64)) < TOLERANCE[torch.float16]


def test_torch_compile_fullgraph(gen):
    def step(value, shapes, starts, ref, offsets, logits):
        return torch.ops.cute_deform.forward_fused(value, shapes, starts, ref, offsets, logits) * 2 + 1

    compiled = torch.compile(step, fullgraph=True)
    args = on_cuda(make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=4, dtype=torch.float16, ref_dtype=torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        out = compiled(*args)
    assert rel_err(out, fused_reference(*args, out_dtype=torch.float64) * 2 + 1) < TOLERANCE[torch.float16]


@pytest.mark.skipif(not torch.cuda.is_available() or not hopper_fused_available(),
                    reason="cute_deform.hopper.interface (the fused Hopper kernel) is not available here")
def test_sm90_runs_the_fused_kernel(gen, monkeypatch):
    """On sm_90 the op runs the fused Hopper kernel (locations and softmax inside), without warnings."""
    from cute_deform import native
    from cute_deform.hopper import interface

    native.clear()  # a launch the C++ launcher holds from an earlier test would not come through Python
    calls = []
    real = interface.msda_forward_fused
    monkeypatch.setattr(interface, "msda_forward_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    args = on_cuda(make_fused_inputs(gen, LEVELS, **SIZES, dtype=torch.float16, ref_dtype=torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        out = torch.ops.cute_deform.forward_fused(*args)
    assert calls
    assert rel_err(out, fused_reference(*args, out_dtype=torch.float64)) < TOLERANCE[torch.float16]


@pytest.mark.skipif(not torch.cuda.is_available() or not hopper_fused_available(),
                    reason="cute_deform.hopper.interface (the fused Hopper kernel) is not available here")
@pytest.mark.parametrize("levels,batch,queries", [([(200, 200)], 2, 40000), ([(80, 80), (40, 40), (20, 20)], 4, 300)])
def test_fused_kernel_under_session_30_launch_rules(gen, levels, batch, queries):
    """The fused kernel on a BEV-like level too large to stage (no staging buffer) and on RT-DETR's decoder at N=4
    (short ranges: 8-byte vectors, four groups, the setup split): within the bound of float64, outputs poisoned, as
    with the launch before those rules (a 96 KB stage; a caller's window)."""
    from cute_deform.hopper import interface

    args = on_cuda(make_fused_inputs(gen, levels, batch=batch, queries=queries, heads=8, head_dim=32, points=4,
                                     ref_dim=4 if queries == 300 else 2, dtype=torch.float16,
                                     ref_dtype=torch.float16, offset_dtype=torch.float16, logit_dtype=torch.float16))
    ref = fused_reference(*args, out_dtype=torch.float64)
    before = dict(stage_bytes=96 * 1024) if len(levels) == 1 else dict(window_fraction=0.5)
    for tuning in ({}, before):
        out = output_on_nan(lambda: interface.msda_forward_fused(*args, **tuning))
        assert torch.isfinite(out).all() and rel_err(out, ref) < TOLERANCE[torch.float16], tuning


@pytest.mark.skipif(not torch.cuda.is_available() or not hopper_fused_available(),
                    reason="cute_deform.hopper.interface (the fused Hopper kernel) is not available here")
@pytest.mark.parametrize("levels", [[(128, 128), (64, 64), (32, 32)], [(100, 167), (50, 84), (25, 42)]])
def test_fused_op_with_a_host_level_table_takes_strips_where_they_are_on(gen, levels):
    """Through the op, a level table on the CPU (as transformers' models pass it) tells the fused launch whether
    the kernel's strips are on (interface._host_strips): Mask2Former's levels take them, DETR's 167-pixel rows
    do not; each within the bound of float64 (outputs poisoned), as the launch without strips."""
    from cute_deform.hopper import interface, launch_rules

    S = sum(h * w for h, w in levels)
    args = make_fused_inputs(gen, levels, batch=2, queries=S, heads=8, head_dim=32, points=4, dtype=torch.float16,
                             ref_dtype=torch.float16, offset_dtype=torch.float16, logit_dtype=torch.float16)
    value, shapes, starts, ref_points, offsets, logits = args
    args = [value.cuda(), shapes, starts, ref_points.cuda(), offsets.cuda(), logits.cuda()]  # tables on the CPU
    on = launch_rules.strip_rows(shapes.tolist(), starts.tolist(), S, 32)  # 32 queries a tile at D = 32, fp16
    assert on == (levels[0][1] % 32 == 0)
    expected = fused_reference(*args, out_dtype=torch.float64)
    out = output_on_nan(lambda: run_fused(args))
    assert torch.isfinite(out).all() and rel_err(out, expected) < TOLERANCE[torch.float16]
    # The launch the op chose, cached by size and the host's table: (N, Lq, S, window, reorder, table).
    key = (2, S, S, None, "auto", interface._host_table((shapes.tolist(), starts.tolist())))
    launched = [launch[0].cfg for plan in interface._plans.values() for size, launch in plan.launches.items()
                if size == key and launch[0].cfg.fused]
    assert len(launched) == 1 and launched[0].strips == on, launched
    plain = output_on_nan(lambda: interface.msda_forward_fused(*[t.cuda() for t in args], strips=False))
    assert torch.isfinite(plain).all() and rel_err(plain, expected) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_module_on_the_gpu_equals_the_unfused_formula(gen, dtype):
    """MSDeformAttn (fused op) against the same layer computed unfused in float64 on the GPU."""
    d_model, levels = 256, LEVELS
    module = MSDeformAttn(d_model, len(levels), 8, 4)
    with torch.no_grad():
        for layer in (module.sampling_offsets, module.attention_weights):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / math.sqrt(d_model))
    module = module.cuda().to(dtype).eval()
    shapes, starts = level_tensors(levels)
    S = int(shapes.prod(-1).sum())
    query = torch.randn((2, 300, d_model), generator=gen).cuda().to(dtype)
    flat = torch.randn((2, S, d_model), generator=gen).cuda().to(dtype)
    ref = torch.rand((2, 300, len(levels), 2), generator=gen).cuda().to(dtype)
    mask = (torch.rand((2, S), generator=gen) < 0.2).cuda()
    with torch.no_grad():
        out = run_module(module, query, ref, flat, shapes.cuda(), starts.cuda(), mask)
        double = module.double()
        expected = unfused_double(double, query, ref, flat, shapes.cuda(), starts.cuda(), mask)
    assert out.dtype == dtype
    assert rel_err(out, expected) < (1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps)


def run_module(module, *inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        return module(*inputs)


def unfused_double(module, query, ref, flat, shapes, starts, mask):
    """The module's formula in float64 (locations, softmax, masked value) on the float64 reference."""
    from cute_deform import ms_deform_attn_reference

    query, ref, flat = query.double(), ref.double(), flat.double()
    N, Lq, _ = query.shape
    S = flat.shape[1]
    M, L, P = module.n_heads, module.n_levels, module.n_points
    value = module.value_proj(flat).masked_fill(mask[..., None], 0.0).view(N, S, M, -1)
    offsets = module.sampling_offsets(query).view(N, Lq, M, L, P, 2)
    weights = module.attention_weights(query).view(N, Lq, M, L * P).softmax(-1).view(N, Lq, M, L, P)
    locations = ref[:, :, None, :, None, :] + offsets / shapes.flip(-1).double()[None, None, None, :, None, :]
    return module.output_proj(ms_deform_attn_reference(value, shapes, starts, locations, weights))


def test_patched_transformers_model_on_the_gpu(gen):
    """A small random Deformable DETR (two-stage: 2-d and 4-d reference points) on the GPU, fp32:
    patched equals as shipped within 1e-5."""
    transformers = pytest.importorskip("transformers")
    import cute_deform.integrations.transformers as cdt

    backbone = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1],
                                         out_features=["stage2", "stage3", "stage4"])
    named = {"backbone": None} if int(transformers.__version__.split(".")[0]) < 5 else {}
    config = transformers.DeformableDetrConfig(
        backbone_config=backbone, use_timm_backbone=False, use_pretrained_backbone=False, **named, d_model=64,
        encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=2,
        decoder_attention_heads=2, num_queries=20, two_stage=True, with_box_refine=True, two_stage_num_proposals=20)
    torch.manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
    model = transformers.DeformableDetrForObjectDetection(config).cuda().eval()
    for module in model.modules():
        if cdt._looks_like_msda(module):
            with torch.no_grad():
                for layer in (module.sampling_offsets, module.attention_weights):
                    layer.weight.normal_(0, 1 / math.sqrt(layer.weight.shape[1]))
    pixels = torch.randn((2, 3, 256, 320), generator=gen).cuda()
    mask = torch.ones((2, 256, 320), dtype=torch.long, device="cuda")
    mask[1, :, 240:] = 0
    with torch.no_grad():
        expected = model(pixel_values=pixels, pixel_mask=mask)
        cdt.patch(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SlowPathWarning)
            patched = model(pixel_values=pixels, pixel_mask=mask)
        cdt.unpatch(model)
    for field in ("logits", "pred_boxes", "last_hidden_state", "encoder_last_hidden_state"):
        assert rel_err(patched[field], expected[field]) < 1e-5, field
