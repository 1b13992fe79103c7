"""Hopper (sm_90a) MSDA forward kernel in the CuTe DSL. Interface stub: the kernel lands in a later commit."""
from __future__ import annotations

import torch


def available() -> bool:
    """True when the CuTe kernel can run on this install (the DSL imports and the kernel exists)."""
    return False


def check_supported(value: torch.Tensor, num_levels: int, num_points: int) -> None:
    """Raise ValueError naming the argument when the kernel cannot run this configuration."""
    raise NotImplementedError


def msda_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """Run the kernel on validated CUDA tensors on an sm_90 device; returns (N, Lq, M*D) in value's dtype."""
    raise NotImplementedError
