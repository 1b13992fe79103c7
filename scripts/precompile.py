#!/usr/bin/env python3
"""Compile the Hopper kernels that the GPU test suite and compare.py's presets run into the disk cache,
on any machine: no GPU is needed (the target is sm_90a). A GPU machine then loads them in milliseconds
instead of compiling each for seconds.

    CUTE_DSL_ARCH=sm_90a CUTE_DEFORM_CACHE_DIR=.kcache python scripts/precompile.py --archive .kcache.tar.xz

scripts/gpu_all.sh unpacks .kcache.tar.xz into its cache when the archive travels with the work tree
(about 4 MB for the ~430 configurations).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts"), str(REPO)]
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402

from cute_deform.hopper import compile_cache, interface, launch_rules  # noqa: E402


def _config(dt, loc_dt, M, D, L, P, ref_dims=None):
    """The configuration config_for picks for a problem's static parameters (size-1 tensors stand in
    for N, S and Lq); ref_dims: the fused op with reference points in dt."""
    value = torch.empty(1, 1, M, D, dtype=dt)
    loc, attn = torch.empty(1, 1, M, L, P, 2, dtype=loc_dt), torch.empty(1, 1, M, L, P, dtype=loc_dt)
    ref = torch.empty(1, 1, L, ref_dims, dtype=dt) if ref_dims else None
    return interface.config_for(value, loc, attn, ref)


def configurations() -> list:
    import compare
    import test_kernel_gpu as grid
    import tune

    from cute_deform import demo

    configs = [grid.case_config(case) for case in grid.CASES]
    configs += [grid.fused_case_config(case) for case in grid.FUSED]
    # The Deformable DETR layer and model of scripts/bench_layer.py: the fused op with fp32 and fp16 weights.
    for dt in (torch.float32, torch.float16):
        configs += launch_rules.launch_variants(_config(dt, dt, 8, 32, 4, 4, ref_dims=2))
    # tests/test_gpu.py: the demo's decoder and tiny presets, every value and location dtype.
    for name in ("decoder", "tiny"):
        preset = demo.PRESETS[name]
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            for loc_dt in (torch.float32, torch.float16, torch.bfloat16):
                cfg = _config(dt, loc_dt, preset.heads, preset.head_dim, len(preset.levels), preset.points)
                configs += launch_rules.launch_variants(cfg)
    # tests/test_native_gpu.py: the tiled and generic kernels, and the fused one with points and boxes.
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for D in (32, 6):
            configs += launch_rules.launch_variants(_config(dt, torch.float32, 8, D, 4, 4))
    for ref_dims in (2, 4):
        configs += launch_rules.launch_variants(_config(torch.float16, torch.float16, 8, 32, 4, 4, ref_dims=ref_dims))
    # tests/test_fused_gpu.py: every value and input dtype, points and boxes, on its four small levels (N=2, Lq=300).
    import test_fused_gpu as fused_tests

    S = sum(h * w for h, w in fused_tests.LEVELS)
    floats = fused_tests.FLOATS
    for dt, in_dt, ref_dims in itertools.product(floats, floats, (2, 4)):
        value = torch.empty(1, 1, 8, 32, dtype=dt)
        offsets = torch.empty(1, 1, 8, 4, 4, 2, dtype=in_dt)
        logits = torch.empty(1, 1, 8, 4, 4, dtype=fused_tests.logit_dtype_for(in_dt))
        cfg = interface.config_for(value, offsets, logits, torch.empty(1, 1, 4, ref_dims, dtype=in_dt))
        configs.append(launch_rules.launched_config(cfg, 2, 300, S, {}))
    # ... and its one-level and three-level cases (fp16 value and inputs, points and boxes).
    for levels, ref_dims in itertools.product((1, 3), (2, 4)):
        configs += launch_rules.launch_variants(_config(torch.float16, torch.float16, 8, 32, levels, 4, ref_dims=ref_dims))
    shapes = tune.shapes_of(list(compare.PRESETS))
    for dt in (torch.float16, torch.float32, torch.bfloat16):
        for loc_dt in (torch.float32, dt):
            for cfg in sorted(tune.configs_of(shapes, [{}], dt, loc_dt), key=repr):
                configs += launch_rules.launch_variants(cfg)
    # compare.py --presets models (fp16 value; cute with fp32 locations, cute-half with fp16 ones): the model shapes
    # beyond the presets.
    models = tune.shapes_of(list(compare.MODEL_PRESETS))
    for loc_dt in (torch.float32, torch.float16):
        for cfg in sorted(tune.configs_of(models, [{}], torch.float16, loc_dt), key=repr):
            configs += launch_rules.launch_variants(cfg)
    # compare.py --D 48 / 96 / 256 (fp16 value, fp32 locations): the head dims timed against classic.
    for D in (48, 96, 256):
        args = compare.parse_args(["--presets", ",".join(compare.PRESETS), "--D", str(D)])
        for cfg in sorted(tune.configs_of(compare.selected_shapes(args), [{}], torch.float16), key=repr):
            configs += launch_rules.launch_variants(cfg)
    return list(dict.fromkeys(configs))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archive", help="also write the cache as this .tar.xz")
    args = parser.parse_args(argv)
    cache = compile_cache.cache_dir()
    if cache is None:
        sys.exit("the kernel cache is off: set CUTE_DEFORM_CACHE_DIR to a folder")
    configs = configurations()
    print(f"{len(configs)} configurations into {cache}", flush=True)
    start = time.time()
    compile_cache.precompile(configs, variants=False)
    print(f"done in {time.time() - start:.0f} s", flush=True)
    if args.archive:
        with tarfile.open(args.archive, "w:xz") as tar:
            for path in sorted(cache.glob("msda_*.o")):
                tar.add(path, arcname=path.name)
        print(f"wrote {args.archive} ({Path(args.archive).stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
