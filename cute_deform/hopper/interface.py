"""Torch glue for the Hopper kernels: which kernel and configuration a call runs, its launch plan (kept per
static key and problem size), and the launch.

    msda_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    msda_forward_fused(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                       attention_logits)

take validated CUDA tensors on an sm_90 device (level tables on value's device) and return the
(N, Lq, M*D) output in value's dtype, launched on the current stream of value's device. Shapes the
tiled kernel takes (head rows of whole 16-byte vectors, at most 5 levels and 16 points) run it; every
other shape runs the generic kernel. The knobs each launch takes are launch_rules.py's; the compiled
kernels come from compile_cache.py.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

try:
    import cutlass  # noqa: F401

    _DSL_ERROR = None
except Exception as exc:  # the package works without the DSL, through the reference path
    _DSL_ERROR = exc

from .. import native
from .compile_cache import kernel_for
from .config import KernelConfig, tiled_kernel_fits
from .generic import GenericConfig
from .launch_rules import TUNING, choose_launch, strip_rows
from .order import ORDER_CELLS, ORDER_MAX_QUERIES, OrderConfig, order_grid

TORCH_TO_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def available() -> bool:
    """True when the CuTe kernels can run on this install (the DSL imports)."""
    return _DSL_ERROR is None


def check_supported(value: torch.Tensor) -> None:
    """Raise ValueError naming the argument where no Hopper kernel runs this input."""
    if value.dtype not in TORCH_TO_NAME:
        raise ValueError(f"cute_deform: value: dtype {value.dtype} is not supported; expected float32, float16 or bfloat16")


# ----------------------------------------------------------------------------------------------------
# Configurations and launch plans
# ----------------------------------------------------------------------------------------------------
def config_for(value, loc, attn, ref=None, **tuning):
    """The configuration a call runs: the tiled kernel where it takes the shape, else the generic one."""
    N, S, M, D = value.shape
    L, P = loc.shape[3], loc.shape[4]
    names = dict(value_dtype=TORCH_TO_NAME[value.dtype], loc_dtype=TORCH_TO_NAME[loc.dtype],
                 attn_dtype=TORCH_TO_NAME[attn.dtype], num_heads=M, num_levels=L, num_points=P, head_dim=D)
    if ref is not None:
        names.update(fused=True, ref_dtype=TORCH_TO_NAME[ref.dtype], ref_dims=ref.shape[-1])
    if tiled_kernel_fits(value.element_size(), D, L, P) and not tuning.pop("generic", False):
        return KernelConfig(**names, **{**TUNING, **tuning})
    return GenericConfig(**names)


_sm_props: dict = {}


def _device_props(index: int):
    """(SMs, L2 bytes, DRAM bytes a second or 0 where torch does not say) of a device."""
    props = _sm_props.get(index)
    if props is None:
        p = torch.cuda.get_device_properties(index)
        clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
        props = _sm_props[index] = (p.multi_processor_count, p.L2_cache_size, 2 * clock_khz * 1000 * bus_bits // 8)
    return props


@dataclass
class _LaunchPlan:
    """What a call needs besides the tensors, worked out once per static key. The kernel compiles (or
    loads) when first launched: a plan whose calls all switch to a variant never builds its own."""

    cfg: object
    sms: int
    l2_bytes: int
    dram_bytes_per_s: int
    tuning: dict
    variants: dict = dataclasses.field(default_factory=dict)
    # (N, Lq, S, window, reorder) -> (plan that runs, grid, rounds, whole): choose_launch's answer
    launches: dict = dataclasses.field(default_factory=dict)
    _fn: object = None

    @property
    def fn(self):
        if self._fn is None:
            self._fn = kernel_for(self.cfg)
        return self._fn

    def variant(self, value, loc, attn, ref, **changes) -> "_LaunchPlan":
        """The plan of the same call with other static knobs (cached on this plan)."""
        key = tuple(changes.items())
        plan = self.variants.get(key)
        if plan is None:
            plan = self.variants[key] = _plan_for(value, loc, attn, ref, {**self.tuning, **changes})
        return plan


_plans: dict = {}


def _plan_for(value, loc, attn, ref, tuning) -> _LaunchPlan:
    key = (value.dtype, loc.dtype, attn.dtype, None if ref is None else (ref.dtype, ref.shape[-1]),
           value.shape[2], value.shape[3], loc.shape[3], loc.shape[4], value.get_device(),
           tuple(sorted(tuning.items())) if tuning else ())
    plan = _plans.get(key)
    if plan is None:
        cfg = config_for(value, loc, attn, ref, **tuning)
        sms, l2, dram = _device_props(value.get_device())
        plan = _LaunchPlan(cfg, sms, l2, dram, dict(tuning))
        _plans[key] = plan
    return plan


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _as_table(t: torch.Tensor, device) -> torch.Tensor:
    if t.dtype == torch.int64 and t.device == device and t.is_contiguous():
        return t
    return t.to(device=device, dtype=torch.int64).contiguous()


def msda_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, host_levels=None,
                 **tuning):
    """The op's forward on validated CUDA tensors of an sm_90 device. host_levels: the level table as lists ((H, W)
    pairs, first pixels) where the caller holds it on the host, else None (launch_rules.choose_launch's levels)."""
    return _on_device(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, None, tuning,
                      host_levels)


def msda_forward_fused(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                       attention_logits, host_levels=None, **tuning):
    """Deformable DETR's sampling (locations from reference points and offsets, softmax of the logits)
    and the forward in one kernel, on validated CUDA tensors of an sm_90 device. host_levels: the level table
    as lists ((H, W) pairs, first pixels) where the caller holds it on the host, else None (_host_strips)."""
    return _on_device(value, spatial_shapes, level_start_index, sampling_offsets, attention_logits, reference_points,
                      tuning, host_levels)


@functools.cache
def _one_device() -> bool:
    return torch.cuda.device_count() == 1


def _on_device(value, shapes, starts, loc, attn, ref, tuning, host_levels=None):
    # With one visible GPU it is always current (current_device() is ~2 us of a call).
    if _one_device():
        return _launch(value, shapes, starts, loc, attn, ref, tuning, host_levels)
    index = value.get_device()
    if index == torch.cuda.current_device():
        return _launch(value, shapes, starts, loc, attn, ref, tuning, host_levels)
    with torch.cuda.device(index):
        return _launch(value, shapes, starts, loc, attn, ref, tuning, host_levels)


def query_order(loc: torch.Tensor, ref: torch.Tensor | None, shapes: torch.Tensor) -> torch.Tensor:
    """(N, Lq) int64: each image's queries in raster order of cells of their positions, on the device
    (order.py: bands of y by columns of x, about 6 x 2.5 pixels of the finest level of `shapes`, the (L, 2)
    level table). The position is the reference point's (fused) or the first sample's of head 0 at level 0.
    Any order is correct (the kernel computes each query once); a spatial one lets the queries of a tile
    share footprints. NaN positions sort last, positions outside [0, 1] at the nearest edge. On a GPU the
    order kernel counts queries into cells (the order inside a cell is arbitrary); elsewhere, and for images
    of more than ORDER_MAX_QUERIES queries, a sort of (image, cell) keys gives the same cells in the same
    order."""
    positions = ref if ref is not None else loc
    N, Lq = positions.shape[:2]
    if positions.is_cuda and Lq <= ORDER_MAX_QUERIES and positions.is_contiguous() and available():
        order = torch.empty((N, Lq), dtype=torch.int64, device=positions.device)
        if N and Lq:
            cells = torch.empty((N, Lq), dtype=torch.int32, device=positions.device)
            kernel_for(OrderConfig(TORCH_TO_NAME[positions.dtype]))(positions.view(N, Lq, -1), shapes, cells, order)
        return order
    xy = ref[:, :, 0, :2] if ref is not None else loc[:, :, 0, 0, 0, :]
    # One flat sort of (image, cell) keys: torch's per-row sort of (N, Lq) was 200 us on seed-b48 (H100).
    cell_bits = ORDER_CELLS.bit_length() - 1
    dtype = torch.int64 if N >= 1 << (31 - cell_bits) else torch.int32
    bands, columns = (v.to(xy.device, dtype) for v in order_grid(shapes))
    unit = xy.float().nan_to_num(nan=1.0).clamp_(0.0, 1.0)
    band = torch.minimum(unit[..., 1].mul(bands).to(dtype), bands - 1)
    key = band.mul_(columns).add_(torch.minimum(unit[..., 0].mul(columns).to(dtype), columns - 1))
    key.add_(torch.arange(0, N << cell_bits, 1 << cell_bits, device=xy.device, dtype=dtype).view(N, 1))
    first = torch.arange(0, N * Lq, Lq, device=xy.device, dtype=torch.int64).view(N, 1)
    return torch.argsort(key.view(-1)).view(N, Lq).sub_(first)


_placeholders: dict = {}
_NOTHING_FIXED = frozenset()


def _placeholder(device, shape) -> torch.Tensor:
    """A kernel argument the compiled configuration never reads (the order table without permuted, the
    tensor-map workspace without TMA boxes): one small tensor per device and shape, not an
    allocation per call."""
    key = (device, shape)
    t = _placeholders.get(key)
    if t is None:
        t = _placeholders[key] = torch.zeros(shape, dtype=torch.int64, device=device)
    return t


def _host_strips(cfg, host_levels, Lq: int):
    """Whether the kernel of cfg takes the first level's tiles in strips (launch_rules.strip_rows at its own tile),
    read from a level table the caller holds on the host; None where it does not (a table on the device is not
    read: no host sync)."""
    return None if host_levels is None else strip_rows(*host_levels, Lq, cfg.queries_per_tile)


def _host_table(host_levels):
    """A level table the caller holds on the host ((H, W) pairs, first pixels), as a key of the plan's launches: it
    decides the strips and the staging (choose_launch); None where the table is on the device."""
    return None if host_levels is None else (tuple(map(tuple, host_levels[0])), tuple(host_levels[1]))


def _launch(value, shapes, starts, loc, attn, ref, tuning, host_levels=None):
    N, S, M, D = value.shape
    Lq = loc.shape[1]
    window, reorder = None, "auto"
    if tuning:
        tuning = dict(tuning)
        window = tuning.pop("window_fraction", window)
        reorder = tuning.pop("reorder_queries", reorder)
    plan = _plan_for(value, loc, attn, ref, tuning)
    device = value.device
    out = torch.empty((N, Lq, M * D), dtype=value.dtype, device=device)
    if out.numel() == 0:
        return out
    cfg = plan.cfg
    given = (value, loc, attn, ref)
    shapes, starts = _as_table(shapes, device), _as_table(starts, device)
    value, loc, attn = _aligned(value), _aligned(loc), _aligned(attn)
    third = _aligned(ref) if ref is not None else loc
    # The C++ launcher (cute_deform.native) takes over launches of the default tuning on dense inputs
    # (others would come back here every call).
    handover = (native.LOADED and not tuning and given[0] is value and given[1] is loc and given[2] is attn
                and (ref is None or given[3] is third))
    if isinstance(cfg, GenericConfig):
        grid = plan.sms * cfg.ctas_per_sm
        plan.fn(value, shapes, starts, loc, attn, third, out, grid)
        if handover:
            native.register(value, loc, attn, ref, plan.fn, True, grid, 0, 0, _placeholder(device, (1, 1)),
                            _placeholder(device, (1, 1, 16)))
        return out
    host = _host_table(host_levels)
    size = (N, Lq, S, window, reorder, host)
    launch = plan.launches.get(size)
    if launch is None:
        changes, grid, schedule = choose_launch(cfg, N, Lq, S, plan.sms, plan.l2_bytes, window, reorder,
                                                frozenset(tuning) if tuning else _NOTHING_FIXED,
                                                _host_strips(cfg, host, Lq), plan.dram_bytes_per_s,
                                                None if host is None else host[0])
        runs = plan.variant(value, loc, attn, ref, **changes) if changes else plan
        if len(plan.launches) >= 4096:  # sizes that keep changing must not grow it without bound
            plan.launches.clear()
        launch = plan.launches[size] = (runs, grid, schedule.rounds, int(schedule.whole))
    runs, grid, rounds, whole = launch
    # The kernel's own configuration says whether it reads the table (a caller may ask for permuted=True).
    order = query_order(loc, ref, shapes) if runs.cfg.permuted else _placeholder(device, (1, 1))
    if runs.cfg.fine_gather == "tma":
        maps = torch.empty((grid, runs.cfg.map_slots, 16), dtype=torch.int64, device=device)
    else:
        maps = _placeholder(device, (1, 1, 16))
    runs.fn(value, shapes, starts, loc, attn, third, order, out, maps, grid, rounds, whole)
    if handover and not runs.cfg.permuted and runs.cfg.fine_gather != "tma":
        native.register(value, loc, attn, ref, runs.fn, False, grid, rounds, whole, order, maps)
    return out
