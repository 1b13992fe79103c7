#!/usr/bin/env python3
"""Microbenchmarks behind the baselines (kernels/microbench.cu, kernels/msda_distributed.cu).

Sections (all by default, or --sections a,b):
  tma      TMA descriptor check: [D,1,2,2,1] boxes at random and edge coordinates, negative and past the end,
           some wholly outside, copied out verbatim and compared exactly (bit for bit) with a zero-padded gather.
  tiles    2x2x32 fp16 tile copy into shared memory, GB/s and M tiles/s: cooperative 16-byte LDG, against
           cooperative_groups::memcpy_async, against one TMA box per tile; local and uniform patterns; a value that
           sits in L2 and one that does not. Exact check of every method first.
  cluster  distributed kernel with many clusters in the grid (and >= 96 co-resident where the shape allows),
           each launch under a watchdog: a launch that does not finish in --watchdog seconds is reported as a
           hang and the process exits 3. Also checks each result against the float64 reference.

    python benchmarks/microbench.py [--sections tma,tiles,cluster] [--watchdog 30]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import baselines  # noqa: E402

LDG, MEMCPY_ASYNC, TMA = 0, 1, 2
METHOD_NAMES = {LDG: "LDG 16B coop", MEMCPY_ASYNC: "cg::memcpy_async", TMA: "TMA box"}


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


# ---------------------------------------------------------------------------------------------------------------
# tma: descriptor check


def box_reference(value, coords):
    """Zero-padded gather of the 2x2 footprint at (n, head, x0, y0): (K, 2, 2, D)."""
    pad = 4
    N, H, W, M, D = value.shape
    padded = torch.zeros(N, H + 2 * pad, W + 2 * pad, M, D, dtype=value.dtype, device=value.device)
    padded[:, pad:pad + H, pad:pad + W] = value
    n, m, x0, y0 = (coords[:, i].long() for i in range(4))
    rows = []
    for dy in (0, 1):
        cols = [padded[n, y0 + dy + pad, x0 + dx + pad, m] for dx in (0, 1)]
        rows.append(torch.stack(cols, 1))
    return torch.stack(rows, 1)


def section_tma(ext, log) -> bool:
    ok = True
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    cases = [(torch.float16, 32, 13, 19), (torch.bfloat16, 32, 13, 19), (torch.float32, 32, 13, 19),
             (torch.float16, 64, 13, 19), (torch.float16, 16, 13, 19), (torch.float16, 32, 1, 1),
             (torch.float32, 32, 1, 5)]
    for dtype, D, H, W in cases:
        N, M = 3, 8
        value = torch.randn(N, H, W, M, D, device="cuda", generator=g).to(dtype)
        K = 8192
        coords = torch.stack([
            torch.randint(0, N, (K,), device="cuda", generator=g),
            torch.randint(0, M, (K,), device="cuda", generator=g),
            torch.randint(-3, W + 2, (K,), device="cuda", generator=g),  # x0: -3, -2 and W, W+1 are wholly outside
            torch.randint(-3, H + 2, (K,), device="cuda", generator=g),
        ], 1).to(torch.int32)
        edges = torch.tensor([[0, 0, -1, -1], [0, 0, W - 1, H - 1], [1, 7, -1, H - 1], [2, 3, W - 1, -1],
                              [0, 0, -2, -2], [0, 0, W, H], [1, 1, -2, 0], [1, 1, 0, H]],
                             dtype=torch.int32, device="cuda")
        coords = torch.cat([edges, coords]).contiguous()
        out = torch.full((coords.shape[0], 2, 2, D), float("nan"), dtype=dtype, device="cuda")
        try:
            ext.tma_box_check(value, coords, out, stream())
            torch.cuda.synchronize()
        except RuntimeError as exc:
            log(f"  {str(dtype).replace('torch.', ''):9s} D={D:3d} H={H:2d} W={W:2d}: FAILED: {str(exc).splitlines()[0][:160]}")
            ok = False
            continue
        ref = box_reference(value, coords)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        exact = torch.equal(out.view(bits), ref.view(bits))
        wholly_out = ((coords[:, 2] < -1) | (coords[:, 2] >= W) | (coords[:, 3] < -1) | (coords[:, 3] >= H))
        partial = ((coords[:, 2] == -1) | (coords[:, 2] == W - 1) | (coords[:, 3] == -1) | (coords[:, 3] == H - 1))
        zero_ok = bool((out[wholly_out] == 0).all().item())
        log(f"  {str(dtype).replace('torch.', ''):9s} D={D:3d} H={H:2d} W={W:2d}: {coords.shape[0]} boxes ({int(wholly_out.sum())} wholly "
            f"outside, {int((partial & ~wholly_out).sum())} partly outside, negative coords included): "
            f"exact match {exact}, wholly-outside boxes all zero {zero_ok}")
        ok &= exact and zero_ok
    return ok


# ---------------------------------------------------------------------------------------------------------------
# tiles: 2x2x32 tile copy


def tile_coords(pattern, N, H, W, M, K, g):
    """int32 (K, 4) = n, y0, x0, head with y0 in [-1, H-1], x0 in [-1, W-1] (MSDA footprints)."""
    P = 8
    queries = K // (M * P)
    if pattern == "local":
        # raster-ordered query pixels (a random subset when there are more pixels than queries), 8 heads x 8 points
        # each, a few pixels around the query's own pixel: encoder-like
        total = N * H * W
        pixel = torch.randperm(total, device="cuda", generator=g)[:queries].sort().values if total > queries else \
            torch.arange(queries, device="cuda") % total
        n = pixel // (H * W)
        y = (pixel // W) % H
        x = pixel % W
        shape = (queries, M, P)
        n = n.view(-1, 1, 1).expand(shape)
        yf = y.view(-1, 1, 1).float() + 0.5 + torch.randn(shape, device="cuda", generator=g) * 2.0
        xf = x.view(-1, 1, 1).float() + 0.5 + torch.randn(shape, device="cuda", generator=g) * 2.0
    else:
        shape = (queries, M, P)
        n = torch.randint(0, N, shape, device="cuda", generator=g)
        yf = torch.rand(shape, device="cuda", generator=g) * H
        xf = torch.rand(shape, device="cuda", generator=g) * W
    y0 = torch.floor(yf - 0.5).clamp(-1, H - 1)
    x0 = torch.floor(xf - 0.5).clamp(-1, W - 1)
    m = torch.arange(M, device="cuda").view(1, M, 1).expand(shape)
    return torch.stack([n, y0.long(), x0.long(), m], -1).reshape(-1, 4).to(torch.int32).contiguous()


def tile_reference(value, coords):
    n, y0, x0, m = (coords[:, i].long() for i in range(4))
    return box_reference(value, torch.stack([n, m, x0, y0], 1))


def section_tiles(ext, log, rows) -> bool:
    import triton.testing

    ok = True
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    H, W, M = 100, 152, 8
    K = 1 << 22
    occupancy = {(mth, b): ext.tile_copy_occupancy(mth, b) for mth in METHOD_NAMES for b in (8, 32)}
    for N in (4, 64):
        value = torch.randn(N, H, W, M, 32, device="cuda", generator=g).to(torch.float16)
        where = f"value {value.numel() * 2 / 1e6:.0f} MB"
        for pattern in ("local", "uniform"):
            coords = tile_coords(pattern, N, H, W, M, K, g)
            # exact check of every method on the first tiles, output poisoned
            check = coords[: 1 << 16].contiguous()
            ref = tile_reference(value, check)
            checksums = {}
            for method in METHOD_NAMES:
                for batch in (8, 32):
                    per_sm, threads = occupancy[(method, batch)]
                    blocks = sms * per_sm
                    out = torch.full((check.shape[0], 2, 2, 32), float("nan"), dtype=torch.float16, device="cuda")
                    cs = torch.zeros(blocks * threads, dtype=torch.int32, device="cuda")
                    ext.tile_copy(method, batch, value, check, out, cs, blocks, True, stream())
                    torch.cuda.synchronize()
                    exact = torch.equal(out.view(torch.int16), ref.view(torch.int16))
                    ok &= exact
                    # timed: loads into shared memory, XOR-reduced there (no output traffic)
                    cs = torch.zeros(blocks * threads, dtype=torch.int32, device="cuda")
                    fn = lambda: ext.tile_copy(method, batch, value, coords, cs, cs, blocks, False, stream())
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    fn()
                    torch.cuda.synchronize()
                    folded = int(np.bitwise_xor.reduce(cs.cpu().numpy().view(np.uint32)))
                    checksums[(method, batch)] = folded
                    row = dict(value=where, pattern=pattern, method=METHOD_NAMES[method], batch=batch,
                               blocks_per_sm=per_sm, us=ms * 1e3, gbs=K * 256 / (ms * 1e-3) / 1e9,
                               mtiles=K / (ms * 1e-3) / 1e6, exact=exact)
                    rows.append(row)
                    log(f"  {where:>7s} {pattern:7s} {METHOD_NAMES[method]:17s} batch {batch:2d} ({per_sm:2d} CTAs/SM): "
                        f"{row['us']:8.1f} us {row['gbs']:8.1f} GB/s {row['mtiles']:8.1f} M tiles/s  exact {exact}")
            agree = len(set(checksums.values())) == 1
            ok &= agree
            log(f"  {where} {pattern}: XOR of all loaded words agrees across methods: {agree}")
    return ok


# ---------------------------------------------------------------------------------------------------------------
# cluster: distributed kernel, many clusters, watchdog


def run_with_watchdog(fn, seconds: float) -> float | None:
    """Launch fn on the current stream and wait on an event for at most `seconds`; None means it did not finish."""
    done = torch.cuda.Event()
    t0 = time.time()
    fn()
    done.record()
    while not done.query():
        if time.time() - t0 > seconds:
            return None
        time.sleep(0.001)
    return time.time() - t0


def section_cluster(ext, log, watchdog: float) -> bool:
    sys.path.insert(0, str(baselines.REPO / "scripts"))
    import compare

    ok = True
    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    small = dict(levels=[(24, 32), (12, 16), (6, 8)], P=4)
    configs = [  # (label, shape, dtype, cluster size)
        ("dcnv4-test", compare.Shape("dcnv4-test", 1, 15200, [(100, 152), (50, 76), (25, 38), (13, 19)], 8, 8, 32,
                                     "local"), torch.float16, 0),
        ("dcnv4-test C=16", compare.Shape("dcnv4-test", 1, 15200, [(100, 152), (50, 76), (25, 38), (13, 19)], 8, 8,
                                          32, "local"), torch.float16, 16),
        ("detr-encoder fp32", compare.Shape("detr-encoder", 2, 22223, [(100, 167), (50, 84), (25, 42), (13, 21)], 4,
                                            8, 32, "local"), torch.float32, 0),
        ("small levels C=2", compare.Shape("small", 16, 1344, small["levels"], small["P"], 8, 32, "uniform"),
         torch.float16, 2),
        ("small levels C=4", compare.Shape("small", 16, 1344, small["levels"], small["P"], 8, 32, "local"),
         torch.bfloat16, 4),
        ("seed-b48", compare.Shape("seed-b48", 48, 15422, [(92, 160), (46, 80), (23, 40), (12, 20)], 8, 8, 32,
                                   "local"), torch.float16, 0),
    ]
    for label, shape, dtype, cluster_size in configs:
        (value, ss, ls, loc, attn), _ = compare.make_inputs(shape, dtype, g)
        shapes, starts = baselines.host_levels(ss, ls)
        out = torch.full((shape.N, shape.Lq, shape.M * shape.D), float("nan"), dtype=dtype, device="cuda")
        try:
            info = ext.distributed_info(value, ss, ls, loc, attn, out, shapes, starts, cluster_size)
        except RuntimeError as exc:
            log(f"  {label}: FAILED to plan: {str(exc).splitlines()[0][:200]}")
            ok = False
            continue
        fn = lambda: ext.distributed(value, ss, ls, loc, attn, out, shapes, starts, cluster_size, stream())
        try:
            seconds = run_with_watchdog(fn, watchdog)
        except RuntimeError as exc:
            log(f"  {label}: FAILED to launch: {str(exc).splitlines()[0][:200]}")
            ok = False
            continue
        if seconds is None:
            log(f"  {label}: HANG: not finished after {watchdog:.0f} s ({info})")
            sys.stdout.flush()
            os._exit(3)
        n_check = min(shape.N, 2)
        ref, _ = baselines.reference_forward(value[:n_check], ss, ls, loc[:n_check], attn[:n_check])
        finite = bool(torch.isfinite(out).all().item())
        err = baselines.relative_error(out[:n_check], ref) if finite else float("inf")
        good = finite and err <= baselines.ERROR_BOUND[dtype]
        ok &= good
        log(f"  {label:18s} {str(dtype).replace('torch.', ''):8s} cluster {info['cluster_size']:2d} CTAs x "
            f"{info['threads_per_cta']} threads, {info['smem_bytes'] / 1024:6.1f} KiB smem/CTA: "
            f"{info['grid_clusters']:5d} clusters in the grid, {info['max_active_clusters']:4d} co-resident at most; "
            f"finished in {seconds * 1e3:8.1f} ms (first launch); rel err {err:.2e} {'ok' if good else 'MISMATCH'}")
        del value, loc, attn, out, ref
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="tma,tiles,cluster")
    ap.add_argument("--watchdog", type=float, default=30.0, help="seconds before a distributed launch counts as hung")
    ap.add_argument("--csv", help="write the tile copy table here")
    args = ap.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    ext = baselines.build()
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB; "
          f"torch {torch.__version__}", flush=True)
    log = lambda s: print(s, flush=True)
    results = {}
    tile_rows = []
    if "tma" in sections:
        log("TMA descriptor check (box [D,1,2,2,1], zero OOB fill, negative coordinates):")
        results["tma"] = section_tma(ext, log)
    if "cluster" in sections:
        log(f"distributed kernel under a {args.watchdog:.0f} s watchdog:")
        results["cluster"] = section_cluster(ext, log, args.watchdog)
    if "tiles" in sections:
        log("2x2x32 fp16 tile copy into shared memory (timed without output: XOR-reduced from shared memory):")
        results["tiles"] = section_tiles(ext, log, tile_rows)
    if args.csv and tile_rows:
        import csv

        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(tile_rows[0]))
            w.writeheader()
            w.writerows(tile_rows)
    if tile_rows:
        print("\ntile copy summary (best batch per method):")
        print(f"  {'value':>7s} {'pattern':7s} {'method':17s} {'batch':>5s} {'GB/s':>8s} {'M tiles/s':>10s}")
        best = {}
        for r in tile_rows:
            key = (r["value"], r["pattern"], r["method"])
            if key not in best or r["gbs"] > best[key]["gbs"]:
                best[key] = r
        for r in best.values():
            print(f"  {r['value']:>7s} {r['pattern']:7s} {r['method']:17s} {r['batch']:5d} {r['gbs']:8.1f} "
                  f"{r['mtiles']:10.1f}")
    print("microbench:", ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
