"""`torch.ops.cute_deform.forward`: schema, CPU and CUDA kernels, fake implementation.

    forward(Tensor value, Tensor spatial_shapes, Tensor level_start_index,
            Tensor sampling_locations, Tensor attention_weights, int im2col_step=64) -> Tensor

- CPU: `cute_deform.cpu.forward` (a weighted embedding_bag per chunk of queries, fp32 arithmetic,
  the reference's exact rules for skipped samples).
- CUDA on sm_90 with the CuTe kernels available: `cute_deform.hopper.interface.msda_forward`.
- Any other CUDA device (or sm_90 without the kernel): a slower pure-PyTorch path
  (`ms_deform_attn_grid_sample`, fp32 arithmetic, same semantics), with a one-time SlowPathWarning.

value fp32/fp16/bf16, locations and weights fp32/fp16/bf16 in any combination, output in value's
dtype. im2col_step is accepted for drop-in compatibility and ignored: any batch size works.
The op is forward only; backpropagating through it raises.

Registered through public `torch.library` calls only: `Library.define` / `Library.impl` for the CPU
and CUDA kernels, `register_fake`, and `register_autograd` with a backward that raises. Where the C++
launcher loads (`cute_deform.native`), it holds the CUDA and Autograd kernels instead, and the Python
CUDA kernel becomes `cute_deform::_forward_python`, which it calls for what it cannot launch itself.
"""
from __future__ import annotations

import collections
import functools
import warnings

import torch

from . import cpu, native
from ._checks import FORWARD_ONLY, OP_NAMES, validate
from .reference import ms_deform_attn_grid_sample

SCHEMA = (
    "(Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_locations, "
    "Tensor attention_weights, int im2col_step=64) -> Tensor"
)


class SlowPathWarning(UserWarning):
    """The op ran its pure-PyTorch path on a CUDA device because the Hopper kernel cannot run there."""


# torch.library's define/impl rather than torch.library.custom_op: custom_op wraps every call in
# more layers of Python (a per-device wrapper, an aliasing check), ~8 us more host time a call
# (scripts/overhead.py op-layer --routes).
_lib = torch.library.Library("cute_deform", "FRAGMENT")
_lib.define("forward" + SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))
forward = torch.ops.cute_deform.forward.default


def _forward_cpu(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step=64):
    """CPU kernel: cute_deform.cpu.forward, fp32 arithmetic."""
    (N, _, M, D, Lq, L, P), shapes, starts = validate(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights
    )
    if not (N and Lq and M and D):  # nothing to compute
        return value.new_empty((N, Lq, M * D))
    if not (L and P):  # every output is an empty sum
        return value.new_zeros((N, Lq, M * D))
    # On the CPU the checks read both level tables (shapes and starts are their values).
    levels = [(height, width, start) for (height, width), start in zip(shapes, starts)]
    return cpu.forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, levels)


_DEVICE_LEVEL_TABLES: "collections.OrderedDict" = collections.OrderedDict()


def _host_table(spatial_shapes, level_start_index, shapes=None, starts=None):
    """A level table on the CPU as lists ((H, W) pairs, first pixels): what the checks already read, or read now."""
    return (shapes if shapes is not None else spatial_shapes.tolist(),
            starts if starts is not None else level_start_index.tolist())


def _level_tables_on(device, spatial_shapes, level_start_index, shapes=None, starts=None):
    """Level tables on value's device. Tables given on the CPU (already read by the checks: pass what
    they read as shapes / starts, lists as .tolist() gives them) are copied once per distinct table and
    device and then reused: no copy per call, so a call can be captured in a CUDA graph after a
    warm-up call."""
    if spatial_shapes.device == device and level_start_index.device == device:
        return spatial_shapes, level_start_index
    if spatial_shapes.is_cpu and level_start_index.is_cpu:
        shapes, starts = _host_table(spatial_shapes, level_start_index, shapes, starts)
        key = (device, tuple(map(tuple, shapes)), tuple(starts))
        tables = _DEVICE_LEVEL_TABLES.get(key)
        if tables is None:
            tables = (spatial_shapes.to(device, torch.int64), level_start_index.to(device, torch.int64))
            _DEVICE_LEVEL_TABLES[key] = tables
            if len(_DEVICE_LEVEL_TABLES) > 64:
                _DEVICE_LEVEL_TABLES.popitem(last=False)
        else:
            _DEVICE_LEVEL_TABLES.move_to_end(key)
        return tables
    return spatial_shapes.to(device, non_blocking=True), level_start_index.to(device, non_blocking=True)


def _tables_for_kernel(device, spatial_shapes, level_start_index, shapes=None, starts=None):
    """(spatial_shapes, level_start_index) on value's device for the kernel (_level_tables_on), and the level table as
    lists ((H, W) pairs, first pixels) where the caller holds it on the host, which the launch may read, else None.
    shapes / starts: what the checks read of a CPU table, or None."""
    host = None
    if spatial_shapes.is_cpu and level_start_index.is_cpu:
        host = _host_table(spatial_shapes, level_start_index, shapes, starts)
        shapes, starts = host
    if spatial_shapes.is_cpu or level_start_index.is_cpu:
        spatial_shapes, level_start_index = _level_tables_on(device, spatial_shapes, level_start_index, shapes, starts)
    return spatial_shapes, level_start_index, host


_hopper = None  # cute_deform.hopper.interface once imported (a function-level import costs ~0.2 us a call)


def _forward_cuda(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step=64):
    # Value checks run only for CPU-resident spatial_shapes / level_start_index: no host sync here.
    (N, _, M, D, Lq, L, P), shapes, starts = validate(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights
    )
    if not (N and Lq and M and D):  # nothing to compute: no launch
        return value.new_empty((N, Lq, M * D))
    if not (L and P):  # every output is an empty sum
        return value.new_zeros((N, Lq, M * D))
    # The kernel takes every tensor on value's device (value is not on the CPU here).
    spatial_shapes, level_start_index, host_levels = _tables_for_kernel(
        value.device, spatial_shapes, level_start_index, shapes, starts
    )

    device_index = value.get_device()
    reason = kernel_unavailable_reason(device_index if device_index >= 0 else torch.cuda.current_device())
    if reason is None:
        global _hopper
        hopper = _hopper
        if hopper is None:
            from .hopper import interface as hopper

            _hopper = hopper
        # msda_forward makes every input contiguous (and 16-byte aligned) itself.
        return hopper.msda_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                                   host_levels=host_levels)
    _warn_slow_path(reason)
    return ms_deform_attn_grid_sample(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        compute_dtype=torch.float32, out_dtype=value.dtype,
    )


def _forward_fake(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step=64):
    """Fake implementation (torch.compile's fake tensors) and meta kernel (meta tensors).

    A level table that is a real CPU tensor (value on the meta device) is checked against value as the
    CPU and CUDA kernels check it. A fake one (a FakeTensor, or a functional wrapper of one, while
    torch.compile traces) has no values to read: those are checked when the compiled graph runs."""
    real_tables = type(spatial_shapes) is torch.Tensor and type(level_start_index) is torch.Tensor
    (N, _, M, D, Lq, _, _), _, _ = validate(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, check_values=real_tables
    )
    return value.new_empty((N, Lq, M * D))


def _forward_other_device(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                          im2col_step=64):
    """What the dispatcher runs where no kernel above applies: tensors on another backend (MPS, XPU, ...)
    or of another layout (sparse), or no tensor at all (every tensor argument None). Bad arguments get
    their usual named error."""
    tensors = (value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    validate(*tensors, check_values=False)
    for name, tensor in zip(OP_NAMES, tensors):
        if tensor.layout != torch.strided:
            raise NotImplementedError(f"cute_deform: {name}: expected a dense (strided) tensor, got layout {tensor.layout}")
    raise NotImplementedError(
        f"cute_deform: value: expected a tensor on the CPU or a CUDA device, got device {value.device}"
    )


def _backward(ctx, grad_output):
    raise RuntimeError(FORWARD_ONLY)


_lib.impl("forward", _forward_cpu, "CPU")
_lib.impl("forward", _forward_other_device, "CompositeExplicitAutograd")
torch.library.register_fake("cute_deform::forward", _forward_fake, lib=_lib)
if native.load():
    # The C++ launcher (cute_deform/native.py) holds the CUDA and Autograd kernels; it runs the launches
    # Python made before and hands every other call to this Python kernel.
    _lib.define("_forward_python" + SCHEMA)
    _lib.impl("_forward_python", _forward_cuda, "CUDA")
else:
    _lib.impl("forward", _forward_cuda, "CUDA")
    # With an input that requires grad, the output gets a grad_fn whose backward raises (_backward);
    # otherwise torch's autograd kernel passes the call down to the CPU / CUDA kernel.
    torch.library.register_autograd("cute_deform::forward", _backward, lib=_lib)


@functools.lru_cache(maxsize=None)
def kernel_unavailable_reason(device_index: int) -> str | None:
    """Why the CuTe kernel cannot run on cuda:device_index, or None when it can."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) != (9, 0):
        return f"the CuTe kernel targets sm_90 (Hopper) and cuda:{device_index} is sm_{major}{minor}"
    try:
        from .hopper import interface
    except Exception as exc:  # a broken DSL install must not take the op down with it
        return f"cute_deform.hopper failed to import ({type(exc).__name__}: {exc})"
    if not interface.available():
        return "cute_deform.hopper.interface.available() is False on this install"
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
