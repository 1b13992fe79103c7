"""Drop-in functional API with the argument order of Deformable DETR's `MSDeformAttnFunction.apply`."""
from __future__ import annotations

import torch

from . import op as _op  # noqa: F401  (registers torch.ops.cute_deform.forward)
from ._checks import DROP_IN_NAMES, check_inputs


def ms_deform_attn(
    value: torch.Tensor,
    value_spatial_shapes: torch.Tensor,
    value_level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    im2col_step: int = 64,
) -> torch.Tensor:
    """Multi-scale deformable attention forward; returns (N, Lq, M*D) in value's dtype.

    value (N, S, M, D); value_spatial_shapes (L, 2) int64 as (H, W); value_level_start_index (L,)
    int64; sampling_locations (N, Lq, M, L, P, 2) as (x, y) in [0, 1]; attention_weights
    (N, Lq, M, L, P). im2col_step is accepted and ignored (any batch size works).
    """
    if not isinstance(im2col_step, int) or isinstance(im2col_step, bool):
        raise TypeError(f"cute_deform: im2col_step: expected an int, got {type(im2col_step).__name__}")
    # While torch.compile traces, reading the level table would break the graph; the op's kernel
    # checks those values at run time anyway.
    check_inputs(
        value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
        names=DROP_IN_NAMES, check_values=not torch.compiler.is_compiling(),
    )
    return torch.ops.cute_deform.forward(
        value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights, im2col_step
    )


class MSDeformAttnFunction:
    """Stand-in for Deformable DETR's autograd Function, so `MSDeformAttnFunction.apply(...)` call sites
    keep working. Forward only."""

    apply = staticmethod(ms_deform_attn)
