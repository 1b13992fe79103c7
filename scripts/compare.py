#!/usr/bin/env python3
"""Multi-Scale Deformable Attention forward, side by side: the CUDA C++ baselines in kernels/ and cute_deform.

Every implementation is first checked against a float64 reference (relative Frobenius error, output poisoned
with NaN before the run), then timed with triton.testing.do_bench (median after warm-up). A mismatch or a failed
run is reported and the script exits non-zero. The table is printed last.

    python scripts/compare.py                                   # all presets, fp16 value, fp32 locations
    python scripts/compare.py --presets dcnv4-test --dtype bf16 --impls classic,vec,tma
    python scripts/compare.py --levels 64x64,32x32 --N 2 --Lq 5120 --P 4 --locations uniform
    python scripts/compare.py --presets models --impls dcnv4,cute   # Mask2Former, BEV and RT-DETR shapes
    python scripts/compare.py --presets detr-encoder --ncu tma   # dram / l1tex / sm throughput of one kernel
    python scripts/compare.py --presets detr-decoder --ncu cute --ncu-l2 dirty   # the L2 state do_bench times in
    python scripts/compare.py --csv results/compare.csv --png results/compare.png

Implementations: classic-fp32 (classic on an fp32 copy of value: the paper's kernel at fp32, the speed anchor of
issue 3), classic, vec, tile2x2, tma, distributed (kernels/), cute (torch.ops.cute_deform.forward, given the level
table on the host as transformers' models give it; fp32 locations and weights), cute-half (the same op given its
locations and weights in value's dtype, as a half-precision model passes them and as DCNv4 computes with them),
dcnv4 (built from its sdist, scripts/peers.py) and grid_sample (F.grid_sample in fp32, pure PyTorch).
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402
import peers  # noqa: E402

DETR_LEVELS = [(100, 167), (50, 84), (25, 42), (13, 21)]
SEED_LEVELS = [(92, 160), (46, 80), (23, 40), (12, 20)]
RTDETR_LEVELS = [(80, 80), (40, 40), (20, 20)]  # 640x640 at strides 8-32
# locations: local = around the query's own pixel (an encoder), init = Deformable DETR's initial offsets
# around the query's pixel, ref = a few pixels around a random reference point per query (a decoder's
# object queries), uniform = anywhere. order: queries as generated (raster order of their pixels) or
# shuffled within each image, as callers with per-query reference points hand them over.
PRESETS = {
    "dcnv4-test": dict(N=1, Lq=15200, levels=[(100, 152), (50, 76), (25, 38), (13, 19)], P=8, locations="local"),
    "detr-encoder": dict(N=2, Lq=None, levels=DETR_LEVELS, P=4, locations="local"),
    "detr-encoder-init": dict(N=2, Lq=None, levels=DETR_LEVELS, P=4, locations="init"),
    "detr-decoder": dict(N=8, Lq=900, levels=DETR_LEVELS, P=4, locations="uniform"),
    "detr-decoder-ref": dict(N=8, Lq=900, levels=DETR_LEVELS, P=4, locations="ref"),
    "decoder-b16": dict(N=16, Lq=300, levels=DETR_LEVELS, P=4, locations="uniform"),
    "seed-b48": dict(N=48, Lq=15422, levels=SEED_LEVELS, P=8, locations="local"),
    "seed-b48-shuffled": dict(N=48, Lq=15422, levels=SEED_LEVELS, P=8, locations="local", order="shuffled"),
}
# Shapes of models beyond Deformable DETR (docs/performance.md, session 29), by name or all at once with
# `--presets models`; not part of `all`, the presets.
MODEL_PRESETS = {
    # Mask2Former's pixel decoder at 1024x1024 (1/8 to 1/32 of the image), and at Cityscapes' 1024x2048.
    "mask2former-encoder": dict(N=2, Lq=None, levels=[(128, 128), (64, 64), (32, 32)], P=4, locations="local"),
    "mask2former-cityscapes": dict(N=1, Lq=None, levels=[(128, 256), (64, 128), (32, 64)], P=4, locations="local"),
    # BEVFormer-like self-attention over a 200x200 BEV grid: one level, a query a cell.
    "bev-self-attention": dict(N=2, Lq=None, levels=[(200, 200)], P=4, locations="local"),
    # RT-DETR's decoder at 640x640: 300 queries around reference points.
    "rtdetr-decoder": dict(N=16, Lq=300, levels=RTDETR_LEVELS, P=4, locations="ref"),
    "rtdetr-decoder-b4": dict(N=4, Lq=300, levels=RTDETR_LEVELS, P=4, locations="ref"),
    # Deformable DETR's decoder at inference on one image: 300 object queries (two-stage) around reference points.
    "detr-decoder-b1": dict(N=1, Lq=300, levels=DETR_LEVELS, P=4, locations="ref"),
}
ALL_IMPLS = ("classic-fp32", "classic", "vec", "tile2x2", "tma", "distributed", "grid_sample", "dcnv4", "cute",
             "cute-half")
# cute's bounds: fp32 arithmetic, and packed half arithmetic for the corner sums of fp16 / bf16 value.
CUTE_BOUND = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NCU_METRICS = [
    "gpu__time_duration.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_sector_hit_rate.pct",
    "l1tex__t_sector_hit_rate.pct",
    "smsp__inst_executed.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
]
TIMED = ("ok", "inexact")
GRID_SAMPLE_MAX_BYTES = 4 << 30  # its (N*M, D, Lq, P) fp32 intermediate per level; larger presets skip it


@dataclass
class Shape:
    name: str
    N: int
    Lq: int
    levels: list
    P: int
    M: int
    D: int
    locations: str
    order: str = "sorted"

    @property
    def S(self) -> int:
        return sum(h * w for h, w in self.levels)

    @property
    def L(self) -> int:
        return len(self.levels)

    @property
    def samples(self) -> int:
        return self.N * self.Lq * self.M * self.L * self.P

    def floor_bytes(self, value_bytes: int, value_rows: int | None = None) -> int:
        """Each input read once and the output written once: value (the value_rows (image, pixel, head)
        rows that some sample's corner reads, or all of them), fp32 locations and weights, output."""
        rows = self.N * self.S * self.M if value_rows is None else value_rows
        value = rows * self.D * value_bytes
        locations = self.samples * 2 * 4
        weights = self.samples * 4
        out = self.N * self.Lq * self.M * self.D * value_bytes
        return value + locations + weights + out

    def describe(self) -> str:
        lv = ",".join(f"{h}x{w}" for h, w in self.levels)
        return (f"{self.name}: N={self.N} Lq={self.Lq} S={self.S} levels={lv} M={self.M} D={self.D} P={self.P} "
                f"locations={self.locations} order={self.order}")


@dataclass
class Row:
    preset: str
    impl: str
    dtype: str
    status: str = "ok"  # ok | inexact (a peer past the bound, still timed) | MISMATCH | FAILED | skipped
    rel_err: float = float("nan")
    bound: float = float("nan")
    us: float = float("nan")
    speedup_classic: float = float("nan")
    speedup_classic_fp32: float = float("nan")
    speedup_dcnv4: float = float("nan")
    gsamples: float = float("nan")
    tbs: float = float("nan")
    floor_us: float = float("nan")
    note: str = ""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="all",
                   help=f"comma list of {','.join(PRESETS)} or 'all'; model shapes: {','.join(MODEL_PRESETS)} or "
                        "'models'")
    p.add_argument("--levels", help="custom shape: levels as HxW,HxW,... (adds a 'custom' preset and drops the rest "
                   "unless --presets is given too)")
    p.add_argument("--N", type=int, default=1, help="custom: batch")
    p.add_argument("--Lq", type=int, default=None, help="custom: queries (default S)")
    p.add_argument("--P", type=int, default=4, help="custom: points per level")
    p.add_argument("--M", type=int, default=8, help="heads (all presets use 8)")
    p.add_argument("--D", type=int, default=32, help="channels per head (all presets use 32)")
    p.add_argument("--locations", choices=("local", "init", "ref", "uniform"), default=None,
                   help="sampling locations: local = a few pixels around each query's own pixel (encoder-like), "
                        "init = Deformable DETR's initial offsets around it, ref = a few pixels around a random "
                        "reference point per query (decoder-like), uniform = uniform in [0,1]; default: the preset's")
    p.add_argument("--order", choices=("sorted", "shuffled"), default=None,
                   help="query order within each image (default: the preset's)")
    p.add_argument("--dcnv4-src", default=None, help="extracted DCNv4==1.0.0.post2 sdist for the dcnv4 peer "
                   "(default: $DCNV4_SRC or .peers/DCNv4-1.0.0.post2)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp16", help="value dtype (locations are fp32)")
    p.add_argument("--impls", default=",".join(ALL_IMPLS), help="comma list of " + ",".join(ALL_IMPLS))
    p.add_argument("--seed", type=int, default=None, help="input seed (default: fresh, printed)")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench repetition time, ms")
    p.add_argument("--check-samples", type=float, default=16e6,
                   help="float64 check on the first images of the batch, up to this many samples (at least 1 image)")
    p.add_argument("--cluster-size", type=int, default=0, help="distributed: CTAs per cluster (0 = auto)")
    p.add_argument("--csv", help="write the results table as CSV here")
    p.add_argument("--png", help="write a bar chart (matplotlib) here")
    p.add_argument("--ncu", metavar="IMPLS", help="profile implementations (comma list) with ncu (dram, l1tex, sm "
                   "throughput) on each selected preset instead of the comparison")
    p.add_argument("--ncu-sections", default="", metavar="LIST",
                   help="with --ncu: also these ncu sections (comma list, e.g. WarpStateStats,SchedulerStats,"
                        "MemoryWorkloadAnalysis_Tables): stall reasons, issue slots, L1 wavefronts")
    p.add_argument("--ncu-l2", choices=("flushed", "dirty"), default="flushed",
                   help="with --ncu: L2 before the profiled launch; flushed: ncu invalidates it (clean, empty); "
                        "dirty: as do_bench leaves it (a 256 MB buffer just zeroed, so the kernel's misses first "
                        "write those lines back), each metric pass replaying the whole script")
    p.add_argument("--ncu-child", metavar="IMPL", help=argparse.SUPPRESS)
    p.add_argument("--watchdog", type=float, default=60.0,
                   help="seconds the first (checked) run of an implementation may take before it counts as hung")
    p.add_argument("--no-time", action="store_true", help="correctness only (e.g. under compute-sanitizer)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    return p.parse_args(argv)


def selected_shapes(args) -> list[Shape]:
    shapes = []
    names = [] if (args.levels and args.presets == "all") else [n.strip() for n in args.presets.split(",") if n.strip()]
    names = [m for n in names for m in (PRESETS if n == "all" else MODEL_PRESETS if n == "models" else [n])]
    known = {**PRESETS, **MODEL_PRESETS}
    for name in names:
        if name not in known:
            sys.exit(f"unknown preset {name!r}; choose from {', '.join(known)}")
        cfg = known[name]
        levels = list(cfg["levels"])
        S = sum(h * w for h, w in levels)
        shapes.append(Shape(name, cfg["N"], cfg["Lq"] or S, levels, cfg["P"], args.M, args.D,
                            args.locations or cfg["locations"], args.order or cfg.get("order", "sorted")))
    if args.levels:
        levels = [tuple(int(v) for v in lv.lower().split("x")) for lv in args.levels.split(",")]
        S = sum(h * w for h, w in levels)
        shapes.append(Shape("custom", args.N, args.Lq or S, levels, args.P, args.M, args.D,
                            args.locations or "local", args.order or "sorted"))
    return shapes


def make_inputs(shape: Shape, dtype: torch.dtype, generator: torch.Generator, device="cuda"):
    """Fresh random inputs as callers produce them: value ~ N(0,1); attention weights the softmax over (level,
    point) of N(0,1) logits (returned too, for peers that take logits); locations by shape.locations (see
    PRESETS; local and ref offsets have sigma 2 pixels of each level, so some fall outside [0,1]), queries in
    shape.order."""
    N, Lq, M, D, L, P = shape.N, shape.Lq, shape.M, shape.D, shape.L, shape.P
    spatial_shapes = torch.tensor(shape.levels, dtype=torch.int64, device=device)
    areas = spatial_shapes[:, 0] * spatial_shapes[:, 1]
    level_start_index = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    value = torch.randn(N, shape.S, M, D, device=device, generator=generator).to(dtype)
    sizes = spatial_shapes.flip(-1).float().view(1, 1, 1, L, 1, 2)  # (W, H), matching (x, y)
    if shape.locations == "uniform":
        loc = torch.rand(N, Lq, M, L, P, 2, device=device, generator=generator)
    else:
        if shape.locations == "ref":
            ref = torch.rand(N, Lq, 1, 1, 1, 2, device=device, generator=generator)
        else:  # each query owns one pixel of the multi-level map
            pixel = torch.arange(Lq, device=device) % shape.S
            level_of = torch.searchsorted(level_start_index, pixel, right=True) - 1
            within = pixel - level_start_index[level_of]
            Hq, Wq = spatial_shapes[level_of, 0], spatial_shapes[level_of, 1]
            ref = torch.stack([((within % Wq).float() + 0.5) / Wq, ((within // Wq).float() + 0.5) / Hq], -1)
            ref = ref.view(1, Lq, 1, 1, 1, 2)
        if shape.locations == "init":
            # Deformable DETR's initial sampling_offsets bias: point p of head m sits p+1 pixels out along
            # the direction at angle 2*pi*m/M (scaled so its larger component is 1), on every level.
            angle = torch.arange(M, device=device, dtype=torch.float32) * (2 * math.pi / M)
            direction = torch.stack([angle.cos(), angle.sin()], -1)
            direction = direction / direction.abs().max(-1, keepdim=True).values
            steps = torch.arange(1, P + 1, device=device, dtype=torch.float32)
            offsets = (direction.view(M, 1, 1, 2) * steps.view(1, 1, P, 1)).expand(M, L, P, 2).unsqueeze(0).unsqueeze(0)
        else:
            offsets = torch.randn(N, Lq, M, L, P, 2, device=device, generator=generator) * 2.0
        loc = (ref + offsets / sizes).expand(N, Lq, M, L, P, 2)
        del offsets
    logits = torch.randn(N, Lq, M, L * P, device=device, generator=generator)
    attn = torch.softmax(logits, -1).view(N, Lq, M, L, P).contiguous()
    logits = logits.view(N, Lq, M, L, P)
    loc = loc.contiguous()
    if shape.order == "shuffled":
        order = torch.argsort(torch.rand(N, Lq, device=device, generator=generator), dim=1)
        pick = order.view(N, Lq, 1, 1, 1)
        loc = torch.gather(loc, 1, pick.view(N, Lq, 1, 1, 1, 1).expand_as(loc))
        attn = torch.gather(attn, 1, pick.expand_as(attn))
        logits = torch.gather(logits, 1, pick.expand_as(logits))
    return (value, spatial_shapes, level_start_index, loc.contiguous(), attn.contiguous()), logits.contiguous()


def touched_value_rows(shape: Shape, loc: torch.Tensor) -> int:
    """How many (image, pixel, head) rows of value some in-level corner of some sample reads, by the
    original kernel's rule (a sample counts where -1 < h < H and -1 < w < W, in fp32). Where locations are
    sparse (decoders) this is far below the whole value: the DRAM floor counts only these rows."""
    N, Lq, M, L, P, _ = loc.shape
    heads = torch.arange(M, device=loc.device).view(1, M, 1)
    touched = 0
    start = 0
    starts = []
    for H, W in shape.levels:
        starts.append(start)
        start += H * W
    for n in range(N):
        mask = torch.zeros(shape.S * M, dtype=torch.bool, device=loc.device)
        for level, (H, W) in enumerate(shape.levels):
            w = loc[n, :, :, level, :, 0].float() * W - 0.5
            h = loc[n, :, :, level, :, 1].float() * H - 0.5
            inside = (h > -1) & (h < H) & (w > -1) & (w < W)
            x0 = torch.floor(w).nan_to_num(-2).clamp(-2, W).long()
            y0 = torch.floor(h).nan_to_num(-2).clamp(-2, H).long()
            for dy in (0, 1):
                for dx in (0, 1):
                    x, y = x0 + dx, y0 + dy
                    ok = inside & (x >= 0) & (x < W) & (y >= 0) & (y < H)
                    row = (starts[level] + y * W + x) * M + heads
                    mask[row[ok]] = True
        touched += int(mask.sum())
    return touched


def copy_bandwidth() -> float:
    """Bytes read plus written per second of a large device-to-device copy (the DRAM ceiling we compare with)."""
    import triton.testing

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    del src, dst
    return 2 * n / (ms * 1e-3)


def cute_forward():
    """torch.ops.cute_deform.forward, or (None, reason)."""
    repo = str(baselines.REPO)
    if repo not in sys.path:
        sys.path.insert(0, repo)
    try:
        import cute_deform  # noqa: F401  (registers torch.ops.cute_deform)
        op = torch.ops.cute_deform.forward
    except Exception as exc:  # ImportError, AttributeError from torch.ops, ...
        return None, f"cute_deform unavailable: {type(exc).__name__}: {str(exc)[:160]}"
    # Without its kernel the op falls back to grid_sample: that must not be timed under the name cute.
    unavailable = getattr(getattr(cute_deform, "op", None), "kernel_unavailable_reason", None)
    if unavailable is not None:
        reason = unavailable(torch.cuda.current_device())
        if reason:
            return None, f"the CuTe kernel is unavailable ({reason[:160]}); the op would take its slow path"
    return op, ""


class Impl:
    """One implementation bound to one set of inputs: run() writes into self.out (poisonable) or returns a tensor."""

    def __init__(self, name, run, out, value_dtype, poisonable=True, note="", peer=False):
        self.name, self._run, self.out, self.value_dtype = name, run, out, value_dtype
        self.poisonable, self.note = poisonable, note
        # A peer (DCNv4) is timed even where it misses the bound: its accuracy is its own, and is reported.
        self.peer = peer
        self.reference_inputs = None  # (locations, weights) the implementation really computes with, if not ours

    def __call__(self):
        return self._run()


def unsupported(name: str, shape: Shape) -> str:
    """Why a baseline cannot take this shape ('' when it can): the limits of the designs in kernels/."""
    if name in ("tile2x2", "tma", "distributed") and shape.D != 32:
        return f"{name} is written for D = 32"
    if name in ("tma", "distributed") and shape.L > 8:
        return f"{name} takes at most 8 levels"
    if name == "vec" and shape.D % 8:
        return "vec needs D % 8 == 0"
    return ""


def bind_impls(names, ext, ext_error, inputs, shape: Shape, args, logits=None, dcnv4=(None, "")):
    """Impl objects, or (name, reason) for those that cannot run here."""
    value, spatial_shapes, level_start_index, loc, attn = inputs
    out_shape = (shape.N, shape.Lq, shape.M * shape.D)
    bound, skipped = [], []
    value32 = None
    for name in names:
        if name in ("classic-fp32", "grid_sample") and value32 is None:
            value32 = value.float()
        if name in baselines.KERNEL_IMPLS or name == "classic-fp32":
            if unsupported(name, shape):
                skipped.append((name, f"skipped: {unsupported(name, shape)}"))
                continue
            if ext is None:
                skipped.append((name, f"FAILED: baselines did not build: {ext_error}"))
                continue
            kernel = "classic" if name == "classic-fp32" else name
            v = value32 if name == "classic-fp32" else value
            out = torch.empty(out_shape, dtype=v.dtype, device="cuda")
            launch = baselines.launcher(ext, kernel, v, spatial_shapes, level_start_index, loc, attn,
                                        cluster_size=args.cluster_size)
            bound.append(Impl(name, (lambda launch=launch, out=out: launch(out)), out, v.dtype))
        elif name == "dcnv4":
            dcnv4_ext, why = dcnv4
            if dcnv4_ext is None:
                skipped.append((name, f"skipped: {why}"))
                continue
            run, _ = peers.dcnv4_launcher(dcnv4_ext, value, spatial_shapes, level_start_index, loc, logits)
            impl = Impl(name, run, None, value.dtype, poisonable=False, peer=True,
                        note="fp16 locations and its own softmax: checked against a reference on those inputs")
            impl.reference_inputs = peers.dcnv4_inputs_as_seen(loc, logits, value.dtype)
            bound.append(impl)
        elif name in ("cute", "cute-half"):
            half = name == "cute-half"
            if half and value.dtype == torch.float32:
                skipped.append((name, "skipped: fp32 value, so the same inputs as cute"))
                continue
            op, why = cute_forward()
            if op is None:
                skipped.append((name, why))
                continue
            # The level table on the host, as cute_deform's transformers integration passes it: the launch reads it
            # (launch_rules.choose_launch's levels), with no host sync.
            host_shapes, host_starts = spatial_shapes.cpu(), level_start_index.cpu()
            note = "allocates its output: poisoned through the allocator (run_poisoned)"
            op_loc, op_attn = loc, attn
            if half:
                # The inputs an fp16 or bf16 model hands the op (its offsets and weights are in the model's dtype),
                # and the ones DCNv4 computes with: locations and weights rounded to value's dtype. Half the input
                # bytes.
                op_loc, op_attn = loc.to(value.dtype), attn.to(value.dtype)
                note = ("locations and weights in value's dtype, as a half-precision model passes them: checked "
                        "against a reference on those inputs")
            impl = Impl(name, lambda op=op, l=op_loc, a=op_attn: op(value, host_shapes, host_starts, l, a), None,
                        value.dtype, poisonable=False, note=note)
            if half:
                impl.reference_inputs = (op_loc.float(), op_attn.float())
            bound.append(impl)
        elif name == "grid_sample":
            per_level = shape.N * shape.M * shape.D * shape.Lq * shape.P * 4
            if per_level > GRID_SAMPLE_MAX_BYTES:
                skipped.append((name, f"skipped: {per_level / 2**30:.1f} GiB intermediate per level"))
                continue
            out = torch.empty(out_shape, dtype=torch.float32, device="cuda")

            def run_grid_sample(out=out):
                out.copy_(baselines.grid_sample_forward(value32, spatial_shapes, level_start_index, loc, attn,
                                                        compute_dtype=torch.float32))
            bound.append(Impl(name, run_grid_sample, out, torch.float32, note="pure PyTorch, fp32 copy of value"))
        else:
            sys.exit(f"unknown implementation {name!r}; choose from {', '.join(ALL_IMPLS)}")
    return bound, skipped


class PresetAborted(RuntimeError):
    def __init__(self, rows):
        super().__init__("hang")
        self.rows = rows


class Hang(RuntimeError):
    """An implementation did not finish within the watchdog: the GPU is now busy with it, nothing else can run."""


def run_watched(fn, seconds: float):
    """fn() on a worker thread (an op may block on the host), then wait for the device with a deadline."""
    import threading

    result, done = {}, torch.cuda.Event()
    device = torch.cuda.current_device()

    def work():
        try:
            # A new thread has no current CUDA context until its first runtime call; code that goes straight to
            # the driver (a tensor-map encode, the CuTe DSL runtime) would fail with "invalid context".
            torch.cuda.set_device(device)
            torch.cuda.synchronize()
            result["out"] = fn()
            done.record()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=work, daemon=True)
    deadline = time.time() + seconds
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise Hang(f"the call did not return within {seconds:g} s")
    if "error" in result:
        raise result["error"]
    while not done.query():
        if time.time() > deadline:
            raise Hang(f"the kernel did not finish within {seconds:g} s")
        time.sleep(0.001)
    return result["out"]


def run_poisoned(run, attempts: int = 4):
    """(output, whether it was written over poison) of run(), an implementation that allocates its output. torch's
    caching allocator gives a request the smallest free block that fits, so the block a call's output was in, filled
    with 0xFF bytes (NaN in every float dtype) and freed, is where the next call of the same shapes writes; each miss
    poisons the block it got, and the next attempt lands on it. Without this, a check that follows another run on the
    same inputs (a tuning sweep) would read that run's correct output from the reused block wherever the kernel
    skipped a tile."""
    poisoned = set()
    for _ in range(attempts):
        out = run()
        if out.data_ptr() in poisoned:
            return out, True
        out.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype, -1 in the integer ones
        poisoned.add(out.data_ptr())
        del out
    return run(), False


def check_impl(impl: Impl, ref: torch.Tensor, n_check: int, watchdog: float):
    """Poison, run once under the watchdog, check every element was written (no NaN anywhere) and the relative
    error on the checked images. Returns (rel_err, note)."""
    if impl.poisonable:
        impl.out.fill_(float("nan"))
        torch.cuda.synchronize()
        run_watched(impl, watchdog)
        out = impl.out
    else:
        out, poisoned = run_poisoned(lambda: run_watched(impl, watchdog))
        if not poisoned:
            return float("inf"), "the output never landed on a block filled with NaN: not checked"
    torch.cuda.synchronize()
    finite = torch.isfinite(out).all().item()
    if not finite:
        return float("inf"), "non-finite values in the output (unwritten or NaN)"
    return baselines.relative_error(out[:n_check], ref), ""


def time_impl(impl: Impl, args) -> float:
    import triton.testing

    return triton.testing.do_bench(impl, warmup=args.warmup, rep=args.rep, return_mode="median") * 1e3


def run_preset(shape: Shape, args, ext, ext_error, copy_bw, names, progress) -> list[Row]:
    dtype = DTYPES[args.dtype]
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    inputs, logits = make_inputs(shape, dtype, generator)
    value, spatial_shapes, level_start_index, loc, attn = inputs
    per_image = shape.samples // shape.N
    n_check = max(1, min(shape.N, int(args.check_samples // per_image)))
    t0 = time.time()
    ref, ref_source = baselines.reference_forward(value[:n_check], spatial_shapes, level_start_index,
                                                  loc[:n_check], attn[:n_check])
    ref_note = f"reference: {ref_source}, images 0..{n_check - 1} of {shape.N}, {time.time() - t0:.1f} s"
    if ref_source == "cute_deform.reference":  # cross-check the package's reference against grid_sample
        alt = baselines.grid_sample_forward(value[:n_check], spatial_shapes, level_start_index, loc[:n_check],
                                            attn[:n_check])
        ref_note += f"; vs grid_sample float64: {baselines.relative_error(alt, ref):.2e}"
        del alt
    value_rows = touched_value_rows(shape, loc)
    torch.cuda.synchronize()
    print(f"[{shape.name}] seed {seed}; {ref_note}; value rows read: {value_rows / (shape.N * shape.S * shape.M):.1%}",
          flush=True)

    bound, skipped = bind_impls(names, ext, ext_error, inputs, shape, args, logits, args.dcnv4)
    rows = []
    for name, why in skipped:
        rows.append(Row(shape.name, name, args.dtype, status="FAILED" if why.startswith("FAILED") else "skipped",
                        note=why))
        progress.update(1)
    for impl in bound:
        value_bytes = torch.empty(0, dtype=impl.value_dtype).element_size()
        row = Row(shape.name, impl.name, str(impl.value_dtype).replace("torch.", ""), note=impl.note)
        row.bound = (CUTE_BOUND if impl.name.startswith("cute") else baselines.ERROR_BOUND)[impl.value_dtype]
        progress.set_postfix_str(f"{shape.name} {impl.name}")
        try:
            impl_ref = ref
            if impl.reference_inputs is not None:
                seen_loc, seen_attn = impl.reference_inputs
                impl_ref, _ = baselines.reference_forward(value[:n_check], spatial_shapes, level_start_index,
                                                          seen_loc[:n_check], seen_attn[:n_check])
            row.rel_err, why = check_impl(impl, impl_ref, n_check, args.watchdog)
            del impl_ref
            within = row.rel_err <= row.bound
            if why or not (within or impl.peer):
                row.status = "MISMATCH"
                row.note = why or f"rel err {row.rel_err:.3e} > bound {row.bound:g}"
            else:
                if not within:
                    row.status = "inexact"
                    row.note = (f"rel err {row.rel_err:.3e} > bound {row.bound:g} (it computes positions and "
                                "bilinear weights in value's dtype); timed anyway")
                if not args.no_time:
                    row.us = time_impl(impl, args)
                    row.gsamples = shape.samples / row.us * 1e-3
                    floor_bytes = shape.floor_bytes(value_bytes, value_rows)
                    row.tbs = floor_bytes / row.us * 1e-6
                    row.floor_us = floor_bytes / copy_bw * 1e6
        except Hang as exc:
            row.status = "HANG"
            row.note = str(exc)
            rows.append(row)
            raise PresetAborted(rows) from exc
        except Exception as exc:
            row.status = "FAILED"
            row.note = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
            torch.cuda.synchronize()
        rows.append(row)
        progress.update(1)
    timed = {r.impl: r.us for r in rows if r.status in TIMED}
    for r in rows:
        if r.status in TIMED:
            r.speedup_classic = timed.get("classic", float("nan")) / r.us
            r.speedup_classic_fp32 = timed.get("classic-fp32", float("nan")) / r.us
            r.speedup_dcnv4 = timed.get("dcnv4", float("nan")) / r.us
    del inputs, value, loc, attn, ref, bound
    torch.cuda.empty_cache()
    return rows


def fmt(v, spec):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_table(rows: list[Row], header: str):
    cols = ["preset", "impl", "value", "status", "rel err", "µs", "x classic", "x cl-fp32", "x dcnv4", "Gsamp/s",
            "TB/s", "floor µs"]
    table = [[r.preset, r.impl, r.dtype, r.status, fmt(r.rel_err, ".2e"), fmt(r.us, ".1f"),
              fmt(r.speedup_classic, ".2f"), fmt(r.speedup_classic_fp32, ".2f"), fmt(r.speedup_dcnv4, ".2f"),
              fmt(r.gsamples, ".2f"),
              fmt(r.tbs, ".3f"), fmt(r.floor_us, ".1f")] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w) if i >= 4 else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths)))
    notes = [f"  {r.preset}/{r.impl}: {r.note}" for r in rows if r.note]
    print("results:")
    if notes:
        print("notes:")
        print("\n".join(notes))
    print(header)
    print("TB/s: DRAM-floor bytes (the value rows some corner reads + fp32 locations + weights read once, output "
          "written once) / time; "
          "floor µs: those bytes / copy bandwidth; x classic: speedup over classic at the same value dtype; "
          "x cl-fp32: over classic on fp32 value; x dcnv4: over DCNv4 in this run")
    print(line(cols))
    print(line(["-" * w for w in widths]))
    prev = None
    for r, t in zip(rows, table):
        if prev is not None and r.preset != prev:
            print()
        prev = r.preset
        print(line(t))


def write_csv(rows: list[Row], path: str):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["preset", "impl", "value_dtype", "status", "rel_err", "bound", "us", "speedup_vs_classic",
                    "speedup_vs_classic_fp32", "speedup_vs_dcnv4", "gsamples_per_s", "tb_per_s", "dram_floor_us", "note"])
        for r in rows:
            w.writerow([r.preset, r.impl, r.dtype, r.status, r.rel_err, r.bound, r.us, r.speedup_classic,
                        r.speedup_classic_fp32, r.speedup_dcnv4, r.gsamples, r.tbs, r.floor_us, r.note])


PNG_PANEL_INCHES = 4.2


def wrapped_title(title: str, panels: int) -> str:
    """The run's header in lines that fit the figure's width (about 12 characters an inch at 9 points)."""
    return textwrap.fill(title, width=max(40, int(12 * PNG_PANEL_INCHES * panels)))


def write_png(rows: list[Row], path: str, title: str):
    """A bar chart a preset (log scale, the DRAM floor dashed); returns the matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r.preset for r in rows))
    fig, axes = plt.subplots(1, len(presets), figsize=(PNG_PANEL_INCHES * len(presets), PNG_PANEL_INCHES), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        ok = [r for r in rows if r.preset == preset and r.status in TIMED]
        names = [r.impl for r in ok]
        times = [r.us for r in ok]
        bars = ax.bar(range(len(ok)), times, color=["#4c72b0" if n != "cute" else "#dd8452" for n in names])
        floor = next((r.floor_us for r in ok if r.impl not in ("classic-fp32", "grid_sample")), None)
        if floor:
            ax.axhline(floor, color="k", ls="--", lw=1, label=f"DRAM floor {floor:.0f} µs")
            ax.legend(fontsize=8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(ok)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_title(preset, fontsize=10)
        ax.set_ylabel("µs (median, log)")
        for b, t in zip(bars, times):
            ax.text(b.get_x() + b.get_width() / 2, t, f"{t:.0f}", ha="center", va="bottom", fontsize=7)
    fig.suptitle(wrapped_title(title, len(presets)), fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return fig


def strip_option(argv, option):
    """argv without `option VALUE` / `option=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def ncu_parent(args, argv):
    """Re-run this script under ncu with --ncu-child; only the kernels between cudaProfilerStart/Stop count."""
    sections = [x for name in args.ncu_sections.split(",") if name.strip() for x in ("--section", name.strip())]
    # Dirty: ncu must not flush between passes, so each pass replays the whole script (same seed, same state).
    l2 = (["--cache-control", "none", "--replay-mode", "application"] if args.ncu_l2 == "dirty"
          else ["--cache-control", "all"])
    cmd = ["ncu", "--clock-control", "none", *l2, "--profile-from-start", "off", "--metrics",
           ",".join(NCU_METRICS), *sections, sys.executable, os.path.abspath(__file__)] + strip_option(
              strip_option(argv, "--ncu"), "--ncu-sections") + [
              "--ncu-child", args.ncu, "--no-progress"]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def ncu_child(args, shapes, ext):
    dtype = DTYPES[args.dtype]
    names = [n.strip() for n in args.ncu_child.split(",") if n.strip()]
    for shape in shapes:
        generator = torch.Generator(device="cuda").manual_seed(args.seed or 0)
        inputs, logits = make_inputs(shape, dtype, generator)
        bound, skipped = bind_impls(names, ext, None, inputs, shape, args, logits, args.dcnv4)
        for name, why in skipped:
            print(f"[{shape.name}] {name}: {why}")
        for impl in bound:
            impl()
            impl()  # warm: compiles, caches, tensor maps
            torch.cuda.synchronize()
            print(f"[{shape.name}] profiling {impl.name}: {shape.describe()}", flush=True)
            if args.ncu_l2 == "dirty":  # triton's do_bench clears L2 this way before each timed call
                flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
                flush.zero_()
                del flush
            torch.cuda.cudart().cudaProfilerStart()
            impl()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
    return 0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.ncu:
        return ncu_parent(args, argv)
    shapes = selected_shapes(args)
    names = [n.strip() for n in args.impls.split(",") if n.strip()]
    for n in names:
        if n not in ALL_IMPLS:
            sys.exit(f"unknown implementation {n!r}; choose from {', '.join(ALL_IMPLS)}")
    if not torch.cuda.is_available():
        sys.exit("compare.py needs a CUDA GPU (sm_90 for tma and distributed)")
    ext, ext_error = None, None
    if args.ncu_child:
        names = [n.strip() for n in args.ncu_child.split(",") if n.strip()]
    needs_ext = any(n in baselines.KERNEL_IMPLS or n == "classic-fp32" for n in names)
    if needs_ext:
        try:
            ext = baselines.build(progress=not args.no_progress)
        except Exception as exc:
            ext_error = f"{type(exc).__name__}: {str(exc)[-400:]}"
            print(f"baselines build failed: {ext_error}", file=sys.stderr)
    args.dcnv4 = (None, "not selected")
    if "dcnv4" in names:
        src = peers.dcnv4_source(args.dcnv4_src)
        if src is None:
            args.dcnv4 = (None, "no DCNv4 source (--dcnv4-src, $DCNV4_SRC or .peers/DCNv4-1.0.0.post2)")
        else:
            try:
                t0 = time.time()
                args.dcnv4 = (peers.build_dcnv4(src), "")
                print(f"dcnv4: built from {src} in {time.time() - t0:.1f} s", flush=True)
            except Exception as exc:
                args.dcnv4 = (None, f"FAILED: DCNv4 did not build: {type(exc).__name__}: {str(exc)[-300:]}")
                print(args.dcnv4[1], file=sys.stderr)
    if args.ncu_child:
        return ncu_child(args, shapes, ext)

    from tqdm import tqdm

    props = torch.cuda.get_device_properties(0)
    copy_bw = float("nan") if args.no_time else copy_bandwidth()
    header = (f"device {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}; value {args.dtype}, "
              f"locations fp32; copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write); do_bench median, ms "
              f"warm-up {args.warmup:g} / rep {args.rep:g}")
    print(header, flush=True)
    if ext is not None:
        print(f"baselines: {ext.__file__} (build or cache load {ext.build_seconds:.1f} s)")
    for s in shapes:
        print(" ", s.describe())
    rows = []
    hung = False
    with tqdm(total=len(shapes) * len(names), desc="compare", disable=args.no_progress, file=sys.stderr) as progress:
        for shape in shapes:
            try:
                rows += run_preset(shape, args, ext, ext_error, copy_bw, names, progress)
            except PresetAborted as aborted:  # the GPU is stuck: report what we have and leave
                rows += aborted.rows
                hung = True
                break
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}")
    if args.png:
        write_png(rows, args.png, header)
        print(f"wrote {args.png}")
    print_table(rows, header)
    if hung:
        print("\na kernel hung (see HANG above); the remaining presets and implementations were not run")
        sys.stdout.flush()
        os._exit(3)  # a normal exit would wait for the stuck kernel
    bad = [r for r in rows if r.status in ("MISMATCH", "FAILED")]
    if bad:
        print(f"\n{len(bad)} implementation(s) failed the check or the run: "
              + ", ".join(f"{r.preset}/{r.impl} ({r.status})" for r in bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
