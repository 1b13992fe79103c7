"""Input validation shared by the op's kernels, its fake implementation, the drop-in API and the reference.

Every error names the argument and what was expected. Checks that need the *values* of
spatial_shapes / level_start_index (S == sum(H*W), the level starts) run only when those
tensors live on the CPU: reading a CUDA tensor would be a host sync on the hot path.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

_Tensor = torch.Tensor

# What the op computes with (fp32 arithmetic); the reference also takes float64.
OP_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REFERENCE_FLOAT_DTYPES = (torch.float64,) + OP_FLOAT_DTYPES
INDEX_DTYPE = torch.int64

# The backward's refusals, raised from Python or from the C++ launcher (which gets them at load time).
FORWARD_ONLY = (
    "cute_deform.forward is forward only: it has no backward (autograd formula), so gradients cannot flow "
    "through it to value, sampling_locations or attention_weights. Call it under torch.no_grad() or "
    "torch.inference_mode(), or detach its inputs."
)
FUSED_FORWARD_ONLY = "cute_deform.forward_fused is forward only: there is no backward through it (no autograd formula)"

OP_NAMES = ("value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights")
# Argument names of Deformable DETR's MSDeformAttnFunction.apply, used by the drop-in function.
DROP_IN_NAMES = (
    "value",
    "value_spatial_shapes",
    "value_level_start_index",
    "sampling_locations",
    "attention_weights",
)


class MSDAShape(NamedTuple):
    """Sizes of one MSDA call, read off validated inputs (immutable; a NamedTuple because it is
    built on every call and costs a third of a frozen dataclass)."""

    batch: int  # N
    num_keys: int  # S = sum over levels of H*W
    num_heads: int  # M
    head_dim: int  # D
    num_queries: int  # Lq
    num_levels: int  # L
    num_points: int  # P

    @property
    def output_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.num_queries, self.num_heads * self.head_dim)

    @property
    def output_is_empty(self) -> bool:
        return self.batch * self.num_queries * self.num_heads * self.head_dim == 0

    @property
    def sums_nothing(self) -> bool:
        """No level or no point: every output is an empty sum, i.e. 0."""
        return self.num_levels == 0 or self.num_points == 0


def _fmt_shape(t: torch.Tensor) -> str:
    return str(tuple(int(s) for s in t.shape))


def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"cute_deform: {name}: expected a torch.Tensor, got {type(t).__name__}")


def _check_rank(t: torch.Tensor, name: str, layout: str) -> None:
    ndim = len([part for part in layout.strip("()").split(",") if part.strip()])
    if t.dim() != ndim:
        raise ValueError(
            f"cute_deform: {name}: expected {ndim} dims {layout}, got {t.dim()} dims with shape {_fmt_shape(t)}"
        )


def _check_dtype(t: torch.Tensor, name: str, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"cute_deform: {name}: expected dtype {names}, got {str(t.dtype).replace('torch.', '')}")


def _check_devices(value: torch.Tensor, n_value: str, per_query, tables) -> None:
    """Per-query tensors on value's device; level tables there or on the CPU. Pairs of (tensor, name)."""
    device = value.device
    for t, name in per_query:
        if t.device != device:
            raise ValueError(f"cute_deform: {name}: expected device {device} (the device of {n_value}), got {t.device}")
    for t, name in tables:
        if t.device != device and t.device.type != "cpu":
            raise ValueError(
                f"cute_deform: {name}: expected device {device} (the device of {n_value}) or cpu, got {t.device}"
            )


def _check_size(got, want, name: str, what: str, dim: int, t: torch.Tensor, source: str) -> None:
    if got != want:
        raise ValueError(
            f"cute_deform: {name}: expected dim {dim} ({what}) to be {want} as in {source}, "
            f"got {got} (shape {_fmt_shape(t)})"
        )


def check_inputs(
    value,
    spatial_shapes,
    level_start_index,
    sampling_locations,
    attention_weights,
    *,
    float_dtypes: tuple[torch.dtype, ...] = OP_FLOAT_DTYPES,
    names: tuple[str, str, str, str, str] = OP_NAMES,
    check_values: bool = True,
) -> MSDAShape:
    """Validate MSDA inputs and return their sizes; raise TypeError / ValueError naming the argument.

    Layouts: value (N, S, M, D); spatial_shapes (L, 2) int64 as (H, W); level_start_index (L,) int64;
    sampling_locations (N, Lq, M, L, P, 2) as (x, y); attention_weights (N, Lq, M, L, P).

    Devices: value, sampling_locations and attention_weights share one device. spatial_shapes and
    level_start_index are on that device too, or on the CPU (then their values are checked for free).

    check_values=False skips the checks that read spatial_shapes / level_start_index (fake tensors,
    tracing). They are skipped anyway for tensors that are not on the CPU.
    """
    sizes, _, _ = validate(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        float_dtypes, names, check_values,
    )
    return MSDAShape._make(sizes)


def validate(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
             float_dtypes=OP_FLOAT_DTYPES, names=OP_NAMES, check_values=True):
    """check_inputs without the MSDAShape, for the op's hot path (positional arguments only).

    Returns (sizes, shapes, starts): sizes = (N, S, M, D, Lq, L, P) as a tuple; shapes and starts are
    the level table's values as lists ([[H, W], ...] and [start, ...]) where this call read them (a
    table on the CPU and check_values), else None.
    """
    sizes = _sizes_if_well_formed(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, float_dtypes
    )
    if sizes is None:
        # The detailed checks explain the failure; they stay the single source of truth for what is
        # accepted (the fast path above only accepts a subset of what they accept).
        sizes = _detailed_checks(
            value, spatial_shapes, level_start_index, sampling_locations, attention_weights, float_dtypes, names
        )
    shapes = starts = None
    if check_values and spatial_shapes.is_cpu:
        # Reading a CPU tensor is no host sync: ~0.5 us for both tables (.tolist()).
        shapes, starts = _read_level_table(spatial_shapes, level_start_index, sizes[1], names)
    return sizes, shapes, starts


def _sizes_if_well_formed(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                          float_dtypes):
    """(N, S, M, D, Lq, L, P) when _detailed_checks would accept the inputs (level values aside), else
    None. The fast path: about a microsecond, no message built."""
    if not (
        isinstance(value, _Tensor)
        and isinstance(spatial_shapes, _Tensor)
        and isinstance(level_start_index, _Tensor)
        and isinstance(sampling_locations, _Tensor)
        and isinstance(attention_weights, _Tensor)
    ):
        return None
    try:
        N, S, M, D = value.shape
        L, pair = spatial_shapes.shape
        (L_starts,) = level_start_index.shape
        N_loc, Lq, M_loc, L_loc, P, xy = sampling_locations.shape
    except ValueError:  # a rank that is not the layout's
        return None
    device = value.device
    if (
        pair == 2
        and xy == 2
        and L_starts == L
        and N_loc == N
        and M_loc == M
        and L_loc == L
        and attention_weights.shape == (N, Lq, M, L, P)
        and value.dtype in float_dtypes
        and sampling_locations.dtype in float_dtypes
        and attention_weights.dtype in float_dtypes
        and spatial_shapes.dtype == INDEX_DTYPE
        and level_start_index.dtype == INDEX_DTYPE
        and sampling_locations.device == device
        and attention_weights.device == device
        and (spatial_shapes.is_cpu or spatial_shapes.device == device)
        and (level_start_index.is_cpu or level_start_index.device == device)
    ):
        return (N, S, M, D, Lq, L, P)
    return None


def _detailed_checks(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                     float_dtypes, names):
    """Every check short of the level values, one at a time, raising with a message that names the
    argument; returns (N, S, M, D, Lq, L, P) when all pass."""
    n_value, n_shapes, n_starts, n_loc, n_attn = names
    tensors = (value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    for t, name in zip(tensors, names):
        _check_tensor(t, name)

    _check_rank(value, n_value, "(N, S, M, D)")
    _check_rank(spatial_shapes, n_shapes, "(L, 2)")
    _check_rank(level_start_index, n_starts, "(L,)")
    _check_rank(sampling_locations, n_loc, "(N, Lq, M, L, P, 2)")
    _check_rank(attention_weights, n_attn, "(N, Lq, M, L, P)")
    if spatial_shapes.shape[1] != 2:
        raise ValueError(
            f"cute_deform: {n_shapes}: expected shape (L, 2) holding (H, W) per level, got {_fmt_shape(spatial_shapes)}"
        )
    if sampling_locations.shape[-1] != 2:
        raise ValueError(
            f"cute_deform: {n_loc}: expected last dim 2 holding (x, y), got shape {_fmt_shape(sampling_locations)}"
        )

    _check_dtype(value, n_value, float_dtypes)
    _check_dtype(spatial_shapes, n_shapes, (INDEX_DTYPE,))
    _check_dtype(level_start_index, n_starts, (INDEX_DTYPE,))
    _check_dtype(sampling_locations, n_loc, float_dtypes)
    _check_dtype(attention_weights, n_attn, float_dtypes)

    _check_devices(value, n_value, ((sampling_locations, n_loc), (attention_weights, n_attn)),
                   ((spatial_shapes, n_shapes), (level_start_index, n_starts)))

    batch, num_keys, num_heads, head_dim = value.shape
    num_queries = sampling_locations.shape[1]
    num_levels = spatial_shapes.shape[0]
    num_points = sampling_locations.shape[4]
    _check_size(sampling_locations.shape[0], batch, n_loc, "N, batch", 0, sampling_locations, n_value)
    _check_size(sampling_locations.shape[2], num_heads, n_loc, "M, heads", 2, sampling_locations, n_value)
    _check_size(sampling_locations.shape[3], num_levels, n_loc, "L, levels", 3, sampling_locations, n_shapes)
    _check_size(level_start_index.shape[0], num_levels, n_starts, "L, levels", 0, level_start_index, n_shapes)
    _check_size(attention_weights.shape[0], batch, n_attn, "N, batch", 0, attention_weights, n_value)
    _check_size(attention_weights.shape[1], num_queries, n_attn, "Lq, queries", 1, attention_weights, n_loc)
    _check_size(attention_weights.shape[2], num_heads, n_attn, "M, heads", 2, attention_weights, n_value)
    _check_size(attention_weights.shape[3], num_levels, n_attn, "L, levels", 3, attention_weights, n_shapes)
    _check_size(attention_weights.shape[4], num_points, n_attn, "P, points", 4, attention_weights, n_loc)

    return (batch, num_keys, num_heads, head_dim, num_queries, num_levels, num_points)


def _check_level_values(spatial_shapes, level_start_index, num_keys, names) -> None:
    """Checks that read the level table; only called for CPU tensors (no host sync)."""
    n_value, n_shapes, n_starts = names[:3]
    shapes = spatial_shapes.tolist()
    for level, (height, width) in enumerate(shapes):
        if height < 1 or width < 1:
            raise ValueError(f"cute_deform: {n_shapes}: expected every (H, W) >= 1, got ({height}, {width}) at level {level}")
    pixels = [h * w for h, w in shapes]
    if sum(pixels) != num_keys:
        raise ValueError(
            f"cute_deform: {n_value}: expected dim 1 (S) to be sum(H*W) = {sum(pixels)} over {n_shapes} {shapes}, "
            f"got {num_keys}"
        )
    if level_start_index.device.type == "cpu":
        # The levels are stored back to back: start of level l = sum of H*W over the levels before it.
        expected = [sum(pixels[:level]) for level in range(len(pixels))]
        got = level_start_index.tolist()
        if got != expected:
            raise ValueError(
                f"cute_deform: {n_starts}: expected the running sum of H*W over {n_shapes}, {expected}, got {got}"
            )


# --- The fused op (torch.ops.cute_deform.forward_fused): reference points, raw offsets and raw logits
# instead of sampling locations and attention weights.

FUSED_NAMES = ("value", "spatial_shapes", "level_start_index", "reference_points", "sampling_offsets",
               "attention_logits")


def validate_fused(value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits,
                   float_dtypes=OP_FLOAT_DTYPES, names=FUSED_NAMES, check_values=True):
    """Validate the fused op's inputs; raise TypeError / ValueError naming the argument.

    Layouts: value (N, S, M, D); spatial_shapes (L, 2) int64 as (H, W); level_start_index (L,) int64;
    reference_points (N, Lq, L, 2) as (x, y) or (N, Lq, L, 4) as (cx, cy, w, h); sampling_offsets
    (N, Lq, M, L, P, 2) as (x, y); attention_logits (N, Lq, M, L, P). Devices and the level table's
    values as for the unfused op (`validate`).

    Returns (sizes, shapes, starts) as `validate` does; sizes = (N, S, M, D, Lq, L, P).
    """
    sizes = _fused_sizes_if_well_formed(
        value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits, float_dtypes
    )
    if sizes is None:
        sizes = _fused_detailed_checks(
            value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits,
            float_dtypes, names,
        )
    shapes = starts = None
    if check_values and spatial_shapes.is_cpu:
        shapes, starts = _read_level_table(spatial_shapes, level_start_index, sizes[1], names)
    return sizes, shapes, starts


def _read_level_table(spatial_shapes, level_start_index, num_keys, names):
    """The CPU level table's values as lists (starts None when level_start_index is not on the CPU),
    after checking them against value's S; raises naming the argument."""
    shapes = spatial_shapes.tolist()
    expected = []
    start = 0
    for height, width in shapes:
        if height < 1 or width < 1:
            break
        expected.append(start)
        start += height * width
    else:
        if start == num_keys:
            if not level_start_index.is_cpu:
                return shapes, None
            starts = level_start_index.tolist()
            if starts == expected:
                return shapes, starts
    _check_level_values(spatial_shapes, level_start_index, num_keys, names)  # raises, naming the argument
    raise AssertionError("cute_deform: the level table checks disagree")  # pragma: no cover


def _fused_sizes_if_well_formed(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                                attention_logits, float_dtypes):
    """(N, S, M, D, Lq, L, P) when _fused_detailed_checks would accept the inputs (level values aside),
    else None; no message built."""
    if not (
        isinstance(value, _Tensor)
        and isinstance(spatial_shapes, _Tensor)
        and isinstance(level_start_index, _Tensor)
        and isinstance(reference_points, _Tensor)
        and isinstance(sampling_offsets, _Tensor)
        and isinstance(attention_logits, _Tensor)
    ):
        return None
    try:
        N, S, M, D = value.shape
        L, pair = spatial_shapes.shape
        (L_starts,) = level_start_index.shape
        N_ref, Lq, L_ref, coords = reference_points.shape
        N_off, Lq_off, M_off, L_off, P, xy = sampling_offsets.shape
    except ValueError:  # a rank that is not the layout's
        return None
    device = value.device
    if (
        pair == 2
        and (coords == 2 or coords == 4)
        and xy == 2
        and L_starts == L
        and N_ref == N
        and L_ref == L
        and N_off == N
        and Lq_off == Lq
        and M_off == M
        and L_off == L
        and attention_logits.shape == (N, Lq, M, L, P)
        and value.dtype in float_dtypes
        and reference_points.dtype in float_dtypes
        and sampling_offsets.dtype in float_dtypes
        and attention_logits.dtype in float_dtypes
        and spatial_shapes.dtype == INDEX_DTYPE
        and level_start_index.dtype == INDEX_DTYPE
        and reference_points.device == device
        and sampling_offsets.device == device
        and attention_logits.device == device
        and (spatial_shapes.is_cpu or spatial_shapes.device == device)
        and (level_start_index.is_cpu or level_start_index.device == device)
    ):
        return (N, S, M, D, Lq, L, P)
    return None


def _fused_detailed_checks(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                           attention_logits, float_dtypes, names):
    """Every check of the fused op's inputs short of the level values, one at a time, raising with a
    message that names the argument; returns (N, S, M, D, Lq, L, P) when all pass."""
    n_value, n_shapes, n_starts, n_ref, n_off, n_logits = names
    tensors = (value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits)
    for t, name in zip(tensors, names):
        _check_tensor(t, name)

    _check_rank(value, n_value, "(N, S, M, D)")
    _check_rank(spatial_shapes, n_shapes, "(L, 2)")
    _check_rank(level_start_index, n_starts, "(L,)")
    _check_rank(reference_points, n_ref, "(N, Lq, L, 2 or 4)")
    _check_rank(sampling_offsets, n_off, "(N, Lq, M, L, P, 2)")
    _check_rank(attention_logits, n_logits, "(N, Lq, M, L, P)")
    if spatial_shapes.shape[1] != 2:
        raise ValueError(
            f"cute_deform: {n_shapes}: expected shape (L, 2) holding (H, W) per level, got {_fmt_shape(spatial_shapes)}"
        )
    if reference_points.shape[-1] not in (2, 4):
        raise ValueError(
            f"cute_deform: {n_ref}: expected last dim 2 (x, y) or 4 (cx, cy, w, h), "
            f"got shape {_fmt_shape(reference_points)}"
        )
    if sampling_offsets.shape[-1] != 2:
        raise ValueError(
            f"cute_deform: {n_off}: expected last dim 2 holding (x, y), got shape {_fmt_shape(sampling_offsets)}"
        )

    _check_dtype(value, n_value, float_dtypes)
    _check_dtype(spatial_shapes, n_shapes, (INDEX_DTYPE,))
    _check_dtype(level_start_index, n_starts, (INDEX_DTYPE,))
    _check_dtype(reference_points, n_ref, float_dtypes)
    _check_dtype(sampling_offsets, n_off, float_dtypes)
    _check_dtype(attention_logits, n_logits, float_dtypes)

    _check_devices(value, n_value, ((reference_points, n_ref), (sampling_offsets, n_off), (attention_logits, n_logits)),
                   ((spatial_shapes, n_shapes), (level_start_index, n_starts)))

    batch, num_keys, num_heads, head_dim = value.shape
    num_queries = reference_points.shape[1]
    num_levels = spatial_shapes.shape[0]
    num_points = sampling_offsets.shape[4]
    _check_size(level_start_index.shape[0], num_levels, n_starts, "L, levels", 0, level_start_index, n_shapes)
    _check_size(reference_points.shape[0], batch, n_ref, "N, batch", 0, reference_points, n_value)
    _check_size(reference_points.shape[2], num_levels, n_ref, "L, levels", 2, reference_points, n_shapes)
    _check_size(sampling_offsets.shape[0], batch, n_off, "N, batch", 0, sampling_offsets, n_value)
    _check_size(sampling_offsets.shape[1], num_queries, n_off, "Lq, queries", 1, sampling_offsets, n_ref)
    _check_size(sampling_offsets.shape[2], num_heads, n_off, "M, heads", 2, sampling_offsets, n_value)
    _check_size(sampling_offsets.shape[3], num_levels, n_off, "L, levels", 3, sampling_offsets, n_shapes)
    _check_size(attention_logits.shape[0], batch, n_logits, "N, batch", 0, attention_logits, n_value)
    _check_size(attention_logits.shape[1], num_queries, n_logits, "Lq, queries", 1, attention_logits, n_ref)
    _check_size(attention_logits.shape[2], num_heads, n_logits, "M, heads", 2, attention_logits, n_value)
    _check_size(attention_logits.shape[3], num_levels, n_logits, "L, levels", 3, attention_logits, n_shapes)
    _check_size(attention_logits.shape[4], num_points, n_logits, "P, points", 4, attention_logits, n_off)

    return (batch, num_keys, num_heads, head_dim, num_queries, num_levels, num_points)
