#!/usr/bin/env python3
"""Tuning sweep of the Hopper kernel: every variant on every preset, checked against the float64
reference (first image, outputs poisoned), then timed (do_bench median). The presets and their inputs are
compare.py's, shuffled queries included.

    python scripts/tune.py                                        # the defaults on every preset
    python scripts/tune.py --sweep ",num_groups=4,window_fraction=0" --presets seed-b48,seed-b48-shuffled
    python scripts/tune.py --precompile --sweep ...               # only fill the kernel cache (no GPU needed)
    python scripts/tune.py --presets "" --custom "--levels 100x167,50x84 --N 16 --Lq 900 --locations uniform"

A variant is a ":"-separated list of knob=value of cute_deform.hopper.launch_rules (TUNING, window_fraction,
reorder_queries, generic); the empty variant is the default.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from cute_deform.hopper import compile_cache, interface, launch_rules  # noqa: E402
from cute_deform.hopper.config import KernelConfig  # noqa: E402


# The on/off knobs: KernelConfig's boolean fields, and the launch's generic and reorder_queries.
BOOL_KNOBS = ({f.name for f in dataclasses.fields(KernelConfig) if f.type in (bool, "bool")}
              | {"generic", "reorder_queries"})


def parse_variant(spec: str) -> dict:
    out = {}
    for item in filter(None, spec.split(":")):
        key, value = item.split("=")
        out[key] = float(value) if "." in value else int(value) if value.lstrip("-").isdigit() else value
    for key in BOOL_KNOBS:
        if key in out:
            out[key] = bool(out[key])
    return out


def variant_name(tuning: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in tuning.items()) or "default"


def shapes_of(names: list[str], custom: list[str] = ()) -> list:
    """compare.py's presets, and shapes in compare.py's custom syntax (--levels ... --N ... --Lq ...)."""
    shapes = compare.selected_shapes(compare.parse_args(["--presets", ",".join(names)])) if names else []
    for spec in custom:
        shape = compare.selected_shapes(compare.parse_args(["--presets", ""] + shlex.split(spec)))[-1]
        # Named by every field a custom shape sets, so that two shapes never share a row of the table.
        levels = ",".join(f"{h}x{w}" for h, w in shape.levels)
        heads = "" if (shape.M, shape.D) == (8, 32) else f"-M{shape.M}-D{shape.D}"
        name = f"{levels}-N{shape.N}-Lq{shape.Lq}-P{shape.P}{heads}-{shape.locations}-{shape.order}"
        shapes.append(dataclasses.replace(shape, name=name))
    return shapes


def _variant_configs(shapes, variants, dtype, loc_dtype):
    """(shape, tuning, configuration the variant compiles) for every preset shape and variant (value in
    dtype, locations and weights in loc_dtype)."""
    for shape in shapes:
        value = torch.empty(1, 1, shape.M, shape.D, dtype=dtype)
        loc = torch.empty(1, 1, shape.M, shape.L, shape.P, 2, dtype=loc_dtype)
        attn = torch.empty(1, 1, shape.M, shape.L, shape.P, dtype=loc_dtype)
        for tuning in variants:
            yield shape, tuning, interface.config_for(value, loc, attn, **launch_rules.static_tuning(tuning))


def configs_of(shapes, variants, dtype, loc_dtype=torch.float32) -> set:
    """The configurations the presets' shapes run with each variant."""
    return {cfg for _, _, cfg in _variant_configs(shapes, variants, dtype, loc_dtype)}


def launched_configs(shapes, variants, dtype, loc_dtype=torch.float32) -> set:
    """The configurations the presets' launches run with each variant (launch_rules.launched_config)."""
    return {launch_rules.launched_config(cfg, shape.N, shape.Lq, shape.S, tuning, levels=shape.levels)
            for shape, tuning, cfg in _variant_configs(shapes, variants, dtype, loc_dtype)}


def precompile(shapes, variants, dtype):
    configs = launched_configs(shapes, variants, dtype)
    t0 = time.time()
    compile_cache.precompile(sorted(configs, key=repr), variants=False)
    print(f"{len(configs)} configurations (and their launch variants) in the cache in {time.time() - t0:.1f} s",
          flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default=",".join(compare.PRESETS), help="comma list ('' for none)")
    p.add_argument("--custom", action="append", default=[], metavar="ARGS",
                   help="a shape in compare.py's custom options, e.g. \"--levels 100x167,50x84 --N 16 --Lq 900 "
                        "--locations uniform\" (repeatable)")
    p.add_argument("--sweep", default="", help="comma list of variants (see above)")
    p.add_argument("--dtype", choices=tuple(compare.DTYPES), default="fp16")
    p.add_argument("--precompile", action="store_true", help="only compile into the disk cache")
    p.add_argument("--no-check", action="store_true", help="time only")
    p.add_argument("--rep", type=float, default=200.0, help="do_bench repetition time, ms")
    args = p.parse_args(argv)
    dtype = compare.DTYPES[args.dtype]
    variants = [parse_variant(spec) for spec in args.sweep.split(",")]
    shapes = shapes_of([n for n in args.presets.split(",") if n], args.custom)
    precompile(shapes, variants, dtype)
    if args.precompile:
        return 0
    import triton.testing
    from tqdm import tqdm

    results, failures = {}, []
    print(f"device {torch.cuda.get_device_name()}; value {args.dtype}, fp32 locations; µs, do_bench median", flush=True)
    with tqdm(total=len(shapes) * len(variants), desc="tune", file=sys.stderr, mininterval=10) as bar:
        for shape in shapes:
            seed = int.from_bytes(os.urandom(4), "little")
            (value, shapes_t, starts, loc, attn), _ = compare.make_inputs(
                shape, dtype, torch.Generator(device="cuda").manual_seed(seed))
            # The level table as the op reads it from a caller that holds it on the host (transformers' models).
            host_levels = (shapes_t.tolist(), starts.tolist())
            ref = None
            if not args.no_check:
                ref, _ = compare.baselines.reference_forward(value[:1], shapes_t, starts, loc[:1], attn[:1])
            for tuning in variants:
                bar.set_postfix_str(f"{shape.name} {variant_name(tuning)}")

                def run(tuning=tuning):
                    return interface.msda_forward(value, shapes_t, starts, loc, attn, host_levels=host_levels,
                                                  **tuning)

                # The output lands on a block filled with NaN (compare.run_poisoned), not on the block where the
                # variant before wrote the right answer to the same inputs.
                out, poisoned = compare.run_poisoned(run)
                torch.cuda.synchronize()
                err = float("nan")
                if not poisoned:
                    failures.append(f"{shape.name} {variant_name(tuning)}: the output never landed on poisoned memory")
                if ref is not None:
                    err = compare.baselines.relative_error(out[:1], ref)
                    if not (err <= compare.CUTE_BOUND[dtype]) or not torch.isfinite(out).all():
                        failures.append(f"{shape.name} {variant_name(tuning)}: rel err {err:.2e}")
                del out
                us = triton.testing.do_bench(run, warmup=25, rep=args.rep, return_mode="median") * 1e3
                results[shape.name, variant_name(tuning)] = (us, err)
                bar.update(1)
            del value, loc, attn, ref
            torch.cuda.empty_cache()
    names = [variant_name(t) for t in variants]
    # Columns by short labels (a legend above the table) so that long variants keep the table readable.
    labels = [f"v{i}" for i in range(len(names))]
    for label, n in zip(labels, names):
        print(f"{label}: {n}")
    first = max([20] + [len(s.name) for s in shapes]) + 2
    print("\n" + "preset".ljust(first) + "".join(label.rjust(16) for label in labels))
    for shape in shapes:
        cells = []
        for n in names:
            us, err = results[shape.name, n]
            cells.append(f"{us:.1f} ({err:.0e})".rjust(16))
        print(shape.name.ljust(first) + "".join(cells))
    print("cells: µs (rel err of image 0 against float64)")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
