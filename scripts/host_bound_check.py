"""Diagnostic: one preset's time through do_bench (L2 flushed between calls), back-to-back calls, and a CUDA
graph, for the op and for msda_fwd.msda_forward, on compare.py's inputs and on kernel_check.py's.
    python3 scripts/host_bound_check.py [preset]
"""
import sys
import time

import torch
import triton.testing as tt

sys.path.insert(0, "scripts")
import compare  # noqa: E402
import kernel_check as kc  # noqa: E402
from cute_deform import msda_fwd  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "detr-decoder"
p = kc.PRESETS[name]
inputs = {"kernel_check": kc.make_inputs(N=p["N"], Lq=p["Lq"], M=8, D=32, levels=p["levels"], P=p["P"],
                                         vdt=torch.float16, local=p["local"])}
cfg = compare.PRESETS[name]
S = sum(h * w for h, w in cfg["levels"])
shape = compare.Shape(name, cfg["N"], cfg["Lq"] or S, cfg["levels"], cfg["P"], 8, 32,
                      cfg.get("locations", "local"))
inputs["compare"] = compare.make_inputs(shape, torch.float16, torch.Generator("cuda").manual_seed(1))
op = torch.ops.cute_deform.forward
for source, (value, shapes, starts, loc, attn) in inputs.items():
    for label, fn in (("op", lambda: op(value, shapes, starts, loc, attn)),
                      ("msda_forward", lambda: msda_fwd.msda_forward(value, shapes, starts, loc, attn)),
                      ("whole_segments=0", lambda: msda_fwd.msda_forward(value, shapes, starts, loc, attn,
                                                                         whole_segments=False))):
        fn()
        torch.cuda.synchronize()
        flushed = tt.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            fn()
        end.record()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(300):
            fn()
        host = (time.perf_counter() - t0) / 300 * 1e6
        torch.cuda.synchronize()
        print(f"{source:13s} {label:17s} do_bench {flushed:7.1f}  back-to-back {start.elapsed_time(end) / 200 * 1e3:7.1f}"
              f"  host/call {host:6.1f} us   loc range [{loc.min().item():.2f}, {loc.max().item():.2f}]")
