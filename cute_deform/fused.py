"""`torch.ops.cute_deform.forward_fused`: MSDA from reference points, raw offsets and raw logits.

    forward_fused(Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor reference_points,
                  Tensor sampling_offsets, Tensor attention_logits) -> Tensor

What Deformable DETR's module computes between its Linear layers and output_proj, in one op:

- locations: with reference_points (N, Lq, L, 2) as (x, y), `ref + offset / (W_l, H_l)`; with
  reference_points (N, Lq, L, 4) as (cx, cy, w, h), `ref[:2] + offset / P * ref[2:] * 0.5`;
- weights: a softmax over the L*P samples of each (query, head), in fp32 (a NaN logit makes that
  query and head's weights NaN, as torch's softmax does);
- then `torch.ops.cute_deform.forward`'s rules (outside and NaN samples add 0).

sampling_offsets is the `sampling_offsets` Linear's output viewed as (N, Lq, M, L, P, 2),
attention_logits the `attention_weights` Linear's output viewed as (N, Lq, M, L, P); any strides.
Float inputs fp32/fp16/bf16 in any mix, arithmetic fp32, output (N, Lq, M*D) in value's dtype.

- CPU: locations and softmax with torch in fp32, then the exact reference in fp32.
- CUDA with the Hopper kernel: `cute_deform.hopper.interface.msda_forward_fused`, which computes
  locations and softmax inside the kernel (no location or weight tensor, no host sync).
- Any other CUDA device (or Hopper before that module is installed): locations and softmax with
  torch in fp32, then `torch.ops.cute_deform.forward` (its own slow path there), with the op's
  one-time SlowPathWarning.

Forward only: backpropagating through the op raises.
"""
from __future__ import annotations

import torch

from . import native
from . import op as _op
from ._checks import FUSED_FORWARD_ONLY, FUSED_NAMES, _check_tensor, validate_fused
from .reference import fused_sampling_inputs, ms_deform_attn_reference

SCHEMA = (
    "(Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor reference_points, "
    "Tensor sampling_offsets, Tensor attention_logits) -> Tensor"
)

_lib = torch.library.Library("cute_deform", "FRAGMENT")
_lib.define("forward_fused" + SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))
forward_fused = torch.ops.cute_deform.forward_fused.default


def _forward_fused_cpu(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                       attention_logits):
    (N, _, M, D, Lq, L, P), _, _ = validate_fused(
        value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits
    )
    if not (N and Lq and M and D):  # nothing to compute
        return value.new_empty((N, Lq, M * D))
    if not (L and P):  # every output is an empty sum
        return value.new_zeros((N, Lq, M * D))
    locations, weights = fused_sampling_inputs(
        spatial_shapes, reference_points, sampling_offsets, attention_logits, torch.float32
    )
    return ms_deform_attn_reference(
        value, spatial_shapes, level_start_index, locations, weights,
        compute_dtype=torch.float32, out_dtype=value.dtype,
    )


_hopper_interface = None  # cute_deform.hopper.interface once imported
_hopper_import_error: str | None = None


def _hopper_fused_unavailable_reason() -> str | None:
    """Why the fused Hopper entry point cannot be imported, or None when it can (tried once)."""
    global _hopper_interface, _hopper_import_error
    if _hopper_interface is None and _hopper_import_error is None:
        try:
            from .hopper import interface
        except Exception as exc:  # not installed yet, or a broken DSL install
            _hopper_import_error = f"cute_deform.hopper.interface failed to import ({type(exc).__name__}: {exc})"
        else:
            _hopper_interface = interface
    return _hopper_import_error


def _forward_fused_cuda(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                        attention_logits):
    # The level table is read only where it lives on the CPU: no host sync.
    (N, _, M, D, Lq, L, P), shapes, starts = validate_fused(
        value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits
    )
    if not (N and Lq and M and D):  # nothing to compute: no launch
        return value.new_empty((N, Lq, M * D))
    if not (L and P):  # every output is an empty sum
        return value.new_zeros((N, Lq, M * D))
    # Cached device copies per distinct table: no copy per call, so CUDA graphs can capture it.
    spatial_shapes, level_start_index, host_table = _op._tables_for_kernel(
        value.device, spatial_shapes, level_start_index, shapes, starts
    )

    device_index = value.get_device()
    reason = _op.kernel_unavailable_reason(device_index if device_index >= 0 else torch.cuda.current_device())
    if reason is None:
        reason = _hopper_fused_unavailable_reason()
    if reason is None:
        return _hopper_interface.msda_forward_fused(
            value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits,
            host_levels=host_table,
        )
    _op._warn_slow_path(reason)
    # Locations and softmax with torch ops, then the forward op (its slow path here).
    locations, weights = fused_sampling_inputs(
        spatial_shapes, reference_points, sampling_offsets, attention_logits, torch.float32
    )
    return _op.forward(value, spatial_shapes, level_start_index, locations, weights)


def _forward_fused_fake(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                        attention_logits):
    (N, _, M, D, Lq, _, _), _, _ = validate_fused(
        value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits,
        check_values=False,
    )
    return value.new_empty((N, Lq, M * D))


def _refuse_backward(ctx, grad):
    raise RuntimeError(FUSED_FORWARD_ONLY)


_lib.impl("forward_fused", _forward_fused_cpu, "CPU")
torch.library.register_fake("cute_deform::forward_fused", _forward_fused_fake, lib=_lib)
if native.LOADED:  # the C++ launcher's CUDA and Autograd kernels call this one for what they cannot launch
    _lib.define("_forward_fused_python" + SCHEMA)
    _lib.impl("_forward_fused_python", _forward_fused_cuda, "CUDA")
else:
    _lib.impl("forward_fused", _forward_fused_cuda, "CUDA")
    torch.library.register_autograd("cute_deform::forward_fused", _refuse_backward, lib=_lib)


def ms_deform_attn_fused(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    reference_points: torch.Tensor,
    sampling_offsets: torch.Tensor,
    attention_logits: torch.Tensor,
) -> torch.Tensor:
    """torch.ops.cute_deform.forward_fused, where an argument that is not a tensor (None, a list) gets a
    TypeError naming it instead of the dispatcher's RuntimeError."""
    args = (value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits)
    for arg, name in zip(args, FUSED_NAMES):
        _check_tensor(arg, name)
    return forward_fused(*args)
