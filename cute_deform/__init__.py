"""cute_deform: Multi-Scale Deformable Attention forward for NVIDIA Hopper, as `torch.ops.cute_deform.forward`
and `torch.ops.cute_deform.forward_fused` (locations and softmax inside the op)."""
from . import op  # noqa: F401  (registers torch.ops.cute_deform.forward)
from . import fused  # noqa: F401  (registers torch.ops.cute_deform.forward_fused)
from . import nn
from .fused import ms_deform_attn_fused
from .functional import MSDeformAttnFunction, ms_deform_attn
from .op import SlowPathWarning
from .reference import fused_reference, ms_deform_attn_grid_sample, ms_deform_attn_reference

__version__ = "0.1.0"

__all__ = [
    "MSDeformAttnFunction",
    "SlowPathWarning",
    "fused_reference",
    "ms_deform_attn",
    "ms_deform_attn_fused",
    "ms_deform_attn_grid_sample",
    "ms_deform_attn_reference",
    "nn",
]
