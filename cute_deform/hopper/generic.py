"""The generic Hopper kernel: every shape the tiled kernel does not take.

Head dims whose rows are not whole 16-byte vectors (D = 1, 2, 3, 30, 71, 1025, ... in any dtype) or
longer than 128 vectors, and more than 5 levels or 16 points. A thread owns one vector of C channels
(the widest power of two that divides D, at most 16 bytes) of one (image, query, head) and walks every
level and point of it; consecutive threads hold consecutive vectors of a head, so a warp's corner
loads are coalesced and the query's inputs are read once per warp through L1. No shared memory, no
TMA: the rule and the fp32 accumulation are the tiled kernel's (sampling.Bilinear), fused inputs
included.
"""
from __future__ import annotations

from dataclasses import dataclass

try:
    import cutlass
    import cutlass.cute as cute
except Exception:
    pass

from .config import ProblemConfig
from .inputs import checked_level, exp_shifted, row_pointer
from .sampling import Bilinear

THREADS = 256


@dataclass(frozen=True)
class GenericConfig(ProblemConfig):
    """The generic kernel takes the problem's static parameters and nothing else."""

    @property
    def channels_per_thread(self) -> int:
        """The widest power of two that divides D, at most 16 bytes."""
        c = 1
        while self.head_dim % (2 * c) == 0 and 2 * c * self.itemsize <= 16:
            c *= 2
        return c

    @property
    def ctas_per_sm(self) -> int:
        return 2048 // THREADS


class MSDAGeneric:
    def __init__(self, config: GenericConfig):
        self.cfg = config
        self.M, self.L, self.P, self.D = config.num_heads, config.num_levels, config.num_points, config.head_dim
        self.LP = self.L * self.P
        self.C = config.channels_per_thread
        self.V = self.D // self.C  # vectors per head
        dt = {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}
        self.value_dtype = dt[config.value_dtype]
        self.bilinear = Bilinear(self.value_dtype, self.C, packed=False)

    @cute.jit
    def __call__(self, mValue: cute.Tensor, mShapes: cute.Tensor, mStarts: cute.Tensor, mLoc: cute.Tensor,
                 mAttn: cute.Tensor, mRef: cute.Tensor, mOut: cute.Tensor, grid_size: cutlass.Int32, stream):
        self.kernel(mValue, mShapes, mStarts, mLoc, mAttn, mRef, mOut).launch(
            grid=[grid_size, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mValue: cute.Tensor, mShapes: cute.Tensor, mStarts: cute.Tensor, mLoc: cute.Tensor,
               mAttn: cute.Tensor, mRef: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid = cute.arch.grid_dim()[0]
        N, S = mValue.shape[0], mValue.shape[1]
        Lq = mLoc.shape[1]
        M, D, C, P = self.M, self.D, self.C, self.P
        e = self.cfg.itemsize
        pixel_bytes = M * D * e
        # A level that does not fit in value turns the output NaN (and is read as a 1x1 level).
        levels_ok = cutlass.Boolean(True)
        for level in cutlass.range(self.L, unroll=1):
            H, W, start, ok = checked_level(mShapes, mStarts, level, S)
            levels_ok = levels_ok & ok
        items = cutlass.Int64(N) * Lq * M * self.V
        step = cutlass.Int64(grid) * THREADS
        item = cutlass.Int64(bidx) * THREADS + tidx
        while item < items:
            row = item // self.V  # (image, query, head)
            vector = cutlass.Int32(item % self.V)
            m = cutlass.Int32(row % M)
            nq = row // M
            n = nq // Lq
            acc = cute.make_rmem_tensor(cute.make_layout(C), cutlass.Float32)
            acc.fill(0.0)
            top, inv_total = cutlass.Float32(0.0), cutlass.Float32(1.0)
            if cutlass.const_expr(self.cfg.fused):
                top, inv_total = self.softmax(mAttn, row)
            for level in cutlass.range(self.L, unroll=1):
                H, W, start, _ = checked_level(mShapes, mStarts, level, S)
                Wf, Hf = cutlass.Float32(W), cutlass.Float32(H)
                base_w, base_h = cutlass.Float32(-0.5), cutlass.Float32(-0.5)
                scale_w, scale_h = Wf, Hf
                if cutlass.const_expr(self.cfg.fused):
                    R = self.cfg.ref_dims
                    ref = cute.make_tensor(row_pointer(mRef, nq, self.L * R, level * R, 1), cute.make_layout(R))
                    base_w = ref[0].to(cutlass.Float32) * Wf - 0.5
                    base_h = ref[1].to(cutlass.Float32) * Hf - 0.5
                    scale_w, scale_h = cutlass.Float32(1.0), cutlass.Float32(1.0)
                    if cutlass.const_expr(R == 4):
                        scale_w = ref[2].to(cutlass.Float32) * (0.5 / P) * Wf
                        scale_h = ref[3].to(cutlass.Float32) * (0.5 / P) * Hf
                value_base = (mValue.iterator.toint() + (cutlass.Int64(n) * S + start) * pixel_bytes
                              + (m * D + vector * C) * e)
                row_bytes = cutlass.Int64(W) * pixel_bytes
                for point in cutlass.range(P, unroll=1):
                    k = level * P + point
                    x = self.loc_of(mLoc, row, k, 0)
                    y = self.loc_of(mLoc, row, k, 1)
                    a = self.attn_of(mAttn, row, k)
                    w = x * scale_w + base_w
                    h = y * scale_h + base_h
                    if cutlass.const_expr(self.cfg.fused):
                        a = exp_shifted(a, top) * inv_total
                    inside, x0, y0, lw, lh = self.bilinear.footprint(w, h, H, W)
                    rows, cols = self.bilinear.inside_corners(x0, y0, H, W)
                    first = value_base + cutlass.Int64(y0 * W + x0) * pixel_bytes
                    corners = []
                    for dy in cutlass.range_constexpr(2):
                        for dx in cutlass.range_constexpr(2):
                            v = cute.make_rmem_tensor(cute.make_layout(C), self.value_dtype)
                            v.fill(0.0)
                            if rows[dy] and cols[dx]:
                                addr = first + ((row_bytes if dy else 0) + (pixel_bytes if dx else 0))
                                ptr = cute.make_ptr(self.value_dtype, addr, cute.AddressSpace.gmem,
                                                    assumed_align=C * e)
                                v.store(cute.make_tensor(ptr, cute.make_layout(C)).load())
                            corners.append(v.load())
                    a = cutlass.select_(inside, a, cutlass.Float32(0.0))
                    self.bilinear.accumulate(acc, a, self.bilinear.weights(lw, lh), corners)
            if not levels_ok:
                acc.fill(cutlass.Float32(float("nan")))
            out = cute.make_tensor(row_pointer(mOut, row, D, vector * C, C), cute.make_layout(C))
            out.store(acc.load().to(mOut.element_type))
            item += step

    def loc_of(self, mLoc, row, k, axis: int):
        ptr = row_pointer(mLoc, row, 2 * self.LP, k * 2 + axis, 1)
        return cute.make_tensor(ptr, cute.make_layout(1)).load().to(cutlass.Float32)[0]

    def attn_of(self, mAttn, row, k):
        ptr = row_pointer(mAttn, row, self.LP, k, 1)
        return cute.make_tensor(ptr, cute.make_layout(1)).load().to(cutlass.Float32)[0]

    @cute.jit
    def softmax(self, mAttn, row):
        """Maximum and reciprocal sum of exponentials of the row's L*P logits."""
        top = cutlass.Float32(-float("inf"))
        for k in cutlass.range(self.LP, unroll=1):
            top = cute.arch.fmax(top, self.attn_of(mAttn, row, k))
        total = cutlass.Float32(0.0)
        for k in cutlass.range(self.LP, unroll=1):
            total = total + exp_shifted(self.attn_of(mAttn, row, k), top)
        return top, 1.0 / total
