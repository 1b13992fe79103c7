"""torch.ops.cute_deform.forward_fused on the CPU: the module formula (locations and softmax) followed
by the forward's rules, in every dtype combination, with 2-d and 4-d reference points, hostile values,
empty sizes, any strides; opcheck, torch.compile, forward only; the CUDA kernel's dispatch (without a
GPU: meta tensors and a stand-in for the Hopper entry point)."""
import itertools
import math
import sys

import pytest
import torch

import cute_deform
from cute_deform import fused, fused_reference, ms_deform_attn_fused, ms_deform_attn_reference, op
from msda_testing import (brute_force_msda, draw_nonzero, finite_rel_err, make_fused_inputs, nonfinite_mismatch,
                          rel_err, stand_in_hopper_interface, unfused_locations_and_weights)

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
LEVELS = [(7, 9), (4, 5), (2, 3), (1, 1)]
# The float64 reference sees the same rounded inputs. What is left: fp32 arithmetic, where rounding a
# location by ~6e-8 moves a sample by up to W*6e-8 pixels (a few 1e-7 of the output), and for fp16 /
# bf16 values the rounding of the output (at most eps/2 per element).
TOLERANCE = {torch.float32: 2e-6, torch.float16: torch.finfo(torch.float16).eps,
             torch.bfloat16: torch.finfo(torch.bfloat16).eps}
SIZES = dict(batch=2, queries=6, heads=3, head_dim=8, points=3)


def fused_op(*args):
    return torch.ops.cute_deform.forward_fused(*args)


@pytest.mark.parametrize("ref_dim", [2, 4])
def test_fused_reference_is_the_module_formula_then_the_original_rule(gen, ref_dim):
    """fused_reference equals the module formula written out per level (float64) followed by a scalar
    loop of the original kernel's rule: the reference itself is what it claims."""
    args = make_fused_inputs(gen, [(3, 4), (2, 2), (1, 3)], batch=2, queries=3, heads=2, head_dim=3, points=2,
                             ref_dim=ref_dim)
    value, shapes, starts, ref, offsets, logits = args
    locations, weights = unfused_locations_and_weights(shapes, ref, offsets, logits)
    expected = brute_force_msda(value, shapes, starts, locations, weights)
    assert rel_err(fused_reference(*args), expected) < 1e-13
    inside = ((locations > -0.5 / 4) & (locations < 1 + 0.5 / 4)).all(-1)
    assert 0 < inside.double().mean() < 1  # some samples inside a level, some outside


@pytest.mark.parametrize(
    "value_dtype,ref_dtype,offset_dtype,logit_dtype", list(itertools.product(FLOATS, repeat=4)),
    ids=lambda d: str(d)[6:],
)
def test_fused_op_matches_float64_reference_in_every_dtype_mix(gen, value_dtype, ref_dtype, offset_dtype,
                                                                logit_dtype):
    for ref_dim in (2, 4):
        args = make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=ref_dim, dtype=value_dtype, ref_dtype=ref_dtype,
                                 offset_dtype=offset_dtype, logit_dtype=logit_dtype)
        out = fused_op(*args)
        assert out.dtype == value_dtype and out.shape == (2, 6, 3 * 8)
        ref = fused_reference(*args, out_dtype=torch.float64)
        assert rel_err(out, ref) < TOLERANCE[value_dtype], f"ref_dim {ref_dim}"


@pytest.mark.parametrize("ref_dim", [2, 4])
def test_fused_op_equals_the_unfused_module_formula(gen, ref_dim):
    """fp32: the fused op equals the formula MSDeformAttn used before it (locations and softmax with
    torch ops, then torch.ops.cute_deform.forward) within fp32 rounding."""
    args = make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=ref_dim, dtype=torch.float32)
    value, shapes, starts, ref, offsets, logits = args
    N, Lq, M, L, P, _ = offsets.shape
    weights = logits.view(N, Lq, M, L * P).softmax(-1).view(N, Lq, M, L, P)
    r = ref[:, :, None, :, None, :]
    if ref_dim == 2:
        locations = r + offsets / shapes.flip(-1).to(offsets.dtype)[None, None, None, :, None, :]
    else:
        locations = r[..., :2] + offsets / P * r[..., 2:] * 0.5
    unfused = torch.ops.cute_deform.forward(value, shapes, starts, locations, weights)
    out = fused_op(*args)
    assert rel_err(out, unfused) < 1e-6
    assert rel_err(out, fused_reference(*args)) < 2e-6


@pytest.mark.parametrize("case", range(6))
def test_fused_op_any_sizes(gen, case):
    """Random L, P, M, D, N, Lq and level sizes, including H or W == 1, single levels/points/heads."""
    def pick(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    levels = [(pick(1, 9), pick(1, 9)) for _ in range(pick(1, 5))]
    sizes = dict(batch=pick(1, 3), queries=pick(1, 12), heads=pick(1, 4), head_dim=pick(1, 33), points=pick(1, 9))
    args, ref = draw_nonzero(lambda: make_fused_inputs(gen, levels, **sizes, ref_dim=(2, 4)[case % 2],
                                                       dtype=torch.float32), fused_reference)
    out = fused_op(*args)
    assert out.shape == (sizes["batch"], sizes["queries"], sizes["heads"] * sizes["head_dim"])
    assert rel_err(out, ref) < 2e-6, f"levels {levels}, sizes {sizes}"


def sprinkle(gen, t: torch.Tensor, pool: list[float], fraction: float) -> torch.Tensor:
    """t with a random `fraction` of its entries replaced by values drawn from pool."""
    pool = torch.tensor(pool, dtype=torch.float64)
    pick = pool[torch.randint(len(pool), t.shape, generator=gen)].to(t.dtype)
    return torch.where(torch.rand(t.shape, generator=gen) < fraction, pick, t)


@pytest.mark.parametrize("ref_dim", [2, 4])
def test_hostile_values_give_the_reference_answer(gen, ref_dim):
    """Huge, inf and NaN offsets and reference points, and NaN / +-inf logits: NaN and inf exactly where
    the float64 reference has them, the rest within fp32 rounding."""
    args = list(make_fused_inputs(gen, LEVELS, batch=2, queries=12, heads=3, head_dim=4, points=3, ref_dim=ref_dim,
                                  dtype=torch.float32))
    huge = [1e30, -1e30, 1e10, math.inf, -math.inf, math.nan, 40.0, -40.0]
    args[3] = sprinkle(gen, args[3], [math.nan, math.inf, -5.0, 7.0], 0.02)
    args[4] = sprinkle(gen, args[4], huge, 0.1)
    args[5] = sprinkle(gen, args[5], [math.nan, math.inf, -math.inf, 80.0, -80.0], 0.01)
    # The sprinkle leaves no NaN or +inf logit in about 3% of seeds: one NaN logit makes the mix certain.
    args[5][1, 5, 2, 0, 1] = math.nan
    out = fused_op(*args)
    ref = fused_reference(*args, out_dtype=torch.float64)
    assert nonfinite_mismatch(out, ref) is None
    assert finite_rel_err(out, ref) < 2e-6
    assert torch.isnan(ref).any() and torch.isfinite(ref).any()  # the case really mixes both


def test_a_nan_logit_poisons_its_query_and_head_only(gen):
    """A NaN logit makes the softmax of its (query, head) NaN, as torch's softmax does: that output is
    NaN (its samples are inside), every other output is finite; a sample that lands outside its level
    still ignores its (NaN) weight."""
    args = list(make_fused_inputs(gen, LEVELS, batch=2, queries=4, heads=3, head_dim=4, points=2, ref_dim=2,
                                  dtype=torch.float32))
    args[3] = torch.full_like(args[3], 0.5)  # every sample inside: centre of each level, small offsets
    args[4] = args[4].clamp(-0.4, 0.4)
    args[5] = args[5].clone()
    args[5][1, 2, 0, 3, 1] = math.nan
    out = fused_op(*args).view(2, 4, 3, 4)
    nan = torch.zeros(2, 4, 3, dtype=torch.bool)
    nan[1, 2, 0] = True
    assert torch.isnan(out[nan]).all() and torch.isfinite(out[~nan]).all()

    args[4] = args[4].clone()
    args[4][1, 2, 0] = 1e6  # every sample of that (query, head) outside: an empty sum, not NaN
    out = fused_op(*args).view(2, 4, 3, 4)
    assert torch.equal(out[1, 2, 0], torch.zeros(4)) and torch.isfinite(out).all()


@pytest.mark.parametrize("ref_dim", [2, 4])
def test_fused_op_accepts_views_of_the_linear_outputs(gen, ref_dim):
    """Offsets and logits as the Linear layers give them, viewed; and as non-contiguous views."""
    value, shapes, starts, ref, offsets, logits = make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=ref_dim,
                                                                    dtype=torch.float32)
    expected = fused_op(value, shapes, starts, ref, offsets, logits)
    N, Lq, M, L, P, _ = offsets.shape
    raw_offsets = offsets.reshape(N, Lq, -1)  # what sampling_offsets(query) returns
    raw_logits = logits.reshape(N, Lq, -1)
    views = fused_op(value, shapes, starts, ref, raw_offsets.view(N, Lq, M, L, P, 2), raw_logits.view(N, Lq, M, L, P))
    assert torch.equal(views, expected)
    strided = [
        value.transpose(1, 2).contiguous().transpose(1, 2),
        shapes.t().contiguous().t(),
        torch.stack([starts, starts], -1)[:, 0],
        torch.cat([ref, ref], -1)[..., ref_dim:],
        torch.cat([-offsets, offsets], -1)[..., 2:],
        logits.transpose(-1, -2).contiguous().transpose(-1, -2),
    ]
    assert not any(t.is_contiguous() for t in strided)
    assert torch.equal(fused_op(*strided), expected)


@pytest.mark.parametrize("batch,queries,heads,head_dim", [(0, 5, 3, 4), (2, 0, 3, 4), (2, 5, 0, 4), (2, 5, 3, 0)])
def test_empty_sizes_give_empty_outputs(gen, batch, queries, heads, head_dim):
    args = make_fused_inputs(gen, LEVELS, batch=batch, queries=queries, heads=heads, head_dim=head_dim,
                             dtype=torch.bfloat16)
    out = fused_op(*args)
    assert out.shape == (batch, queries, heads * head_dim) and out.dtype == torch.bfloat16


def test_no_points_or_no_levels_give_zeros(gen):
    no_points = make_fused_inputs(gen, LEVELS, batch=2, queries=3, heads=2, head_dim=4, points=0, dtype=torch.float32)
    no_levels = make_fused_inputs(gen, [], batch=2, queries=3, heads=2, head_dim=4, points=2, ref_dim=4,
                                  dtype=torch.float32)
    for args in (no_points, no_levels):
        out = fused_op(*args)
        assert out.shape == (2, 3, 8) and torch.equal(out, torch.zeros_like(out))
        assert torch.equal(fused_reference(*args), torch.zeros((2, 3, 8), dtype=torch.float64))


def test_python_function_matches_the_op(gen):
    args = make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=4, dtype=torch.float16, ref_dtype=torch.float32)
    assert torch.equal(ms_deform_attn_fused(*args), fused_op(*args))


def test_backward_is_refused_whichever_float_input_requires_grad(gen):
    for index in (0, 3, 4, 5):  # value, reference_points, sampling_offsets, attention_logits
        args = list(make_fused_inputs(gen, LEVELS, dtype=torch.float32))
        args[index] = args[index].requires_grad_(True)
        out = fused_op(*args)
        assert out.requires_grad
        with pytest.raises(RuntimeError, match="forward_fused is forward only"):
            out.sum().backward()
        with torch.no_grad():
            assert torch.equal(fused_op(*args), out.detach())


OPCHECK_CASES = {
    "fp32-2d": dict(dtype=torch.float32, ref_dim=2),
    "fp16-bf16-fp32-4d": dict(dtype=torch.float16, ref_dtype=torch.bfloat16, offset_dtype=torch.float32,
                              logit_dtype=torch.bfloat16, ref_dim=4),
    "bf16-single-pixel": dict(dtype=torch.bfloat16, levels=[(1, 1)], points=1),
    "empty-batch": dict(dtype=torch.float32, batch=0),
}


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck(gen, case):
    kwargs = dict(OPCHECK_CASES[case])
    levels = kwargs.pop("levels", LEVELS)
    args = make_fused_inputs(gen, levels, **{"batch": 2, "queries": 5, "heads": 2, "head_dim": 8, **kwargs})
    torch.library.opcheck(torch.ops.cute_deform.forward_fused.default, args)


def test_torch_compile_fullgraph(gen):
    def step(value, shapes, starts, ref, offsets, logits):
        return torch.ops.cute_deform.forward_fused(value, shapes, starts, ref, offsets * 1.5, logits) * 2 + 1

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for queries, ref_dim in ((5, 2), (8, 2), (7, 4)):  # several sizes through one dynamic-shape graph
        args = make_fused_inputs(gen, LEVELS, batch=2, queries=queries, heads=2, head_dim=8, points=3, ref_dim=ref_dim,
                                 dtype=torch.float32)
        out = compiled(*args)
        assert out.shape == (2, queries, 16)
        torch.testing.assert_close(out, step(*args), rtol=1e-6, atol=1e-6)
        value, shapes, starts, ref, offsets, logits = args
        assert rel_err(out, fused_reference(value, shapes, starts, ref, offsets * 1.5, logits) * 2 + 1) < 2e-6


# --- The CUDA kernel's dispatch, without a GPU. Meta tensors stand in for CUDA ones: any read of
# their data (a host sync on a GPU) raises.


class _Calls(list):
    """The stand-in entry point's calls, and (as .tables) the host's level table each was handed."""


@pytest.fixture
def cuda_kernel(monkeypatch):
    """fused._forward_fused_cuda with the device probe answered: returns (run, set_reason, calls), where
    run(args) calls it, set_reason(r) sets what op.kernel_unavailable_reason says, and calls records the
    arguments the stand-in Hopper entry point received."""
    calls = _Calls()

    def msda_forward_fused(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                           attention_logits, host_levels=None):
        calls.append((value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits))
        tables.append(host_levels)
        N, _, M, D = value.shape
        return value.new_empty((N, reference_points.shape[1], M * D))

    tables = []  # the level table each call handed over as read on the host (a CPU table), or None
    calls.tables = tables
    stand_in_hopper_interface(monkeypatch, msda_forward_fused=msda_forward_fused)
    monkeypatch.setattr(fused, "_hopper_interface", None)
    monkeypatch.setattr(fused, "_hopper_import_error", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    reason = {"now": None}
    monkeypatch.setattr(op, "kernel_unavailable_reason", lambda index: reason["now"])
    monkeypatch.setattr(op, "_warned_slow_path", False)

    def run(args):
        return fused._forward_fused_cuda(*args)

    return run, lambda r: reason.update(now=r), calls


@pytest.mark.parametrize("ref_dim", [2, 4])
def test_cuda_kernel_hands_raw_inputs_to_the_hopper_entry_point(gen, cuda_kernel, ref_dim):
    """On Hopper the raw reference points, offsets and logits go to msda_forward_fused as given (no
    location or weight tensor made), with level tables on value's device, and nothing is read."""
    run, _, calls = cuda_kernel
    args = make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=ref_dim, dtype=torch.float16, ref_dtype=torch.float32)
    meta = [t.to("meta") for t in args]
    out = run(meta)
    assert out.shape == (2, 6, 24) and out.device.type == "meta" and len(calls) == 1
    value, shapes, starts, ref, offsets, logits = calls[0]
    assert value is meta[0] and ref is meta[3] and offsets is meta[4] and logits is meta[5]
    assert shapes is meta[1] and starts is meta[2]
    # A level table on the CPU: checked there for free, handed over as a cached device copy.
    run([meta[0], args[1], args[2]] + meta[3:])
    shapes, starts = calls[1][1:3]
    assert shapes.device.type == "meta" and starts.device.type == "meta"
    run([meta[0], args[1].clone(), args[2].clone()] + meta[3:])
    assert calls[2][1] is shapes and calls[2][2] is starts
    # The entry point is handed a CPU table as the host read it (the launch decides the kernel's strips from it), and
    # None for a table on the device, which the host does not read.
    read = (args[1].tolist(), args[2].tolist())
    assert calls.tables == [None, read, read]
    with pytest.raises(ValueError, match=r"cute_deform: value: expected dim 1 \(S\)"):
        run([meta[0][:, 1:], args[1], args[2]] + meta[3:])


def test_cuda_kernel_without_hopper_computes_locations_then_runs_forward(gen, cuda_kernel):
    """Elsewhere: locations and softmax with torch in fp32, then torch.ops.cute_deform.forward, with
    the op's one-time SlowPathWarning; the result is the fused semantics. On meta tensors (no data
    read anywhere on that path), and on CPU tensors (to check the values)."""
    run, set_reason, calls = cuda_kernel
    set_reason("the CuTe kernel targets sm_90 (Hopper) and cuda:0 is sm_80")
    args = make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=4, dtype=torch.float32)
    with pytest.warns(cute_deform.SlowPathWarning, match="sm_80"):
        out = run([t.to("meta") for t in args])
    assert out.shape == (2, 6, 24) and out.device.type == "meta"
    out = run(args)
    assert not calls
    assert rel_err(out, fused_reference(*args)) < 2e-6


def test_cuda_kernel_falls_back_while_the_hopper_entry_point_is_missing(gen, cuda_kernel, monkeypatch):
    run, _, calls = cuda_kernel
    monkeypatch.setitem(sys.modules, "cute_deform.hopper", None)  # import fails
    monkeypatch.setitem(sys.modules, "cute_deform.hopper.interface", None)
    args = make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=2, dtype=torch.float32)
    with pytest.warns(cute_deform.SlowPathWarning, match="cute_deform.hopper.interface failed to import"):
        out = run(args)
    assert not calls
    assert rel_err(out, fused_reference(*args)) < 2e-6


def test_unfused_op_is_still_registered(gen):
    """The fused op comes in addition to torch.ops.cute_deform.forward, which is unchanged."""
    args = make_fused_inputs(gen, LEVELS, **SIZES, dtype=torch.float32)
    value, shapes, starts, ref, offsets, logits = args
    from cute_deform.reference import fused_sampling_inputs

    locations, weights = fused_sampling_inputs(shapes, ref, offsets, logits)
    out = torch.ops.cute_deform.forward(value, shapes, starts, locations, weights)
    assert rel_err(out, ms_deform_attn_reference(value, shapes, starts, locations, weights)) < 1e-6
