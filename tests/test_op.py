"""torch.ops.cute_deform.forward and the drop-in API on the CPU: values in every dtype combination,
any sizes, layouts, empty inputs, opcheck and torch.compile."""
import itertools

import pytest
import torch

import cute_deform
from cute_deform import MSDeformAttnFunction, ms_deform_attn, ms_deform_attn_reference
from msda_testing import draw_nonzero, make_inputs, rel_err, stand_in_hopper_interface, strided_copies

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# The float64 reference sees the same rounded inputs, so what is left is fp32 arithmetic and, for
# fp16/bf16 values, the rounding of the output (at most eps/2 per element).
TOLERANCE = {torch.float32: 1e-6, torch.float16: torch.finfo(torch.float16).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps}
LEVELS = [(7, 9), (4, 5), (2, 3), (1, 1)]


@pytest.mark.parametrize(
    "value_dtype,loc_dtype,attn_dtype", list(itertools.product(FLOATS, repeat=3)), ids=lambda d: str(d)[6:]
)
def test_op_matches_float64_reference(gen, value_dtype, loc_dtype, attn_dtype):
    args = make_inputs(gen, LEVELS, batch=2, queries=9, heads=3, head_dim=8, points=3,
                       dtype=value_dtype, loc_dtype=loc_dtype, attn_dtype=attn_dtype)
    out = torch.ops.cute_deform.forward(*args)
    assert out.dtype == value_dtype and out.shape == (2, 9, 3 * 8) and out.device.type == "cpu"
    ref = ms_deform_attn_reference(*args, out_dtype=torch.float64)
    assert rel_err(out, ref) < TOLERANCE[value_dtype]


@pytest.mark.parametrize("case", range(8))
def test_op_any_sizes(gen, case):
    """Random L, P, M, D, N, Lq and level sizes, including H or W == 1, single levels/points/heads."""
    def pick(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    levels = [(pick(1, 9), pick(1, 9)) for _ in range(pick(1, 5))]
    sizes = dict(batch=pick(1, 3), queries=pick(1, 12), heads=pick(1, 4), head_dim=pick(1, 33), points=pick(1, 9))
    args, ref = draw_nonzero(lambda: make_inputs(gen, levels, dtype=torch.float32, **sizes),
                             lambda *a: ms_deform_attn_reference(*a, out_dtype=torch.float64))
    out = torch.ops.cute_deform.forward(*args)
    assert out.shape == (sizes["batch"], sizes["queries"], sizes["heads"] * sizes["head_dim"])
    assert rel_err(out, ref) < 1e-6, f"levels {levels}, sizes {sizes}"


def test_op_accepts_non_contiguous_inputs(gen):
    args = make_inputs(gen, LEVELS[:2], batch=2, queries=5, heads=2, head_dim=8, points=2, dtype=torch.float32)
    strided = strided_copies(*args)
    assert not any(t.is_contiguous() for t in strided)
    assert torch.equal(torch.ops.cute_deform.forward(*strided), torch.ops.cute_deform.forward(*args))


def test_im2col_step_is_ignored(gen):
    """Any batch size works with any im2col_step (the original required N % im2col_step == 0)."""
    args = make_inputs(gen, LEVELS, batch=3, queries=4, heads=2, head_dim=4, points=2, dtype=torch.float32)
    outs = [torch.ops.cute_deform.forward(*args, step) for step in (64, 1, 2, 5)]
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert rel_err(outs[0], ms_deform_attn_reference(*args)) < 1e-6


@pytest.mark.parametrize("batch,queries", [(0, 5), (2, 0), (0, 0)])
def test_empty_batch_or_queries(gen, batch, queries):
    args = make_inputs(gen, LEVELS, batch=batch, queries=queries, heads=3, head_dim=4, dtype=torch.bfloat16)
    out = torch.ops.cute_deform.forward(*args)
    assert out.shape == (batch, queries, 12) and out.dtype == torch.bfloat16
    assert ms_deform_attn(*args).shape == (batch, queries, 12)


def test_no_points_or_no_levels_gives_zeros(gen):
    no_points = make_inputs(gen, LEVELS, batch=2, queries=3, heads=2, head_dim=4, points=0, dtype=torch.float32)
    no_levels = make_inputs(gen, [], batch=2, queries=3, heads=2, head_dim=4, points=2, dtype=torch.float32)
    for args in (no_points, no_levels):
        out = torch.ops.cute_deform.forward(*args)
        assert out.shape == (2, 3, 8) and torch.equal(out, torch.zeros_like(out))


def test_drop_in_function_and_apply_match_the_op(gen):
    args = make_inputs(gen, LEVELS, batch=2, queries=6, heads=2, head_dim=8, points=4, dtype=torch.float16,
                       loc_dtype=torch.float32, attn_dtype=torch.float32)
    out = torch.ops.cute_deform.forward(*args)
    assert torch.equal(ms_deform_attn(*args), out)
    assert torch.equal(ms_deform_attn(*args, im2col_step=3), out)
    assert torch.equal(MSDeformAttnFunction.apply(*args, 64), out)


def test_backward_is_refused(gen):
    """Forward only: backpropagating through the op raises instead of returning wrong gradients."""
    value, *rest = make_inputs(gen, LEVELS, dtype=torch.float32)
    value.requires_grad_(True)
    out = torch.ops.cute_deform.forward(value, *rest)
    with pytest.raises(RuntimeError, match=r"cute_deform.forward is forward only: it has no backward"):
        out.sum().backward()
    with pytest.raises(RuntimeError, match="forward only"):
        torch.autograd.grad(ms_deform_attn(value, *rest).sum(), value)


OPCHECK_CASES = {
    "fp32": dict(dtype=torch.float32),
    "fp16-bf16-fp32": dict(dtype=torch.float16, loc_dtype=torch.bfloat16, attn_dtype=torch.float32),
    "bf16-single-pixel": dict(dtype=torch.bfloat16, levels=[(1, 1)], points=1),
    "empty-batch": dict(dtype=torch.float32, batch=0),
}


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck(gen, case):
    kwargs = dict(OPCHECK_CASES[case])
    levels = kwargs.pop("levels", LEVELS)
    args = make_inputs(gen, levels, **{"batch": 2, "queries": 5, "heads": 2, "head_dim": 8, **kwargs})
    torch.library.opcheck(torch.ops.cute_deform.forward.default, args)
    torch.library.opcheck(torch.ops.cute_deform.forward.default, args, {"im2col_step": 2})


def test_torch_compile_fullgraph(gen):
    def step(value, shapes, starts, loc, attn):
        out = cute_deform.ms_deform_attn(value, shapes, starts, loc, attn)
        return out * 2 + 1  # work around the op, so the graph is more than one call

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for queries in (5, 8):  # two sizes through one dynamic-shape graph: exercises the fake impl symbolically
        args = make_inputs(gen, LEVELS, batch=2, queries=queries, heads=2, head_dim=8, points=3, dtype=torch.float32)
        out = compiled(*args)
        assert out.shape == (2, queries, 16)
        torch.testing.assert_close(out, step(*args), rtol=1e-6, atol=1e-6)
        assert rel_err(out, ms_deform_attn_reference(*args) * 2 + 1) < 1e-6


def test_kernel_dispatch_decision(monkeypatch):
    """The CUDA kernel runs only on capability (9, 0) with the kernel module available; any other
    device gets a reason, which the op's slower path puts in its warning."""
    from cute_deform import op
    from cute_deform.hopper import interface

    for capability in [(8, 0), (8, 9), (9, 0), (10, 0)]:
        op.kernel_unavailable_reason.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        reason = op.kernel_unavailable_reason(0)
        if capability == (9, 0):
            assert (reason is None) == interface.available()
        else:
            assert f"cuda:0 is sm_{capability[0]}{capability[1]}" in reason
    op.kernel_unavailable_reason.cache_clear()


def test_slow_path_warns_once(monkeypatch):
    from cute_deform import op

    monkeypatch.setattr(op, "_warned_slow_path", False)
    with pytest.warns(cute_deform.SlowPathWarning, match="sm_80.*slower pure-PyTorch path") as record:
        op._warn_slow_path("the CuTe kernel targets sm_90 (Hopper) and cuda:0 is sm_80")
        op._warn_slow_path("the CuTe kernel targets sm_90 (Hopper) and cuda:0 is sm_80")
    assert len(record) == 1


def test_backward_is_refused_whichever_float_input_requires_grad(gen):
    for index in (0, 3, 4):  # value, sampling_locations, attention_weights
        args = list(make_inputs(gen, LEVELS, dtype=torch.float32))
        args[index] = args[index].requires_grad_(True)
        out = torch.ops.cute_deform.forward(*args)
        assert out.requires_grad
        with pytest.raises(RuntimeError, match="forward only"):
            out.sum().backward()


def test_no_grad_and_inference_mode_give_the_same_output(gen):
    args = make_inputs(gen, LEVELS, dtype=torch.float32)
    expected = torch.ops.cute_deform.forward(*args)
    value = args[0].clone().requires_grad_(True)
    with torch.no_grad():
        out = torch.ops.cute_deform.forward(value, *args[1:])
    assert not out.requires_grad and torch.equal(out, expected)
    with torch.inference_mode():  # the dispatcher skips the autograd layer here
        assert torch.equal(torch.ops.cute_deform.forward(*args), expected)
        assert torch.equal(ms_deform_attn(*args), expected)


def test_dispatch_modes_still_see_the_op(gen):
    """A TorchDispatchMode (and so FakeTensorMode, FlopCounterMode, ...) sees the op below autograd."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    args = make_inputs(gen, LEVELS, dtype=torch.float32)
    with Record() as mode:
        out = torch.ops.cute_deform.forward(*args)
    assert torch.ops.cute_deform.forward.default in mode.seen
    assert torch.equal(out, torch.ops.cute_deform.forward(*args))


def test_device_copies_of_a_cpu_level_table_are_cached_by_contents(gen):
    """value on another device (meta stands in for CUDA), level table on the CPU: one device copy per
    distinct table, whether the caller read the table already or not, never one per call."""
    from cute_deform import op

    device = torch.device("meta")
    shapes, starts = make_inputs(gen, [(2, 3), (1, 1)])[1:3]
    first = op._level_tables_on(device, shapes, starts)
    assert first[0].device == device and first[0].dtype == torch.int64
    assert op._level_tables_on(device, shapes.clone(), starts.clone()) is first
    assert op._level_tables_on(device, shapes, starts, shapes.tolist(), starts.tolist()) is first
    transposed = make_inputs(gen, [(3, 2), (1, 1)])[1:3]  # the same S and starts, other (H, W)
    assert op._level_tables_on(device, *transposed) is not first
    assert op._level_tables_on(device, shapes.to(device), starts.to(device))[0].device == device


def test_cuda_kernel_hands_a_host_level_table_to_the_launch(gen, monkeypatch):
    """On Hopper the op hands msda_forward a level table the caller holds on the CPU as the host read it (the launch's
    staging rule reads it), with the tables themselves as device copies, and None for a table on the device, which the
    host does not read (meta tensors stand in for CUDA; the Hopper entry point is a stand-in)."""
    from cute_deform import op

    seen = []

    def msda_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                     host_levels=None):
        seen.append((spatial_shapes.device.type, level_start_index.device.type, host_levels))
        N, _, M, D = value.shape
        return value.new_empty((N, sampling_locations.shape[1], M * D))

    stand_in_hopper_interface(monkeypatch, msda_forward=msda_forward)
    monkeypatch.setattr(op, "_hopper", None)
    monkeypatch.setattr(op, "kernel_unavailable_reason", lambda index: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    args = make_inputs(gen, LEVELS, dtype=torch.float16)
    meta = [t.to("meta") for t in args]
    out = op._forward_cuda(*meta)
    assert out.shape == (2, 5, 12) and out.device.type == "meta"
    op._forward_cuda(meta[0], args[1], args[2], *meta[3:])
    read = (args[1].tolist(), args[2].tolist())
    assert read[0] == [list(level) for level in LEVELS]
    assert seen == [("meta", "meta", None), ("meta", "meta", read)]


def test_kernel_for_other_backends_names_value_device(gen):
    """The kernel the dispatcher runs for tensors of another backend (MPS, XPU, ...) checks the inputs and
    then names value's device; meta tensors stand in for such a backend here (the op itself gives meta
    tensors to its fake implementation)."""
    from cute_deform import op

    args = [t.to("meta") for t in make_inputs(gen, LEVELS, dtype=torch.float32)]
    with pytest.raises(NotImplementedError, match=r"^cute_deform: value: expected a tensor on the CPU or a CUDA "
                                                  r"device, got device meta$"):
        op._forward_other_device(*args)
    with pytest.raises(TypeError, match=r"cute_deform: sampling_locations: expected a torch.Tensor, got NoneType"):
        op._forward_other_device(args[0], args[1], args[2], None, args[4])


@pytest.mark.parametrize("index", range(5))
def test_sparse_inputs_are_named(gen, index):
    """A sparse tensor dispatches to the op's kernel for other backends, which names it."""
    from cute_deform._checks import OP_NAMES

    args = list(make_inputs(gen, LEVELS, dtype=torch.float32))
    args[index] = args[index].to_sparse()
    with pytest.raises(NotImplementedError, match=rf"^cute_deform: {OP_NAMES[index]}: expected a dense \(strided\) "
                                                  r"tensor, got layout torch.sparse_coo$"):
        torch.ops.cute_deform.forward(*args)
