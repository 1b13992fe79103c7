"""`MSDeformAttn`: Deformable DETR's multi-scale deformable attention module on top of cute_deform.

Same constructor, forward signature, parameter names and shapes, and initialization as Deformable
DETR's module, so a checkpoint's state dict loads unchanged (strict=True). The forward runs
`torch.ops.cute_deform.forward_fused`: sampling locations and attention weights are computed inside
the op (in fp32) from the raw outputs of the sampling_offsets and attention_weights layers.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .fused import forward_fused as _forward_fused


class MSDeformAttn(nn.Module):
    """Multi-scale deformable attention (Zhu et al., Deformable DETR), forward only.

    Parameters (Deformable DETR's names):
      sampling_offsets  Linear(d_model, n_heads*n_levels*n_points*2)
      attention_weights Linear(d_model, n_heads*n_levels*n_points), softmax over levels*points
      value_proj        Linear(d_model, d_model)
      output_proj       Linear(d_model, d_model)
    """

    def __init__(self, d_model: int = 256, n_levels: int = 4, n_heads: int = 8, n_points: int = 4):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"cute_deform: d_model: expected a multiple of n_heads={n_heads}, got {d_model}")
        self.im2col_step = 64  # kept for attribute compatibility; the op ignores it
        self.d_model = d_model
        self.n_levels = n_levels
        self.n_heads = n_heads
        self.n_points = n_points
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # Offsets start as a fixed pattern: head m looks along the direction at angle 2*pi*m/n_heads,
        # scaled so the larger of |cos|, |sin| is 1, and point p sits (p+1) steps out, on every level.
        nn.init.zeros_(self.sampling_offsets.weight)
        angle = torch.arange(self.n_heads, dtype=torch.float32) * (2.0 * math.pi / self.n_heads)
        direction = torch.stack([angle.cos(), angle.sin()], -1)  # (M, 2) as (x, y)
        direction = direction / direction.abs().max(-1, keepdim=True).values
        step = torch.arange(1, self.n_points + 1, dtype=torch.float32).view(1, 1, -1, 1)
        pattern = direction.view(self.n_heads, 1, 1, 2) * step  # (M, 1, P, 2)
        pattern = pattern.expand(self.n_heads, self.n_levels, self.n_points, 2)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(pattern.reshape(-1))
        # Uniform attention at start: zero logits.
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)
        nn.init.xavier_uniform_(self.value_proj.weight)
        nn.init.zeros_(self.value_proj.bias)
        nn.init.xavier_uniform_(self.output_proj.weight)
        nn.init.zeros_(self.output_proj.bias)

    def forward(
        self,
        query: torch.Tensor,
        reference_points: torch.Tensor,
        input_flatten: torch.Tensor,
        input_spatial_shapes: torch.Tensor,
        input_level_start_index: torch.Tensor,
        input_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """
        query                   (N, Lq, d_model)
        reference_points        (N, Lq, n_levels, 2) as (x, y) in [0, 1], or
                                (N, Lq, n_levels, 4) as boxes (cx, cy, w, h)
        input_flatten           (N, S, d_model), the levels' pixels back to back
        input_spatial_shapes    (n_levels, 2) int64 as (H, W)
        input_level_start_index (n_levels,) int64
        input_padding_mask      (N, S) bool, True at padding pixels (their values become 0), or None
        returns                 (N, Lq, d_model)
        """
        N, Lq, _ = query.shape
        S = input_flatten.shape[1]
        M, L, P = self.n_heads, self.n_levels, self.n_points

        value = self.value_proj(input_flatten)
        if input_padding_mask is not None:
            # In place on the projection's fresh output: one pass, no second (N, S, d_model) tensor.
            value.masked_fill_(input_padding_mask[..., None], 0.0)
        value = value.view(N, S, M, self.d_model // M)

        # Raw Linear outputs: the op computes locations and the softmax over L*P itself.
        offsets = self.sampling_offsets(query).view(N, Lq, M, L, P, 2)
        logits = self.attention_weights(query).view(N, Lq, M, L, P)
        out = _forward_fused(value, input_spatial_shapes, input_level_start_index, reference_points, offsets, logits)
        return self.output_proj(out)
