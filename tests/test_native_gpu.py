"""On an sm_90 GPU: calls the C++ launcher runs without Python (a launch planned before) against the float64
reference, on any stream, in CUDA graphs, with CPU or device level tables; and what it must hand back to Python
(new sizes, strided inputs, bad inputs) still gets Python's result or error."""
from __future__ import annotations

import pytest
import torch

from cute_deform import native
from cute_deform.hopper import interface
from msda_testing import fused_reference, make_fused_inputs, make_inputs, ms_deform_attn_reference_f64, output_on_nan, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not native.LOADED, reason="the C++ launcher is not loaded (CUTE_DEFORM_NATIVE)"),
]

LEVELS = [(23, 31), (12, 16), (6, 8), (3, 4)]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def unfused(gen, dtype, *, tables="cuda", batch=2, queries=300, head_dim=32):
    value, shapes, starts, loc, attn = make_inputs(gen, LEVELS, batch=batch, queries=queries, heads=8,
                                                   head_dim=head_dim, points=4, dtype=torch.float32)
    return (value.to("cuda", dtype), shapes.to(tables), starts.to(tables), loc.cuda(), attn.cuda())


def fused(gen, dtype, ref_dim=2):
    value, shapes, starts, ref, offsets, logits = make_fused_inputs(gen, LEVELS, batch=2, queries=300, heads=8,
                                                                    head_dim=32, points=4, ref_dim=ref_dim,
                                                                    dtype=torch.float32)
    # Every float in value's dtype, as a .half() layer makes them.
    return (value.to("cuda", dtype), shapes.cuda(), starts.cuda(), ref.to("cuda", dtype), offsets.to("cuda", dtype),
            logits.to("cuda", dtype))


@pytest.fixture
def python_launch_forbidden(monkeypatch):
    """After this fixture's switch, a call that reaches the Python launch fails the test."""
    state = {"forbid": False}
    launch = interface._launch

    def guarded(*args, **kwargs):
        assert not state["forbid"], "the call went through the Python launch, not the C++ launcher"
        return launch(*args, **kwargs)

    monkeypatch.setattr(interface, "_launch", guarded)
    native.clear()
    return state


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tables", ["cuda", "cpu"])
@pytest.mark.parametrize("head_dim", [32, 6], ids=["tiled", "generic"])
def test_second_call_runs_from_cpp(gen, python_launch_forbidden, dtype, tables, head_dim):
    torch.ops.cute_deform.forward(*unfused(gen, dtype, tables=tables, head_dim=head_dim))  # planned in Python
    assert native.entries() == 1
    python_launch_forbidden["forbid"] = True
    args = unfused(gen, dtype, tables=tables, head_dim=head_dim)  # fresh inputs, same sizes
    out = output_on_nan(lambda: torch.ops.cute_deform.forward(*args))
    assert torch.isfinite(out).all(), "output elements left unwritten (poisoned with NaN)"
    assert rel_err(out, ms_deform_attn_reference_f64(*args)) < TOLERANCE[dtype]


@pytest.mark.parametrize("ref_dim", [2, 4])
def test_fused_second_call_runs_from_cpp(gen, python_launch_forbidden, ref_dim):
    torch.ops.cute_deform.forward_fused(*fused(gen, torch.float16, ref_dim))
    python_launch_forbidden["forbid"] = True
    args = fused(gen, torch.float16, ref_dim)
    out = output_on_nan(lambda: torch.ops.cute_deform.forward_fused(*args))
    assert torch.isfinite(out).all()
    assert rel_err(out, fused_reference(*args)) < TOLERANCE[torch.float16]


def test_cpp_launch_on_a_side_stream(gen, python_launch_forbidden):
    torch.ops.cute_deform.forward(*unfused(gen, torch.float16))
    python_launch_forbidden["forbid"] = True
    args = unfused(gen, torch.float16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # A long kernel queued first on the side stream: a launch on another stream would read too early.
        value = args[0] * 1.0
        for _ in range(20):
            value = value * 1.0
        out = torch.ops.cute_deform.forward(value, *args[1:])
    stream.synchronize()
    assert rel_err(out, ms_deform_attn_reference_f64(*args)) < TOLERANCE[torch.float16]


def test_cpp_launch_in_a_cuda_graph(gen, python_launch_forbidden):
    static = unfused(gen, torch.float16)
    torch.ops.cute_deform.forward(*static)  # warm-up: plans (and compiles) in Python
    python_launch_forbidden["forbid"] = True
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.cute_deform.forward(*static)
    fresh = unfused(gen, torch.float16)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, ms_deform_attn_reference_f64(*fresh)) < TOLERANCE[torch.float16]


def test_what_cpp_cannot_launch_goes_to_python(gen):
    native.clear()
    args = unfused(gen, torch.float16)
    torch.ops.cute_deform.forward(*args)
    assert native.entries() == 1
    # Strided locations: Python makes them dense and launches (and does not register: it would come back).
    strided = args[3].transpose(0, 1).contiguous().transpose(0, 1)
    out = torch.ops.cute_deform.forward(*args[:3], strided, args[4])
    assert rel_err(out, ms_deform_attn_reference_f64(*args)) < TOLERANCE[torch.float16]
    assert native.entries() == 1
    # Another size: planned in Python, then registered.
    other = unfused(gen, torch.float16, queries=77)
    out = torch.ops.cute_deform.forward(*other)
    assert rel_err(out, ms_deform_attn_reference_f64(*other)) < TOLERANCE[torch.float16]
    assert native.entries() == 2
    # A bad input of a registered size gets Python's named error.
    with pytest.raises(TypeError, match="sampling_locations"):
        torch.ops.cute_deform.forward(*args[:3], args[3].long(), args[4])
    bad_tables = args[1].cpu() + 1  # S no longer matches
    with pytest.raises(ValueError, match="value"):
        torch.ops.cute_deform.forward(args[0], bad_tables, args[2].cpu(), args[3], args[4])


def test_backward_raises_on_cuda(gen):
    value, *rest = unfused(gen, torch.float32)
    value.requires_grad_(True)
    out = torch.ops.cute_deform.forward(value, *rest)
    with pytest.raises(RuntimeError, match="forward only"):
        out.sum().backward()
