#!/usr/bin/env python3
"""The order table's cost: the device kernels (cute_deform/hopper/order.py) against torch's sort of the same
cells, alone and inside the op, on scripts/compare.py's inputs for a preset (fp16 value, fp32 locations).

    python3 benchmarks/order_table.py seed-b48 seed-b48-shuffled

For each preset, two rounds of the pair (device kernels, host sort), do_bench medians in µs: the table alone,
then the op (which runs through the table from 2^26 samples). Each op run's first image is checked against a
launch without the table: any table gives the same bits, so the error must be 0. The table alone is timed call
by call and includes the host's Python between its launches; inside the op the GPU is busy with the last
call's kernel while the host prepares the next, so the op's difference is the table's GPU time difference.
Result, session 24 (H100): seed-b48 3698.5 against 3812.4 µs, seed-b48-shuffled 3698.0 against 3811.4;
H200: 3618.3 against 3730.2 and 3625.7 against 3732.5 (docs/performance.md, v41).
"""
import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(REPO)]
import compare  # noqa: E402
from cute_deform.hopper import interface  # noqa: E402


def bench(fn) -> float:
    import triton.testing  # on the GPU machine only

    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median") * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("presets", nargs="+", help="compare.py presets, e.g. seed-b48 seed-b48-shuffled")
    args = parser.parse_args(argv)
    device_limit = interface.ORDER_MAX_QUERIES
    print(f"{'preset':20s} {'table':12s} {'alone µs':>9s} {'op µs':>9s}  image 0 against no table")
    for preset in args.presets:
        shape = compare.selected_shapes(compare.parse_args(["--presets", preset]))[0]
        generator = torch.Generator(device="cuda").manual_seed(0)
        (value, shapes, starts, loc, attn), _ = compare.make_inputs(shape, torch.float16, generator)
        expected = interface.msda_forward(value[:1], shapes, starts, loc[:1], attn[:1], reorder_queries=False).float()
        try:
            for label, limit in (("device", device_limit), ("host sort", 0)) * 2:
                interface.ORDER_MAX_QUERIES = limit  # 0: every image goes to torch's sort
                alone = bench(lambda: interface.query_order(loc, None, shapes))
                out = interface.msda_forward(value, shapes, starts, loc, attn, reorder_queries=True)
                err = float((out[:1].float() - expected).norm() / expected.norm())
                op = bench(lambda: interface.msda_forward(value, shapes, starts, loc, attn, reorder_queries=True))
                print(f"{preset:20s} {label:12s} {alone:9.1f} {op:9.1f}  {err:.1e}", flush=True)
        finally:
            interface.ORDER_MAX_QUERIES = device_limit
    return 0


if __name__ == "__main__":
    sys.exit(main())
