#!/usr/bin/env python3
"""What a call costs besides the kernel, and a small check for the sanitizers: one entry point.

    python scripts/overhead.py compile      # any machine: cold compile time of each kernel variant
    python scripts/overhead.py first-call   # GPU: a fresh process with the kernel in the disk cache
    python scripts/overhead.py host         # GPU: host time per call (op, fused op, launch function), and
                                           #      where it goes (cProfile, with --cprofile); with --layer
                                           #      also the encoder layer's forward and each of its launches
    python scripts/overhead.py smoke        # GPU: one small case against float64 (run under compute-sanitizer)
    python scripts/overhead.py op-layer     # any machine: the op layer's host cost piece by piece, on the CPU
                                           #      with the math and the launch stubbed (--routes: also a stub
                                           #      kernel through each public torch.library route)
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from cute_deform.hopper import compile_cache, interface, launch_rules  # noqa: E402
from cute_deform.hopper.config import KernelConfig  # noqa: E402
from cute_deform.hopper.generic import GenericConfig  # noqa: E402

import bench_layer  # noqa: E402  (this script's folder: the layer and the host-time loop are bench_layer.py's)

SHAPE = ("float16", "float32", "float32", 8, 4, 4, 32)  # value, locations, weights dtypes, M, L, P, D
VARIANTS = {
    "default": lambda: KernelConfig(*SHAPE, **launch_rules.TUNING),
    "fused": lambda: KernelConfig(*SHAPE, fused=True, **launch_rules.TUNING),
    "tma boxes": lambda: KernelConfig(*SHAPE, **{**launch_rules.TUNING, "fine_gather": "tma", "num_groups": 4,
                                                 "num_stages": 3}),
    "no multicast": lambda: KernelConfig(*SHAPE, **{**launch_rules.TUNING, "cluster_size": 1}),
    "generic": lambda: GenericConfig(*SHAPE),
}
LEVELS = bench_layer.COCO_LEVELS
OP_N, OP_LQ, OP_M, OP_P, OP_D = 1, 64, 8, 4, 32  # op-layer: a tiny decoder call, where the host side dominates

FIRST_CALL = r"""
import time, torch
t0 = time.perf_counter()
import cute_deform
import_s = time.perf_counter() - t0
shapes = torch.tensor(LEVELS, device="cuda")
starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
S = int((shapes[:, 0] * shapes[:, 1]).sum())
value = torch.randn(1, S, 8, 32, device="cuda", dtype=torch.float16)
loc = torch.rand(1, 900, 8, 4, 4, 2, device="cuda")
attn = torch.rand(1, 900, 8, 4, 4, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
torch.ops.cute_deform.forward(value, shapes, starts, loc, attn)
torch.cuda.synchronize()
print(f"{import_s:.3f} {time.perf_counter() - t0:.4f}")
""".replace("LEVELS", repr(LEVELS))


def level_tables(device="cuda"):
    shapes, starts = bench_layer.level_tables(LEVELS, device)
    return shapes, starts, sum(h * w for h, w in LEVELS)


def cmd_compile(args):
    os.environ["CUTE_DEFORM_CACHE_DIR"] = "off"
    print(f"cold compile, value/locations/weights/M/L/P/D = {SHAPE}:")
    for name, make in VARIANTS.items():
        t0 = time.perf_counter()
        compile_cache.compile_kernel(make())
        print(f"  {name:14s} {time.perf_counter() - t0:6.2f} s", flush=True)


def cmd_first_call(args):
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "CUTE_DEFORM_CACHE_DIR": cache, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
        subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, check=True, capture_output=True)  # fills it
        times = []
        for _ in range(3):
            out = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, check=True, capture_output=True, text=True)
            times.append([float(v) for v in out.stdout.split()])
    for import_s, first_s in times:
        print(f"fresh process, kernel in the disk cache: import {import_s:.2f} s, first call {first_s * 1e3:.1f} ms")


def host_calls(Lq=64):
    """The ops and the launch function on a decoder-shaped problem with Lq queries (64: a tiny launch, where
    the host side dominates), as named callables."""
    import cute_deform  # noqa: F401  (registers the ops)

    shapes, starts, S = level_tables()
    value = torch.randn(1, S, 8, 32, device="cuda", dtype=torch.float16)
    loc = torch.rand(1, Lq, 8, 4, 4, 2, device="cuda")
    attn = torch.rand(1, Lq, 8, 4, 4, device="cuda")
    ref = torch.rand(1, Lq, 4, 2, device="cuda")
    calls = [("hopper.interface.msda_forward", lambda: interface.msda_forward(value, shapes, starts, loc, attn)),
             ("torch.ops.cute_deform.forward", lambda: torch.ops.cute_deform.forward(value, shapes, starts, loc, attn)),
             ("hopper.interface.msda_forward_fused",
              lambda: interface.msda_forward_fused(value, shapes, starts, ref, loc, attn))]
    if hasattr(torch.ops.cute_deform, "forward_fused"):
        calls.append(("torch.ops.cute_deform.forward_fused",
                      lambda: torch.ops.cute_deform.forward_fused(value, shapes, starts, ref, loc, attn)))
    # What any op call costs on this host, for scale: the output's allocation alone, and a dispatcher round
    # trip with no tensors (the C++ launcher's registry size).
    calls.append(("torch.empty of the output (for scale)",
                  lambda: torch.empty((1, Lq, 256), dtype=torch.float16, device="cuda")))
    from cute_deform import native

    if native.LOADED:
        calls.append(("torch.ops.cute_deform._native_entries (for scale)", torch.ops.cute_deform._native_entries))
    return calls


def layer_calls():
    """bench_layer.py's Deformable DETR encoder layer (fp16 weights, a padding mask) and each of its launches
    alone, as named callables: where the eager layer's host time goes."""
    layer, (query, ref, flat, shapes, starts, mask) = bench_layer.encoder_layer(
        LEVELS, 256, 8, 4, 2, torch.float16, "cuda", torch.Generator().manual_seed(0))
    N, S, _ = flat.shape
    value = layer.value_proj(flat)
    offsets = layer.sampling_offsets(query).view(N, S, 8, 4, 4, 2)
    logits = layer.attention_weights(query).view(N, S, 8, 4, 4)
    heads = value.view(N, S, 8, 32)
    return [("MSDeformAttn (whole layer)", lambda: layer(query, ref, flat, shapes, starts, mask)),
            ("  value_proj (Linear)", lambda: layer.value_proj(flat)),
            ("  masked_fill_", lambda: value.masked_fill_(mask[..., None], 0.0)),
            ("  sampling_offsets (Linear)", lambda: layer.sampling_offsets(query)),
            ("  forward_fused op", lambda: torch.ops.cute_deform.forward_fused(heads, shapes, starts, ref, offsets, logits)),
            ("  output_proj (Linear)", lambda: layer.output_proj(query))]


def cmd_host(args):
    from cute_deform import native

    calls = host_calls()
    print(f"C++ launcher (CUTE_DEFORM_NATIVE): {'loaded' if native.LOADED else 'not loaded'}", flush=True)
    if args.layer:
        calls += layer_calls()
    grad_mode = torch.inference_mode if args.inference_mode else torch.no_grad
    # Loops of at most 100 calls: the launch queue never fills, even where a call's GPU work is longer (the layer).
    per_loop = min(args.calls, 100)
    loops = max(1, args.calls // per_loop)
    for name, fn in calls:
        with grad_mode():
            us = bench_layer.host_seconds_per_call(fn, torch.device("cuda"), per_loop, loops, warmup=50) * 1e6
        print(f"host time per call, {name}: {us:.1f} us (median of {loops} loops of {per_loop})", flush=True)
        if args.cprofile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.calls):
                fn()
            profiler.disable()
            torch.cuda.synchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def op_layer_inputs(device="cpu", table_device="cpu"):
    """op-layer's inputs: value, locations and weights on `device`, the level table on `table_device`."""
    shapes, starts, S = level_tables("cpu")
    L = len(LEVELS)
    value = torch.randn(OP_N, S, OP_M, OP_D).to(torch.float16)
    loc = torch.rand(OP_N, OP_LQ, OP_M, L, OP_P, 2)
    attn = torch.rand(OP_N, OP_LQ, OP_M, L, OP_P)
    return [value.to(device), shapes.to(table_device), starts.to(table_device), loc.to(device), attn.to(device)]


def calls_us(fn, number):
    """Microseconds a call of fn, over `number` calls back to back."""
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number * 1e6


def per_call_us(fn, number, repeats):
    calls_us(fn, min(number, 1000))  # warm-up (caches, lazy imports)
    return statistics.median(calls_us(fn, number) for _ in range(repeats))


def paired_difference_us(fn, baseline, number, repeats):
    """Median over repeats of (time of fn - time of baseline), each pair timed back to back: steadier
    than the difference of two medians on a busy machine."""
    calls_us(fn, min(number, 1000))
    calls_us(baseline, min(number, 1000))
    return statistics.median(calls_us(fn, number) - calls_us(baseline, number) for _ in range(repeats))


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


def cmd_op_layer(args):
    """Host cost of the op layer of torch.ops.cute_deform.forward, piece by piece, on the CPU: tiny inputs
    (N=1, Lq=64, M=8, L=4, P=4, D=32, the Deformable DETR levels), microseconds a call, the median of
    --repeats runs of --number calls. Needs no GPU:
    - the CUDA flow is the op's CUDA kernel (`op._forward_cuda`) called directly, with
      `hopper.interface.msda_forward` replaced by a stub that returns a preallocated tensor and the device
      capability probe answered from its cache, so what is timed is the op layer alone. "cuda-like" rows
      put value, locations and weights on the meta device (the tests' stand-in for a GPU);
    - the dispatcher rows call torch.ops.cute_deform.forward on CPU tensors with the CPU math stubbed.
    It replaces functions in this process: run it on its own."""
    import cute_deform
    from cute_deform import _checks, op


    cpu = op_layer_inputs()
    cuda_like = op_layer_inputs(device="meta")  # value & co. on a "device", level table on the CPU
    on_device = op_layer_inputs(device="meta", table_device="meta")  # everything on the "device"
    out = torch.empty(OP_N, OP_LQ, OP_M * OP_D, dtype=torch.float16)

    # Stubs: the math and the launch are not what is timed here.
    def stub_launch(value, *rest, **tuning):
        return out
    op.cpu.forward = lambda *a, **k: out
    interface.msda_forward = stub_launch
    interface.available = lambda: True
    torch.cuda.get_device_capability = lambda index=None: (9, 0)
    torch.cuda.current_device = lambda: 0
    op.kernel_unavailable_reason.cache_clear()
    assert op.kernel_unavailable_reason(0) is None

    cpu_body = op._forward_cpu
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
    row("_checks.validate, cuda-like, CPU level table", lambda: _checks.validate(*cuda_like))
    row("_checks.validate, everything on device", lambda: _checks.validate(*on_device))
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
    print(f"torch {torch.__version__}; N={OP_N} Lq={OP_LQ} M={OP_M} L={len(LEVELS)} P={OP_P} D={OP_D}; median of "
          f"{args.repeats} x {args.number} calls")
    print(f"{'piece':<{width}}  us/call")
    for name, us in rows:
        print(f"{name:<{width}}  {us:7.2f}")


def cmd_smoke(args):
    from cute_deform import ms_deform_attn_reference

    def run(levels, N, Lq, M, D, dtype, low, high):
        """One launch on fresh inputs (locations uniform on [low, high]): its configuration and its relative
        error against the float64 reference."""
        shapes, starts = bench_layer.level_tables(levels, "cuda")
        value = torch.randn(N, sum(h * w for h, w in levels), M, D, device="cuda").to(dtype)
        loc = torch.rand(N, Lq, M, len(levels), 4, 2, device="cuda") * (high - low) + low
        attn = torch.rand(N, Lq, M, len(levels), 4, device="cuda")
        cfg = launch_rules.launched_config(interface.config_for(value, loc, attn), N, Lq, value.shape[1], {})
        out = interface.msda_forward(value, shapes, starts, loc, attn)
        torch.cuda.synchronize()
        ref = ms_deform_attn_reference(value, shapes, starts, loc, attn, out_dtype=torch.float64)
        return cfg, bench_layer.rel_err(out, ref)

    torch.manual_seed(0)
    worst = 0.0
    for D, dtype in ((32, torch.float16), (30, torch.float32)):  # the tiled kernel, then the generic one
        _, err = run([(9, 13), (5, 6), (1, 3), (3, 1)], 2, 50, 2, D, dtype, -0.2, 1.2)
        worst = max(worst, err)
        print(f"smoke D={D} {dtype}: rel err {err:.2e}")
    # A decoder on one image (Deformable DETR's levels, 300 queries): the short-range launch (launch_rules.SHORT_RANGES).
    cfg, err = run(LEVELS, 1, 300, 8, 32, torch.float16, 0.0, 1.0)
    assert cfg.vector_bytes == 8 and cfg.num_groups == 4 and cfg.cluster_size == 1, cfg
    worst = max(worst, err)
    print(f"smoke decoder N=1 Lq=300 (short ranges): rel err {err:.2e}")
    return 0 if worst < 1e-3 else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("compile", "first-call", "host", "smoke", "op-layer"))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--inference-mode", action="store_true", help="host: time under torch.inference_mode, not no_grad")
    ap.add_argument("--layer", action="store_true", help="host: also the encoder layer's forward and its parts")
    ap.add_argument("--repeats", type=int, default=7, help="op-layer: runs of --number calls (the median is shown)")
    ap.add_argument("--number", type=int, default=20000, help="op-layer: calls a run")
    ap.add_argument("--routes", action="store_true",
                    help="op-layer: also time a stub kernel through each public registration route")
    args = ap.parse_args()
    commands = {"compile": cmd_compile, "first-call": cmd_first_call, "host": cmd_host, "smoke": cmd_smoke,
                "op-layer": cmd_op_layer}
    return commands[args.command](args) or 0


if __name__ == "__main__":
    sys.exit(main())
