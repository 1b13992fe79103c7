"""Drop-in functional API with the argument order of Deformable DETR's `MSDeformAttnFunction.apply`."""
from __future__ import annotations

import torch

from . import op as _op  # registers torch.ops.cute_deform.forward
from ._checks import DROP_IN_NAMES, check_inputs

_forward = _op.forward  # torch.ops.cute_deform.forward.default: skips the overload packet's resolution


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
    if torch.compiler.is_compiling():
        # While torch.compile traces, reading the level table would break the graph; the op's kernel
        # checks those values at run time anyway.
        check_inputs(
            value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
            names=DROP_IN_NAMES, check_values=False,
        )
        return torch.ops.cute_deform.forward(
            value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights, im2col_step
        )
    # Eager: the op runs the very checks check_inputs runs, so they are not run twice on the hot path;
    # only when the op refuses the inputs are they checked again here, to name the arguments as
    # MSDeformAttnFunction.apply does (value_spatial_shapes, ...).
    try:
        return _forward(
            value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights, im2col_step
        )
    except (TypeError, ValueError, RuntimeError) as exc:
        error = exc
    check_inputs(  # raises where the op's own checks refused the inputs
        value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
        names=DROP_IN_NAMES,
    )
    raise error


class MSDeformAttnFunction:
    """Stand-in for Deformable DETR's autograd Function, so `MSDeformAttnFunction.apply(...)` call sites
    keep working. Forward only."""

    apply = staticmethod(ms_deform_attn)
