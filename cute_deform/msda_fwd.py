"""Multi-scale deformable attention forward for Hopper (sm_90a), written in the CuTe DSL.

One CTA works on tiles of G queries of one (image, head). A producer warp turns each sampling
location into the top-left pixel of its bilinear footprint and loads the footprint (2x2 pixels x D
channels) with one TMA box into a ring of shared-memory stages; the tensor map's out-of-bounds zero
fill is the zero padding of the original kernel. Four consumer warps wait on each stage, weight the
four corners with the bilinear and attention weights, and accumulate every level and point of a
query in fp32 registers; each output row is written once.

Level sizes may live on the GPU, so the host never reads them: each CTA rewrites a template tensor
map per level on the device (tensormap.replace) into its own slot of a small global workspace.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

try:
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    from cutlass.cute.nvgpu import cpasync
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from cutlass.experimental import primitives as prims
    from cutlass.experimental.cuda import tensor_map
    from cutlass.tensor_utils import TensorMapManager, TensorMapUpdateMode

    _DSL_ERROR = None
except Exception as exc:  # the package works without the DSL, through the reference path
    _DSL_ERROR = exc

CONSUMER_WARPS = 4
TENSORMAP_BYTES = 128
SUPPORTED_HEAD_DIMS = (8, 16, 32, 64, 128)
MAX_LEVELS = 5
MAX_POINTS = 16

_TORCH_TO_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def available() -> bool:
    """True when the CuTe kernel can run on this install (the DSL imports)."""
    return _DSL_ERROR is None


def check_supported(value: torch.Tensor, num_levels: int, num_points: int) -> None:
    """Raise ValueError naming the argument when the kernel cannot run this configuration."""
    if value.dtype not in _TORCH_TO_NAME:
        raise ValueError(f"value: dtype {value.dtype} is not supported; expected float32, float16 or bfloat16")
    head_dim = value.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS or head_dim * value.element_size() < 16:
        raise ValueError(
            f"value: head dim D={head_dim} with {value.dtype} is not supported by the Hopper kernel; "
            f"expected D in {SUPPORTED_HEAD_DIMS} with D*itemsize >= 16 bytes"
        )
    if not 1 <= num_levels <= MAX_LEVELS:
        raise ValueError(f"spatial_shapes: {num_levels} levels; the Hopper kernel supports 1 to {MAX_LEVELS}")
    if not 1 <= num_points <= MAX_POINTS:
        raise ValueError(f"sampling_locations: {num_points} points; the Hopper kernel supports 1 to {MAX_POINTS}")


@dataclass(frozen=True)
class KernelConfig:
    """Static parameters: everything the compiled kernel depends on. Never sizes N, Lq, S or H, W."""

    value_dtype: str
    loc_dtype: str
    attn_dtype: str
    num_heads: int
    num_levels: int
    num_points: int
    head_dim: int
    num_stages: int = 6

    @property
    def itemsize(self) -> int:
        return 4 if self.value_dtype == "float32" else 2

    @property
    def channels_per_thread(self) -> int:  # one 16-byte vector of value per thread and corner
        return 16 // self.itemsize

    @property
    def threads_per_query(self) -> int:
        return self.head_dim // self.channels_per_thread

    @property
    def queries_per_tile(self) -> int:
        return CONSUMER_WARPS * 32 // self.threads_per_query

    @property
    def box_bytes(self) -> int:
        return 4 * self.head_dim * self.itemsize


def _dsl_dtype(name: str):
    return {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[name]


class MSDAForward:
    """The kernel for one KernelConfig: producer warp + CONSUMER_WARPS consumer warps per CTA."""

    def __init__(self, config: KernelConfig):
        self.cfg = config
        self.value_dtype = _dsl_dtype(config.value_dtype)
        self.loc_dtype = _dsl_dtype(config.loc_dtype)
        self.attn_dtype = _dsl_dtype(config.attn_dtype)
        self.M, self.L, self.P, self.D = config.num_heads, config.num_levels, config.num_points, config.head_dim
        self.C = config.channels_per_thread
        self.T = config.threads_per_query
        self.G = config.queries_per_tile
        self.stages = config.num_stages
        self.boxes_per_lane = (self.G + 31) // 32
        self.producer_warp = CONSUMER_WARPS
        self.threads = (CONSUMER_WARPS + 1) * 32

    @cute.jit
    def __call__(
        self,
        mValue: cute.Tensor,  # (N, S, M, D)
        mShapes: cute.Tensor,  # (L, 2) int64, (H, W)
        mStarts: cute.Tensor,  # (L,) int64
        mLoc: cute.Tensor,  # (N, Lq, M, L, P, 2)
        mAttn: cute.Tensor,  # (N, Lq, M, L, P)
        mOut: cute.Tensor,  # (N, Lq, M, D)
        mDesc: cute.Tensor,  # (grid, L, 16) int64: per-CTA tensor-map slots
        grid_size: cutlass.Int32,
        stream,
    ):
        N, S = mValue.shape[0], mValue.shape[1]
        M, D, e = self.M, self.D, self.cfg.itemsize
        # Template map over one level viewed as (D, M, W, H, N), innermost first, box (D, 1, 2, 2, 1).
        # W, H, the H stride and the base address are placeholders: each CTA writes the real ones
        # of every level on the device, so the host never reads spatial_shapes.
        template = tensor_map.create_tensor_map_tiled(
            global_address=mValue.iterator.toint(),
            dtype=self.value_dtype,
            global_dims=[D, M, 2, 2, N],
            global_strides=[D * e // 16, M * D * e // 16, 2 * M * D * e // 16, S * (M * D * e // 16)],
            box_dims=[D, 1, 2, 2, 1],
        )

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[cutlass.Int64, self.stages]
            empty: cute.struct.MemRange[cutlass.Int64, self.stages]
            desc: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 16 * self.L], 128]
            boxes: cute.struct.Align[
                cute.struct.MemRange[self.value_dtype, self.stages * self.G * 4 * D], 128
            ]

        self.shared_storage = SharedStorage
        Lq = mLoc.shape[1]
        num_tiles = N * M * ((Lq + self.G - 1) // self.G)
        self.kernel(template, mValue, mShapes, mStarts, mLoc, mAttn, mOut, mDesc, num_tiles).launch(
            grid=[grid_size, 1, 1],
            block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        template: cutlass.GridConstant[tensor_map.TensorMap],
        mValue: cute.Tensor,
        mShapes: cute.Tensor,
        mStarts: cute.Tensor,
        mLoc: cute.Tensor,
        mAttn: cute.Tensor,
        mOut: cute.Tensor,
        mDesc: cute.Tensor,
        num_tiles: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)

        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.full.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_WARPS),
            tx_count=self.G * self.cfg.box_bytes,
        )
        sBoxes = storage.boxes.get_tensor(cute.make_layout((self.G * 4 * self.D, self.stages)))

        if warp == self.producer_warp:
            self.producer(template, mValue, mShapes, mStarts, mLoc, mDesc, storage, pipe, sBoxes, bidx, num_tiles)
        else:
            self.consumer(mShapes, mLoc, mAttn, mOut, pipe, sBoxes, tidx, bidx, num_tiles)

    @cute.jit
    def tile_coords(self, tile: cutlass.Int32, Lq: cutlass.Int32):
        """Tile -> (image, head, first query). Query blocks vary fastest so that concurrent tiles share a head."""
        blocks = (Lq + self.G - 1) // self.G
        qb = tile % blocks
        nm = tile // blocks
        return nm // self.M, nm % self.M, qb * self.G

    @cute.jit
    def level_size(self, mShapes: cute.Tensor, level: int):
        return cutlass.Int32(mShapes[level, 0]), cutlass.Int32(mShapes[level, 1])

    @cute.jit
    def producer(self, template, mValue, mShapes, mStarts, mLoc, mDesc, storage, pipe, sBoxes, bidx, num_tiles):
        lane = cute.arch.lane_idx()
        Lq = mLoc.shape[1]
        M, D, e = self.M, self.D, self.cfg.itemsize
        manager = TensorMapManager(TensorMapUpdateMode.SMEM, TENSORMAP_BYTES)
        template_words = cutlass.Pointer(template.get_ptr(), dtype=cutlass.Int64)
        sDesc = storage.desc.get_tensor(cute.make_layout((16, self.L)))

        # Per-level tensor maps: copy the template to shared memory, patch it, publish it to this
        # CTA's global slot with a proxy fence (the TMA unit reads maps through the tensormap proxy).
        for level in cutlass.range_constexpr(self.L):
            H, W = self.level_size(mShapes, level)
            start = cutlass.Int64(mStarts[level])
            if lane < 16:
                sDesc[lane, level] = (template_words + lane).load()
            cute.arch.sync_warp()
            smem_map = cutlass.Pointer(sDesc[None, level].iterator.llvm_ptr, dtype=cutlass.Int64)
            with cute.arch.elect_one():
                prims.tensormap_replace(prims.TensormapField.GLOBAL_ADDRESS, smem_map,
                                        new_value=mValue.iterator.toint() + start * (M * D * e))
                prims.tensormap_replace(prims.TensormapField.GLOBAL_DIM, smem_map, new_value=W, ord=2)
                prims.tensormap_replace(prims.TensormapField.GLOBAL_DIM, smem_map, new_value=H, ord=3)
                prims.tensormap_replace(prims.TensormapField.GLOBAL_STRIDE, smem_map,
                                        new_value=cutlass.Int64(W) * (M * D * e), ord=2)
            cute.arch.sync_warp()
            cpasync.cp_fence_tma_desc_release(
                manager.get_tensormap_ptr(mDesc[bidx, level, None].iterator), sDesc[None, level].iterator
            )
        for level in cutlass.range_constexpr(self.L):
            cpasync.fence_tma_desc_acquire(manager.get_tensormap_ptr(mDesc[bidx, level, None].iterator))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        tile = bidx
        while tile < num_tiles:
            n, m, q0 = self.tile_coords(tile, Lq)
            for level in cutlass.range_constexpr(self.L):
                H, W = self.level_size(mShapes, level)
                desc = manager.get_tensormap_ptr(mDesc[bidx, level, None].iterator, cutlass.AddressSpace.generic)
                # One vector load of all points of this level per query, so that the location latency
                # is paid once per level, not once per stage.
                corners = []
                for j in cutlass.range_constexpr(self.boxes_per_lane):
                    q = q0 + lane + 32 * j
                    locs = self.level_locations(mLoc, n, cutlass.min(q, Lq - 1), m, level)
                    for point in cutlass.range_constexpr(self.P):
                        _, x0, y0 = self.footprint(locs[2 * point], locs[2 * point + 1], H, W)
                        outside = q >= Lq
                        corners.append((cutlass.select_(outside, -2, x0), cutlass.select_(outside, -2, y0)))
                for point in cutlass.range_constexpr(self.P):
                    pipe.producer_acquire(state)
                    bar = pipe.producer_get_barrier(state)
                    for j in cutlass.range_constexpr(self.boxes_per_lane):
                        slot = lane + 32 * j
                        if slot < self.G:
                            x0, y0 = corners[j * self.P + point]
                            dst = sBoxes[None, state.index].iterator + slot * (4 * D)
                            prims.cp_async_bulk_tensor_shared_cta_global(
                                dst, desc, [cutlass.Int32(0), m, x0, y0, n], bar
                            )
                    state.advance()
            tile += cute.arch.grid_dim()[0]
        pipe.producer_tail(state)

    @cute.jit
    def level_locations(self, mLoc, n, q, m, level: int):
        """All (x, y) of one query, head and level as a register vector of 2P fp32."""
        src = cute.make_tensor(mLoc[n, q, m, level, None, None].iterator, cute.make_layout(2 * self.P))
        return src.load().to(cutlass.Float32)

    @cute.jit
    def footprint(self, x, y, H, W):
        """Sample position in pixels and the top-left corner of its 2x2 footprint.

        A sample outside (-1, H) x (-1, W), or NaN, gets the corner (-2, -2): a box wholly outside the
        level, which TMA fills with zeros; its weights are zeroed too, so nothing leaks in."""
        w = x * cutlass.Float32(W) - 0.5
        h = y * cutlass.Float32(H) - 0.5
        inside = h > -1.0 and h < cutlass.Float32(H) and w > -1.0 and w < cutlass.Float32(W)
        x0 = cutlass.Int32(-2)
        y0 = cutlass.Int32(-2)
        if inside:
            x0 = cutlass.Int32(cute.math.floor(w))
            y0 = cutlass.Int32(cute.math.floor(h))
        return (h, w, inside), x0, y0

    @cute.jit
    def corner_weights(self, x, y, a, H, W):
        """Bilinear weights of the four corners times the attention weight; all zero outside."""
        (h, w, inside), _, _ = self.footprint(x, y, H, W)
        lw = w - cute.math.floor(w)
        lh = h - cute.math.floor(h)
        w00 = cutlass.Float32(0.0)
        w01 = cutlass.Float32(0.0)
        w10 = cutlass.Float32(0.0)
        w11 = cutlass.Float32(0.0)
        if inside:
            w00 = (1.0 - lh) * (1.0 - lw) * a
            w01 = (1.0 - lh) * lw * a
            w10 = lh * (1.0 - lw) * a
            w11 = lh * lw * a
        return w00, w01, w10, w11

    @cute.jit
    def consumer(self, mShapes, mLoc, mAttn, mOut, pipe, sBoxes, tidx, bidx, num_tiles):
        Lq = mLoc.shape[1]
        D, C = self.D, self.C
        slot = tidx // self.T
        chunk = tidx % self.T
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        tile = bidx
        while tile < num_tiles:
            n, m, q0 = self.tile_coords(tile, Lq)
            q = q0 + slot
            qc = cutlass.min(q, Lq - 1)
            acc = cute.make_rmem_tensor(cute.make_layout(C), cutlass.Float32)
            acc.fill(0.0)
            for level in cutlass.range_constexpr(self.L):
                H, W = self.level_size(mShapes, level)
                locs = self.level_locations(mLoc, n, qc, m, level)
                attn = cute.make_tensor(mAttn[n, qc, m, level, None].iterator, cute.make_layout(self.P)).load()
                attn = attn.to(cutlass.Float32)
                for point in cutlass.range_constexpr(self.P):
                    w00, w01, w10, w11 = self.corner_weights(locs[2 * point], locs[2 * point + 1], attn[point], H, W)
                    pipe.consumer_wait(state)
                    base = sBoxes[None, state.index].iterator + slot * (4 * D) + chunk * C
                    v00 = cute.make_tensor(base, cute.make_layout(C)).load().to(cutlass.Float32)
                    v01 = cute.make_tensor(base + D, cute.make_layout(C)).load().to(cutlass.Float32)
                    v10 = cute.make_tensor(base + 2 * D, cute.make_layout(C)).load().to(cutlass.Float32)
                    v11 = cute.make_tensor(base + 3 * D, cute.make_layout(C)).load().to(cutlass.Float32)
                    pipe.consumer_release(state)
                    acc.store(acc.load() + w00 * v00 + w01 * v01 + w10 * v10 + w11 * v11)
                    state.advance()
            if q < Lq:
                out = cute.make_tensor(mOut[n, q, m, None].iterator + chunk * C, cute.make_layout(C))
                out.store(acc.load().to(mOut.element_type))
            tile += cute.arch.grid_dim()[0]


_compiled: dict = {}


def _sym_fake_tensors(cfg: KernelConfig):
    """Fake tensors with symbolic N, S, Lq, grid: the compiled kernel serves every size."""
    n, s, lq, grid = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    M, L, P, D = cfg.num_heads, cfg.num_levels, cfg.num_points, cfg.head_dim
    vdt, ldt, adt = _dsl_dtype(cfg.value_dtype), _dsl_dtype(cfg.loc_dtype), _dsl_dtype(cfg.attn_dtype)

    def row_major(dtype, shape, align=None):
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)),
                                        assumed_align=align)

    return (
        row_major(vdt, (n, s, M, D), 16),
        row_major(cutlass.Int64, (L, 2)),
        row_major(cutlass.Int64, (L,)),
        row_major(ldt, (n, lq, M, L, P, 2), 16),
        row_major(adt, (n, lq, M, L, P), 16),
        row_major(vdt, (n, lq, M, D), 16),
        row_major(cutlass.Int64, (grid, L, 16), 128),
    )


def compile_kernel(cfg: KernelConfig):
    """Compile (once per process) the kernel for one static configuration."""
    fn = _compiled.get(cfg)
    if fn is None:
        fn = cute.compile(
            MSDAForward(cfg), *_sym_fake_tensors(cfg), cutlass.Int32(1),
            make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi",
        )
        _compiled[cfg] = fn
    return fn


CTAS_PER_SM = 4
NUM_STAGES = 6
_sm_count: dict = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_count:
        _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_count[index]


def config_for(value, sampling_locations, attention_weights) -> KernelConfig:
    N, S, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    return KernelConfig(
        value_dtype=_TORCH_TO_NAME[value.dtype],
        loc_dtype=_TORCH_TO_NAME[sampling_locations.dtype],
        attn_dtype=_TORCH_TO_NAME[attention_weights.dtype],
        num_heads=M, num_levels=L, num_points=P, head_dim=D, num_stages=NUM_STAGES,
    )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def msda_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """Run the kernel on validated CUDA tensors on an sm_90 device; returns (N, Lq, M*D) in value's dtype."""
    N, S, M, D = value.shape
    Lq = sampling_locations.shape[1]
    L = sampling_locations.shape[3]
    cfg = config_for(value, sampling_locations, attention_weights)
    fn = compile_kernel(cfg)
    device = value.device
    out = torch.empty((N, Lq, M * D), dtype=value.dtype, device=device)
    if out.numel() == 0:
        return out
    num_tiles = N * M * math.ceil(Lq / cfg.queries_per_tile)
    grid = min(num_tiles, _num_sms(device) * CTAS_PER_SM)
    desc = torch.empty((grid, L, 16), dtype=torch.int64, device=device)
    fn(
        _aligned(value),
        spatial_shapes.to(device=device, dtype=torch.int64).contiguous(),
        level_start_index.to(device=device, dtype=torch.int64).contiguous(),
        _aligned(sampling_locations),
        _aligned(attention_weights),
        out.view(N, Lq, M, D),
        desc,
        grid,
    )
    return out
