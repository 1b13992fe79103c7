"""Host cost of the op layer of torch.ops.cute_deform.forward, piece by piece, on the CPU.

    PYTHONPATH=. python3 scripts/op_overhead.py [--repeats 7] [--number 20000]

(PYTHONPATH=. times this checkout's cute_deform rather than whichever one is installed.)

Everything the op runs before it hands over to `hopper.interface.msda_forward` is Python on the host, and
none of it needs a GPU: this times each piece on tiny CPU inputs (N=1, Lq=64, M=8, L=4, P=4, D=32,
the Deformable DETR levels) in microseconds per call, the median of --repeats runs of --number calls.

- The CUDA flow is the op's CUDA kernel (`op._forward_cuda`) called directly with
  `hopper.interface.msda_forward` replaced by a stub that returns a preallocated tensor and the device
  capability probe answered from its cache, so what is timed is the op layer alone. "cuda-like" rows
  put value, sampling_locations and attention_weights on the meta device (the tests' stand-in for a
  GPU): with the level table on the CPU, the op checks its values and uses its cached device copy.
- The dispatcher rows call torch.ops.cute_deform.forward on CPU tensors with the CPU math (the
  reference in older versions, `cute_deform.cpu.forward` now) replaced by a stub, so what is timed is
  the dispatcher plus the op's CPU kernel minus the math.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import cute_deform
from cute_deform import _checks, op
from cute_deform.hopper import interface as hopper

LEVELS = [(100, 167), (50, 84), (25, 42), (13, 21)]
N, LQ, M, P, D = 1, 64, 8, 4, 32


def make_inputs(device="cpu", table_device="cpu"):
    shapes = torch.tensor(LEVELS, dtype=torch.int64)
    pixels = shapes.prod(-1)
    starts = pixels.cumsum(0) - pixels
    S, L = int(pixels.sum()), len(LEVELS)
    value = torch.randn(N, S, M, D).to(torch.float16)
    loc = torch.rand(N, LQ, M, L, P, 2)
    attn = torch.rand(N, LQ, M, L, P)
    return [value.to(device), shapes.to(table_device), starts.to(table_device), loc.to(device), attn.to(device)]


def per_call_us(fn, number, repeats):
    for _ in range(min(number, 1000)):  # warm-up (caches, lazy imports)
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - t0) / number * 1e6)
    return statistics.median(runs)


def paired_difference_us(fn, baseline, number, repeats):
    """Median over repeats of (time of fn - time of baseline), each pair timed back to back: steadier
    than the difference of two medians on a busy machine."""
    for _ in range(min(number, 1000)):
        fn()
        baseline()
    diffs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        t1 = time.perf_counter()
        for _ in range(number):
            baseline()
        t2 = time.perf_counter()
        diffs.append(((t1 - t0) - (t2 - t1)) / number * 1e6)
    return statistics.median(diffs)


_REGISTRATIONS = []


def public_routes(inputs, out):
    """The same stub kernel (returns `out`) registered through each public torch.library route, as
    {route: callable}: what the registration alone costs a call, without cute_deform's own code."""
    schema = ("(Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_locations, "
              "Tensor attention_weights, int im2col_step=64) -> Tensor")

    def stub(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step=64):
        return out

    def fake(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step=64):
        return value.new_empty(out.shape)

    def backward(ctx, grad):
        raise RuntimeError("forward only")

    libs = {}
    for name in ("register_autograd", "no_autograd"):
        lib = libs[name] = torch.library.Library(f"cute_deform_route_{name}", "DEF")
        lib.define("f" + schema)
        lib.impl("f", stub, "CPU")
        torch.library.register_fake(f"cute_deform_route_{name}::f", fake, lib=lib)
    torch.library.register_autograd("cute_deform_route_register_autograd::f", backward,
                                    lib=libs["register_autograd"])

    @torch.library.custom_op("cute_deform_route_custom_op::f", mutates_args=())
    def custom(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
               sampling_locations: torch.Tensor, attention_weights: torch.Tensor, im2col_step: int = 64
               ) -> torch.Tensor:
        return out

    custom.register_fake(fake)
    custom.register_autograd(backward)
    _REGISTRATIONS.append(libs)  # a Library's registrations last as long as the object
    ops = torch.ops
    return {
        "define/impl + register_autograd (the op's route)":
            lambda: ops.cute_deform_route_register_autograd.f.default(*inputs),
        "torch.library.custom_op + register_autograd":
            lambda: ops.cute_deform_route_custom_op.f.default(*inputs),
        "define/impl, no autograd kernel (floor; backward would pass through)":
            lambda: ops.cute_deform_route_no_autograd.f.default(*inputs),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--routes", action="store_true",
                        help="also time a stub kernel through each public registration route")
    args = parser.parse_args()

    cpu = make_inputs()
    cuda_like = make_inputs(device="meta")  # value & co. on a "device", level table on the CPU
    on_device = make_inputs(device="meta", table_device="meta")  # everything on the "device"
    out = torch.empty(N, LQ, M * D, dtype=torch.float16)
    L = len(LEVELS)

    # Stubs: the math and the launch are not what is timed here.
    def stub_launch(value, *rest, **tuning):
        return out
    if hasattr(op, "cpu"):
        op.cpu.forward = lambda *a, **k: out
    else:  # the op layer before cute_deform/cpu.py
        op.ms_deform_attn_reference = lambda *a, **k: out
    hopper.msda_forward = stub_launch
    hopper.available = lambda: True
    torch.cuda.get_device_capability = lambda index=None: (9, 0)
    torch.cuda.current_device = lambda: 0
    op.kernel_unavailable_reason.cache_clear()
    assert op.kernel_unavailable_reason(0) is None

    shape = _checks.check_inputs(*cpu)
    # The op's CPU kernel, as registered (custom_op keeps the decorated function as _init_fn).
    cpu_body = getattr(op, "_forward_cpu", None) or op.forward._init_fn
    rows = []
    timed = {}

    def row(name, fn, key=None):
        us = per_call_us(fn, args.number, args.repeats)
        rows.append((name, us))
        if key:
            timed[key] = us

    row("python call of an empty function (scale)", lambda: None)
    row("check_inputs, CPU level table (values read)", lambda: _checks.check_inputs(*cpu))
    row("check_inputs, cuda-like, CPU level table", lambda: _checks.check_inputs(*cuda_like))
    row("check_inputs, everything on device", lambda: _checks.check_inputs(*on_device))
    row("check_inputs, check_values=False (fake impl)", lambda: _checks.check_inputs(*cpu, check_values=False))
    row("check_inputs, drop-in names", lambda: _checks.check_inputs(*cpu, names=_checks.DROP_IN_NAMES))
    if hasattr(_checks, "validate"):  # the op's own entry to the same checks
        row("_checks.validate, cuda-like, CPU level table", lambda: _checks.validate(*cuda_like))
        row("_checks.validate, everything on device", lambda: _checks.validate(*on_device))
    if hasattr(op, "_trivial_output"):
        row("_trivial_output", lambda: op._trivial_output(cpu[0], shape))
    row("_level_tables_on, cuda-like, CPU table (cached copy)",
        lambda: op._level_tables_on(cuda_like[0].device, cuda_like[1], cuda_like[2]))
    row("kernel_unavailable_reason(0) (lru_cache hit)", lambda: op.kernel_unavailable_reason(0))
    row("5x .contiguous() (contiguous inputs)", lambda: [t.contiguous() for t in cpu])
    row("op CPU kernel body (math stubbed)", lambda: cpu_body(*cpu), "cpu_body")
    row("op CUDA kernel body, cuda-like, CPU level table", lambda: op._forward_cuda(*cuda_like))
    row("op CUDA kernel body, everything on device", lambda: op._forward_cuda(*on_device), "cuda_body")
    row("op CUDA kernel body, CPU tensors", lambda: op._forward_cuda(*cpu))
    row("torch.ops.cute_deform.forward (CPU, math stubbed)", lambda: torch.ops.cute_deform.forward(*cpu), "op")
    with torch.no_grad():
        row("  same, under torch.no_grad()", lambda: torch.ops.cute_deform.forward(*cpu))
    with torch.inference_mode():
        row("  same, under torch.inference_mode()", lambda: torch.ops.cute_deform.forward(*cpu), "op_inference")
    row("torch.ops.cute_deform.forward.default (CPU, stubbed)", lambda: torch.ops.cute_deform.forward.default(*cpu))
    row("cute_deform.ms_deform_attn (drop-in, CPU, stubbed)", lambda: cute_deform.ms_deform_attn(*cpu))
    # The dispatcher's share: the op on CPU tensors minus its CPU kernel called directly.
    def op_call():
        return torch.ops.cute_deform.forward(*cpu)

    def body_call():
        return cpu_body(*cpu)

    dispatch = paired_difference_us(op_call, body_call, args.number, args.repeats)
    rows.append(("= dispatcher + autograd layer (op - its CPU kernel, paired)", dispatch))
    with torch.inference_mode():
        rows.append(("= dispatcher, inference_mode (op - its CPU kernel, paired)",
                     paired_difference_us(op_call, body_call, args.number, args.repeats)))
    rows.append(("= op layer on a GPU, estimated (dispatcher + CUDA kernel body on device)",
                 dispatch + timed["cuda_body"]))

    if args.routes:
        for name, call in public_routes(cpu, out).items():
            row(f"stub kernel via {name}", call)

    width = max(len(name) for name, _ in rows)
    print(f"cute_deform from {cute_deform.__file__}")
    print(f"torch {torch.__version__}; N={N} Lq={LQ} M={M} L={L} P={P} D={D}; median of {args.repeats} x "
          f"{args.number} calls")
    print(f"{'piece':<{width}}  us/call")
    for name, us in rows:
        print(f"{name:<{width}}  {us:7.2f}")


if __name__ == "__main__":
    main()
