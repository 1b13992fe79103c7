"""cute_deform: Multi-Scale Deformable Attention forward for NVIDIA Hopper, as `torch.ops.cute_deform.forward`."""
from . import op  # noqa: F401  (registers torch.ops.cute_deform.forward)
from . import nn
from .functional import MSDeformAttnFunction, ms_deform_attn
from .op import SlowPathWarning
from .reference import ms_deform_attn_grid_sample, ms_deform_attn_reference

__version__ = "0.1.0"

__all__ = [
    "MSDeformAttnFunction",
    "SlowPathWarning",
    "ms_deform_attn",
    "ms_deform_attn_grid_sample",
    "ms_deform_attn_reference",
    "nn",
]
