"""The order table on the device: each image's queries by position.

The tiled kernel can take a tile's queries through a table (KernelConfig.permuted), so that the queries
of a tile are spatial neighbours whatever order the caller hands them over in. The table needs no full
sort: a counting sort into ORDER_BANDS x ORDER_COLUMNS cells of the unit square (raster order: bands of
y, then columns of x) puts neighbours side by side, and the order inside a cell does not matter. Each
query's output is computed on its own in a fixed order, so a different table gives the same bits.

A first launch finds every query's cell (a thread a query). Then a CTA takes one image: it counts its
queries per cell in shared memory, turns the counts into each cell's first place (an exclusive scan), then
hands every query the next place of its cell (a shared-memory atomic: the order inside a cell is whichever
thread came first). The position of a query is the first
two numbers of its row of `positions` (the first sample's location, or the first level's reference
point); NaN counts as 1 and anything outside [0, 1] as the nearest edge.
"""
from __future__ import annotations

from dataclasses import dataclass

try:
    import cutlass
    import cutlass.cute as cute
    import cutlass.memory
except Exception:
    pass

# Bands of y finer than any level's rows: a 512 x 512 raster measured 2.7% faster than 128 x 128 on seed-b48
# (H100); 64 columns of x (32768 cells, 128 KB of counts in shared memory) timed the same as 512 (3812 against
# 3784-3810 us through the host sort, docs/performance.md, session 24).
ORDER_BANDS = 512
ORDER_COLUMNS = 64
ORDER_THREADS = 1024
# Queries of one image the kernels take; larger images are sorted by torch (a CTA an image would take long).
ORDER_MAX_QUERIES = 1 << 18


@cute.jit
def inclusive_scan(x, lane):
    """Sum of x over lanes 0..lane of the warp (shuffles up)."""
    for step in (1, 2, 4, 8, 16):
        up = cute.arch.shuffle_sync_up(x, step)
        x = x + cutlass.select_(lane >= step, up, cutlass.Int32(0))
    return x


@dataclass(frozen=True)
class OrderConfig:
    """What one compiled order kernel depends on: the dtype of the positions."""

    position_dtype: str


class QueryOrder:
    def __init__(self, config: OrderConfig):
        self.cfg = config
        self.cells = ORDER_BANDS * ORDER_COLUMNS
        self.per_thread = self.cells // ORDER_THREADS  # cells each thread clears

    @cute.jit
    def __call__(self, mPositions: cute.Tensor, mCells: cute.Tensor, mOrder: cute.Tensor, stream):
        """mPositions: (N, Lq, row) with a query's (x, y) first in its row; mCells: (N, Lq) int32, scratch;
        mOrder: (N, Lq) int64. Two launches: every query's cell (a thread a query, over the whole GPU: the
        positions lie a row apart), then the table (a CTA an image)."""

        @cute.struct
        class SharedStorage:
            counts: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.cells], 16]
            warp_sums: cute.struct.MemRange[cutlass.Int32, ORDER_THREADS // 32]

        self.shared_storage = SharedStorage
        N, Lq = mOrder.shape
        queries = cutlass.Int64(N) * Lq
        self.cell_kernel(mPositions, mCells).launch(grid=[cutlass.Int32((queries + 255) // 256), 1, 1],
                                                    block=[256, 1, 1], stream=stream)
        self.kernel(mCells, mOrder).launch(grid=[N, 1, 1], block=[ORDER_THREADS, 1, 1],
                                           smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def cell_kernel(self, mPositions: cute.Tensor, mCells: cute.Tensor):
        """The raster cell of every query."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        Lq = mCells.shape[1]
        i = cutlass.Int64(bidx) * 256 + tidx
        if i < cutlass.Int64(mCells.shape[0]) * Lq:
            n, q = cutlass.Int32(i // Lq), cutlass.Int32(i % Lq)
            cells = []
            for axis, count in ((1, ORDER_BANDS), (0, ORDER_COLUMNS)):
                v = cutlass.Float32(mPositions[n, q, axis])
                v = cutlass.select_(v == v, v, cutlass.Float32(1.0))  # NaN sorts last
                v = cutlass.min(cutlass.max(v, cutlass.Float32(0.0)), cutlass.Float32(1.0))
                cells.append(cutlass.Int32(v * cutlass.Float32(count - 1)))
            mCells[n, q] = cells[0] * ORDER_COLUMNS + cells[1]

    @cute.kernel
    def kernel(self, mCells: cute.Tensor, mOrder: cute.Tensor):
        """One image's table: count, scan, place."""
        tidx, _, _ = cute.arch.thread_idx()
        n, _, _ = cute.arch.block_idx()
        Lq = mOrder.shape[1]
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        counts = storage.counts.get_tensor(cute.make_layout(self.cells))
        warp_sums = storage.warp_sums.get_tensor(cute.make_layout(ORDER_THREADS // 32))
        lane = cute.arch.lane_idx()
        warp = tidx // 32
        for i in cutlass.range_constexpr(self.per_thread):
            counts[tidx + i * ORDER_THREADS] = cutlass.Int32(0)
        cute.arch.sync_threads()
        for q in cutlass.range(tidx, Lq, ORDER_THREADS, unroll=4):
            cute.arch.atomic_add(counts.iterator + mCells[n, q], cutlass.Int32(1), scope="cta")
        cute.arch.sync_threads()
        # Exclusive scan of the counts. Warp w owns cells [w * run, (w + 1) * run) and reads them 32 at a
        # time (a lane a cell: no bank conflicts): first the run's total, then, from the totals' scan
        # across warps, each cell's first place.
        run = self.cells // (ORDER_THREADS // 32)
        start = warp * run
        total = cutlass.Int32(0)
        for i in cutlass.range_constexpr(run // 32):
            total = total + counts[start + i * 32 + lane]
        total = cute.arch.warp_reduction_sum(total)
        if lane == 0:
            warp_sums[warp] = total
        cute.arch.sync_threads()
        if warp == 0:
            mine = warp_sums[lane]
            warp_sums[lane] = inclusive_scan(mine, lane) - mine
        cute.arch.sync_threads()
        carry = warp_sums[warp]
        for i in cutlass.range_constexpr(run // 32):
            c = counts[start + i * 32 + lane]
            inclusive = inclusive_scan(c, lane)
            counts[start + i * 32 + lane] = carry + inclusive - c
            carry = carry + cute.arch.shuffle_sync(inclusive, 31)
        cute.arch.sync_threads()
        for q in cutlass.range(tidx, Lq, ORDER_THREADS, unroll=4):
            place = cute.arch.atomic_add(counts.iterator + mCells[n, q], cutlass.Int32(1), scope="cta")
            mOrder[n, place] = cutlass.Int64(q)
