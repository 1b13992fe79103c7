"""Diagnostic: where the host time of one call goes (cProfile over many calls of a tiny launch), for
the op and for the launch function.
    python3 scripts/profile_host.py
"""
import cProfile
import pstats

import torch

import cute_deform  # noqa: F401  (registers the op)
from launch_costs import host_calls

for name, fn in host_calls():
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3000):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"== {name}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
