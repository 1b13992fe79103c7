"""CPU time of torch.ops.cute_deform.forward against the grid_sample formulation and the fp32 reference
(the op's CPU kernel before cute_deform/cpu.py), on the demo's presets.

    PYTHONPATH=. python scripts/cpu_speed.py [--presets encoder,decoder] [--dtype fp32] [--repeats 5]
                                             [--impls op,grid_sample,reference_fp32] [--threads N] [--no-check]

Each implementation is first checked against the float64 reference (||out - ref|| / ||ref||), then
timed: one warm-up call each, then --repeats rounds calling each implementation once in turn (on a
shared machine, load from other processes then falls on all alike); the table gives the median and
the fastest in ms, and the median's ratio to grid_sample's. Progress goes to stderr, the table to stdout. Inputs are the
demo's (`cute_deform.demo.make_inputs`, fixed seed); locations and weights are fp32.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import cute_deform
from cute_deform import demo
from cute_deform.reference import ms_deform_attn_grid_sample, ms_deform_attn_reference

IMPLS = {
    "op": lambda *args: torch.ops.cute_deform.forward(*args),
    "grid_sample": lambda *args: ms_deform_attn_grid_sample(*args, out_dtype=args[0].dtype),
    "reference_fp32": lambda *args: ms_deform_attn_reference(*args, compute_dtype=torch.float32,
                                                             out_dtype=args[0].dtype),
}


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def time_round_robin(impls: list[str], args, repeats: int, label: str) -> dict[str, list[float]]:
    """ms per call of each implementation: one warm-up call each, then `repeats` rounds that call each
    once in turn, so that load from other processes falls on all of them alike."""
    for impl in impls:
        IMPLS[impl](*args)
    times = {impl: [] for impl in impls}
    for i in range(repeats):
        for impl in impls:
            begin = time.perf_counter()
            IMPLS[impl](*args)
            times[impl].append((time.perf_counter() - begin) * 1e3)
        progress(f"  {label} round {i + 1}/{repeats}: " + ", ".join(f"{impl} {times[impl][-1]:.1f} ms" for impl in impls))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="encoder,decoder", help=f"comma-separated, of {sorted(demo.PRESETS)}")
    parser.add_argument("--dtype", choices=sorted(demo._DTYPES), default="fp32", help="value dtype")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {list(IMPLS)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="skip the float64 reference check")
    opts = parser.parse_args()
    presets = opts.presets.split(",")
    impls = opts.impls.split(",")
    for name in presets:
        if name not in demo.PRESETS:
            parser.error(f"argument --presets: unknown preset {name!r}; expected one of {sorted(demo.PRESETS)}")
    for name in impls:
        if name not in IMPLS:
            parser.error(f"argument --impls: unknown implementation {name!r}; expected one of {list(IMPLS)}")
    if opts.threads:
        torch.set_num_threads(opts.threads)

    rows = []
    for preset_name in presets:
        preset = demo.PRESETS[preset_name]
        progress(f"[{preset_name}] inputs ({preset.about})")
        args = demo.make_inputs(preset, demo._DTYPES[opts.dtype], torch.device("cpu"),
                                torch.Generator().manual_seed(opts.seed))
        reference = None
        if not opts.no_check:
            progress(f"[{preset_name}] float64 reference (for the check)")
            reference = ms_deform_attn_reference(*args, out_dtype=torch.float64)
        errors = dict.fromkeys(impls)
        if reference is not None:
            for impl in impls:
                progress(f"[{preset_name}] {impl}: check")
                out = IMPLS[impl](*args)
                errors[impl] = ((out.double() - reference).norm() / reference.norm()).item()
                del out
        progress(f"[{preset_name}] timing")
        times = time_round_robin(impls, args, opts.repeats, preset_name)
        baseline = statistics.median(times["grid_sample"]) if "grid_sample" in times else None
        for impl in impls:
            median, error = statistics.median(times[impl]), errors[impl]
            rows.append((preset_name, impl, f"{median:.1f}", f"{min(times[impl]):.1f}",
                         "" if baseline is None else f"{baseline / median:.2f}x",
                         "" if error is None else f"{error:.1e}"))

    value_shape = "N, Lq, levels, M=8, D=32, P as in cute_deform.demo.PRESETS"
    print(f"cute_deform from {cute_deform.__file__}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"value {opts.dtype}, locations and weights fp32 ({value_shape}); {opts.repeats} timed calls each")
    header = ("preset", "implementation", "median ms", "fastest ms", "grid_sample / this", "rel err vs float64")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
