"""Diagnostic: where the host time of one op call goes (cProfile over many calls of a tiny launch).
    python3 scripts/profile_host.py
"""
import cProfile
import pstats

import torch

import cute_deform  # noqa: F401
from cute_deform import msda_fwd

levels = [(100, 167), (50, 84), (25, 42), (13, 21)]
shapes = torch.tensor(levels, device="cuda")
starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
S = int((shapes[:, 0] * shapes[:, 1]).sum())
value = torch.randn(1, S, 8, 32, device="cuda", dtype=torch.float16)
loc = torch.rand(1, 64, 8, 4, 4, 2, device="cuda")
attn = torch.rand(1, 64, 8, 4, 4, device="cuda")
op = torch.ops.cute_deform.forward
for fn in (lambda: op(value, shapes, starts, loc, attn), lambda: msda_fwd.msda_forward(value, shapes, starts, loc, attn)):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3000):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
