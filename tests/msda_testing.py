"""Helpers for the tests: random MSDA inputs, a scalar brute-force MSDA, relative error."""
from __future__ import annotations

import math

import torch


def level_tensors(levels, device="cpu"):
    """spatial_shapes (L, 2) and level_start_index (L,) for levels given as (H, W) pairs."""
    shapes = torch.tensor(levels, dtype=torch.int64).view(-1, 2)
    pixels = shapes.prod(-1)
    starts = pixels.cumsum(0) - pixels  # each level starts where the previous ones end
    return shapes.to(device), starts.to(device)


def make_inputs(gen, levels, *, batch=2, queries=5, heads=3, head_dim=4, points=2,
                dtype=torch.float64, loc_dtype=None, attn_dtype=None, low=-0.2, high=1.2):
    """Random inputs; locations uniform in [low, high]^2 so some fall outside every level."""
    shapes, starts = level_tensors(levels)
    num_keys = int(shapes.prod(-1).sum())
    L = len(levels)
    value = torch.randn((batch, num_keys, heads, head_dim), generator=gen, dtype=torch.float64).to(dtype)
    loc = low + (high - low) * torch.rand((batch, queries, heads, L, points, 2), generator=gen, dtype=torch.float64)
    attn = torch.rand((batch, queries, heads, L, points), generator=gen, dtype=torch.float64)
    return value, shapes, starts, loc.to(loc_dtype or dtype), attn.to(attn_dtype or dtype)


def special_coordinates(size: int) -> list[float]:
    """Coordinates in [0, 1] units along an axis of `size` pixels that hit the rule's edge cases."""
    coords = [0.0, 1.0, -0.5 / size, (size + 0.5) / size, math.nan, math.inf, -math.inf, 1e30, -1e30]
    coords += [j / size for j in range(size + 1)]  # pixel edges (integer pixel coordinates - 0.5)
    coords += [(j + 0.5) / size for j in range(size)]  # pixel centres
    for border in (-0.5 / size, (size + 0.5) / size, 0.0, 1.0):  # just inside / outside the skip borders
        coords += [math.nextafter(border, -math.inf), math.nextafter(border, math.inf)]
    return coords


def sprinkle_special_locations(gen, loc: torch.Tensor, levels, fraction=0.6) -> torch.Tensor:
    """Replace a random `fraction` of the coordinates with per-level special ones (borders, pixel
    edges and centres, NaN, inf)."""
    loc = loc.clone()
    for level, (height, width) in enumerate(levels):
        for axis, size in ((0, width), (1, height)):
            pool = torch.tensor(special_coordinates(size), dtype=loc.dtype)
            target = loc[..., level, :, axis]
            pick = torch.randint(len(pool), target.shape, generator=gen)
            use = torch.rand(target.shape, generator=gen) < fraction
            loc[..., level, :, axis] = torch.where(use, pool[pick], target)
    return loc


def brute_force_msda(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """The original kernel's rule as a scalar loop over samples in Python floats (IEEE double).

    Written independently of cute_deform.reference, in the original's order of operations, so the
    two agree bit for bit in float64.
    """
    N, S, M, D = value.shape
    Lq, L, P = sampling_locations.shape[1], sampling_locations.shape[3], sampling_locations.shape[4]
    v = value.double().tolist()
    loc = sampling_locations.double().tolist()
    attn = attention_weights.double().tolist()
    shapes = spatial_shapes.tolist()
    starts = level_start_index.tolist()
    out = torch.zeros((N, Lq, M, D), dtype=torch.float64)
    for n in range(N):
        for q in range(Lq):
            for m in range(M):
                col = [0.0] * D
                for l in range(L):
                    H, W = shapes[l]
                    for p in range(P):
                        x, y = loc[n][q][m][l][p]
                        h = y * H - 0.5
                        w = x * W - 0.5
                        if not (h > -1 and w > -1 and h < H and w < W):
                            continue
                        h_low, w_low = math.floor(h), math.floor(w)
                        lh, lw = h - h_low, w - w_low
                        hh, hw = 1 - lh, 1 - lw

                        def pixel(i, j):
                            if 0 <= i <= H - 1 and 0 <= j <= W - 1:
                                return v[n][starts[l] + i * W + j][m]
                            return [0.0] * D

                        v1, v2 = pixel(h_low, w_low), pixel(h_low, w_low + 1)
                        v3, v4 = pixel(h_low + 1, w_low), pixel(h_low + 1, w_low + 1)
                        a = attn[n][q][m][l][p]
                        for d in range(D):
                            val = hh * hw * v1[d] + hh * lw * v2[d] + lh * hw * v3[d] + lh * lw * v4[d]
                            col[d] += val * a
                out[n, q, m] = torch.tensor(col, dtype=torch.float64)
    return out.view(N, Lq, M * D)


def strided_copies(value, shapes, starts, loc, attn):
    """The same inputs as non-contiguous views."""
    return [
        value.transpose(1, 2).contiguous().transpose(1, 2),  # stored as (N, M, S, D)
        shapes.t().contiguous().t(),  # column-major
        torch.stack([starts, starts], -1)[:, 0],  # stride 2
        torch.cat([-loc, loc], -1)[..., 2:],  # every other pair of a wider tensor
        attn.transpose(-1, -2).contiguous().transpose(-1, -2),
    ]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()
