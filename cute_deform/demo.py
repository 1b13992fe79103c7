"""Run torch.ops.cute_deform.forward on a realistic preset and check it against the float64 reference.

    python -m cute_deform.demo [--preset decoder|encoder|seed|tiny] [--dtype fp16|bf16|fp32] [--device cpu|cuda]

On an sm_90 GPU with the kernel available this runs the CuTe kernel; on any other machine it runs
the op's pure-PyTorch path and says so. Exit status 1 when the check fails, 2 for a bad argument
(such as --device cuda where torch sees no CUDA device).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from . import op as _op
from .reference import ms_deform_attn_reference

# Levels of a Deformable DETR backbone (strides 8..64) on ~800x1333 and ~736x1280 images.
_COCO_LEVELS = ((100, 167), (50, 84), (25, 42), (13, 21))
_SEED_LEVELS = ((92, 160), (46, 80), (23, 40), (12, 20))


@dataclass(frozen=True)
class Preset:
    batch: int
    queries: int | None  # None: one query per pixel (encoder self-attention)
    levels: tuple[tuple[int, int], ...]
    heads: int
    head_dim: int
    points: int
    local: bool  # samples a few pixels around each query's reference point, else uniform
    about: str


PRESETS = {
    "decoder": Preset(8, 900, _COCO_LEVELS, 8, 32, 4, False, "Deformable DETR decoder cross-attention, 900 queries"),
    "encoder": Preset(2, None, _COCO_LEVELS, 8, 32, 4, True, "Deformable DETR encoder self-attention, a query per pixel"),
    "seed": Preset(48, 15422, _SEED_LEVELS, 8, 32, 8, True, "large batch, 8 points"),
    "tiny": Preset(2, 50, ((8, 10), (4, 5), (2, 3), (1, 1)), 2, 8, 2, False, "a few pixels, for tests"),
}
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def make_inputs(preset: Preset, value_dtype: torch.dtype, device: torch.device, generator: torch.Generator):
    """Random inputs shaped like the preset; attention weights are a softmax over levels*points, as in the module."""
    shapes = torch.tensor(preset.levels, dtype=torch.int64)
    pixels = shapes.prod(-1)
    starts = pixels.cumsum(0) - pixels  # levels stored back to back
    N, M, D, L, P = preset.batch, preset.heads, preset.head_dim, len(preset.levels), preset.points
    S = int(pixels.sum())
    Lq = S if preset.queries is None else preset.queries

    def rand(*size):
        return torch.rand(size, generator=generator)

    value = torch.randn((N, S, M, D), generator=generator).to(value_dtype)
    if preset.local:
        # A few pixels around a reference point, in each level's own pixel units.
        reference = rand(N, Lq, 1, 1, 1, 2)
        level_size = shapes.flip(-1).view(1, 1, 1, L, 1, 2).float()  # (W, H)
        locations = reference + 2.0 * torch.randn((N, Lq, M, L, P, 2), generator=generator) / level_size
    else:
        locations = rand(N, Lq, M, L, P, 2)
    weights = torch.randn((N, Lq, M, L * P), generator=generator).softmax(-1).view(N, Lq, M, L, P)
    return [t.to(device) for t in (value, shapes, starts, locations, weights)]


def describe_path(device: torch.device) -> str:
    if device.type == "cpu":
        return ("the op's CPU path (pure PyTorch, fp32 arithmetic): no Hopper GPU was used, "
                "so the CuTe kernel did not run")
    index = device.index if device.index is not None else torch.cuda.current_device()
    reason = _op.kernel_unavailable_reason(index)
    if reason is None:
        return f"the CuTe kernel on {torch.cuda.get_device_name(index)} (sm_90)"
    return f"the op's slower pure-PyTorch path (grid_sample, fp32 arithmetic) because {reason}"


def time_op(args, device: torch.device) -> tuple[torch.Tensor, float]:
    """Output and median seconds per call, after one warm-up call (first-call setup, kernel compile)."""
    out = torch.ops.cute_deform.forward(*args)
    times = []
    for _ in range(10 if device.type == "cuda" else 3):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            torch.ops.cute_deform.forward(*args)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            torch.ops.cute_deform.forward(*args)
            times.append(time.perf_counter() - begin)
    return out, sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cute_deform.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="decoder")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp16", help="value dtype (locations and weights are fp32)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one)")
    opts = parser.parse_args(argv)
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda is not available here (torch.cuda.is_available() is False); "
                     "use --device cpu")

    preset = PRESETS[opts.preset]
    device = torch.device(opts.device)
    value_dtype = _DTYPES[opts.dtype]
    generator = torch.Generator()
    seed = generator.seed() if opts.seed is None else generator.manual_seed(opts.seed).initial_seed()
    args = make_inputs(preset, value_dtype, device, generator)
    N, S, M, D = args[0].shape
    Lq, P = args[3].shape[1], args[3].shape[4]
    levels = ",".join(f"({h},{w})" for h, w in preset.levels)
    print(f"cute_deform demo, preset '{opts.preset}' ({preset.about}), seed {seed}")
    print(f"  N={N} Lq={Lq} S={S} M={M} D={D} P={P} levels {levels}; value {opts.dtype}, locations/weights fp32")
    print(f"  device {device}: running {describe_path(device)}")

    out, seconds = time_op(args, device)
    reference = ms_deform_attn_reference(*args, compute_dtype=torch.float64, out_dtype=torch.float64)
    error = ((out.double() - reference).norm() / reference.norm()).item()
    # The reference sees the same (rounded) inputs, so what remains is fp32 arithmetic and the
    # rounding of the output to value's dtype.
    tolerance = max(torch.finfo(value_dtype).eps, 1e-5)
    ok = error <= tolerance and out.shape == reference.shape and out.dtype == value_dtype
    print(f"  time: {seconds * 1e3:.3f} ms per call (median)")
    print(f"  check vs the float64 reference: ||out - ref|| / ||ref|| = {error:.2e} "
          f"(tolerance {tolerance:.1e}): {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
