"""Where a query's sampling positions and attention weights come from, point by point.

A consumer thread reads one query's row of one head: either from the tile's stage that its group's
producer prefetched into shared memory, or, for shapes whose rows TMA cannot load, from global memory
one level at a time. The unfused kernel reads sampling locations and attention weights; the fused
kernel reads reference points, the raw sampling offsets and the attention logits, and computes what
Deformable DETR's module computes before calling the op:
    locations = ref + offset / (W, H)                      2-d reference points (x, y)
    locations = ref[:2] + offset / P * ref[2:] * 0.5       boxes (cx, cy, w, h)
    weights = softmax over the L*P logits of a (query, head), in fp32
Everything is returned in pixel units of the level: w = x * W - 0.5, h = y * H - 0.5.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .config import ceil_div

try:
    import cutlass
    import cutlass.cute as cute
except Exception:
    pass

LOG2E = math.log2(math.e)


def exp_shifted(logit, top):
    """exp(logit - top) as exp2, the difference first. Scaling first (logit * log2 e minus the scaled
    maximum) lets the compiler contract it into one FMA whose exact product no longer cancels the rounded
    maximum: a logit of 1e30 then got the weight 0 or inf instead of 1."""
    return cute.math.exp2((logit - top) * LOG2E, fastmath=True)


def _butterfly(x, lanes: int, op):
    """op over the aligned runs of `lanes` threads, in every thread of the run (xor shuffles)."""
    step = lanes // 2
    while step:
        x = op(x, cute.arch.shuffle_sync_bfly(x, step))
        step //= 2
    return x


def checked_level(mShapes: cute.Tensor, mStarts: cute.Tensor, level, S):
    """(H, W, first pixel, fits) of one level, read on the device. A level that does not fit in value
    (H or W < 1, start < 0, start + H*W > S: shapes the host could not check without a sync) reads as a
    1x1 level at pixel 0, so nothing is read out of bounds; the kernels then write their outputs as NaN
    rather than a silently wrong answer."""
    H = cutlass.Int64(mShapes[level, 0])
    W = cutlass.Int64(mShapes[level, 1])
    start = cutlass.Int64(mStarts[level])
    one = cutlass.Int64(1)
    ok = (H >= one) & (W >= one) & (H <= S) & (W <= S) & (start >= 0) & (start <= S - H * W)
    return (cutlass.Int32(cutlass.select_(ok, H, one)), cutlass.Int32(cutlass.select_(ok, W, one)),
            cutlass.select_(ok, start, cutlass.Int64(0)), ok)


def row_pointer(tensor: cute.Tensor, row, per_row: int, offset, length: int):
    """Pointer to `length` contiguous elements at `offset` of row `row` of a row-major tensor whose
    rows hold per_row elements; the index in 64 bits (N*Lq*M*L*P may exceed 2^31). Aligned to the
    largest power of two (at most 16 bytes) that divides the length in bytes: rows and level offsets
    are multiples of it."""
    width = tensor.element_type.width // 8
    index = cutlass.Int64(row) * per_row + offset
    align = min(16, length * width & -length * width)
    return cute.make_ptr(tensor.element_type, tensor.iterator.toint() + index * width, cute.AddressSpace.gmem,
                         assumed_align=align)


def load_row(tensor: cute.Tensor, row, per_row: int, offset, length: int):
    """`length` elements of a row as an fp32 register vector."""
    ptr = row_pointer(tensor, row, per_row, offset, length)
    return cute.make_tensor(ptr, cute.make_layout(length)).load().to(cutlass.Float32)


@dataclass(frozen=True)
class QueryInputs:
    """One thread's view of its query's inputs for one head (read only, so the DSL's branches need not
    carry it).

    source: ("smem", loc stage, weight stage, slot, elements from one row of locations to the next, the
    same for weights) or ("global", mLoc, mAttn, row) where row is the
    (image, query, head) row index; ref: (mRef, image * Lq + query) for the fused kernel, else None;
    softmax: fused, the logits' maximum (times log2 e) and the reciprocal of the sum of exponentials;
    lanes: None, or (chunk, T) where the T threads of a query split its points (thread `chunk` reads
    points chunk, chunk + T, ..., at run-time indices: `level`'s function then takes those)."""

    L: int
    P: int
    fused: bool
    ref_dims: int
    source: tuple
    ref: object
    softmax: object
    lanes: object = None
    stagger: bool = False

    @property
    def LP(self) -> int:
        return self.L * self.P

    @staticmethod
    def create(num_levels: int, num_points: int, fused: bool, ref_dims: int, source, ref,
               lanes=None, stagger: bool = False) -> "QueryInputs":
        inputs = QueryInputs(num_levels, num_points, fused, ref_dims, source, ref, None, lanes, stagger)
        if fused:
            softmax = inputs._softmax_split() if lanes is not None else inputs._softmax()
            inputs = dataclasses.replace(inputs, softmax=softmax)
        return inputs

    def _raw_logit(self, k):
        """Attention input k of the row (a weight, or a logit when fused) as fp32; k may be a run-time
        index."""
        if self.source[0] == "smem":
            _, _, sAttn, slot, _, attn_row = self.source
            a = cute.make_tensor(sAttn.iterator + slot * attn_row + k, cute.make_layout(1)).load()
            return a.to(cutlass.Float32)[0]
        _, _, mAttn, row = self.source
        return load_row(mAttn, row, self.LP, k, 1)[0]

    def _raw_xy(self, k):
        """Location (or offset) k of the row as fp32; k may be a run-time index."""
        if self.source[0] == "smem":
            _, sLoc, _, slot, loc_row, _ = self.source
            i = slot * loc_row + k * 2
            xy = cute.make_tensor(sLoc.iterator + i, cute.make_layout(2)).load().to(cutlass.Float32)
        else:
            _, mLoc, _, row = self.source
            xy = load_row(mLoc, row, 2 * self.LP, k * 2, 2)
        return xy[0], xy[1]

    def own_points(self):
        """Split: (point index, whether it is a point) of each point this thread computes in a level:
        chunk, chunk + T, ... (past the last point: the last, not used)."""
        chunk, T = self.lanes
        out = []
        for j in range(ceil_div(self.P, T)):
            point = chunk + j * T
            out.append((cutlass.min(point, self.P - 1), point < self.P))
        return out

    def _softmax_split(self):
        """_softmax with the T threads of a query each taking its own points of every level, then a
        butterfly over the T threads for the maximum and for the sum."""
        _, T = self.lanes
        own = []
        for level in range(self.L):
            for point, real in self.own_points():
                own.append((self._raw_logit(level * self.P + point), real))
        top = cutlass.Float32(-float("inf"))
        for logit, real in own:
            top = cute.arch.fmax(top, cutlass.select_(real, logit, cutlass.Float32(-float("inf"))))
        top = _butterfly(top, T, cute.arch.fmax)
        total = cutlass.Float32(0.0)
        for logit, real in own:
            total = total + cutlass.select_(real, exp_shifted(logit, top), cutlass.Float32(0.0))
        total = _butterfly(total, T, lambda x, y: x + y)
        return top, 1.0 / total

    def _softmax(self):
        """The logits' maximum and the reciprocal of the sum of exponentials, once per query."""
        logits = []
        if self.source[0] == "smem":
            for k in range(self.LP):
                logits.append(self._raw_logit(k))
        else:
            _, _, mAttn, row = self.source
            row_logits = load_row(mAttn, row, self.LP, 0, self.LP)
            for k in range(self.LP):
                logits.append(row_logits[k])
        top = logits[0]
        for k in range(1, self.LP):
            top = cute.arch.fmax(top, logits[k])
        total = cutlass.Float32(0.0)
        for k in range(self.LP):
            total = total + exp_shifted(logits[k], top)
        return top, 1.0 / total

    def _staggered_level(self, level: int, Wf, Hf):
        """level() where KernelConfig.staggers_locations: TMA loaded the ring with its 128-byte swizzle, so row q's
        16-byte chunk k (a level's two halves are chunks 2 level and 2 level + 1) lies at chunk k ^ (q % 8); the two
        queries of a quarter-warp then read different banks."""
        _, sLoc, _, slot, loc_row, _ = self.source
        row = sLoc.iterator + slot * loc_row
        flip = (slot & 7) * 4
        halves = [cute.make_tensor(row + ((level * 8 + 4 * h) ^ flip), cute.make_layout(4)).load().to(cutlass.Float32)
                  for h in range(2)]

        def staggered(point):
            half = halves[point // 2]
            x, y = half[2 * (point % 2)], half[2 * (point % 2) + 1]
            return x * Wf - 0.5, y * Hf - 0.5, self._raw_logit(level * self.P + point)
        return staggered

    def level(self, level: int, H, W):
        """A function of the point: (w, h, a) of every point of one level, in pixels of the level."""
        P = self.P
        Wf, Hf = cutlass.Float32(W), cutlass.Float32(H)
        if self.stagger:
            return self._staggered_level(level, Wf, Hf)
        if self.source[0] == "smem" or self.lanes is not None:
            def raw(point):
                x, y = self._raw_xy(level * P + point)
                return x, y, self._raw_logit(level * P + point)
        else:
            _, mLoc, mAttn, row = self.source
            xys = load_row(mLoc, row, 2 * self.LP, level * 2 * P, 2 * P)
            attn = load_row(mAttn, row, self.LP, level * P, P)

            def raw(point):
                return xys[2 * point], xys[2 * point + 1], attn[point]

        if not self.fused:
            def unfused(point):
                x, y, a = raw(point)
                return x * Wf - 0.5, y * Hf - 0.5, a
            return unfused

        mRef, ref_row = self.ref
        ref = load_row(mRef, ref_row, self.L * self.ref_dims, level * self.ref_dims, self.ref_dims)
        # Pixel position of the reference point, and of one unit of offset.
        base_w = ref[0] * Wf - 0.5
        base_h = ref[1] * Hf - 0.5
        scale_w, scale_h = cutlass.Float32(1.0), cutlass.Float32(1.0)
        if self.ref_dims == 4:
            scale_w = ref[2] * (0.5 / P) * Wf
            scale_h = ref[3] * (0.5 / P) * Hf
        top, inv_total = self.softmax

        def fused(point):
            dx, dy, logit = raw(point)
            a = exp_shifted(logit, top) * inv_total
            if self.ref_dims == 4:
                return base_w + dx * scale_w, base_h + dy * scale_h, a
            return base_w + dx, base_h + dy, a
        return fused
