"""Exact MSDA forward semantics in pure PyTorch.

The rule is the original Deformable-DETR CUDA kernel's. For a sample at (x, y) on a level of
size (H, W):

    h = y*H - 0.5,  w = x*W - 0.5
    skip the sample (it adds 0) unless -1 < h < H and -1 < w < W   # NaN / inf locations fail this
    h0 = floor(h), w0 = floor(w), lh = h - h0, lw = w - w0
    bilinear = (1-lh)(1-lw) v[h0, w0] + (1-lh) lw v[h0, w0+1] + lh (1-lw) v[h0+1, w0] + lh lw v[h0+1, w0+1]
               where a corner outside [0, H-1] x [0, W-1] reads 0
    output[n, q, m] = sum over levels l, then points p, of attention_weight * bilinear

`ms_deform_attn_reference` follows that rule operation by operation, in the original's order
(corners summed left to right, levels outer, points inner), so in float64 it matches a scalar
loop bit for bit. `ms_deform_attn_grid_sample` computes the same thing with
`torch.nn.functional.grid_sample` and serves as an independent check and as the op's slower path
on CUDA devices without the kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import REFERENCE_FLOAT_DTYPES, check_inputs, validate_fused

# Upper bound on the elements of the per-chunk working set, so that the reference for
# N=48, Lq=15422, M=8, L=4, P=8, D=32 in float64 stays well under a GPU's memory.
_CHUNK_ELEMENTS = 1 << 23


def _level_table(spatial_shapes: torch.Tensor, level_start_index: torch.Tensor) -> list[tuple[int, int, int]]:
    """(H, W, start) per level, read to the host (the reference is not the hot path)."""
    shapes = spatial_shapes.tolist()
    starts = level_start_index.tolist()
    return [(h, w, s) for (h, w), s in zip(shapes, starts)]


def _inside(h: torch.Tensor, w: torch.Tensor, height, width) -> torch.Tensor:
    # Written as comparisons that are False for NaN, so NaN and +-inf locations are skipped.
    return (h > -1) & (h < height) & (w > -1) & (w < width)


def _check_compute_dtype(compute_dtype: torch.dtype) -> None:
    if not compute_dtype.is_floating_point:
        raise TypeError(f"cute_deform: compute_dtype: expected a floating dtype, got {compute_dtype}")


def ms_deform_attn_reference(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    *,
    compute_dtype: torch.dtype = torch.float64,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """MSDA forward with the original kernel's exact semantics; returns (N, Lq, M*D).

    Inputs are cast to `compute_dtype` and every operation runs in it; the result is returned in
    `out_dtype` (default: value.dtype). Works on any device; reads spatial_shapes and
    level_start_index to the host. Memory is bounded by chunking over the N*Lq queries.
    """
    shape = check_inputs(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        float_dtypes=REFERENCE_FLOAT_DTYPES,
    )
    _check_compute_dtype(compute_dtype)
    out_dtype = value.dtype if out_dtype is None else out_dtype
    N, S, M, D = shape.batch, shape.num_keys, shape.num_heads, shape.head_dim
    Lq, L, P = shape.num_queries, shape.num_levels, shape.num_points
    device = value.device

    out = torch.zeros((N * Lq, M, D), dtype=compute_dtype, device=device)
    if shape.output_is_empty or shape.sums_nothing:
        return out.view(shape.output_shape).to(out_dtype)

    levels = _level_table(spatial_shapes, level_start_index)
    # Row (n*S + s)*M + m of the table is value[n, s, m, :]; one extra zero row is what a corner
    # outside its level (or a skipped sample) reads.
    table = torch.cat([value.reshape(N * S * M, D).to(compute_dtype), value.new_zeros((1, D), dtype=compute_dtype)])
    zero_row = N * S * M

    locations = sampling_locations.flatten(0, 1)  # (N*Lq, M, L, P, 2)
    weights = attention_weights.flatten(0, 1)  # (N*Lq, M, L, P)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // (M * (L * P + D)))
    for first in range(0, N * Lq, rows_per_chunk):
        last = min(first + rows_per_chunk, N * Lq)
        out[first:last] = _reference_chunk(
            table, zero_row, levels, locations[first:last], weights[first:last],
            first_query_row=first, num_queries=Lq, num_keys=S, compute_dtype=compute_dtype,
        )
    return out.view(shape.output_shape).to(out_dtype)


def _reference_chunk(table, zero_row, levels, locations, weights, *, first_query_row, num_queries, num_keys, compute_dtype):
    """Output rows [first_query_row, first_query_row + B) of the flattened (N*Lq, M, D) output."""
    B, M, L, P, _ = locations.shape
    D = table.shape[1]
    device = table.device
    locations = locations.to(compute_dtype)
    weights = weights.to(compute_dtype)

    # Per-level constants, shaped (L, 1) to broadcast over (B, M, L, P).
    height = torch.tensor([h for h, _, _ in levels], device=device).view(L, 1)
    width = torch.tensor([w for _, w, _ in levels], device=device).view(L, 1)
    start = torch.tensor([s for _, _, s in levels], device=device).view(L, 1)

    x, y = locations[..., 0], locations[..., 1]
    h = y * height.to(compute_dtype) - 0.5
    w = x * width.to(compute_dtype) - 0.5
    inside = _inside(h, w, height, width)
    # Park skipped samples at (0, 0) so floor/long see finite numbers; their corners read the zero row.
    h = torch.where(inside, h, 0.0)
    w = torch.where(inside, w, 0.0)
    weights = torch.where(inside, weights, 0.0)  # a skipped sample ignores its weight, even NaN

    h0, w0 = h.floor(), w.floor()
    lh, lw = h - h0, w - w0
    hh, hw = 1 - lh, 1 - lw
    h0, w0 = h0.long(), w0.long()

    image = torch.arange(first_query_row, first_query_row + B, device=device) // num_queries
    head = torch.arange(M, device=device)
    first_row = (image.view(B, 1, 1, 1) * num_keys + start) * M + head.view(1, M, 1, 1)  # pixel (0, 0)

    corners = []  # (row into table, bilinear weight), in the original's order
    for dh, dw, corner_weight in ((0, 0, hh * hw), (0, 1, hh * lw), (1, 0, lh * hw), (1, 1, lh * lw)):
        hc, wc = h0 + dh, w0 + dw
        in_level = inside & (hc >= 0) & (hc <= height - 1) & (wc >= 0) & (wc <= width - 1)
        row = torch.where(in_level, first_row + (hc * width + wc) * M, zero_row)
        corners.append((row, corner_weight))

    acc = torch.zeros((B, M, D), dtype=compute_dtype, device=device)
    for level in range(L):
        for point in range(P):
            bilinear = None
            for row, corner_weight in corners:
                corner_value = table.index_select(0, row[:, :, level, point].reshape(-1)).view(B, M, D)
                term = corner_weight[:, :, level, point, None] * corner_value
                bilinear = term if bilinear is None else bilinear + term
            acc += bilinear * weights[:, :, level, point, None]
    return acc


def ms_deform_attn_grid_sample(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    *,
    compute_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """MSDA forward through `F.grid_sample(mode="bilinear", padding_mode="zeros", align_corners=False)`.

    grid_sample at 2*loc - 1 unnormalizes to exactly h = y*H - 0.5, w = x*W - 0.5 and reads 0 outside
    the image, which is the original's bilinear rule. What grid_sample does not give is the skip: a NaN
    or inf location must add 0 (and ignore its weight), so skipped samples are moved far outside and
    their weights zeroed first. Same result as the reference up to rounding; bounded memory (chunks
    over queries). This is the op's slower path on CUDA devices without the kernel.
    """
    shape = check_inputs(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        float_dtypes=REFERENCE_FLOAT_DTYPES,
    )
    _check_compute_dtype(compute_dtype)
    out_dtype = value.dtype if out_dtype is None else out_dtype
    N, M, D = shape.batch, shape.num_heads, shape.head_dim
    Lq, P = shape.num_queries, shape.num_points

    out = torch.zeros((N, Lq, M, D), dtype=compute_dtype, device=value.device)
    if shape.output_is_empty or shape.sums_nothing:
        return out.view(shape.output_shape).to(out_dtype)

    # (N*M, D, S): one image of D channels per (batch, head), as grid_sample wants.
    images = value.to(compute_dtype).permute(0, 2, 3, 1).reshape(N * M, D, shape.num_keys)
    levels = [
        (images[:, :, start : start + h * w].reshape(N * M, D, h, w), h, w)
        for h, w, start in _level_table(spatial_shapes, level_start_index)
    ]
    queries_per_chunk = max(1, _CHUNK_ELEMENTS // (N * M * P * (D + 4)))
    for first in range(0, Lq, queries_per_chunk):
        last = min(first + queries_per_chunk, Lq)
        Q = last - first
        # (N, Q, M, L, P, ...) -> (N*M, Q, L, P, ...): batch and head lead, like the images.
        loc = sampling_locations[:, first:last].to(compute_dtype).transpose(1, 2).reshape(N * M, Q, -1, P, 2)
        attn = attention_weights[:, first:last].to(compute_dtype).transpose(1, 2).reshape(N * M, Q, -1, P)
        acc = torch.zeros((N * M, D, Q), dtype=compute_dtype, device=value.device)
        for level, (image, h, w) in enumerate(levels):
            loc_l, attn_l = loc[:, :, level], attn[:, :, level]  # (N*M, Q, P, 2), (N*M, Q, P)
            inside = _inside(loc_l[..., 1] * h - 0.5, loc_l[..., 0] * w - 0.5, h, w)
            grid = torch.where(inside[..., None], 2 * loc_l - 1, -3.0)  # -3: every corner outside
            attn_l = torch.where(inside, attn_l, 0.0)
            sampled = F.grid_sample(image, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
            acc += (sampled * attn_l[:, None]).sum(-1)  # (N*M, D, Q, P) -> (N*M, D, Q)
        out[:, first:last] = acc.view(N, M, D, Q).permute(0, 3, 1, 2)
    return out.view(shape.output_shape).to(out_dtype)


def fused_sampling_inputs(
    spatial_shapes: torch.Tensor,
    reference_points: torch.Tensor,
    sampling_offsets: torch.Tensor,
    attention_logits: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampling_locations, attention_weights) as Deformable DETR's module computes them, in compute_dtype.

    Locations: with 2-d reference points (x, y), `ref + offset / (W_l, H_l)` (offsets in pixels of
    each level); with 4-d boxes (cx, cy, w, h), `ref[:2] + offset / P * ref[2:] * 0.5`. Weights: a
    softmax over the L*P samples of each (query, head), NaN where torch's softmax gives NaN.
    spatial_shapes must be on the offsets' device (it is only used there, never read to the host).
    """
    N, Lq, M, L, P, _ = sampling_offsets.shape
    ref = reference_points.to(compute_dtype)[:, :, None, :, None, :]  # (N, Lq, 1, L, 1, 2 or 4)
    offsets = sampling_offsets.to(compute_dtype)
    if reference_points.shape[-1] == 2:
        pixels = spatial_shapes.flip(-1).to(compute_dtype)  # (L, 2) as (W, H)
        locations = ref + offsets / pixels[:, None, :]
    else:
        locations = ref[..., :2] + offsets / P * ref[..., 2:] * 0.5
    weights = attention_logits.to(compute_dtype).reshape(N, Lq, M, L * P).softmax(-1).view(N, Lq, M, L, P)
    return locations, weights


def fused_reference(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    reference_points: torch.Tensor,
    sampling_offsets: torch.Tensor,
    attention_logits: torch.Tensor,
    *,
    compute_dtype: torch.dtype = torch.float64,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The fused op's semantics: locations and softmax (`fused_sampling_inputs`) in compute_dtype, then
    `ms_deform_attn_reference` in compute_dtype; returns (N, Lq, M*D) in out_dtype (default value.dtype).

    Inputs as for torch.ops.cute_deform.forward_fused, float64 also accepted. Reads the level table to
    the host.
    """
    validate_fused(
        value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits,
        float_dtypes=REFERENCE_FLOAT_DTYPES,
    )
    _check_compute_dtype(compute_dtype)
    locations, weights = fused_sampling_inputs(
        spatial_shapes.to(value.device), reference_points, sampling_offsets, attention_logits, compute_dtype
    )
    return ms_deform_attn_reference(
        value, spatial_shapes, level_start_index, locations, weights, compute_dtype=compute_dtype, out_dtype=out_dtype
    )
