#!/usr/bin/env python3
"""What a call costs besides the kernel, and a small check for the sanitizers: one entry point.

    python scripts/overhead.py compile      # any machine: cold compile time of each kernel variant
    python scripts/overhead.py first-call   # GPU: a fresh process with the kernel in the disk cache
    python scripts/overhead.py host         # GPU: host time per call (op, fused op, launch function), and
                                           #      where it goes (cProfile, with --cprofile); with --layer
                                           #      also the encoder layer's forward and each of its launches
    python scripts/overhead.py smoke        # GPU: one small case against float64 (run under compute-sanitizer)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from cute_deform.hopper import interface  # noqa: E402
from cute_deform.hopper.config import KernelConfig  # noqa: E402
from cute_deform.hopper.generic import GenericConfig  # noqa: E402

import bench_layer  # noqa: E402  (this script's folder: the layer and the host-time loop are bench_layer.py's)

SHAPE = ("float16", "float32", "float32", 8, 4, 4, 32)  # value, locations, weights dtypes, M, L, P, D
VARIANTS = {
    "default": lambda: KernelConfig(*SHAPE, **interface.TUNING),
    "fused": lambda: KernelConfig(*SHAPE, fused=True, **interface.TUNING),
    "tma boxes": lambda: KernelConfig(*SHAPE, **{**interface.TUNING, "fine_gather": "tma", "num_groups": 4,
                                                 "num_stages": 3}),
    "no multicast": lambda: KernelConfig(*SHAPE, **{**interface.TUNING, "cluster_size": 1}),
    "generic": lambda: GenericConfig(*SHAPE),
}
LEVELS = [(100, 167), (50, 84), (25, 42), (13, 21)]

FIRST_CALL = r"""
import time, torch
t0 = time.perf_counter()
import cute_deform
import_s = time.perf_counter() - t0
shapes = torch.tensor([(100, 167), (50, 84), (25, 42), (13, 21)], device="cuda")
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
"""


def level_tables(device="cuda"):
    shapes = torch.tensor(LEVELS, device=device)
    starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
    return shapes, starts, int((shapes[:, 0] * shapes[:, 1]).sum())


def cmd_compile(args):
    os.environ["CUTE_DEFORM_CACHE_DIR"] = "off"
    print(f"cold compile, value/locations/weights/M/L/P/D = {SHAPE}:")
    for name, make in VARIANTS.items():
        t0 = time.perf_counter()
        interface.compile_kernel(make())
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
        bench_layer.COCO_LEVELS, 256, 8, 4, 2, torch.float16, "cuda", torch.Generator().manual_seed(0))
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


def cmd_smoke(args):
    from cute_deform import ms_deform_attn_reference

    torch.manual_seed(0)
    levels = [(9, 13), (5, 6), (1, 3), (3, 1)]
    shapes = torch.tensor(levels, device="cuda")
    starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
    S = int((shapes[:, 0] * shapes[:, 1]).sum())
    worst = 0.0
    for D, dtype in ((32, torch.float16), (30, torch.float32)):  # the tiled kernel, then the generic one
        value = torch.randn(2, S, 2, D, device="cuda").to(dtype)
        loc = torch.rand(2, 50, 2, 4, 4, 2, device="cuda") * 1.4 - 0.2
        attn = torch.rand(2, 50, 2, 4, 4, device="cuda")
        out = interface.msda_forward(value, shapes, starts, loc, attn)
        torch.cuda.synchronize()
        ref = ms_deform_attn_reference(value, shapes, starts, loc, attn, out_dtype=torch.float64)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
        print(f"smoke D={D} {dtype}: rel err {err:.2e}")
    return 0 if worst < 1e-3 else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("compile", "first-call", "host", "smoke"))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--inference-mode", action="store_true", help="host: time under torch.inference_mode, not no_grad")
    ap.add_argument("--layer", action="store_true", help="host: also the encoder layer's forward and its parts")
    args = ap.parse_args()
    return {"compile": cmd_compile, "first-call": cmd_first_call, "host": cmd_host, "smoke": cmd_smoke}[args.command](args) or 0


if __name__ == "__main__":
    sys.exit(main())
