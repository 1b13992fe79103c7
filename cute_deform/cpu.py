"""The op's CPU kernel: MSDA as one weighted embedding_bag per chunk of queries.

Each (query, head) is a bag of its L*P*4 bilinear corners: rows of value seen as an (N*S*M, D)
table, with weights corner weight * attention weight, summed by `F.embedding_bag(mode="sum")`, which
reads each corner's D channels as one contiguous row (no copy of value for fp32 value; fp16/bf16 value
is converted to an fp32 table once). All arithmetic is fp32.

The corner weights are bilinear "hat" weights, max(0, 1 - |pos - pixel|) per axis, with the pixel
clamped into the level. They are 0 for a corner outside the level and for a whole sample outside
(-1, H) x (-1, W), so the skip rule needs no comparison or select: NaN locations become -2 (outside)
first. What this leaves out is a non-finite factor meeting a zero weight (a NaN or inf attention
weight on a skipped sample, a NaN or inf value under a zero weight): the product is NaN where the
rule says 0. Any output row that is not finite is therefore recomputed with the exact reference
(`ms_deform_attn_reference` in fp32), so those rows follow the rule exactly too; inputs without NaN or
inf never take that path (short of an overflow).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import ms_deform_attn_reference

_F32 = torch.float32
# Samples (query, head, level, point) per chunk: each working tensor stays a few MB, reused by the
# allocator from chunk to chunk (fresh large allocations would cost a page fault per 4 KB).
SAMPLES_PER_CHUNK = 1 << 18
# Bound on the fp32 table of a chunk of whole images (a copy where value is not contiguous fp32).
TABLE_BYTES_PER_CHUNK = 1 << 26
# Tables up to this many rows are indexed with int32 (half the index memory traffic of int64).
INT32_ROWS = 2**31 - 1


def forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, levels):
    """(N, Lq, M*D) in value's dtype, for validated inputs with N, Lq, M, D, L, P >= 1.

    levels: [(H, W, start), ...], the level table as validated (read once by the caller)."""
    N, S, M, D = value.shape
    Lq, L, P = sampling_locations.shape[1], sampling_locations.shape[3], sampling_locations.shape[4]
    # A chunk is a run of queries of one image, or whole images when images have few queries. Its
    # table is its images' rows of value: a view of fp32 value, else an fp32 copy of those images only
    # (one buffer, reused from chunk to chunk).
    rows_per_image = S * M
    images_per_chunk = max(1, min(SAMPLES_PER_CHUNK // (Lq * M * L * P), TABLE_BYTES_PER_CHUNK // (rows_per_image * D * 4)))
    queries_per_chunk = max(1, SAMPLES_PER_CHUNK // (M * L * P))
    copy_table = value.dtype != _F32 or not value.is_contiguous()
    table_buffer = torch.empty((images_per_chunk * rows_per_image, D), dtype=_F32) if copy_table else None
    index_dtype = torch.int32 if images_per_chunk * rows_per_image <= INT32_ROWS else torch.int64

    # Per-(head, level, point) constants, materialized so that every elementwise op below runs over a
    # long contiguous inner dimension (a broadcast along P or the (x, y) pair would not vectorize).
    def per_sample(rows, dtype):  # rows[l] -> (M, L, P)
        return torch.tensor(rows, dtype=dtype).view(1, L, 1).expand(M, L, P).contiguous()

    heights = [h for h, _, _ in levels]
    widths = [w for _, w, _ in levels]
    size = torch.stack([per_sample(widths, _F32), per_sample(heights, _F32)]).unsqueeze(1)  # (2, 1, M, L, P)
    # The lower corner's pixel is clamped to [0, size - 2] so that the upper one (pixel + 1) stays in
    # the level; a level 1 pixel wide has no upper corner (offset 0, weight 0).
    last_lower = size.sub(2).clamp_(min=0)
    has_upper = [[int(s > 1) for s in widths], [int(s > 1) for s in heights]]
    row_stride = per_sample([w * M for w in widths], index_dtype)  # (M, L, P)
    # Table row of corner (dy, dx) of the sample whose lower corner is pixel (0, 0), in image 0: the
    # level's first row, the head, and dy rows and dx columns.
    corner_row = torch.stack([
        per_sample([start * M + dy * has_upper[1][l] * widths[l] * M + dx * has_upper[0][l] * M
                    for l, (_, _, start) in enumerate(levels)], index_dtype)
        for dy in (0, 1) for dx in (0, 1)
    ], 1).add_(torch.arange(M, dtype=index_dtype).view(M, 1, 1, 1))  # (M, 4, L, P)
    upper_mask = None
    if not all(has_upper[0]) or not all(has_upper[1]):
        upper_mask = torch.stack([per_sample(has_upper[0], _F32), per_sample(has_upper[1], _F32)]).unsqueeze(1)

    locations = sampling_locations.flatten(0, 1)  # (N*Lq, M, L, P, 2)
    weights = attention_weights.flatten(0, 1)  # (N*Lq, M, L, P)
    out = torch.empty((N * Lq * M, D), dtype=_F32)
    for first_image in range(0, N, images_per_chunk):
        images = min(images_per_chunk, N - first_image)
        if copy_table:
            table = table_buffer[:images * rows_per_image]
            table.view(images, S, M, D).copy_(value[first_image:first_image + images])
        else:
            table = value[first_image:first_image + images].view(images * rows_per_image, D)
        if images > 1:  # one chunk; each query's rows start at its image's first row in the table
            image_row = torch.arange(images, dtype=index_dtype).mul_(rows_per_image).repeat_interleave(Lq)
            spans = [(first_image * Lq, (first_image + images) * Lq, image_row.view(-1, 1, 1, 1))]
        else:
            spans = [(first_image * Lq + query, first_image * Lq + min(query + queries_per_chunk, Lq), None)
                     for query in range(0, Lq, queries_per_chunk)]
        for first, end, image_row in spans:
            out[first * M:end * M] = _chunk(
                table, locations[first:end], weights[first:end], image_row, size, last_lower, upper_mask,
                row_stride, corner_row, index_dtype,
            )

    out = out.view(N * Lq, M * D)
    if not torch.isfinite(out.sum()):
        _recompute_non_finite_rows(out, value, spatial_shapes, level_start_index, sampling_locations,
                                   attention_weights)
    return out.view(N, Lq, M * D).to(value.dtype)


def _chunk(table, locations, weights, image_row, size, last_lower, upper_mask, row_stride, corner_row, index_dtype):
    """Output rows (B*M, D) of B queries: locations (B, M, L, P, 2), weights (B, M, L, P); image_row
    (B, 1, 1, 1), each query's image's first row in table, or None for one image."""
    B, M, L, P, _ = locations.shape
    # h = y*H - 0.5, w = x*W - 0.5, as (2, B, M, L, P): x plane, then y plane.
    pos = torch.mul(locations.movedim(-1, 0), size)
    pos.sub_(0.5).nan_to_num_(nan=-2.0)  # NaN: outside; +-inf: +-max float, outside
    lower = pos.floor().clamp_(min=0).clamp_(max=last_lower)
    offset = pos.sub_(lower)  # from the lower corner's pixel (exact for a sample in the level)
    corner_weight = torch.empty((2, B, M, 2, L, P), dtype=_F32)
    lower_weight, upper_weight = corner_weight[:, :, :, 0], corner_weight[:, :, :, 1]
    # max(0, 1 - |offset|) and max(0, min(offset, 2 - offset)): in the level these round as the
    # reference's 1 - l and l do (l the fractional part), and they are 0 for a corner or sample outside.
    torch.abs(offset, out=lower_weight).neg_().add_(1).clamp_(min=0)
    torch.minimum(offset, torch.rsub(offset, 2), out=upper_weight).clamp_(min=0)
    if upper_mask is not None:
        upper_weight.mul_(upper_mask)

    pixel = lower.to(index_dtype)
    row = torch.mul(pixel[1], row_stride).add_(pixel[0], alpha=M)
    if image_row is not None:
        row.add_(image_row)
    index = row.unsqueeze(2) + corner_row  # (B, M, 4, L, P)

    y_weight = corner_weight[1].mul_(weights.unsqueeze(2))  # attention weight folded into y
    bilinear = y_weight.unsqueeze(3) * corner_weight[0].unsqueeze(2)  # (B, M, 2, 2, L, P), corners as index
    return F.embedding_bag(index.view(B * M, 4 * L * P), table, per_sample_weights=bilinear.view(B * M, 4 * L * P),
                           mode="sum")


def _recompute_non_finite_rows(out, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """Rows of out (N*Lq, M*D) with a NaN or inf, recomputed with the exact reference, image by image."""
    Lq = sampling_locations.shape[1]
    rows = (~torch.isfinite(out)).any(1).nonzero().flatten()
    images = rows.div(Lq, rounding_mode="floor")
    for n in images.unique().tolist():
        queries = rows[images == n] - n * Lq
        out[queries + n * Lq] = ms_deform_attn_reference(
            value[n:n + 1], spatial_shapes, level_start_index, sampling_locations[n:n + 1, queries],
            attention_weights[n:n + 1, queries], compute_dtype=_F32, out_dtype=_F32,
        )[0]
