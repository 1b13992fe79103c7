"""`torch.ops.cute_deform.forward`: schema, CPU and CUDA kernels, fake implementation.

    forward(Tensor value, Tensor spatial_shapes, Tensor level_start_index,
            Tensor sampling_locations, Tensor attention_weights, int im2col_step=64) -> Tensor

- CPU: the exact reference (`cute_deform.reference`), fp32 arithmetic.
- CUDA on sm_90 with the CuTe kernel available: `cute_deform.msda_fwd.msda_forward`.
- Any other CUDA device (or sm_90 without the kernel): a slower pure-PyTorch path
  (`ms_deform_attn_grid_sample`, fp32 arithmetic, same semantics), with a one-time SlowPathWarning.

value fp32/fp16/bf16, locations and weights fp32/fp16/bf16 in any combination, output in value's
dtype. im2col_step is accepted for drop-in compatibility and ignored: any batch size works.
The op is forward only; backpropagating through it raises.
"""
from __future__ import annotations

import collections
import functools
import warnings

import torch

from ._checks import MSDAShape, check_inputs
from .reference import ms_deform_attn_grid_sample, ms_deform_attn_reference

SCHEMA = (
    "(Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_locations, "
    "Tensor attention_weights, int im2col_step=64) -> Tensor"
)


class SlowPathWarning(UserWarning):
    """The op ran its pure-PyTorch path on a CUDA device because the Hopper kernel cannot run there."""


def _trivial_output(value: torch.Tensor, shape: MSDAShape) -> torch.Tensor | None:
    """The output when there is nothing to compute (no kernel launch), else None."""
    if shape.output_is_empty:
        return value.new_empty(shape.output_shape)
    if shape.sums_nothing:
        return value.new_zeros(shape.output_shape)
    return None


@torch.library.custom_op("cute_deform::forward", mutates_args=(), device_types="cpu", schema=SCHEMA)
def forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step=64):
    """CPU kernel: the exact reference, in fp32 arithmetic (float64 would be ~2x slower for no user benefit)."""
    shape = check_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    trivial = _trivial_output(value, shape)
    if trivial is not None:
        return trivial
    return ms_deform_attn_reference(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        compute_dtype=torch.float32, out_dtype=value.dtype,
    )


_DEVICE_LEVEL_TABLES: "collections.OrderedDict" = collections.OrderedDict()


def _level_tables_on(device, spatial_shapes, level_start_index):
    """Level tables on value's device. Tables given on the CPU (already read by the checks) are copied
    once per distinct table and device and then reused: no copy per call, so a call can be captured in
    a CUDA graph after a warm-up call."""
    if spatial_shapes.device == device and level_start_index.device == device:
        return spatial_shapes, level_start_index
    if spatial_shapes.is_cpu and level_start_index.is_cpu:
        key = (str(device), tuple(spatial_shapes.reshape(-1).tolist()), tuple(level_start_index.tolist()))
        tables = _DEVICE_LEVEL_TABLES.get(key)
        if tables is None:
            tables = (spatial_shapes.to(device, torch.int64), level_start_index.to(device, torch.int64))
            _DEVICE_LEVEL_TABLES[key] = tables
            if len(_DEVICE_LEVEL_TABLES) > 64:
                _DEVICE_LEVEL_TABLES.popitem(last=False)
        _DEVICE_LEVEL_TABLES.move_to_end(key)
        return tables
    return spatial_shapes.to(device, non_blocking=True), level_start_index.to(device, non_blocking=True)


@forward.register_kernel("cuda")
def _forward_cuda(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step=64):
    # Value checks run only for CPU-resident spatial_shapes / level_start_index: no host sync here.
    shape = check_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    trivial = _trivial_output(value, shape)
    if trivial is not None:
        return trivial
    # The kernel takes every tensor on value's device.
    spatial_shapes, level_start_index = _level_tables_on(value.device, spatial_shapes, level_start_index)

    device_index = value.device.index if value.device.index is not None else torch.cuda.current_device()
    reason = kernel_unavailable_reason(device_index)
    if reason is None:
        from . import msda_fwd

        msda_fwd.check_supported(value, shape.num_levels, shape.num_points)
        return msda_fwd.msda_forward(
            value.contiguous(), spatial_shapes.contiguous(), level_start_index.contiguous(),
            sampling_locations.contiguous(), attention_weights.contiguous(),
        )
    _warn_slow_path(reason)
    return ms_deform_attn_grid_sample(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        compute_dtype=torch.float32, out_dtype=value.dtype,
    )


@forward.register_fake
def _forward_fake(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step=64):
    shape = check_inputs(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, check_values=False
    )
    return value.new_empty(shape.output_shape)


@functools.lru_cache(maxsize=None)
def kernel_unavailable_reason(device_index: int) -> str | None:
    """Why the CuTe kernel cannot run on cuda:device_index, or None when it can."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) != (9, 0):
        return f"the CuTe kernel targets sm_90 (Hopper) and cuda:{device_index} is sm_{major}{minor}"
    try:
        from . import msda_fwd
    except Exception as exc:  # a broken DSL install must not take the op down with it
        return f"cute_deform.msda_fwd failed to import ({type(exc).__name__}: {exc})"
    if not msda_fwd.available():
        return "cute_deform.msda_fwd.available() is False on this install"
    return None


_warned_slow_path = False


def _warn_slow_path(reason: str) -> None:
    global _warned_slow_path
    if _warned_slow_path:
        return
    _warned_slow_path = True
    warnings.warn(
        f"cute_deform.forward: {reason}; running the slower pure-PyTorch path "
        "(grid_sample, fp32 arithmetic, same semantics). This warning is shown once.",
        SlowPathWarning,
        stacklevel=3,
    )
