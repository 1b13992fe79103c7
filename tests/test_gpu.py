"""On an sm_90 GPU: the op (CuTe kernel, or its fallback until the kernel is available) against the
float64 reference, no host sync in validation, and the reference's bounded memory on the largest preset.
Skipped on machines without a CUDA device of capability 9.0 (see conftest.py)."""
import itertools
import warnings

import pytest
import torch

from cute_deform import SlowPathWarning, demo, ms_deform_attn_grid_sample, ms_deform_attn_reference
from cute_deform.hopper import interface
from cute_deform._checks import check_inputs
from msda_testing import make_inputs, output_on_nan, rel_err

pytestmark = pytest.mark.gpu

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: torch.finfo(torch.float16).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps}


def on_cuda(args):
    return [t.cuda() for t in args]


@pytest.mark.parametrize("value_dtype,loc_dtype", list(itertools.product(FLOATS, repeat=2)), ids=str)
@pytest.mark.parametrize("preset", ["decoder", "tiny"])
def test_op_matches_float64_reference(gen, preset, value_dtype, loc_dtype):
    args = demo.make_inputs(demo.PRESETS[preset], value_dtype, torch.device("cuda"), gen)
    args[3], args[4] = args[3].to(loc_dtype), args[4].to(loc_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        out = output_on_nan(lambda: torch.ops.cute_deform.forward(*args))
    ref = ms_deform_attn_reference(*args, out_dtype=torch.float64)
    assert out.dtype == value_dtype and out.shape == ref.shape and out.is_cuda
    assert torch.isfinite(out).all(), "output elements left unwritten (poisoned with NaN)"
    assert rel_err(out, ref) < TOLERANCE[value_dtype]


@pytest.mark.skipif(not interface.available(), reason="the CuTe DSL is not installed")
def test_sm90_runs_the_kernel_not_the_fallback(gen):
    args = on_cuda(make_inputs(gen, [(8, 8), (4, 4)], head_dim=32, dtype=torch.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        torch.ops.cute_deform.forward(*args)


def test_validation_does_not_synchronize(gen):
    args = on_cuda(make_inputs(gen, [(8, 8), (4, 4)], dtype=torch.float16))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        check_inputs(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fallback_path_matches_reference_on_gpu(gen):
    levels = [(17, 23), (9, 12), (5, 6), (1, 3)]
    args = on_cuda(make_inputs(gen, levels, batch=3, queries=100, heads=8, head_dim=32, points=4, dtype=torch.float16))
    out = ms_deform_attn_grid_sample(*args, out_dtype=torch.float64)
    assert rel_err(out, ms_deform_attn_reference(*args, out_dtype=torch.float64)) < 1e-6


def test_reference_memory_is_bounded_on_the_largest_preset(gen):
    """The float64 reference for N=48, Lq=15422, M=8, L=4, P=8, D=32 fits in one GPU."""
    args = demo.make_inputs(demo.PRESETS["seed"], torch.float16, torch.device("cuda"), gen)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = ms_deform_attn_reference(*args, out_dtype=torch.float64)
    assert out.shape == (48, 15422, 256) and torch.isfinite(out).all()
    assert torch.cuda.max_memory_allocated() - before < 12 * 2**30


@pytest.mark.skipif(not interface.available(), reason="the CuTe DSL is not installed")
@pytest.mark.parametrize("head_dim", [3, 30, 48])
def test_any_head_dim_runs_on_the_kernel(gen, head_dim):
    """Head dims whose rows are not whole 16-byte vectors (or not a power of two) run on a Hopper kernel
    (the generic one for 3 and 30, the tiled one for 48), not on the slow path."""
    args = on_cuda(make_inputs(gen, [(8, 8), (3, 5)], head_dim=head_dim, dtype=torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        out = torch.ops.cute_deform.forward(*args)
    assert rel_err(out, ms_deform_attn_reference(*args, out_dtype=torch.float64)) < 1e-5


