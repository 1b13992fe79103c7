"""What a call of the Hopper kernel costs besides the kernel: cold compile, first call from the disk
cache (a fresh process), and the host time of an in-memory call.

    python3 scripts/launch_costs.py --compile-only     # any machine: cold compile time of every variant
    python3 scripts/launch_costs.py                     # GPU machine: all three
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

from cute_deform import msda_fwd

# One configuration per code path of the kernel (the defaults, then each switch).
VARIANTS = {
    "default": {},
    "tma boxes": dict(fine_gather="tma", num_groups=4, num_stages=3),
    "no multicast": dict(cluster_size=1),
    "no staging": dict(stage_bytes=0, cluster_size=1),
}
SHAPE = dict(value="float16", loc="float32", attn="float32", M=8, L=4, P=4, D=32)


def config(tuning):
    return msda_fwd.KernelConfig(SHAPE["value"], SHAPE["loc"], SHAPE["attn"], SHAPE["M"], SHAPE["L"], SHAPE["P"],
                                 SHAPE["D"], **{**msda_fwd.TUNING, **tuning})


def compile_times():
    rows = []
    for name, tuning in VARIANTS.items():
        t0 = time.perf_counter()
        msda_fwd.compile_kernel(config(tuning))
        rows.append((name, time.perf_counter() - t0))
    return rows


FIRST_CALL = r"""
import time, torch
t0 = time.perf_counter()
from cute_deform import msda_fwd
import_s = time.perf_counter() - t0
levels = [(100, 167), (50, 84), (25, 42), (13, 21)]
shapes = torch.tensor(levels, device="cuda")
starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
S = int((shapes[:, 0] * shapes[:, 1]).sum())
value = torch.randn(1, S, 8, 32, device="cuda", dtype=torch.float16)
loc = torch.rand(1, 900, 8, 4, 4, 2, device="cuda")
attn = torch.rand(1, 900, 8, 4, 4, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
msda_fwd.msda_forward(value, shapes, starts, loc, attn)
torch.cuda.synchronize()
print(f"{import_s:.3f} {time.perf_counter() - t0:.4f}")
"""


def first_call_from_disk(cache):
    env = {**os.environ, "CUTE_DEFORM_CACHE_DIR": cache}
    subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, check=True, capture_output=True)  # fills the cache
    out = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, check=True, capture_output=True, text=True)
    import_s, first_s = (float(v) for v in out.stdout.split())
    return import_s, first_s


def host_calls(Lq=64):
    """The op and the launch function on a decoder-shaped problem with Lq queries (64: a tiny launch,
    where the host side dominates), as named callables."""
    levels = [(100, 167), (50, 84), (25, 42), (13, 21)]
    shapes = torch.tensor(levels, device="cuda")
    starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
    S = int((shapes[:, 0] * shapes[:, 1]).sum())
    value = torch.randn(1, S, 8, 32, device="cuda", dtype=torch.float16)
    loc = torch.rand(1, Lq, 8, 4, 4, 2, device="cuda")
    attn = torch.rand(1, Lq, 8, 4, 4, device="cuda")
    return (("msda_fwd.msda_forward", lambda: msda_fwd.msda_forward(value, shapes, starts, loc, attn)),
            ("torch.ops.cute_deform.forward", lambda: torch.ops.cute_deform.forward(value, shapes, starts, loc, attn)))


def host_time_per_call(calls=2000):
    results = {}
    for name, fn in host_calls():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        results[name] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    print(f"cold compile, {SHAPE}:")
    for name, seconds in compile_times():
        print(f"  {name:14s} {seconds:6.2f} s")
    if args.compile_only:
        return
    import cute_deform  # noqa: F401  (registers the op)

    with tempfile.TemporaryDirectory() as cache:
        import_s, first_s = first_call_from_disk(cache)
    print(f"fresh process, kernel in the disk cache: import {import_s:.2f} s, first call {first_s * 1e3:.1f} ms")
    for name, us in host_time_per_call().items():
        print(f"host time per call, {name}: {us:.1f} us")


if __name__ == "__main__":
    main()
