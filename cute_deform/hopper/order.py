"""The order table on the device: each image's queries by position.

The tiled kernel can take a tile's queries through a table (KernelConfig.permuted), so that the queries
of a tile are spatial neighbours whatever order the caller hands them over in. The table needs no full
sort: a counting sort into cells of the unit square (raster order: bands of y, then columns of x) puts
neighbours side by side, and the order inside a cell does not matter. A cell is about ORDER_CELL_ROWS rows by
2.5 columns of the finest level's pixels (order_grid), so the 32 queries of a tile take a patch of about two
cells, not a strip of one row. Each query's output is computed on its own in a fixed order, so a different
table gives the same bits.

A first launch finds every query's cell (a thread a query). Then a CTA takes one image: it counts its
queries per cell in shared memory, turns the counts into each cell's first place (an exclusive scan), then
hands every query the next place of its cell (a shared-memory atomic: the order inside a cell is whichever
thread came first). The position of a query is the first
two numbers of its row of `positions` (the first sample's location, or the first level's reference
point); NaN counts as 1 and anything outside [0, 1] as the nearest edge.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ceil_div

try:
    import cutlass
    import cutlass.cute as cute
    import cutlass.memory
except Exception:
    pass

# Cells of ORDER_CELL_ROWS rows by 2.5 columns of the finest level. On seed-b48 (92 x 160), through fixed tables
# (H100, session 26, docs/performance.md): 16 bands by 64 columns 3546-3549 us sorted and 3555-3557 shuffled,
# against 3635-3637 and 3637-3721 for session 24's 512 x 64 (bands finer than a row: a tile is a strip of one
# row); 8 bands (11.5 rows) 3665-3674, 32 bands 3554-3562.
ORDER_CELL_ROWS = 6
ORDER_CELL_COLUMNS_X2 = 5  # a column is 5 / 2 pixels wide
ORDER_CELLS = 32768  # bands x columns at most: the counts in shared memory (128 KB)
ORDER_THREADS = 1024
CELL_THREADS = 256  # the cell kernel's block: a thread a query
# Queries of one image the kernels take; larger images are sorted by torch (a CTA an image would take long).
ORDER_MAX_QUERIES = 1 << 18


def order_grid(shapes):
    """(bands, columns) of the cells for a level table (L, 2) of (H, W) (int64, on any device): the finest level
    (the most pixels, the first of equals) in bands of ORDER_CELL_ROWS rows and columns of 2.5 pixels, each at
    least 1, at most ORDER_CELLS cells (columns give way first). 0-d tensors on shapes' device: no host sync.
    The order kernel computes the same on the device."""
    import torch

    pixels = shapes[:, 0] * shapes[:, 1]
    H, W = shapes.index_select(0, pixels.argmax().view(1))[0].unbind()  # indexing by a tensor would sync
    bands = (H // ORDER_CELL_ROWS).clamp(1, ORDER_CELLS)
    columns = torch.minimum((W * 2 // ORDER_CELL_COLUMNS_X2).clamp(min=1), ORDER_CELLS // bands)
    return bands, columns


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
        self.cells = ORDER_CELLS
        self.per_thread = self.cells // ORDER_THREADS  # cells each thread clears

    @cute.jit
    def __call__(self, mPositions: cute.Tensor, mShapes: cute.Tensor, mCells: cute.Tensor, mOrder: cute.Tensor,
                 stream):
        """mPositions: (N, Lq, row) with a query's (x, y) first in its row; mShapes: (L, 2) int64, the levels'
        (H, W); mCells: (N, Lq) int32, scratch; mOrder: (N, Lq) int64. Two launches: every query's cell (a
        thread a query, over the whole GPU: the positions lie a row apart), then the table (a CTA an image)."""

        @cute.struct
        class SharedStorage:
            counts: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.cells], 16]
            warp_sums: cute.struct.MemRange[cutlass.Int32, ORDER_THREADS // 32]

        self.shared_storage = SharedStorage
        N, Lq = mOrder.shape
        queries = cutlass.Int64(N) * Lq
        blocks = cutlass.Int32(ceil_div(queries, CELL_THREADS))
        self.cell_kernel(mPositions, mShapes, mCells).launch(grid=[blocks, 1, 1], block=[CELL_THREADS, 1, 1],
                                                             stream=stream)
        self.kernel(mCells, mOrder).launch(grid=[N, 1, 1], block=[ORDER_THREADS, 1, 1],
                                           smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def cell_kernel(self, mPositions: cute.Tensor, mShapes: cute.Tensor, mCells: cute.Tensor):
        """The raster cell of every query (order_grid's cells)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        Lq = mCells.shape[1]
        i = cutlass.Int64(bidx) * CELL_THREADS + tidx
        if i < cutlass.Int64(mCells.shape[0]) * Lq:
            H, W = cutlass.Int64(mShapes[0, 0]), cutlass.Int64(mShapes[0, 1])
            for level in cutlass.range(1, mShapes.shape[0], unroll=1):
                h, w = cutlass.Int64(mShapes[level, 0]), cutlass.Int64(mShapes[level, 1])
                more = h * w > H * W
                H = cutlass.select_(more, h, H)
                W = cutlass.select_(more, w, W)
            bands = cutlass.Int32(cutlass.min(cutlass.max(H // ORDER_CELL_ROWS, 1), ORDER_CELLS))
            columns = cutlass.Int32(cutlass.min(cutlass.max(W * 2 // ORDER_CELL_COLUMNS_X2, 1),
                                                cutlass.Int64(ORDER_CELLS // bands)))
            n, q = cutlass.Int32(i // Lq), cutlass.Int32(i % Lq)
            cells = []
            for axis, count in ((1, bands), (0, columns)):
                v = cutlass.Float32(mPositions[n, q, axis])
                v = cutlass.select_(v == v, v, cutlass.Float32(1.0))  # NaN sorts last
                v = cutlass.min(cutlass.max(v, cutlass.Float32(0.0)), cutlass.Float32(1.0))
                cells.append(cutlass.min(cutlass.Int32(v * cutlass.Float32(count)), count - 1))
            mCells[n, q] = cells[0] * columns + cells[1]

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
