"""Quick GPU check of the Hopper kernel: correctness against a float64 reference on a grid of
configurations, then timings on the presets. Run on the GPU machine:
    source .device/activate.sh && python3 scripts/kernel_check.py
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F

from cute_deform import msda_fwd

PRESETS = {
    "dcnv4-test": dict(N=1, Lq=15200, levels=[(100, 152), (50, 76), (25, 38), (13, 19)], P=8, local=True),
    "detr-encoder": dict(N=2, Lq=None, levels=[(100, 167), (50, 84), (25, 42), (13, 21)], P=4, local=True),
    "detr-decoder": dict(N=8, Lq=900, levels=[(100, 167), (50, 84), (25, 42), (13, 21)], P=4, local=False),
    "seed-b48": dict(N=48, Lq=15422, levels=[(92, 160), (46, 80), (23, 40), (12, 20)], P=8, local=True),
}


def reference_f64(value, shapes, starts, loc, attn):
    """grid_sample formulation in float64 (no NaN locations are used here)."""
    N, S, M, D = value.shape
    _, Lq, _, L, P, _ = loc.shape
    out = torch.zeros(N, M, D, Lq, dtype=torch.float64, device=value.device)
    for level, (H, W) in enumerate(shapes.tolist()):
        s0 = int(starts[level])
        v = value[:, s0:s0 + H * W].double().permute(0, 2, 3, 1).reshape(N * M, D, H, W)
        g = loc[:, :, :, level].double().permute(0, 2, 1, 3, 4).reshape(N * M, Lq, P, 2) * 2 - 1
        s = F.grid_sample(v, g, mode="bilinear", padding_mode="zeros", align_corners=False)  # (NM, D, Lq, P)
        a = attn[:, :, :, level].double().permute(0, 2, 1, 3).reshape(N * M, 1, Lq, P)
        out += (s * a).sum(-1).view(N, M, D, Lq)
    return out.permute(0, 3, 1, 2).reshape(N, Lq, M * D)


def make_inputs(N, Lq, M, D, levels, P, vdt, ldt=torch.float32, adt=torch.float32, local=False, border=False,
                device="cuda"):
    shapes = torch.tensor(levels, dtype=torch.int64, device=device)
    areas = shapes[:, 0] * shapes[:, 1]
    starts = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    S = int(areas.sum())
    if Lq is None:
        Lq = S
    value = torch.randn(N, S, M, D, device=device).to(vdt)
    L = len(levels)
    if local:
        # a few pixels around each query's own position on the finest level
        H0, W0 = levels[0]
        qi = torch.arange(Lq, device=device) % (H0 * W0)
        cx = ((qi % W0).float() + 0.5) / W0
        cy = ((qi // W0).float() + 0.5) / H0
        base = torch.stack([cx, cy], -1).view(1, Lq, 1, 1, 1, 2)
        wh = torch.tensor([[w, h] for h, w in levels], device=device, dtype=torch.float32).view(1, 1, 1, L, 1, 2)
        loc = base + torch.randn(N, Lq, M, L, P, 2, device=device) * 2.0 / wh
    else:
        loc = torch.rand(N, Lq, M, L, P, 2, device=device) * 1.2 - 0.1
    if border:
        # exact borders, integer pixels and far-outside locations
        wh = torch.tensor([[w, h] for h, w in levels], device=device, dtype=torch.float32).view(1, 1, 1, L, 1, 2)
        k = torch.randint(-2, 3, loc.shape, device=device).float()
        special = torch.where(torch.rand_like(loc) < 0.5, (k + 0.5) / wh, k / wh + (torch.rand_like(loc) > 0.5))
        loc = torch.where(torch.rand_like(loc) < 0.3, special, loc)
    attn = torch.rand(N, Lq, M, L, P, device=device)
    attn = attn / attn.sum((-1, -2), keepdim=True)
    return value, shapes, starts, loc.to(ldt), attn.to(adt)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def correctness_cases(quick):
    cases = []
    for vdt in (torch.float32, torch.float16, torch.bfloat16):
        for ldt in ((torch.float32,) if quick else (torch.float32, torch.float16)):
            for D in ((32,) if quick else (16, 32, 64)):
                cases.append(dict(N=2, Lq=37, M=8, D=D, levels=[(13, 17), (7, 9), (1, 5), (4, 1)], P=4, vdt=vdt, ldt=ldt))
    for L in ((1, 5) if quick else (1, 2, 3, 5)):
        for P in ((1, 16) if quick else (1, 2, 8, 16)):
            cases.append(dict(N=1, Lq=70, M=1, D=32, levels=[(9 + l, 11 - l) for l in range(L)], P=P,
                              vdt=torch.float16, ldt=torch.float32))
    cases.append(dict(N=3, Lq=1000, M=8, D=32, levels=[(40, 60), (20, 30), (10, 15), (5, 8)], P=4, vdt=torch.float16,
                      ldt=torch.float32, border=True))
    cases.append(dict(N=2, Lq=3000, M=4, D=64, levels=[(50, 33), (20, 30), (10, 15), (1, 1)], P=4, vdt=torch.float32,
                      ldt=torch.float16, border=True))
    return cases


def correctness(quick, tunings):
    bounds = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
    cases = correctness_cases(quick)
    failures = 0
    for c in cases:
        vdt = c.pop("vdt")
        ldt = c.pop("ldt")
        border = c.pop("border", False)
        value, shapes, starts, loc, attn = make_inputs(vdt=vdt, ldt=ldt, border=border, **c)
        ref = reference_f64(value, shapes, starts, loc, attn)
        for tuning in tunings:
            out = msda_fwd.msda_forward(value, shapes, starts, loc, attn, **tuning)
            torch.cuda.synchronize()
            err = rel_err(out, ref)
            ok = err <= bounds[vdt] and torch.isfinite(out).all().item()
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} value {str(vdt)[6:]:8s} loc {str(ldt)[6:]:8s} D={c['D']:3d} M={c['M']} "
                  f"L={len(c['levels'])} P={c['P']:2d} Lq={c['Lq']} border={border} {tuning}: rel err {err:.2e}")
    return failures


def bench(names, tuning):
    import triton.testing as tt
    rows = []
    for name in names:
        p = PRESETS[name]
        value, shapes, starts, loc, attn = make_inputs(N=p["N"], Lq=p["Lq"], M=8, D=32, levels=p["levels"], P=p["P"],
                                                       vdt=torch.float16, local=p["local"])
        t0 = time.time()
        out = msda_fwd.msda_forward(value, shapes, starts, loc, attn, **tuning)
        torch.cuda.synchronize()
        first = time.time() - t0
        n_check = min(p["N"], 2)
        ref = reference_f64(value[:n_check], shapes, starts, loc[:n_check], attn[:n_check])
        err = rel_err(out[:n_check], ref)
        del ref
        ms = tt.do_bench(lambda: msda_fwd.msda_forward(value, shapes, starts, loc, attn, **tuning), warmup=50, rep=300,
                         return_mode="median")
        samples = loc.numel() // 2
        rows.append((name, ms * 1e3, samples / ms / 1e6, err, first))
    print(f"\n{'preset':14s} {'us':>9s} {'Gsamples/s':>11s} {'rel err':>9s} {'first call s':>12s}")
    for r in rows:
        print(f"{r[0]:14s} {r[1]:9.1f} {r[2]:11.2f} {r[3]:9.2e} {r[4]:12.2f}")


def precompile(quick, check_tunings, bench_tunings, names):
    """Compile every kernel the run will need into the disk cache, on a machine with no GPU."""
    configs = set()
    for c in correctness_cases(quick):
        value, shapes, starts, loc, attn = make_inputs(N=1, Lq=1, M=c["M"], D=c["D"], levels=c["levels"], P=c["P"],
                                                       vdt=c["vdt"], ldt=c["ldt"], device="cpu")
        for tuning in check_tunings:
            configs.add(msda_fwd.config_for(value, loc, attn, **tuning))
    for name in names:
        p = PRESETS[name]
        value, shapes, starts, loc, attn = make_inputs(N=1, Lq=1, M=8, D=32, levels=p["levels"], P=p["P"],
                                                       vdt=torch.float16, device="cpu")
        for tuning in bench_tunings:
            configs.add(msda_fwd.config_for(value, loc, attn, **tuning))
    t0 = time.time()
    msda_fwd.precompile(sorted(configs, key=repr))
    count = len({v for cfg in configs for v in msda_fwd.launch_variants(cfg)})
    print(f"{count} configurations in the cache ({time.time() - t0:.1f} s)")


def parse_tuning(spec):
    pairs = [kv.split("=") for kv in spec.split(":") if kv]
    return {k: int(v) if v.lstrip("-").isdigit() else v for k, v in pairs}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="dcnv4-test,detr-encoder,detr-decoder,seed-b48")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a smaller correctness grid")
    ap.add_argument("--check", default=",stage_bytes=0", help="tunings to check for correctness")
    ap.add_argument("--sweep", default="", help="comma list of tunings, e.g. num_groups=2:num_stages=6")
    ap.add_argument("--precompile", action="store_true", help="only fill the kernel cache (no GPU needed)")
    args = ap.parse_args()
    tunings = [parse_tuning(spec) for spec in args.sweep.split(",")]
    check_tunings = [parse_tuning(s) for s in args.check.split(",")]
    names = [n for n in args.presets.split(",") if n]
    if args.precompile:
        precompile(args.quick, [] if args.skip_correctness else check_tunings, tunings, names)
        sys.exit(0)
    print(torch.cuda.get_device_name())
    torch.manual_seed(0)
    fails = 0 if args.skip_correctness else correctness(args.quick, check_tunings)
    for tuning in tunings:
        print(f"\n== tuning {tuning or 'default'}")
        bench(names, tuning)
    sys.exit(1 if fails else 0)
