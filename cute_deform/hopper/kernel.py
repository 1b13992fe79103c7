"""The tiled Hopper kernel: `MSDAForward`, one instance per KernelConfig.

A tile is G queries of one (image, head); the 128 threads of a group's four consumer warps cover it,
T threads a query, each thread one vector of channels (KernelConfig.vector_bytes: 16 or 8 bytes). A CTA
has several groups that share a staging buffer. The tile scheduler hands each cluster ranges of tiles;
within a range, the coarse levels of each segment's (image, head) that fit are staged whole in shared
memory by TMA (multicast to both CTAs of a pair), and sampled from there (with prefetch_levels, the rows
of mid-size levels also go to L2 as each segment starts). The other levels are gathered per sample: by
vector loads through L1 (the default), or by one TMA box of 2x2 pixels x D channels per sample through a
ring of stages (fine_gather="tma", whose out-of-bounds zero fill is the original kernel's zero padding).
Producer warps (one a group, or one for several: config.producers) prefetch every tile's locations and
weights (or, fused, offsets and logits) with two TMA boxes into its group's ring, ahead of the
consumers. Consumers accumulate every level and point of a query in fp32 registers and write each
output row once.

Level sizes may live on the GPU, so the host never reads them. Staging boxes and input boxes need no
level sizes; the per-sample box maps do, and each CTA patches them on the device (tensormap.replace)
into its own slot of a small workspace. A level table that does not fit in value makes the output NaN.
"""
from __future__ import annotations

import dataclasses

try:
    import cutlass
    import cutlass.cute as cute
    import cutlass.memory
    from cutlass._mlir.dialects import nvvm
    from cutlass.cute.nvgpu import cpasync
    # TMA goes through cpasync's atoms and cute.copy except at three sites, each measured (its comment says why):
    # the doubled level's stride-0 map, the per-sample box maps patched on the device, and the order table's row
    # copies.
    from cutlass.experimental import primitives as prims
    from cutlass.experimental.cuda import tensor_map
    from cutlass.tensor_utils import TensorMapManager, TensorMapUpdateMode
except Exception:
    pass

from . import pipeline
from .config import (CONSUMER_WARPS, STAGE_BOX_PIXELS, TENSORMAP_BYTES, KernelConfig, ceil_div, stage_levels,
                     staged_pixels, tma_step)
from .inputs import QueryInputs, checked_level, load_row, row_pointer
from .sampling import Bilinear, global_corners, share, staged_corners
from .tile_scheduler import TileScheduler, strip_plan

DTYPES = {}
# Pixels of one head a TMA prefetch box covers (KernelConfig.prefetch_levels): the most a box dimension takes.
PREFETCH_BOX_PIXELS = 256
# The L2 eviction policy of the tile inputs' copies (the createpolicy encoding CUTLASS names EVICT_FIRST):
# each row is read once, and with the default policy the stream of them pushed value out of L2. The output's
# stores take it too where KernelConfig.output_evict_first.
L2_EVICT_FIRST = 0x12F0000000000000
# The L2 policy of the gathers of the levels other than the finest where KernelConfig.coarse_evict_last
# (the encoding CUTLASS names EVICT_LAST).
L2_EVICT_LAST = 0x14F0000000000000
try:
    DTYPES = {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}
except NameError:
    pass


def finest_level(sizes):
    """The index of the level with the most pixels (the first of equals)."""
    best, most = cutlass.Int32(0), sizes[0][0] * sizes[0][1]
    for level in range(1, len(sizes)):
        pixels = sizes[level][0] * sizes[level][1]
        more = pixels > most
        best = cutlass.select_(more, cutlass.Int32(level), best)
        most = cutlass.select_(more, pixels, most)
    return best


def input_layout(box, swizzled: bool):
    """A ring stage's layout for one tile's input box. Swizzled (KernelConfig.staggers_locations: 128-byte rows), the
    atom loads it with TMA's 128-byte swizzle, row q's 16-byte chunk k at chunk k ^ (q % 8), which the consumers read
    back by hand (inputs.QueryInputs); the swizzle is spelled in bytes (16-byte units, eight of them a row, eight rows),
    so that the atom keeps one copy a box."""
    if swizzled:
        return cute.make_composed_layout(cute.make_swizzle(3, 4, 3), 0, cute.make_layout(box))
    return cute.make_layout(box)


def padded_rows(per_query: int, dtype) -> bool:
    """Whether a head's row of an input is not a multiple of 16 bytes (config.KernelConfig._row_elems pads it)."""
    return per_query % tma_step(dtype.width // 8) != 0


def head_row_shift(per_query: int, dtype, m):
    """Where head m's row lies in input_atom's box over the heads' rows, which starts at the 16-byte boundary at or
    before it: elements past that boundary."""
    return (m * per_query) % tma_step(dtype.width // 8)


def head_rows(stage: cute.Tensor, per_query: int, m):
    """A ring stage as the consumers read it: with input_atom's box over the heads' rows, from where head m's row
    begins (load_rows)."""
    if cutlass.const_expr(padded_rows(per_query, stage.element_type)):
        return cute.make_tensor(stage.iterator + head_row_shift(per_query, stage.element_type, m), stage.layout)
    return stage


def check_planned_smem(taken: int, planned: int) -> None:
    if taken > planned:
        raise RuntimeError(f"cute_deform: the kernel takes {taken} bytes of shared memory, more than its "
                           f"configuration plans ({planned})")


class MSDAForward:
    def __init__(self, config: KernelConfig):
        self.cfg = config
        self.M, self.L, self.P, self.D = config.num_heads, config.num_levels, config.num_points, config.head_dim
        self.LP = self.L * self.P
        self.C = config.channels_per_thread
        self.T = config.threads_per_query
        self.G = config.queries_per_tile
        self.stages = config.num_stages
        self.groups = config.num_groups
        self.cluster = config.cluster_size
        self.tile_stride = self.groups * self.cluster  # tiles from one of a group's tiles to its next
        # Within each tile_stride tiles, group g of CTA `rank` takes the tile at rank * groups + g, or with
        # KernelConfig.interleave_ranks at g * cluster + rank (group_offset).
        self.group_step = self.cluster if config.interleave_ranks else 1
        self.stage_pixels = config.stage_pixels
        self.boxes = config.fine_gather == "tma"
        self.prefetch = config.prefetch_inputs
        self.fused = config.fused
        self.permuted = config.permuted
        self.split = config.splits_setup
        self.value_dtype = DTYPES[config.value_dtype]
        self.loc_dtype = DTYPES[config.loc_dtype]
        self.attn_dtype = DTYPES[config.attn_dtype]
        self.bilinear = Bilinear(self.value_dtype, self.C, config.packed_math, config.half_sums > 0)
        self.consumer_threads = CONSUMER_WARPS * 32
        self.early_inputs = config.early_inputs and self.prefetch and not self.boxes
        self.threads = config.threads

    # ------------------------------------------------------------------------------------------------
    # Host side: TMA atoms, shared storage, launch
    # ------------------------------------------------------------------------------------------------
    def input_atom(self, tensor: cute.Tensor, per_query: int, row_elems: int, swizzled: bool = False):
        """TMA atom for a tile's rows of an (N, Lq, M, ...) input: the tensor as (per_query, M, Lq, N),
        box (row_elems, 1, G, 1); rows past Lq, and a row's gap past per_query, are zero filled; swizzled: into
        input_layout's swizzled stage. A head's row that is not a multiple of 16 bytes (half-precision weights of
        12 or 4 points) cannot be a TMA stride: the tensor is then (M * per_query, Lq, N), box (row_elems, G, 1),
        placed at the 16-byte boundary at or before the head's first element (a box's first coordinate must be one;
        load_rows), so the head's row lies a few elements into each row of the box (head_rows); the rest of the box
        reads its neighbours' rows, or zeros past the last head, and no thread reads them."""
        Lq, N = tensor.shape[1], tensor.shape[0]
        if cutlass.const_expr(padded_rows(per_query, tensor.element_type)):
            rows = cute.make_tensor(tensor.iterator, cute.make_layout(
                (self.M * per_query, Lq, N), stride=(1, self.M * per_query, tensor.stride[0])))
            box = (row_elems, self.G, 1)
            return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rows, cute.make_layout(box), box)
        rows = cute.make_tensor(tensor.iterator, cute.make_layout(
            (per_query, self.M, Lq, N), stride=(1, per_query, self.M * per_query, tensor.stride[0])))
        box = (row_elems, 1, self.G, 1)
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rows, input_layout(box, swizzled), box)

    @cute.jit
    def __call__(
        self,
        mValue: cute.Tensor,  # (N, S, M, D)
        mShapes: cute.Tensor,  # (L, 2) int64, (H, W)
        mStarts: cute.Tensor,  # (L,) int64
        mLoc: cute.Tensor,  # (N, Lq, M, L, P, 2): locations, or fused: sampling offsets
        mAttn: cute.Tensor,  # (N, Lq, M, L, P): weights, or fused: attention logits
        mRef: cute.Tensor,  # fused: (N, Lq, L, 2 or 4) reference points (unfused: unused)
        mOrder: cute.Tensor,  # permuted: (N, Lq) int64, the queries of each image in the order tiles take them
        mOut: cute.Tensor,  # (N, Lq, M*D): the op's output as is
        mDesc: cute.Tensor,  # (grid, map_slots, 16) int64: tensor-map slots of each CTA
        grid_size: cutlass.Int32,
        rounds: cutlass.Int32,
        whole: cutlass.Int32,
        stream,
    ):
        N, S = mValue.shape[0], mValue.shape[1]
        Lq = mLoc.shape[1]
        M, D, e = self.M, self.D, self.cfg.itemsize
        # Staging: the value as (D, M, S, N), boxes of STAGE_BOX_PIXELS pixels of one head.
        pixels = cute.make_tensor(mValue.iterator, cute.select(mValue.layout, mode=[3, 2, 1, 0]))
        stage_op = (cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cluster > 1
                    else cpasync.CopyBulkTensorTileG2SOp())
        stage_box = (D, 1, STAGE_BOX_PIXELS, 1)
        stage_atom, stage_tma = cpasync.make_tiled_tma_atom(stage_op, pixels, cute.make_layout(stage_box), stage_box)
        loc_atom, loc_tma, attn_atom, attn_tma = stage_atom, stage_tma, stage_atom, stage_tma
        # KernelConfig.prefetch_levels: L2 prefetch boxes of PREFETCH_BOX_PIXELS pixels of one head.
        fetch_atom, fetch_tma = stage_atom, stage_tma
        if cutlass.const_expr(self.cfg.prefetch_levels):
            fetch_box = (D, 1, PREFETCH_BOX_PIXELS, 1)
            fetch_atom, fetch_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), pixels,
                                                                cute.make_layout(fetch_box), fetch_box)
        if cutlass.const_expr(self.prefetch and not self.permuted):
            # KernelConfig.staggers_locations: the location rows land with TMA's 128-byte swizzle (input_layout).
            loc_atom, loc_tma = self.input_atom(mLoc, 2 * self.LP, self.cfg.loc_row_elems,
                                                self.cfg.staggers_locations)
            attn_atom, attn_tma = self.input_atom(mAttn, self.LP, self.cfg.attn_row_elems)
        # Per-sample boxes: a template over one level as (D, M, W, H, N), box (D, 1, 2, 2, 1), whose
        # address and sizes every CTA patches on the device from the level table, which may live on the GPU (the
        # host never reads it). An atom rewritten by cpasync.update_tma_descriptor, with cute.copy's tma_desc_ptr,
        # works but lost 10-11% on detr-decoder's boxes (H100): about 8% the atom's 128-byte L2 promotion, which a
        # caller cannot turn off, the rest the election around each copy (session 49, docs/performance.md).
        box_template = None
        if cutlass.const_expr(self.boxes):
            units = M * D * e // 16
            box_template = tensor_map.create_tensor_map_tiled(
                global_address=mValue.iterator.toint(),
                dtype=self.value_dtype,
                global_dims=[D, M, 2, 2, N],
                global_strides=[D * e // 16, units, 2 * units, S * units],
                box_dims=[D, 1, 2, 2, 1],
            )

        # KernelConfig.doubles_coarsest: the value as (D, 2, M, S, N), the second dimension's stride 0, so that a
        # box (D, 2, 1, STAGE_BOX_PIXELS, 1) lands each pixel row twice, side by side. make_tiled_tma_atom takes
        # this view too and its copies are right, but cost the encoders 0.3-0.5% on both GPUs (session 53).
        pair_map = None
        if cutlass.const_expr(self.cfg.doubles_coarsest):
            pair_map = tensor_map.create_tensor_map_tiled(
                global_address=mValue.iterator.toint(),
                dtype=self.value_dtype,
                global_dims=[D, 2, M, S, N],
                global_strides=[0, mValue.stride[2] * e // 16, mValue.stride[1] * e // 16,
                                mValue.stride[0] * e // 16],
                box_dims=[D, 2, 1, STAGE_BOX_PIXELS, 1],
            )

        cfg = self.cfg

        @cute.struct
        class SharedStorage:
            input_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages * self.groups]
            box_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.stages * self.groups]
            staged_full: cute.struct.MemRange[cutlass.Int64, 2]
            levels: cute.struct.MemRange[cutlass.Int64, 4 * (self.L + 1)]
            maps: cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 16 * cfg.map_slots], 128]
            box_ring: cute.struct.Align[cute.struct.MemRange[self.value_dtype, cfg.box_ring_elems], 128]
            staged: cute.struct.Align[cute.struct.MemRange[self.value_dtype, (self.stage_pixels + 1) * D], 128]
            loc_ring: cute.struct.Align[
                cute.struct.MemRange[self.loc_dtype, cfg.loc_stage_elems * cfg.input_slots],
                1024 if self.cfg.staggers_locations else 128]
            attn_ring: cute.struct.Align[
                cute.struct.MemRange[self.attn_dtype, cfg.attn_stage_elems * cfg.input_slots], 128]

        self.shared_storage = SharedStorage
        # The host plans with cfg.smem_bytes (CTAs an SM, the staging budget, L1's carveout): it must cover
        # what the kernel takes.
        check_planned_smem(SharedStorage.size_in_bytes(), cfg.smem_bytes)
        num_tiles = cutlass.Int64(N) * M * ceil_div(Lq, self.G)
        self.kernel(stage_atom, stage_tma, fetch_atom, fetch_tma, loc_atom, loc_tma, attn_atom, attn_tma, box_template,
                    pair_map, mValue, mShapes, mStarts, mLoc, mAttn, mRef, mOrder, mOut, mDesc, num_tiles,
                    rounds, whole).launch(
            grid=[grid_size, 1, 1],
            block=[self.threads, 1, 1],
            cluster=[self.cluster, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=self.cfg.ctas_per_sm if self.cfg.launch_bound else 0,
            stream=stream,
        )

    # ------------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, stage_atom, stage_tma, fetch_atom, fetch_tma, loc_atom, loc_tma, attn_atom, attn_tma,
               box_template: cutlass.GridConstant[tensor_map.TensorMap],
               pair_map: cutlass.GridConstant[tensor_map.TensorMap], mValue: cute.Tensor, mShapes: cute.Tensor,
               mStarts: cute.Tensor, mLoc: cute.Tensor, mAttn: cute.Tensor, mRef: cute.Tensor, mOrder: cute.Tensor,
               mOut: cute.Tensor, mDesc: cute.Tensor,
               num_tiles: cutlass.Int64, rounds: cutlass.Int32, whole: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        D = self.D

        input_rings = None
        if cutlass.const_expr(self.prefetch):
            input_rings = pipeline.GroupRings.create(storage.input_barriers.data_ptr(), self.groups, self.stages,
                                              self.cfg.input_bytes)
        box_rings = None
        if cutlass.const_expr(self.boxes):
            box_rings = pipeline.GroupRings.create(storage.box_barriers.data_ptr(), self.groups, self.stages,
                                            self.G * self.cfg.box_bytes)
        staging = pipeline.StagingBarrier(storage.staged_full.data_ptr())
        staging.init(warp)
        if warp == 0:
            cpasync.prefetch_descriptor(stage_atom)
            if cutlass.const_expr(self.prefetch and not self.permuted):
                cpasync.prefetch_descriptor(loc_atom)
                cpasync.prefetch_descriptor(attn_atom)
        Lq = mLoc.shape[1]
        blocks = cutlass.Int64(ceil_div(Lq, self.G))
        clusters = cutlass.Int64(cute.arch.grid_dim()[0] // self.cluster)
        strips = None
        level_table = None
        if cutlass.const_expr(self.cfg.strips):  # the tile order needs the level table first
            level_table = self.level_table(mShapes, mStarts, mValue.shape[1])
            strips = strip_plan(level_table[0], level_table[1], Lq, self.G)
        scheduler = TileScheduler.create(num_tiles, blocks, clusters, rounds, whole, bidx // self.cluster, self.M,
                                         self.cfg.segment_cost, strips)
        rank = cutlass.Int32(0)
        if cutlass.const_expr(self.cluster > 1):
            rank = cutlass.Int32(cute.arch.block_idx_in_cluster())
        consumer_warps = self.groups * CONSUMER_WARPS
        if cutlass.const_expr(self.early_inputs):
            # The rings' barriers, initialised by warp 0, are visible to the producer warps, which then
            # issue the first tiles' inputs while the level table loads (they need neither it nor the peer).
            cute.arch.mbarrier_init_fence()
            cute.arch.barrier()
            if warp >= consumer_warps:
                self.issue_first_inputs(warp - consumer_warps, loc_atom, loc_tma, attn_atom, attn_tma, mLoc, mAttn,
                                        mOrder, storage, input_rings, scheduler, rank)
        # A zero pixel after the staged levels: where an out-of-level corner of a staged sample reads.
        sStaged = storage.staged.get_tensor(cute.make_layout((self.stage_pixels + 1) * D))
        if tidx < D:
            sStaged[self.stage_pixels * D + tidx] = self.value_dtype(0.0)

        # Which levels are staged, and where: coarsest first while they fit. The table goes to shared
        # memory: consumers read it where they need it rather than holding ~20 registers of it.
        if cutlass.const_expr(level_table is None):
            level_table = self.level_table(mShapes, mStarts, mValue.shape[1])
        sizes, starts, levels_ok = level_table
        staged, offsets, used = stage_levels(sizes, self.stage_pixels, cutlass.Int32(0), cutlass.select_)
        # KernelConfig.doubles_coarsest: the last level takes twice its rows where the same levels still fit.
        doubled = cutlass.Boolean(False)
        if cutlass.const_expr(self.cfg.doubles_coarsest):
            last_px = staged_pixels(sizes[self.L - 1][0] * sizes[self.L - 1][1])
            doubled = staged[self.L - 1] & (used + last_px <= self.stage_pixels)
            extra = cutlass.select_(doubled, last_px, 0)
            for level in cutlass.range_constexpr(self.L - 1):
                offsets[level] = offsets[level] + extra
            used = used + extra
        sLevels = self.level_table_in(storage)
        if tidx == 0:
            for level in cutlass.range_constexpr(self.L):
                H, W = sizes[level]
                sLevels[level, 0] = cutlass.Int64(H)
                sLevels[level, 1] = cutlass.Int64(W)
                sLevels[level, 2] = starts[level]
                sLevels[level, 3] = cutlass.Int64(cutlass.select_(staged[level], offsets[level], -1))
            sLevels[self.L, 0] = cutlass.Int64(cutlass.select_(levels_ok, 1, 0))
            sLevels[self.L, 1] = cutlass.Int64(finest_level(sizes))
            sLevels[self.L, 2] = cutlass.Int64(cutlass.select_(doubled, 1, 0))
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.barrier()

        if warp >= consumer_warps:
            self.producer(warp - consumer_warps, stage_atom, stage_tma, fetch_atom, fetch_tma, loc_atom, loc_tma,
                          attn_atom, attn_tma, box_template, pair_map, mValue, mLoc, mAttn, mOrder, mDesc,
                          storage, input_rings, box_rings, staging, scheduler, rounds, sizes, starts, staged, offsets,
                          used, doubled, rank, bidx)
        else:
            g = warp // CONSUMER_WARPS
            self.consumer(g, mValue, mLoc, mAttn, mRef, mOrder, mOut, storage, input_rings, box_rings, staging,
                          scheduler, rounds, rank, tidx - g * self.consumer_threads)
        if cutlass.const_expr(self.cluster > 1):
            # Neither CTA of a pair exits while the other may still multicast into it.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def level_table(self, mShapes: cute.Tensor, mStarts: cute.Tensor, S):
        """(H, W) and first pixel of every level (inputs.checked_level), and whether all fit in value."""
        sizes, starts = [], []
        levels_ok = cutlass.Boolean(True)
        for level in range(self.L):
            H, W, start, ok = checked_level(mShapes, mStarts, level, S)
            levels_ok = levels_ok & ok
            sizes.append((H, W))
            starts.append(start)
        return sizes, starts, levels_ok

    def level_table_in(self, storage):
        """The level table in shared memory: a row (H, W, first pixel, staging offset or -1) per level,
        then a row of (1 when every level fits in value, the level with the most pixels)."""
        return storage.levels.get_tensor(cute.make_layout((self.L + 1, 4), stride=(4, 1)))

    def input_rings_of(self, storage):
        cfg = self.cfg
        return (storage.loc_ring.get_tensor(cute.make_layout((cfg.loc_stage_elems, cfg.input_slots))),
                storage.attn_ring.get_tensor(cute.make_layout((cfg.attn_stage_elems, cfg.input_slots))))

    # ------------------------------------------------------------------------------------------------
    # Producer warps: staging (warp 0), the tile inputs, and with fine_gather="tma" the footprint boxes
    # ------------------------------------------------------------------------------------------------
    @cute.jit
    def producer(self, p, stage_atom, stage_tma, fetch_atom, fetch_tma, loc_atom, loc_tma, attn_atom, attn_tma,
                 box_template, pair_map, mValue, mLoc, mAttn, mOrder, mDesc, storage, input_rings, box_rings,
                 staging, scheduler, rounds, sizes, starts, staged, offsets, used, doubled, rank, bidx):
        """Producer warp p feeds groups p, p + producers, ... (with TMA boxes, its own group only)."""
        producers = self.cfg.producer_warps
        served = self.groups // producers
        box_maps = []
        if cutlass.const_expr(self.boxes):
            box_maps = self.publish_box_maps(p, box_template, mValue, mDesc, storage, sizes, starts, bidx)
        sLoc, sAttn = self.input_rings_of(storage)
        sStaged = storage.staged.get_tensor(cute.make_layout((self.stage_pixels + 1) * self.D))
        input_states = None
        if cutlass.const_expr(self.prefetch):
            input_states = [input_rings.producer_state(p + j * producers) for j in range(served)]
            if cutlass.const_expr(self.early_inputs):
                for j in cutlass.range_constexpr(served):
                    _, issued, _, _, _ = self.first_tiles(p, j, scheduler, rank)
                    input_states[j].advance(cutlass.Int32(issued * self.groups))
        box_state = box_rings.producer_state(p) if cutlass.const_expr(self.boxes) else None
        prefetched = []
        if cutlass.const_expr(self.cfg.prefetch_levels):
            prefetched = self.prefetched_levels(sizes, staged, mLoc.shape[1])
        segment = cutlass.Int32(0)
        for round_ in cutlass.range(rounds, unroll=1):
            t, t_end = scheduler.range_of(round_)
            while t < t_end:
                nm, seg_end, n, m = scheduler.segment_at(t, t_end)
                self.segment_sync(segment)
                if p == 0:
                    self.stage_levels(stage_atom, stage_tma, pair_map, sStaged, staging, sizes, starts, staged, offsets,
                                      used, doubled, n, m, rank)
                    if cutlass.const_expr(self.cfg.prefetch_levels):
                        self.prefetch_levels(fetch_atom, fetch_tma, sizes, starts, prefetched, n, m, rank)
                # The tiles of a batch go to the groups in turn (group_offset); this warp's groups come `producers`
                # apart, their tiles `producers * group_step`.
                first = t + self.group_offset(rank, p)
                if cutlass.const_expr(self.early_inputs):
                    # Round 0's first segment: the first `stages` tiles of each group went out early.
                    first = first + cutlass.select_(segment + round_ == 0, self.stages * self.tile_stride, 0)
                for base in cutlass.range(first, seg_end, self.tile_stride, unroll=1):
                    for j in cutlass.range_constexpr(served):
                        tile = base + j * producers * self.group_step
                        if tile < seg_end:
                            q0 = scheduler.first_query(tile, nm, self.G)
                            if cutlass.const_expr(self.prefetch):
                                input_states[j] = self.load_inputs(loc_atom, loc_tma, attn_atom, attn_tma, sLoc, sAttn,
                                                                   input_rings, input_states[j], mLoc, mAttn, mOrder,
                                                                   n, m, q0)
                            if cutlass.const_expr(self.boxes):
                                box_state = self.load_boxes(box_maps, box_rings, box_state, mLoc, storage, sizes,
                                                            staged, n, m, q0)
                t = seg_end
                segment += 1
        if cutlass.const_expr(self.prefetch):
            for j in cutlass.range_constexpr(served):
                input_rings.drain(input_states[j])
        if cutlass.const_expr(self.boxes):
            box_rings.drain(box_state)
        # ... and the last staging has landed: a group with no tile in the last segment never waits for
        # it, and a CTA must not exit with TMA (or a peer's multicast) still writing into it.
        if p == 0 and segment > 0:
            staging.wait(segment - 1)

    def group_offset(self, rank, g):
        """Group g of CTA `rank`'s tile among each tile_stride tiles of a range."""
        if cutlass.const_expr(self.cfg.interleave_ranks):
            return g * self.cluster + rank
        return rank * self.groups + g

    @cute.jit
    def segment_sync(self, segment):
        """pipeline.segment_sync before every segment; where the first tiles' inputs go out early (the same
        condition as theirs) not before the first, whose staging the prologue's barrier already orders."""
        if cutlass.const_expr(self.early_inputs):
            if segment > 0:
                pipeline.segment_sync(self.cluster)
        else:
            pipeline.segment_sync(self.cluster)

    @cute.jit
    def first_tiles(self, p, j: int, scheduler, rank):
        """early_inputs: producer warp p's j-th group's first tile in round 0's first segment, how many of the
        group's tiles from it the ring's free stages take (those inside the segment, at most `stages`; none
        without round 0 work), and the segment's (image, head) index, image and head."""
        t, t_end = scheduler.range_of(0)
        nm, seg_end, n, m = scheduler.segment_at(t, t_end)
        tile = t + self.group_offset(rank, p + j * self.cfg.producer_warps)
        ahead = cutlass.max(seg_end - tile + self.tile_stride - 1, 0) // self.tile_stride
        return tile, cutlass.select_(t < t_end, cutlass.min(ahead, self.stages), 0), nm, n, m

    @cute.jit
    def issue_first_inputs(self, p, loc_atom, loc_tma, attn_atom, attn_tma, mLoc, mAttn, mOrder, storage,
                           input_rings, scheduler, rank):
        """early_inputs: producer warp p issues the inputs of its groups' first tiles (first_tiles), before the
        prologue."""
        producers = self.cfg.producer_warps
        sLoc, sAttn = self.input_rings_of(storage)
        for j in cutlass.range_constexpr(self.groups // producers):
            tile, count, nm, n, m = self.first_tiles(p, j, scheduler, rank)
            state = input_rings.producer_state(p + j * producers)
            for k in cutlass.range(count, unroll=1):
                q0 = scheduler.first_query(tile + k * self.tile_stride, nm, self.G)
                state = self.load_inputs(loc_atom, loc_tma, attn_atom, attn_tma, sLoc, sAttn, input_rings, state,
                                         mLoc, mAttn, mOrder, n, m, q0)

    @cute.jit
    def stage_levels(self, stage_atom, stage_tma, pair_map, sStaged, staging, sizes, starts, staged, offsets, used,
                     doubled, n, m, rank):
        """Load the staged levels of (image n, head m) whole; in a cluster each CTA loads every other
        box and multicasts it to both. The loop is warp-uniform: cute.copy of a TMA atom issues from one
        elected lane. A doubled last level (KernelConfig.doubles_coarsest) goes through pair_map."""
        staging.expect(used * (self.D * self.cfg.itemsize))
        for level in cutlass.range_constexpr(self.L):
            if cutlass.const_expr(self.cfg.doubles_coarsest and level == self.L - 1):
                if doubled:
                    self.stage_doubled(pair_map, sStaged, staging, sizes[level], starts[level], offsets[level], n, m,
                                       rank)
                elif staged[level]:
                    self.stage_level(stage_atom, stage_tma, sStaged, staging, sizes[level], starts[level],
                                     offsets[level], n, m, rank)
            elif staged[level]:
                self.stage_level(stage_atom, stage_tma, sStaged, staging, sizes[level], starts[level], offsets[level],
                                 n, m, rank)

    @cute.jit
    def stage_level(self, stage_atom, stage_tma, sStaged, staging, size, start, offset, n, m, rank):
        """One level's boxes of STAGE_BOX_PIXELS pixel rows, from pixel row `offset` of the buffer on."""
        D = self.D
        H, W = size
        box = (D, 1, STAGE_BOX_PIXELS, 1)
        boxes = ceil_div(H * W, STAGE_BOX_PIXELS)
        for b in cutlass.range(rank, boxes, self.cluster, unroll=1):
            dst = cute.make_tensor(sStaged.iterator + (offset + b * STAGE_BOX_PIXELS) * D, cute.make_layout(box))
            tSs, tSg = self.level_box(stage_atom, stage_tma, dst, start, b, n, m)
            if cutlass.const_expr(self.cluster > 1):
                cute.copy(stage_atom, tSg, tSs, tma_bar_ptr=staging.barrier,
                          mcast_mask=cutlass.Int16((1 << self.cluster) - 1))
            else:
                cute.copy(stage_atom, tSg, tSs, tma_bar_ptr=staging.barrier)

    @cute.jit
    def stage_doubled(self, pair_map, sStaged, staging, size, start, offset, n, m, rank):
        """A level with each pixel row twice, side by side: boxes of STAGE_BOX_PIXELS pixels through pair_map
        (its stride-0 dimension writes the copies), issued by lane 0 (a bulk tensor copy is one thread's)."""
        D = self.D
        H, W = size
        boxes = ceil_div(H * W, STAGE_BOX_PIXELS)
        if cute.arch.lane_idx() == 0:
            desc = cutlass.Pointer(pair_map.get_ptr(), dtype=cutlass.Int64)
            for b in cutlass.range(rank, boxes, self.cluster, unroll=1):
                dst = sStaged.iterator + (offset + 2 * b * STAGE_BOX_PIXELS) * D
                coords = [cutlass.Int32(0), cutlass.Int32(0), m, cutlass.Int32(start) + b * STAGE_BOX_PIXELS, n]
                if cutlass.const_expr(self.cluster > 1):
                    prims.cp_async_bulk_tensor_shared_cluster_global(
                        dst, desc, coords, staging.barrier, [], multicast_mask=cutlass.Int16((1 << self.cluster) - 1))
                else:
                    prims.cp_async_bulk_tensor_shared_cta_global(dst, desc, coords, staging.barrier)
        cute.arch.sync_warp()

    def level_box(self, atom, tma, dst, start, b, n, m):
        """(destination, source) partitions of box b of a level whose first pixel is `start`, head m of image
        n: the box's pixels are dst's mode 2 (STAGE_BOX_PIXELS or PREFETCH_BOX_PIXELS)."""
        box = dst.shape
        pixel = cutlass.Int32(start) + b * box[2]
        src = cute.local_tile(cute.domain_offset((0, m, pixel, n), tma), box, (0, 0, 0, 0))
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 4),
                                     cute.group_modes(src, 0, 4))

    @cute.jit
    def prefetched_levels(self, sizes, staged, Lq):
        """KernelConfig.prefetch_levels: whether each level goes to L2 as a segment starts. A level does where
        it is neither staged nor the finest and has at most half as many pixels as a segment's corner reads
        (4 Lq P: a row is then expected to be read about twice, and few prefetched rows go unread)."""
        finest = finest_level(sizes)
        prefetched = []
        for level in cutlass.range_constexpr(self.L):
            H, W = sizes[level]
            prefetched.append(not staged[level] and finest != level
                              and cutlass.Int64(H * W) <= cutlass.Int64(Lq) * (2 * self.P))
        return prefetched

    @cute.jit
    def prefetch_levels(self, fetch_atom, fetch_tma, sizes, starts, prefetched, n, m, rank):
        """TMA prefetches to L2 of (image n, head m)'s rows of the prefetched levels (prefetched_levels); the
        CTAs of a cluster take every other box."""
        # A prefetch has no destination; tma_partition wants one of the box's shape.
        nowhere = cute.make_ptr(self.value_dtype, 0, cute.AddressSpace.smem, assumed_align=128)
        dst = cute.make_tensor(nowhere, cute.make_layout((self.D, 1, PREFETCH_BOX_PIXELS, 1)))
        for level in cutlass.range_constexpr(self.L):
            if prefetched[level]:
                H, W = sizes[level]
                boxes = ceil_div(H * W, PREFETCH_BOX_PIXELS)
                for b in cutlass.range(rank, boxes, self.cluster, unroll=1):
                    _, tSg = self.level_box(fetch_atom, fetch_tma, dst, starts[level], b, n, m)
                    with cute.arch.elect_one():  # a tensor prefetch is one thread's instruction
                        cute.prefetch(fetch_atom, tSg)

    @cute.jit
    def load_inputs(self, loc_atom, loc_tma, attn_atom, attn_tma, sLoc, sAttn, rings, state, mLoc, mAttn, mOrder, n,
                    m, q0):
        """One tile's rows of locations and weights (or offsets and logits): two TMA boxes; or, through the
        order table, lane j copies the rows of the tile's queries j, j + 32, ... with two bulk copies each
        (rows of 16-byte multiples need no tensor map, and the lanes issue in parallel). Either way L2
        evicts them first (L2_EVICT_FIRST)."""
        full = rings.acquire(state)
        loc_stage, attn_stage = sLoc[None, state.index], sAttn[None, state.index]
        if cutlass.const_expr(self.permuted):
            Lq = mOrder.shape[1]
            lane = cute.arch.lane_idx()
            for base in cutlass.range_constexpr(0, self.G, 32):
                slot = base + lane
                if slot < self.G:
                    query = cutlass.Int32(mOrder[n, cutlass.min(q0 + slot, Lq - 1)])
                    row = (cutlass.Int64(n) * Lq + query) * self.M + m
                    self.copy_row(mLoc, loc_stage.iterator + slot * self.cfg.loc_row_elems, row, 2 * self.LP, full)
                    self.copy_row(mAttn, attn_stage.iterator + slot * self.cfg.attn_row_elems, row, self.LP, full)
        else:
            block = q0 // self.G
            self.load_rows(loc_atom, loc_tma, loc_stage, 2 * self.LP, self.cfg.loc_row_elems, full, n, m, block,
                           self.cfg.staggers_locations)
            self.load_rows(attn_atom, attn_tma, attn_stage, self.LP, self.cfg.attn_row_elems, full, n, m, block)
        state.advance(rings.groups)
        return state

    @cute.jit
    def load_rows(self, atom, tma, stage, per_query: int, row_elems: int, full, n, m, block, swizzled: bool = False):
        if cutlass.const_expr(padded_rows(per_query, stage.element_type)):  # input_atom's heads-together view
            box = (row_elems, self.G, 1)
            start = m * per_query - head_row_shift(per_query, stage.element_type, m)
            src = cute.local_tile(cute.domain_offset((start, 0, 0), tma), box, (0, block, n))
            dst = cute.make_tensor(stage.iterator, cute.make_layout(box))
            modes = 3
        else:
            box = (row_elems, 1, self.G, 1)
            src = cute.local_tile(tma, box, (0, m, block, n))
            dst = cute.make_tensor(stage.iterator, input_layout(box, swizzled))
            modes = 4
        tIs, tIg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, modes),
                                         cute.group_modes(src, 0, modes))
        cute.copy(atom, tIg, tIs, tma_bar_ptr=full, cache_policy=cutlass.Int64(L2_EVICT_FIRST))

    @cute.jit
    def copy_row(self, tensor, dst, row, per_query: int, full):
        """Row `row` of an (N*Lq*M, per_query) input to dst in shared memory: one bulk copy. (cute.copy with
        cpasync.CopyBulkG2SOp drops the evict-first hint and adds a mapa: different PTX, session 48.)"""
        src = row_pointer(tensor, row, per_query, 0, per_query)
        prims.cp_async_bulk_shared_cluster_global(dst, src, full, per_query * (tensor.element_type.width // 8),
                                                  l2_cache_hint=cutlass.Int64(L2_EVICT_FIRST))

    @cute.jit
    def publish_box_maps(self, g, box_template, mValue, mDesc, storage, sizes, starts, bidx):
        """Each group patches its own box map of every level (address, W, H, row stride) in shared memory
        and publishes it to its global slot with a proxy fence (TMA reads maps through the tensormap
        proxy)."""
        M, D, e = self.M, self.D, self.cfg.itemsize
        F = prims.TensormapField
        sMaps = storage.maps.get_tensor(cute.make_layout((16, self.cfg.map_slots)))
        lane = cute.arch.lane_idx()
        maps = []
        for level in cutlass.range_constexpr(self.L):
            H, W = sizes[level]
            slot = self.L * g + level
            words = cutlass.Pointer(box_template.get_ptr(), dtype=cutlass.Int64)
            if lane < 16:
                sMaps[lane, slot] = (words + lane).load()
            cute.arch.sync_warp()
            smem_map = cutlass.Pointer(sMaps[None, slot].iterator.llvm_ptr, dtype=cutlass.Int64)
            base = mValue.iterator.toint() + starts[level] * (M * D * e)
            with cute.arch.elect_one():
                prims.tensormap_replace(F.GLOBAL_ADDRESS, smem_map, new_value=base)
                prims.tensormap_replace(F.GLOBAL_DIM, smem_map, new_value=W, ord=2)
                prims.tensormap_replace(F.GLOBAL_DIM, smem_map, new_value=H, ord=3)
                prims.tensormap_replace(F.GLOBAL_STRIDE, smem_map, new_value=cutlass.Int64(W) * (M * D * e), ord=2)
            cute.arch.sync_warp()
            manager = TensorMapManager(TensorMapUpdateMode.SMEM, TENSORMAP_BYTES)
            gmem_map = manager.get_tensormap_ptr(mDesc[bidx, slot, None].iterator)
            cpasync.cp_fence_tma_desc_release(gmem_map, sMaps[None, slot].iterator)
            cpasync.fence_tma_desc_acquire(gmem_map)
            maps.append(manager.get_tensormap_ptr(mDesc[bidx, slot, None].iterator, cutlass.AddressSpace.generic))
        return maps

    @cute.jit
    def load_boxes(self, box_maps, rings, state, mLoc, storage, sizes, staged, n, m, q0):
        """fine_gather="tma": for every unstaged level, one vector load of each query's locations (lane j
        those of queries j, j + 32, ...), then per point one 2x2xD box per query into a ring stage."""
        lane = cute.arch.lane_idx()
        Lq = mLoc.shape[1]
        D = self.D
        sBoxes = storage.box_ring.get_tensor(cute.make_layout(self.cfg.box_ring_elems))
        per_lane = ceil_div(self.G, 32)
        for level in cutlass.range_constexpr(self.L):
            if not staged[level]:
                H, W = sizes[level]
                corners = []
                for j in cutlass.range_constexpr(per_lane):
                    q = q0 + lane + 32 * j
                    row = (cutlass.Int64(n) * Lq + cutlass.min(q, Lq - 1)) * self.M + m
                    xys = load_row(mLoc, row, 2 * self.LP, level * 2 * self.P, 2 * self.P)
                    for point in cutlass.range_constexpr(self.P):
                        w = xys[2 * point] * cutlass.Float32(W) - 0.5
                        h = xys[2 * point + 1] * cutlass.Float32(H) - 0.5
                        _, x0, y0, _, _ = self.bilinear.footprint(w, h, H, W)
                        corners.append((cutlass.select_(q >= Lq, -2, x0), cutlass.select_(q >= Lq, -2, y0)))
                for point in cutlass.range_constexpr(self.P):
                    full = rings.acquire(state)
                    stage_elems = self.G * 4 * D
                    # Lane 0 issues every box of the stage with the lanes' coordinates (shuffled): a bulk
                    # tensor copy is one thread's instruction. Issued by all 32 lanes at once, boxes landed
                    # wrong at random with four or more groups a CTA (H100, docs/performance.md, session 15).
                    for j in cutlass.range_constexpr(per_lane):
                        x0, y0 = corners[j * self.P + point]
                        for src in cutlass.range(min(32, self.G - 32 * j), unroll=1):
                            xs, ys = share((x0, y0), src, 32)
                            if lane == 0:
                                dst = sBoxes.iterator + state.index * stage_elems + (src + 32 * j) * (4 * D)
                                prims.cp_async_bulk_tensor_shared_cta_global(
                                    dst, box_maps[level], [cutlass.Int32(0), m, xs, ys, n], full)
                    state.advance(rings.groups)
        return state

    # ------------------------------------------------------------------------------------------------
    # Consumer warps
    # ------------------------------------------------------------------------------------------------
    @cute.jit
    def consumer(self, g, mValue, mLoc, mAttn, mRef, mOrder, mOut, storage, input_rings, box_rings, staging,
                 scheduler, rounds, rank, tidx):
        Lq = mLoc.shape[1]
        sLevels = self.level_table_in(storage)
        sStaged = storage.staged.get_tensor(cute.make_layout((self.stage_pixels + 1) * self.D))
        sLoc, sAttn = self.input_rings_of(storage)
        slot = tidx // self.T
        chunk = tidx % self.T
        # Where T does not divide 128, the threads past the tile's last query idle; they still take
        # part in the rings' protocol, and with per-sample boxes (whose waits and releases are per
        # point) they follow the last query's work, reading its row.
        active = True
        read_slot = slot
        if cutlass.const_expr(self.consumer_threads % self.T != 0):
            active = slot < self.G
            read_slot = cutlass.min(slot, self.G - 1)
        gathers = True if cutlass.const_expr(self.boxes) else active
        args = (g, mValue, mLoc, mAttn, mRef, mOrder, mOut, storage, input_rings, box_rings, staging, rounds, rank,
                sLevels, sStaged, sLoc, sAttn, slot, chunk, active, read_slot, gathers)
        if cutlass.const_expr(scheduler.strips is not None):
            # Two copies of the tile loop, chosen once: the one without the strips' map keeps its schedule.
            if scheduler.strips[0] > 0:
                self.consumer_tiles(scheduler, *args)
            else:
                self.consumer_tiles(dataclasses.replace(scheduler, strips=None), *args)
        else:
            self.consumer_tiles(scheduler, *args)

    @cute.jit
    def consumer_tiles(self, scheduler, g, mValue, mLoc, mAttn, mRef, mOrder, mOut, storage, input_rings, box_rings,
                       staging, rounds, rank, sLevels, sStaged, sLoc, sAttn, slot, chunk, active, read_slot, gathers):
        Lq = mLoc.shape[1]
        input_state = input_rings.consumer_state(g) if cutlass.const_expr(self.prefetch) else None
        box_state = box_rings.consumer_state(g) if cutlass.const_expr(self.boxes) else None
        segment = cutlass.Int32(0)
        for round_ in cutlass.range(rounds, unroll=1):
            t, t_end = scheduler.range_of(round_)
            while t < t_end:
                nm, seg_end, n, m = scheduler.segment_at(t, t_end)
                self.segment_sync(segment)
                first = t + self.group_offset(rank, g)
                for tile in cutlass.range(first, seg_end, self.tile_stride, unroll=1):
                    q0 = scheduler.first_query(tile, nm, self.G)
                    # q: the query's place in the tile sequence; qc: the query whose row it reads and writes.
                    q = q0 + slot
                    qc = cutlass.min(q0 + read_slot, Lq - 1)
                    if cutlass.const_expr(self.permuted):
                        qc = cutlass.Int32(mOrder[n, qc])
                    acc = cute.make_rmem_tensor(cute.make_layout(self.C), cutlass.Float32)
                    acc.fill(0.0)
                    row = (cutlass.Int64(n) * Lq + qc) * self.M + m
                    source = ("global", mLoc, mAttn, row)
                    if cutlass.const_expr(self.prefetch):
                        input_rings.wait(input_state)
                        source = ("smem", head_rows(sLoc[None, input_state.index], 2 * self.LP, m),
                                  head_rows(sAttn[None, input_state.index], self.LP, m), read_slot,
                                  self.cfg.loc_row_elems, self.cfg.attn_row_elems)
                    ref = (mRef, cutlass.Int64(n) * Lq + qc) if cutlass.const_expr(self.fused) else None
                    if gathers:
                        inputs = QueryInputs.create(self.L, self.P, self.fused, self.cfg.ref_dims, source, ref,
                                                    (chunk, self.T) if cutlass.const_expr(self.split) else None,
                                                    self.cfg.staggers_locations)
                        # KernelConfig.alternates: the staged levels first or last, by group and tile in turn.
                        staged_phase = 0
                        if cutlass.const_expr(self.cfg.alternates):
                            turn = (tile - first) // self.tile_stride
                            staged_phase = (turn + g) % 2
                            if cutlass.const_expr(self.cfg.l1_first_tile):
                                # A segment's first tile: the L1 levels while the staging lands, in every group.
                                staged_phase = cutlass.select_(turn == 0, 1, staged_phase)
                        box_state = self.gather_tile(acc, inputs, mValue, sStaged, sLevels, staging, box_rings,
                                                     box_state, storage, segment, n, m, read_slot, chunk,
                                                     staged_phase)
                    if cutlass.const_expr(self.prefetch):
                        input_rings.release(input_state)
                        input_state.advance(input_rings.groups)
                    if active and q < Lq:
                        if sLevels[self.L, 0] == 0:
                            acc.fill(cutlass.Float32(float("nan")))
                        out_ptr = row_pointer(mOut, cutlass.Int64(n) * Lq + qc, self.M * self.D,
                                              m * self.D + chunk * self.C, self.C)
                        if cutlass.const_expr(self.cfg.output_evict_first):
                            nvvm.store_ext(acc.load().to(mOut.element_type).ir_value(), out_ptr.llvm_ptr,
                                           l2_cache_hint=cutlass.Int64(L2_EVICT_FIRST).ir_value())
                        else:
                            out = cute.make_tensor(out_ptr, cute.make_layout(self.C))
                            out.store(acc.load().to(mOut.element_type))
                t = seg_end
                segment += 1

    @cute.jit
    def gather_tile(self, acc, inputs, mValue, sStaged, sLevels, staging, box_rings, box_state, storage,
                    segment, n, m, slot, chunk, staged_phase):
        """Every level and point of this thread's query into acc. With L1 gathers the staged levels
        come first (they need the staging to have landed), unless l1_first, or in phase staged_phase (0 or
        1) where the configuration alternates; with per-sample boxes the staged levels overlap the boxes
        in flight."""
        if cutlass.const_expr(self.cfg.alternates):
            for phase in cutlass.range(2, unroll=1):
                if phase == staged_phase:
                    self.gather_staged(acc, inputs, sStaged, sLevels, staging, segment, chunk)
                else:
                    self.gather_unstaged_l1(acc, inputs, mValue, sLevels, n, m, chunk)
            return box_state
        if cutlass.const_expr(self.boxes or not self.cfg.l1_first):
            self.gather_staged(acc, inputs, sStaged, sLevels, staging, segment, chunk)
        if cutlass.const_expr(self.boxes):
            box_state = self.gather_boxes(acc, inputs, sLevels, box_rings, box_state, storage, slot, chunk)
        else:
            self.gather_unstaged_l1(acc, inputs, mValue, sLevels, n, m, chunk)
        if cutlass.const_expr(not self.boxes and self.cfg.l1_first):
            self.gather_staged(acc, inputs, sStaged, sLevels, staging, segment, chunk)
        return box_state

    @cute.jit
    def gather_unstaged_l1(self, acc, inputs, mValue, sLevels, n, m, chunk):
        """Every level that is not staged, through L1."""
        finest = cutlass.Int32(sLevels[self.L, 1])
        finest_l1 = "evict_first" if cutlass.const_expr(self.cfg.finest_evict_first) else ""
        coarse_l2 = L2_EVICT_LAST if cutlass.const_expr(self.cfg.coarse_evict_last) else 0
        for level in cutlass.range_constexpr(self.L):
            H, W, start, offset = self.level_row(sLevels, level)
            if offset < 0:
                if cutlass.const_expr(self.cfg.finest_evict_first or self.cfg.coarse_evict_last):
                    if level == finest:
                        self.gather_level_l1(acc, inputs, mValue, start, H, W, n, m, level, chunk, finest_l1, 0)
                    else:
                        self.gather_level_l1(acc, inputs, mValue, start, H, W, n, m, level, chunk, "", coarse_l2)
                else:
                    self.gather_level_l1(acc, inputs, mValue, start, H, W, n, m, level, chunk, "", 0)

    def level_row(self, sLevels, level: int):
        """(H, W, first pixel, offset in the staging buffer or -1) of one level, from shared memory."""
        return (cutlass.Int32(sLevels[level, 0]), cutlass.Int32(sLevels[level, 1]), sLevels[level, 2],
                cutlass.Int32(sLevels[level, 3]))

    @cute.jit
    def gather_points(self, acc, inputs, level: int, H, W, top_left, corner, batch: int):
        """Every point of one level into acc, the loads of `batch` samples issued before any of them is
        summed."""
        pending = []
        total, summed = None, 0  # KernelConfig.half_sums: the packed half sum of the level's last samples
        for fetched, last in self.fetched_samples(inputs, level, H, W, top_left, corner):
            pending.append(fetched)
            if cutlass.const_expr(len(pending) == batch or last):
                for sample in pending:
                    if cutlass.const_expr(self.bilinear.fold):
                        _, weights, corners = sample
                        total = self.bilinear.sum_half(total, weights, corners)
                        summed += 1
                        if cutlass.const_expr(summed == self.cfg.half_sums):
                            self.bilinear.flush(acc, total)
                            total, summed = None, 0
                    else:
                        self.bilinear.accumulate(acc, *sample)
                pending = []
        if cutlass.const_expr(total is not None):
            self.bilinear.flush(acc, total)

    def fetched_samples(self, inputs, level: int, H, W, top_left, corner):
        """Each sample of one level with its loads issued, in order, and whether a batch ends after it (the
        level's last point; split: the last record of a round). Split: this thread sets up its own points
        (chunk, chunk + T, ...), then each point's record comes from the thread that set it up (a shuffle a
        value); point j * T + src is thread src's j-th, so one record of this thread's is live at a time."""
        points = inputs.level(level, H, W)
        if inputs.lanes is None:
            for point in range(self.P):
                w, h, a = points(point)
                yield self.bilinear.fetch(w, h, a, H, W, top_left, corner), point == self.P - 1
        else:
            for j, (point, _) in enumerate(inputs.own_points()):
                w, h, a = points(point)
                record = self.bilinear.setup(w, h, a, H, W)
                count = min(self.T, self.P - j * self.T)
                for src in range(count):
                    yield self.bilinear.fetch_record(share(record, src, self.T), top_left, corner), src == count - 1

    @cute.jit
    def gather_staged(self, acc, inputs, sStaged, sLevels, staging, segment, chunk):
        """All points of the staged levels, from shared memory. Waits (once per segment, then free) for
        the segment's staging to land."""
        staging.wait(segment)
        for level in cutlass.range_constexpr(self.L):
            H, W, _, base = self.level_row(sLevels, level)
            if base >= 0:
                if cutlass.const_expr(self.cfg.doubles_coarsest and level == self.L - 1):
                    if sLevels[self.L, 2] != 0:  # doubled: this thread reads the copies in its query slot's half
                        self.gather_staged_level(acc, inputs, sStaged, level, H, W, base, chunk,
                                                 cute.arch.thread_idx()[0] // self.T % 2)
                    else:
                        self.gather_staged_level(acc, inputs, sStaged, level, H, W, base, chunk)
                else:
                    self.gather_staged_level(acc, inputs, sStaged, level, H, W, base, chunk)

    def gather_staged_level(self, acc, inputs, sStaged, level: int, H, W, base, chunk, half=None):
        """One staged level's points (half: doubled, the copies in that half of each line)."""
        top_left, corner = staged_corners(self.bilinear, sStaged, base, W, chunk, self.D, self.stage_pixels,
                                          self.cfg.staged_addresses, half)
        self.gather_points(acc, inputs, level, H, W, top_left, corner, 1)

    @cute.jit
    def gather_level_l1(self, acc, inputs, mValue, start, H, W, n, m, level: int, chunk, l1_priority: str,
                        l2_policy: int):
        """All points of one level straight from global memory with vector loads, which L1 caches:
        neighbouring queries of a tile read overlapping footprints."""
        S = mValue.shape[1]
        e = self.cfg.itemsize
        pixel_bytes = self.M * self.D * e
        base = (mValue.iterator.toint() + (cutlass.Int64(n) * S + start) * pixel_bytes
                + (m * self.D + chunk * self.C) * e)
        top_left, corner = global_corners(self.bilinear, base, W, pixel_bytes, self.value_dtype,
                                          self.cfg.line_prefetch, l1_priority, l2_policy)
        self.gather_points(acc, inputs, level, H, W, top_left, corner, self.cfg.gather_batch)

    @cute.jit
    def gather_boxes(self, acc, inputs, sLevels, rings, state, storage, slot, chunk):
        """fine_gather="tma": the unstaged levels' samples from the group's box ring, point by point."""
        D, C = self.D, self.C
        sBoxes = storage.box_ring.get_tensor(cute.make_layout(self.cfg.box_ring_elems))
        stage_elems = self.G * 4 * D
        for level in cutlass.range_constexpr(self.L):
            H, W, _, offset = self.level_row(sLevels, level)
            if offset < 0:
                points = inputs.level(level, H, W)
                for point in cutlass.range_constexpr(self.P):
                    w, h, a = points(point)
                    inside, _, _, lw, lh = self.bilinear.footprint(w, h, H, W)
                    rings.wait(state)
                    box = sBoxes.iterator + state.index * stage_elems + slot * (4 * D) + chunk * C
                    corners = [self.bilinear.load(box + k * D) for k in range(4)]
                    a = cutlass.select_(inside, a, cutlass.Float32(0.0))
                    self.bilinear.accumulate(acc, a, self.bilinear.weights(lw, lh), corners)
                    # Release after the loads are consumed: in-order issue means they completed.
                    rings.release(state)
                    state.advance(rings.groups)
        return state
