"""The per-sample arithmetic of a consumer thread: where a sample's 2x2 footprint lies, its bilinear
weights, which corners lie in the level, and the weighted sum into the fp32 accumulator.

The rule is the original Deformable-DETR kernel's: a sample at pixel position (w, h) adds nothing
unless -1 < h < H and -1 < w < W (false for NaN); otherwise it adds
    a * (w00 v[h0, w0] + w01 v[h0, w0+1] + w10 v[h0+1, w0] + w11 v[h0+1, w0+1])
with a corner outside the level reading 0. A thread holds C channels of one query's head: each corner
is one vector load (16 or 8 bytes).
"""
from __future__ import annotations

try:
    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir import ir
    from cutlass._mlir.dialects import nvvm
except Exception:
    pass


def share(record, src, lanes: int):
    """Every value of a record (numbers, or 32-bit vectors) from thread `src` of each aligned run of
    `lanes` threads of the warp (shfl.sync.idx over segments of `lanes`)."""
    segment = ((32 - lanes) << 8) | 31
    return tuple(cute.arch.shuffle_sync(v, src, mask_and_clamp=segment) for v in record)


class Bilinear:
    def __init__(self, value_dtype, channels: int, packed: bool, fold: bool = False):
        self.value_dtype = value_dtype
        self.C = channels
        # fp16/bf16: the four-corner sum in packed half arithmetic (HFMA2), then one fp32 FMA per
        # channel into the accumulator: half the instructions of converting all four corners first.
        self.packed = packed
        # Packed only (KernelConfig.half_sums): the attention weight goes into the corner weights, and the
        # corner sums of several samples add up in packed half arithmetic before one fp32 add (sum_half, flush).
        self.fold = fold and packed

    @cute.jit
    def footprint(self, w, h, H, W):
        """(inside, x0, y0, lw, lh) of a sample at pixel position (w, h) (already minus 0.5). A skipped
        sample gets the corner (-2, -2), wholly outside the level, and zero fractions, so its weights are
        finite and its corners all read zeros."""
        inside = h > -1.0 and h < cutlass.Float32(H) and w > -1.0 and w < cutlass.Float32(W)
        fw = cute.math.floor(w)
        fh = cute.math.floor(h)
        x0 = cutlass.select_(inside, cutlass.Int32(fw), cutlass.Int32(-2))
        y0 = cutlass.select_(inside, cutlass.Int32(fh), cutlass.Int32(-2))
        lw = cutlass.select_(inside, w - fw, cutlass.Float32(0.0))
        lh = cutlass.select_(inside, h - fh, cutlass.Float32(0.0))
        return inside, x0, y0, lw, lh

    def weights(self, lw, lh, a=None):
        """Bilinear weights of the corners (0,0), (0,1), (1,0), (1,1) as (dy, dx), times a where given."""
        hw = 1.0 - lw
        hh = 1.0 - lh
        if a is not None:
            hh = a * hh
            lh = a * lh
        return hh * hw, hh * lw, lh * hw, lh * lw

    def inside_corners(self, x0, y0, H, W):
        """Whether the footprint's rows (y0, y0 + 1) and columns (x0, x0 + 1) lie in the level: a
        coordinate is in [0, n) when it is below n as an unsigned number (4 compares, not 16)."""
        Wu = cutlass.Uint32(W)
        Hu = cutlass.Uint32(H)
        cols = (cutlass.Uint32(x0) < Wu, cutlass.Uint32(x0 + 1) < Wu)
        rows = (cutlass.Uint32(y0) < Hu, cutlass.Uint32(y0 + 1) < Hu)
        return rows, cols

    @cute.jit
    def load(self, ptr):
        """One corner's C channels, in value's dtype."""
        return cute.make_tensor(ptr, cute.make_layout(self.C)).load()

    @cute.jit
    def accumulate(self, acc, a, weights, corners):
        """acc += a * (sum of weight * corner), the sum in value's dtype (packed) or in fp32."""
        if cutlass.const_expr(self.packed):
            dt = self.value_dtype
            weights = [w if isinstance(w, dt) else dt(w) for w in weights]
            total = corners[0] * weights[0]
            for c in cutlass.range_constexpr(1, 4):
                total = total + corners[c] * weights[c]
            acc.store(acc.load() + a * total.to(cutlass.Float32))
        else:
            total = corners[0].to(cutlass.Float32) * weights[0]
            for c in cutlass.range_constexpr(1, 4):
                total = total + corners[c].to(cutlass.Float32) * weights[c]
            acc.store(acc.load() + a * total)

    @cute.jit
    def sum_half(self, total, weights, corners):
        """fold: one sample's corner sum (its weights include a) in packed half arithmetic, added to total
        (None: the first of a sum). Each sample's sum is formed apart, so the chain from one sample's loads
        to the running sum is one add."""
        dt = self.value_dtype
        weights = [w if isinstance(w, dt) else dt(w) for w in weights]
        own = corners[0] * weights[0]
        for c in cutlass.range_constexpr(1, 4):
            own = own + corners[c] * weights[c]
        if cutlass.const_expr(total is None):
            return own
        return total + own

    @cute.jit
    def flush(self, acc, total):
        """fold: a packed half sum into the fp32 accumulator."""
        acc.store(acc.load() + total.to(cutlass.Float32))

    @cute.jit
    def setup(self, w, h, a, H, W):
        """One sample's record for sample_record: (first corner's pixel index in the level, a bit per
        corner in the level, a (0 for a skipped sample; fold: left out, it is in the weights), then the corner
        weights: four fp32, or, packed, two pairs in value's dtype)."""
        inside, x0, y0, lw, lh = self.footprint(w, h, H, W)
        rows, cols = self.inside_corners(x0, y0, H, W)
        mask = cutlass.Int32(0)
        for dy in cutlass.range_constexpr(2):
            for dx in cutlass.range_constexpr(2):
                mask = mask | cutlass.select_(rows[dy] & cols[dx], cutlass.Int32(1 << (2 * dy + dx)),
                                              cutlass.Int32(0))
        # A skipped sample adds 0 even with an inf or NaN weight, as in the original kernel.
        a = cutlass.select_(inside, a, cutlass.Float32(0.0))
        weights = self.weights(lw, lh, a) if cutlass.const_expr(self.fold) else self.weights(lw, lh)
        if cutlass.const_expr(self.packed):
            pairs = []
            for k in cutlass.range_constexpr(2):
                pair = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
                pair[0] = weights[2 * k]
                pair[1] = weights[2 * k + 1]
                pairs.append(pair.load().to(self.value_dtype))
            weights = tuple(pairs)
        if cutlass.const_expr(self.fold):  # a is in the weights
            return (y0 * W + x0, mask) + tuple(weights)
        return (y0 * W + x0, mask, a) + tuple(weights)

    def record_weights(self, record):
        """The four corner weights of a record (scalars in value's dtype when packed)."""
        if self.packed:
            k = 2 if self.fold else 3
            return record[k][0], record[k][1], record[k + 1][0], record[k + 1][1]
        return record[3:7]

    def load_corners(self, first, corner, in_level):
        """The four corners of a footprint, (0,0), (0,1), (1,0), (1,1) as (dy, dx): corner(first, dy, dx,
        in_level(dy, dx)) each."""
        return [corner(first, dy, dx, in_level(dy, dx)) for dy in range(2) for dx in range(2)]

    @cute.jit
    def fetch_record(self, record, top_left, corner):
        """The loads of a record's sample (setup's, possibly another thread's), issued: (a, weights,
        corners) for accumulate (fold: a is None, and in the weights)."""
        mask = record[1]
        corners = self.load_corners(top_left(record[0]), corner, lambda dy, dx: (mask & (1 << (2 * dy + dx))) != 0)
        if cutlass.const_expr(self.fold):
            return None, self.record_weights(record), corners
        return record[2], self.record_weights(record), corners

    @cute.jit
    def fetch(self, w, h, a, H, W, top_left, corner):
        """The loads of one sample, issued: (a, weights, corners) for accumulate (fold: a is None, and in the
        weights). top_left(pixel index) gives the first corner's location, corner(first, dy, dx, in_level)
        loads one corner (zeros where not in_level)."""
        inside, x0, y0, lw, lh = self.footprint(w, h, H, W)
        rows, cols = self.inside_corners(x0, y0, H, W)
        corners = self.load_corners(top_left(y0 * W + x0), corner, lambda dy, dx: rows[dy] & cols[dx])
        # A skipped sample adds 0 even with an inf or NaN weight, as in the original kernel.
        a = cutlass.select_(inside, a, cutlass.Float32(0.0))
        if cutlass.const_expr(self.fold):
            return None, self.weights(lw, lh, a), corners
        return a, self.weights(lw, lh), corners


def staged_corners(bilinear: Bilinear, sStaged, base, W, chunk, head_dim: int, zero_pixel: int,
                   addresses: bool = False, half=None):
    """(first corner from its pixel index, one corner's channels) in a level staged in shared memory
    at pixel `base`; a corner outside the level reads the zero pixel after the staged levels.
    addresses (KernelConfig.staged_addresses): the first corner is a byte address, and each corner selects
    between its address and the zero pixel's, the column step an immediate offset of the load, instead of
    selecting a pixel index and forming each corner's address from it: the same loads, fewer instructions.
    half (KernelConfig.doubles_coarsest): the level holds each pixel row twice in a 128-byte line, and
    this thread reads the copy in half `half` of it."""
    C = bilinear.C
    copies = 1 if half is None else 2
    first = base if half is None else base + half  # this thread's copy of pixel 0, in 64-byte rows
    if addresses:
        width = bilinear.value_dtype.width // 8
        row = head_dim * width
        origin = (sStaged.iterator + chunk * C).toint()
        zero = origin + zero_pixel * row
        pixel_bytes = copies * row
        row_bytes = W * pixel_bytes
        start = origin + first * row

        def corner_at(top_left, dy: int, dx: int, ok):
            addr = top_left + row_bytes if dy else top_left
            addr = cutlass.select_(ok, addr, zero - dx * pixel_bytes) + dx * pixel_bytes
            return bilinear.load(cute.make_ptr(bilinear.value_dtype, addr, cute.AddressSpace.smem,
                                               assumed_align=C * width))

        return (lambda p: start + p * pixel_bytes), corner_at

    row_step = copies * W

    def corner(top_left, dy: int, dx: int, ok):
        row = cutlass.select_(ok, top_left + ((row_step if dy else 0) + copies * dx), cutlass.Int32(zero_pixel))
        return bilinear.load(sStaged.iterator + row * head_dim + chunk * C)

    return (lambda p: first + copies * p), corner


def global_corners(bilinear: Bilinear, value_base, W, pixel_bytes: int, value_dtype, line_prefetch: bool = False,
                   l1_priority: str = "", l2_policy: int = 0):
    """(first corner's address from its pixel index, one corner's channels) in a level read from global
    memory with vector loads (C channels) that L1 caches. value_base: this thread's channels of the
    level's pixel 0 (an Int64 address). A corner outside the level is a predicated-off load of zeros
    (cheaper than selecting a 64-bit address of zeros). line_prefetch: the loads ask L2 for whole 128-byte lines;
    l2_policy: an L2 eviction policy for the loads (0: none)."""
    hinted = line_prefetch or bool(l1_priority) or bool(l2_policy)
    vector = ir.VectorType.get([bilinear.C], value_dtype.mlir_type) if hinted else None
    align = bilinear.C * value_dtype.width // 8  # one corner's vector
    prefetch = nvvm.L2PrefetchSize.SIZE_128B if line_prefetch else None
    evict = {"": None, "evict_first": nvvm.EvictKind.FIRST}[l1_priority]
    row_bytes = cutlass.Int64(W) * pixel_bytes

    @cute.jit
    def corner(top_left, dy: int, dx: int, ok):
        addr = top_left
        if cutlass.const_expr(dy):
            addr = addr + row_bytes
        if cutlass.const_expr(dx):
            addr = addr + pixel_bytes
        v = cute.make_rmem_tensor(cute.make_layout(bilinear.C), value_dtype)
        v.fill(0.0)
        if ok:
            ptr = cute.make_ptr(value_dtype, addr, cute.AddressSpace.gmem, assumed_align=align)
            if cutlass.const_expr(hinted):
                hint = cutlass.Int64(l2_policy).ir_value() if cutlass.const_expr(l2_policy != 0) else None
                line = nvvm.load_ext(vector, ptr.llvm_ptr, l2_cache_hint=hint, evict=evict, prefetch=prefetch)
                v.store(cute.TensorSSA(line, (bilinear.C,), value_dtype))
            else:
                v.store(bilinear.load(ptr))
        return v.load()

    return (lambda p: value_base + cutlass.Int64(p) * pixel_bytes), corner
