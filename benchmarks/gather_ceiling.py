#!/usr/bin/env python3
"""Gather ceiling of the MSDA access pattern on Hopper (H100/H200): TMA 2x2xD boxes against 16-byte LDG gathers.

Load-only kernels (gather_ceiling.cu, built with nvcc into a small shared library called through ctypes) fetch
the bilinear footprint (2x2 pixels x D=32 fp16 = 256 B) of every sample of the real multi-level presets
(M=8 heads, value (N, S, M, D) fp16, levels concatenated along S) and XOR the loaded words; every method's XOR
is checked against a torch reference before it is timed.

  (a) LDG    16-byte __ldg through L1; a warp covers consecutive queries of one head (DCNv4 / vec style)
      LDG-pairs  the same, a warp covering half as many queries of a head pair (2k, 2k+1), the threads of a
             query's two heads side by side (method 'pairs')
  (b) TMA    one cp.async.bulk.tensor.5d box [32,1,2,2,1] per sample, a producer warp issuing one box per lane,
             rounds of 32/64 boxes in a ring of mbarrier-guarded stages, consumer warps XOR them out of smem
  (c) TMA+stage2  as (b) for the two fine levels; the two coarsest levels of one (image, head) staged whole in
             shared memory (one CTA per SM walks a contiguous range of (n, m, q), restaging when (n, m) changes)
             and gathered with ld.shared, 4 threads per sample; the producer also bulk-copies the round's
             coarse-sample coordinates into the slot. Best with many producer warps per CTA: the TMA box rate
             grows with the number of issuing warps per SM.

Patterns: 'local' (encoder-like: query q sits on pixel q of the levels' concatenated raster (mod S), each sample a
gaussian (sigma 2 px of that level) around the query's reference point), 'uniform' (uniform in [0,1]^2), and
'preset': the very locations scripts/compare.py generates for a preset of its own (any of its names, e.g.
detr-encoder-init or seed-b48-shuffled, in their order), with samples outside their level skipped as the
original kernel skips them. The DRAM floor counts only the value rows that some corner reads.
Samples are visited in (n, q, m, l, p) order. Sample corner coordinates are precomputed as packed int16 pairs
(4 B per sample; a real kernel reads 8 B of fp32 location + 4 B of weight per sample instead).

Result, NVIDIA H200, 2026-11-21 (Gsamples/s of the best configuration; copy bandwidth 4.27 TB/s):
  preset        pattern   LDG   TMA   TMA+stage2    preset        pattern   LDG   TMA   TMA+stage2
  dcnv4-test    local    49.7  23.2   17.0          detr-decoder  local    34.7  18.9   12.4
  dcnv4-test    uniform  37.8  23.2   16.9          detr-decoder  uniform  20.8  18.9   10.3
  detr-encoder  local    51.6  23.4   17.1          seed-b48      local    55.4  24.6   18.6
  detr-encoder  uniform  38.3  23.4   17.0          seed-b48      uniform  45.0  24.6   18.4
  TMA boxes top out near 23-25 G boxes/s (about 6 TB/s of box bytes) whatever the pattern and whether value sits
  in L2 or DRAM, and only with about 12 CTAs per SM each with its own producer warp; LDG through L1 is 2.1-2.3x
  faster on the local pattern. The staged variant here is consumer-bound (one in-order consumer pipeline per CTA,
  1-2 CTAs per SM because of the ~80 KB of staged levels): a lower bound for that design, not its ceiling.

The least data movement of a kernel that stages decoder-b16's two coarse levels (--gather-levels 2 --bulk, session 37,
best configuration): 44.5-45.2 us on an H100 and 36.4-37.4 us on an H200, against 1/1.5 of DCNv4's time of 45.1-45.3
and 38.6-38.8 us; the fine gathers alone take 39.8-40.4 and 32.8-33.5 us.

Run on the GPU machine:  cd benchmarks && python3 gather_ceiling.py      (needs torch, triton, nvcc)
    python3 gather_ceiling.py --patterns preset --methods ldg --presets dcnv4-test,detr-encoder-init,seed-b48
Options: --presets a,b  --quick (fewer configurations)  --dry (CPU check of the torch side only, tiny sizes)
         --gather-levels K (only the first K levels gathered: the time of a kernel that stages the others)
         --bulk (LDG only: each warp item also streams its share of the bytes such a kernel must move besides
                 its gathers: the other levels whole, the inputs' other 8 bytes a sample, the output)
         --bulk-only (the same bulk bytes with no gathers at all: what they take alone)
         --sort-samples (each image's, head's and level's samples dealt to its queries in address order)
         --sort-samples heads (each image's and level's samples of all heads in address order, heads fastest)
         --level-major (LDG only: also the contiguous blocks with their items gathered level by level, in four
                 level orders: whether a level's rows read again within one pass, not across the launch, recover
                 what a few images in flight give; session 50)
"""
import argparse
import ctypes
import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
import compare  # noqa: E402  (its presets' inputs, and the DRAM floor)
SRC = os.path.join(HERE, "gather_ceiling.cu")
BUILD_DIR = os.environ.get("GC_BUILD_DIR", "/tmp/gather_ceiling_build")
M, D, L = 8, 32, 4
SIGMA = 2.0  # px, at each level
BOX_BYTES = 2 * 2 * D * 2

PRESETS = {
    "dcnv4-test": (1, 15200, [(100, 152), (50, 76), (25, 38), (13, 19)], 8),
    "detr-encoder": (2, 22223, [(100, 167), (50, 84), (25, 42), (13, 21)], 4),
    "detr-decoder": (8, 900, [(100, 167), (50, 84), (25, 42), (13, 21)], 4),
    "decoder-b16": (16, 300, [(100, 167), (50, 84), (25, 42), (13, 21)], 4),
    "seed-b48": (48, 15422, [(92, 160), (46, 80), (23, 40), (12, 20)], 8),
}


# ------------------------------------------------------------------------------------------------ build / ctypes
def build_lib():
    src = open(SRC, "rb").read()
    tag = hashlib.sha1(src).hexdigest()[:12]
    path = os.path.join(BUILD_DIR, f"libgather_ceiling_{tag}.so")
    if not os.path.exists(path):
        os.makedirs(BUILD_DIR, exist_ok=True)
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        cmd = [nvcc, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC", "-shared",
               "-o", path + ".tmp", SRC]
        t0 = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit("nvcc failed:\n" + r.stdout + r.stderr)
        os.replace(path + ".tmp", path)
        print(f"built {os.path.basename(path)} in {time.time() - t0:.1f} s")
    lib = ctypes.CDLL(path)
    vp, i, ip = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)
    lib.gc_last_error.restype = i
    lib.gc_error_string.argtypes = [i]
    lib.gc_error_string.restype = ctypes.c_char_p
    lib.gc_encode_maps.argtypes = [vp, vp, ip]
    ll = ctypes.c_longlong
    lib.gc_ldg_occupancy.argtypes = [i, i, i, i, i, ip]
    lib.gc_ldg.argtypes = [vp, vp, ip, i, i, i, i, i, i, i, i, vp, ll, vp, ll, vp, vp]
    lib.gc_tma_occupancy.argtypes = [i, i, i, i, i, i, i, i, ip]
    lib.gc_tma.argtypes = [vp, vp, vp, ip, i, i, i, i, i, i, i, i, vp, vp]
    return lib


def check(lib, rc, what):
    if rc != 0:
        msg = lib.gc_error_string(rc).decode() if rc > 0 and rc < 1000 else str(rc)
        raise RuntimeError(f"{what}: error {rc} ({msg})")


# ------------------------------------------------------------------------------------------------ data
def level_info(levels):
    starts, s = [], 0
    for h, w in levels:
        starts.append(s)
        s += h * w
    return starts, s


def make_coords(pattern, N, Lq, P, levels, gen, dev):
    """(N*Lq*M*L*P,) int32: y0 << 16 | (x0 & 0xffff), x0 = floor(x*W - 0.5) clamped to [-1, W-1]."""
    starts, S = level_info(levels)
    out = torch.empty(N, Lq, M, L, P, dtype=torch.int32, device=dev)
    if pattern == "local":
        st = torch.tensor(starts, device=dev)
        Hs = torch.tensor([h for h, _ in levels], device=dev)
        Ws = torch.tensor([w for _, w in levels], device=dev)
        q = torch.arange(Lq, device=dev) % S
        lq = torch.searchsorted(st, q, right=True) - 1
        idx = q - st[lq]
        rx = ((idx % Ws[lq]).float() + 0.5) / Ws[lq].float()
        ry = ((idx // Ws[lq]).float() + 0.5) / Hs[lq].float()
        rx, ry = rx.view(1, Lq, 1, 1), ry.view(1, Lq, 1, 1)
    for l, (H, W) in enumerate(levels):
        shape = (N, Lq, M, P)
        if pattern == "local":
            x = rx * W + SIGMA * torch.randn(shape, generator=gen, device=dev)
            y = ry * H + SIGMA * torch.randn(shape, generator=gen, device=dev)
        else:
            x = torch.rand(shape, generator=gen, device=dev) * W
            y = torch.rand(shape, generator=gen, device=dev) * H
        x0 = torch.floor(x - 0.5).to(torch.int32).clamp_(-1, W - 1)
        y0 = torch.floor(y - 0.5).to(torch.int32).clamp_(-1, H - 1)
        out[:, :, :, l, :] = (y0 * 65536) | (x0 & 0xFFFF)
        del x, y, x0, y0
    return out.reshape(-1)


def coords_from_locations(loc, levels):
    """make_coords' packing of real fp32 locations (N, Lq, M, L, P, 2): a sample outside its level (the
    original kernel's rule, NaN included) gets the corner (-2, -2), none of whose corners lie in the level."""
    out = torch.empty(loc.shape[:-1], dtype=torch.int32, device=loc.device)
    for l, (H, W) in enumerate(levels):
        w = loc[:, :, :, l, :, 0].float() * W - 0.5
        h = loc[:, :, :, l, :, 1].float() * H - 0.5
        inside = (h > -1) & (h < H) & (w > -1) & (w < W)
        x0 = torch.where(inside, torch.floor(w).nan_to_num(0), -2).to(torch.int32)
        y0 = torch.where(inside, torch.floor(h).nan_to_num(0), -2).to(torch.int32)
        out[:, :, :, l, :] = (y0 * 65536) | (x0 & 0xFFFF)
    return out.reshape(-1)


def unpack(packed):
    """(x0, y0) of packed corners (make_coords' y0 << 16 | (x0 & 0xffff)), x0 sign-extended from 16 bits."""
    return ((packed & 0xFFFF) ^ 0x8000) - 0x8000, packed >> 16


def address_key(packed, W: int):
    """A key that orders packed corners of a level W pixels wide by their top-left pixel's address (row-major,
    the out-of-level corners from -2 included)."""
    x0, y0 = unpack(packed)
    return (y0 + 2) * (W + 4) + (x0 + 2)


def in_address_order(samples, W: int):
    """Packed corners of a level W pixels wide, sorted along the last dimension by address_key (stable)."""
    return samples.gather(-1, address_key(samples, W).argsort(dim=-1, stable=True))


def sort_samples_across_heads(coords, N, Lq, P, levels):
    """Each (image, level)'s samples of all heads dealt back in address order (in place), heads fastest: the next
    samples in address order go to the same query's and point's other heads, so the warps of a block (one query tile,
    eight heads) read the rows of neighbouring pixels, every head's row of a pixel at about the same time. A sample
    dealt to another head reads that head's row of its pixel, so the rows (and the XOR reference, computed after)
    change; dealing heads fastest keeps one head's samples apart, and where locations are uniform (decoder-b16) the
    rows read are 7% (level 0) and 18% (level 1) more than before, not fewer (dealing points fastest would give one
    head runs of neighbouring samples whose footprints overlap: 25-40% fewer rows). The gathers of a design that
    visits each image's samples by pixel, across heads."""
    c = coords.view(N, Lq, M, L, P)
    for l, (H, W) in enumerate(levels):
        cl = c[:, :, :, l, :].reshape(N, Lq * M * P)
        c[:, :, :, l, :] = in_address_order(cl, W).view(N, Lq, P, M).permute(0, 1, 3, 2)


def sort_samples(coords, N, Lq, P, levels):
    """Each (image, head, level)'s samples dealt back to its queries in address order (in place): neighbouring queries,
    which a kernel runs together, then read neighbouring rows. The rows read and their counts are unchanged, so the
    XOR reference is too: the gathers of a design that visits samples by address, without the cost of sorting them or
    of summing each query's samples from wherever they land."""
    c = coords.view(N, Lq, M, L, P)
    for l, (H, W) in enumerate(levels):
        cl = c[:, :, :, l, :].permute(0, 2, 1, 3).reshape(N, M, Lq * P)  # (n, m, samples in (q, p) order)
        c[:, :, :, l, :] = in_address_order(cl, W).view(N, M, Lq, P).permute(0, 2, 1, 3)


def skip_levels(coords, N, Lq, P, first):
    """Levels first.. of packed coordinates (in place) at the corner (-2, -2): none of its corners lies in the level."""
    coords.view(N, Lq, M, L, P)[:, :, :, first:, :] = (-2 * 65536) | (-2 & 0xFFFF)


def inputs_for(name, pattern, gen, dev, small=False):
    """(value, coords, compare.Shape) of one preset and pattern, or None where the preset is compare.py's
    only and the pattern is not 'preset'. small: the first image and at most 500 queries."""
    if pattern == "preset":
        shape = compare.selected_shapes(compare.parse_args(["--presets", name]))[0]
    elif name in PRESETS:
        N, Lq, levels, P = PRESETS[name]
        shape = compare.Shape(name, N, Lq, levels, P, M, D, pattern)
    else:
        return None
    if small:
        shape = dataclasses.replace(shape, N=1, Lq=min(shape.Lq, 500))
    if pattern == "preset":
        assert (shape.M, shape.D, shape.L) == (M, D, L), f"{name}: gather_ceiling.cu takes M={M}, D={D}, L={L}"
        (value, _, _, loc, _), _ = compare.make_inputs(shape, torch.float16, gen, device=dev)
        return value, coords_from_locations(loc, shape.levels), shape
    value = torch.randn(shape.N, shape.S, M, D, dtype=torch.float16, device=dev, generator=gen)
    return value, make_coords(pattern, shape.N, shape.Lq, shape.P, shape.levels, gen, dev), shape


def xor_all(t):
    t = t.reshape(-1)
    if t.numel() == 0:
        return 0
    while t.numel() > 1:
        n = t.numel()
        h = n // 2
        r = t[:h] ^ t[h:2 * h]
        if n & 1:
            r = torch.cat([r, t[2 * h:]])
        t = r
    return int(t.item()) & 0xFFFFFFFF


def reference_xor(value, coords, N, Lq, P, levels):
    """(XOR of every word every sample loads = XOR of the (pixel, head) rows loaded an odd number of times,
    how many (image, pixel, head) rows some corner loads)."""
    starts, S = level_info(levels)
    dev = value.device
    vi = value.view(torch.int32).reshape(-1, D // 2)  # rows (n, s, m), 16 words each
    cnt = torch.zeros(vi.shape[0], dtype=torch.int32, device=dev)
    c5 = coords.view(N, Lq, M, L, P)
    m_idx = torch.arange(M, device=dev).view(1, 1, M, 1)
    nb = max(1, (1 << 24) // (Lq * M * P))
    for n0 in range(0, N, nb):
        n1 = min(N, n0 + nb)
        n_idx = torch.arange(n0, n1, device=dev).view(-1, 1, 1, 1)
        for l, (H, W) in enumerate(levels):
            x0, y0 = unpack(c5[n0:n1, :, :, l, :])
            for dy in (0, 1):
                for dx in (0, 1):
                    y, x = y0 + dy, x0 + dx
                    ok = (y >= 0) & (y < H) & (x >= 0) & (x < W)
                    row = ((n_idx * S + starts[l] + y * W + x) * M + m_idx)[ok]
                    cnt.index_add_(0, row, torch.ones(row.numel(), dtype=torch.int32, device=dev))
    return xor_all(vi[(cnt & 1).bool()]), int((cnt > 0).sum())


# ------------------------------------------------------------------------------------------------ configs
# The LDG kernel's bulk forms (--bulk): the reads after the gathers, four words a lane issued before them, or TMA
# bulk copies into shared memory by one lane a warp.
BULK_FORMS = {1: "bulk after", 2: "bulk 4 ahead", 3: "bulk by TMA"}


def ldg_configs(lib, N, Lq, P, sms, quick, hp=0, bulk=False, level_major=False):
    variants = [(4, 2), (4, 4), (8, 4), (16, 4)] + ([(16, 8)] if P >= 8 else [])
    if quick:
        variants = [(4, 4), (16, 4)]
    if hp:
        variants = [(4, 2), (4, 4)]
    out = []
    for tpq, u in variants:
        for bk in BULK_FORMS if bulk else (0,):
            occ = ctypes.c_int(0)
            check(lib, lib.gc_ldg_occupancy(P, tpq, u, hp, bk, ctypes.byref(occ)), "ldg occupancy")
            b = occ.value
            qw = 32 // tpq // (2 if hp else 1)  # queries per warp; a block is 8 warps = 8 (query tile, head) items
            items = -(-M // 2) if hp else M  # head items, as the kernel counts them
            total_blocks = (N * ((Lq + qw - 1) // qw) * items + 7) // 8
            tag = f"TPQ={tpq} U={u}" + (" head pairs" if hp else "") + (f" {BULK_FORMS[bk]}" if bk else "")
            common = dict(tpq=tpq, u=u, hp=hp, bk=bk)
            out.append(dict(common, contig=0, grid=total_blocks, desc=f"{tag} grid=all"))
            out.append(dict(common, contig=0, grid=sms * b, desc=f"{tag} {b}x256/SM interleaved"))
            out.append(dict(common, contig=1, grid=sms * b, desc=f"{tag} {b}x256/SM contiguous"))
            if level_major and bk in (0, 2) and not hp and P % 4 == 0:  # the level-pass kernel (bk + 4)
                check(lib, lib.gc_ldg_occupancy(P, tpq, u, hp, bk + 4, ctypes.byref(occ)), "ldg occupancy")
                for mode, name in LEVEL_MAJOR_FORMS.items():
                    out.append(dict(common, bk=bk + 4, contig=mode, grid=sms * occ.value,
                                    desc=f"{tag} {occ.value}x256/SM contiguous, {name}"))
    return out


# The level-pass kernel's level orders (passed as its contig argument): contiguous blocks, items one level a pass
LEVEL_MAJOR_FORMS = {2: "level-major 0,1,..", 3: "level-major 1,0,..", 4: "level-major by image parity",
                     5: "level-major rotated by image"}


def bulk_bytes(shape, gather_levels: int) -> tuple[int, int]:
    """(bytes read, bytes written) that a kernel gathering only the first gather_levels levels must still move, beside
    the packed coordinates the load-only kernel reads (4 bytes a sample): the other levels whole (every head of every
    pixel, fp16), the rest of the fp32 locations and weights (12 - 4 bytes a sample), and the fp16 output."""
    staged_pixels = sum(h * w for h, w in shape.levels[gather_levels:])
    read = shape.N * staged_pixels * shape.M * shape.D * 2 + shape.samples * 8
    written = shape.N * shape.Lq * shape.M * shape.D * 2
    return read, written


def tma_configs(lib, P, nstg, sms, staged_px, quick):
    if nstg == 0:
        rings = [(32, 1, 1, 2), (64, 1, 1, 2), (32, 2, 1, 2), (32, 4, 1, 2), (64, 2, 1, 2), (64, 4, 1, 2),
                 (32, 2, 1, 4), (64, 4, 1, 4), (32, 12, 12, 4), (64, 12, 12, 4)]
        orders = (0, 1)
        if quick:
            rings, orders = [(32, 2, 1, 2), (64, 4, 1, 4)], (0,)
    else:
        rings = [(64, 2, 1, 8), (32, 3, 3, 4), (32, 8, 8, 4), (32, 12, 12, 4), (32, 12, 12, 8), (32, 16, 8, 8),
                 (64, 6, 6, 8), (64, 8, 8, 8)]
        orders = (1,)
        if quick:
            rings = [(32, 12, 12, 8), (64, 8, 8, 8)]
    out = []
    for B, stages, nprod, ncons in rings:
        for order in orders:
            occ = ctypes.c_int(0)
            check(lib, lib.gc_tma_occupancy(P, nstg, B, order, stages, nprod, ncons, staged_px, ctypes.byref(occ)),
                  "tma occupancy")
            b = min(occ.value, 16)
            if b < 1:
                continue
            ordname = "natural" if order == 0 else "head-major"
            out.append(dict(B=B, stages=stages, nprod=nprod, ncons=ncons, order=order, grid=sms * b,
                            desc=f"B={B} stages={stages} prod={nprod} cons={ncons} {b} CTA/SM {ordname}"))
    return out


# ------------------------------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--patterns", default="local,uniform")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--methods", default="ldg,tma,stage", help="subset of ldg,pairs,tma,stage")
    ap.add_argument("--dry", action="store_true", help="CPU check of data generation and reference only")
    ap.add_argument("--warmup", type=float, default=10)
    ap.add_argument("--rep", type=float, default=50)
    ap.add_argument("--gather-levels", type=int, default=L,
                    help="gather only the first K levels (the time of a kernel that stages the others, less the "
                         "staging): the LDG methods issue no loads for the others; the TMA methods load their boxes "
                         "at the corner (-2, -2), all zero fill")
    ap.add_argument("--bulk", action="store_true",
                    help="LDG methods only: each warp item also streams its share of what a kernel that gathers only "
                         "--gather-levels levels must move besides (bulk_bytes)")
    ap.add_argument("--bulk-only", action="store_true", help="--bulk with no gathers at all: the bulk bytes alone")
    ap.add_argument("--level-major", action="store_true",
                    help="LDG only: also contiguous blocks that gather their items level by level (reuse within a pass)")
    ap.add_argument("--sort-samples", nargs="?", const="head", choices=("head", "heads"), default=None,
                    help="deal each (image, head, level)'s samples to its queries in address order (sort_samples); "
                         "'heads': each (image, level)'s samples of all heads (sort_samples_across_heads)")
    args = ap.parse_args()
    args.bulk = args.bulk or args.bulk_only
    if not 1 <= args.gather_levels <= L:
        sys.exit(f"--gather-levels must be in [1, {L}]")
    gathered = 0 if args.bulk_only else args.gather_levels  # the levels the kernels gather
    presets = args.presets.split(",")
    which = args.methods.split(",")
    if args.bulk and not set(which) <= {"ldg", "pairs"}:
        sys.exit("--bulk takes the LDG methods only (--methods ldg,pairs)")
    patterns = args.patterns.split(",")
    for pat in patterns:
        if pat not in ("local", "uniform", "preset"):
            sys.exit(f"unknown pattern {pat!r}; choose from local, uniform, preset")
    for name in presets:
        if name not in PRESETS and "preset" not in patterns:
            sys.exit(f"unknown preset {name!r}: {', '.join(PRESETS)} (and, with --patterns preset, compare.py's)")

    if args.dry:
        dev = torch.device("cpu")
        gen = torch.Generator(device=dev).manual_seed(1)
        for name in presets:
            for pat in patterns:
                made = inputs_for(name, pat, gen, dev, small=True)
                if made is None:
                    continue
                value, c, shape = made
                N, Lq, levels, P = shape.N, shape.Lq, shape.levels, shape.P
                starts, S = level_info(levels)
                ref, _ = reference_xor(value, c, N, Lq, P, levels)
                # brute-force check of the reference on the CPU
                vi = value.view(torch.int32).reshape(N, S, M, D // 2)
                c5 = c.view(N, Lq, M, L, P)
                xs, ys = unpack(c5)
                words = []
                for n in range(N):
                    for l, (H, W) in enumerate(levels):
                        x0 = xs[n, :, :, l, :]
                        y0 = ys[n, :, :, l, :]
                        for dy in (0, 1):
                            for dx in (0, 1):
                                y, x = y0 + dy, x0 + dx
                                ok = (y >= 0) & (y < H) & (x >= 0) & (x < W)
                                mm = torch.arange(M).view(1, M, 1).expand_as(y)
                                pix = (starts[l] + y * W + x)[ok]
                                words.append(vi[n][pix, mm[ok]].reshape(-1))
                brute = xor_all(torch.cat(words))
                print(f"dry {name} {pat}: ref {ref:08x} brute {brute:08x} {'OK' if ref == brute else 'MISMATCH'}; "
                      f"x0 range [{int(xs.min())}, {int(xs.max())}] y0 range [{int(ys.min())}, {int(ys.max())}]")
        return

    import triton.testing as tt

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    lib = build_lib()
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    outdir = os.environ.get("OUT")
    log = open(os.path.join(outdir, "gather_ceiling_sweep.txt"), "w") if outdir else None

    def logp(*a):
        s = " ".join(str(x) for x in a)
        if log:
            log.write(s + "\n")
            log.flush()

    print(f"device: {torch.cuda.get_device_name()}, {sms} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB, "
          f"torch {torch.__version__}")

    # copy bandwidth: read + write bytes of a large device-to-device copy
    nbytes = 2 << 30
    src = torch.randn(nbytes // 2, dtype=torch.float16, device=dev)
    dst = torch.empty_like(src)
    ms = tt.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    copy_bw = 2 * nbytes / (ms * 1e-3)
    del src, dst
    print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read+write of a 2 GiB device-to-device copy, {ms * 1e3:.0f} us)")
    torch.cuda.empty_cache()

    gen = torch.Generator(device=dev).manual_seed(20261121)
    rows = []
    floors = {}
    failed = False
    out_buf = torch.empty(1 << 20, dtype=torch.int32, device=dev)  # one XOR word per warp
    try:
        for name in presets:
            for pat in patterns:
                made = inputs_for(name, pat, gen, dev)
                if made is None:
                    continue
                value, coords, shape = made
                N, Lq, levels, P = shape.N, shape.Lq, shape.levels, shape.P
                starts, S = level_info(levels)
                nsamp = shape.samples
                if args.sort_samples == "heads":
                    sort_samples_across_heads(coords, N, Lq, P, levels)
                elif args.sort_samples:
                    sort_samples(coords, N, Lq, P, levels)
                if gathered < L:
                    skip_levels(coords, N, Lq, P, gathered)
                ref, touched = reference_xor(value, coords, N, Lq, P, levels)
                bulk = sink = None
                bulk_note = ""
                if args.bulk:  # fresh random words, each read once: their XOR joins the reference
                    read, written = bulk_bytes(shape, args.gather_levels)
                    bulk = torch.randint(-2**31, 2**31 - 1, (-(-read // 16) * 4,), dtype=torch.int32, device=dev,
                                         generator=gen)
                    sink = torch.empty(-(-written // 16) * 4, dtype=torch.int32, device=dev)
                    ref ^= xor_all(bulk)
                    bulk_note = f"; bulk {bulk.numel() * 4 / 1e6:.1f} MB read, {sink.numel() * 4 / 1e6:.1f} MB written"
                floor_bytes = shape.floor_bytes(2, touched)
                floors[(name, pat)] = (floor_bytes, floor_bytes / copy_bw * 1e6, touched * D * 2, nsamp)
                geom = (ctypes.c_int * 16)(N, Lq, M, S, *[h for h, _ in levels], *[w for _, w in levels], *starts)
                maps = ctypes.create_string_buffer(L * 128)
                maps_p = ctypes.cast(maps, ctypes.c_void_p)
                check(lib, lib.gc_encode_maps(maps_p, ctypes.c_void_p(value.data_ptr()), geom), "encode maps")
                staged_px = sum(h * w for h, w in levels[L - 2:])
                vp, cp = ctypes.c_void_p(value.data_ptr()), ctypes.c_void_p(coords.data_ptr())
                obuf = ctypes.c_void_p(out_buf.data_ptr())

                bulk_p = ctypes.c_void_p(bulk.data_ptr() if bulk is not None else 0)
                sink_p = ctypes.c_void_p(sink.data_ptr() if sink is not None else 0)
                bulk_words = bulk.numel() // 4 if bulk is not None else 0
                sink_words = sink.numel() // 4 if sink is not None else 0

                def run_ldg(c):
                    return lib.gc_ldg(vp, cp, geom, P, c["tpq"], c["u"], c["hp"], c["bk"], c["contig"], c["grid"],
                                      gathered, bulk_p, bulk_words, sink_p, sink_words, obuf, stream)

                def run_tma(c, nstg):
                    return lib.gc_tma(maps_p, vp, cp, geom, P, nstg, c["B"], c["order"], c["stages"], c["nprod"],
                                      c["ncons"], c["grid"], obuf, stream)

                methods = []
                for c in ldg_configs(lib, N, Lq, P, sms, args.quick, bulk=args.bulk,
                                      level_major=args.level_major) if "ldg" in which else []:
                    methods.append(("LDG", c, (lambda c=c: run_ldg(c)), c["grid"] * 8))
                for c in ldg_configs(lib, N, Lq, P, sms, args.quick, hp=1, bulk=args.bulk) if "pairs" in which else []:
                    methods.append(("LDG-pairs", c, (lambda c=c: run_ldg(c)), c["grid"] * 8))
                for c in tma_configs(lib, P, 0, sms, 0, args.quick) if "tma" in which else []:
                    methods.append(("TMA", c, (lambda c=c: run_tma(c, 0)), c["grid"] * (c["nprod"] + c["ncons"])))
                for c in tma_configs(lib, P, 2, sms, staged_px, args.quick) if "stage" in which else []:
                    methods.append(("TMA+stage2", c, (lambda c=c: run_tma(c, 2)), c["grid"] * (c["nprod"] + c["ncons"])))
                best = {}
                need = max(nw for _, _, _, nw in methods)
                if need > out_buf.numel():
                    out_buf = torch.empty(need, dtype=torch.int32, device=dev)
                obuf.value = out_buf.data_ptr()
                for meth, c, fn, nwarps in methods:
                    out_buf[:nwarps].random_(-2**31, 2**31 - 1, generator=gen)  # poison: every warp must write
                    check(lib, fn(), f"{meth} launch")
                    torch.cuda.synchronize()
                    got = xor_all(out_buf[:nwarps])
                    ok = got == ref
                    if not ok:
                        print(f"  XOR MISMATCH {name} {pat} {meth} {c['desc']}: {got:08x} vs ref {ref:08x}")
                        logp(name, pat, meth, c["desc"], "XOR MISMATCH")
                        continue
                    ms = tt.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
                    check(lib, lib.gc_last_error(), f"{meth} after timing")
                    us = ms * 1e3
                    logp(f"{name:17s} {pat:8s} {meth:10s} {us:9.1f} us {nsamp / us / 1e3:6.1f} Gs/s  {c['desc']}")
                    if meth not in best or us < best[meth][0]:
                        best[meth] = (us, c["desc"])
                line = []
                for meth in ("LDG", "LDG-pairs", "TMA", "TMA+stage2"):
                    if {"LDG": "ldg", "LDG-pairs": "pairs", "TMA": "tma", "TMA+stage2": "stage"}[meth] not in which:
                        continue
                    if meth in best:
                        us, desc = best[meth]
                        rows.append((name, pat, meth, us, nsamp / us / 1e3, nsamp * BOX_BYTES / us / 1e6,
                                     us / floors[(name, pat)][1], desc))
                        line.append(f"{meth} {us:.1f} us")
                    else:
                        rows.append((name, pat, meth, float("nan"), float("nan"), float("nan"), float("nan"),
                                     "no config passed"))
                print(f"{name} {pat}: ref xor {ref:08x}{bulk_note}; " + ", ".join(line), flush=True)
                del coords, value, bulk, sink
                torch.cuda.empty_cache()
    except Exception as e:  # print what we have, exit 1 at the end
        failed = True
        print("ERROR:", repr(e)[:500])

    # ------------------------------------------------------------------ summary, table last
    by = {(r[0], r[1], r[2]): r[3] for r in rows}
    print()
    print("speed ratios (time of TMA / time of LDG; > 1 means LDG is faster):")
    for name, pat in floors:
        t_ldg, t_tma, t_st = (by.get((name, pat, m)) for m in ("LDG", "TMA", "TMA+stage2"))
        if t_ldg and t_tma:
            s = f"  {name:17s} {pat:8s} TMA/LDG {t_tma / t_ldg:5.2f}"
            if t_st:
                s += f"   TMA+stage2/LDG {t_st / t_ldg:5.2f}"
            print(s)
    print()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s. DRAM floors (the value rows some corner reads (fp16), "
          f"locations and attention weights (fp32) read once, output fp16 written once, at the copy bandwidth):")
    for (name, pat), (fb, fus, vb, ns) in floors.items():
        print(f"  {name:17s} {pat:8s} {ns / 1e6:7.2f} M samples  value read {vb / 1e6:7.1f} MB  floor "
              f"{fb / 1e6:8.1f} MB = {fus:8.1f} us")
    print()
    print(f"Gather ceiling on {torch.cuda.get_device_name()} (load-only; best configuration of each method; "
          f"TB/s = 256 B of box bytes per sample / time; x floor = time / DRAM floor)")
    hdr = (f"{'preset':17s} {'pattern':8s} {'method':10s} {'us':>9s} {'Gsamp/s':>8s} {'TB/s':>6s} {'x floor':>7s}"
           f"  best config")
    print(hdr)
    print("-" * len(hdr))
    for name, pat, meth, us, gs, tbs, xf, desc in rows:
        print(f"{name:17s} {pat:8s} {meth:10s} {us:9.1f} {gs:8.1f} {tbs:6.2f} {xf:7.1f}  {desc}")
    if failed:
        sys.exit(1)

if __name__ == "__main__":
    main()
