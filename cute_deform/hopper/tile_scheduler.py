"""Which tiles each cluster works on, and in what order.

Tiles are numbered (image, head, query block), so consecutive tiles share an (image, head); a run of
them inside one range is a *segment*, and a segment shares one staging of the coarse levels. The tile
sequence is cut into `clusters * rounds` ranges of equal length, and in round r cluster c works on range
`r * clusters + c`. In any round all clusters therefore work inside one stretch of num_tiles / rounds
consecutive tiles, a bounded number of (image, head) slices of value. The host picks `rounds` so that
those slices fit in L2 (`plan`). With one round each cluster would sweep its own slices, far apart
in the batch, and when the queries of a tile are not spatial neighbours (queries in random order,
decoders) their footprints spread over the whole slice and L2 thrashes. Through the order table, where
they are neighbours, the rounds instead give each range about a segment (`aligned_rounds`), so that the
clusters on one image's heads reach the same place in them at about the same time.

With `whole` (few queries per image and head), range boundaries fall between segments: each cluster
then stages each of its segments once and meets no barrier in the middle of one. Otherwise a range that
crosses into a new segment waits there (a barrier, then the new staging); with `segment_cost` the split
counts each segment's start as that many tiles, and such a range takes fewer.

With `strips` (an encoder whose first level's rows are whole tiles), a segment's places are not its query
blocks in order: the first level's blocks are taken in column strips a tile wide, top to bottom
(`block_of`), so that a range is a tall narrow block of the image whose footprints L1 holds, not a few
whole rows.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ceil_div

try:
    import cutlass
    import cutlass.cute as cute
except Exception:  # the host-side plan works without the DSL
    cutlass = cute = None


@dataclass(frozen=True)
class Schedule:
    """The host's choice for one launch: rounds of ranges, and whether ranges are whole segments."""

    rounds: int
    whole: bool


def aligned_rounds(segments: int, clusters: int, blocks: int, min_range: int, tolerance: float) -> int | None:
    """The fewest rounds that give k ranges a segment, or up to `tolerance` more, for the smallest k that has
    such rounds: each range is then a k-th of a segment or a little less, so that the clusters working on
    one image's heads stay at about the same place in them. None where the ranges would be shorter than
    min_range tiles."""
    k = 1
    while True:
        rounds = ceil_div(k * segments, clusters)
        if blocks * segments < clusters * rounds * min_range:
            return None
        if clusters * rounds <= (1 + tolerance) * k * segments:
            return rounds
        k += 1


def plan(num_tiles: int, blocks: int, clusters: int, slice_bytes: int, window_bytes: int, min_range: int,
         slack: int, align: float = 0.0) -> Schedule:
    """Rounds such that the slices one round works on (its stretch of tiles, plus one slice for a range
    that straddles two) take at most window_bytes, but no range shorter than min_range tiles; then
    whole segments where they lengthen the longest range by at most `slack` tiles. With align > 0 the
    rounds are aligned_rounds' (tolerance align) instead, and the window is not used.

    num_tiles: N * M * blocks; blocks: query blocks (tiles) per (image, head); slice_bytes: one
    (image, head) slice of value; window_bytes <= 0: one round."""
    segments = num_tiles // blocks

    def whole_fits(ranges):
        return ceil_div(segments, ranges) * blocks * ranges <= num_tiles + slack * ranges

    if align > 0:
        rounds = aligned_rounds(segments, clusters, blocks, min_range, align)
        if rounds is not None:
            # Not `whole`, even where the segments divide evenly (the even split then starts every range at
            # a segment's start): one round of whole segments would put each cluster on its own images, and
            # `whole` brings in the rules of the decoders' launches.
            return Schedule(rounds, False)
    # Few segments (decoders): whole segments in one round win (two rounds on detr-decoder, H100: 69.7 against
    # 83.5 us in session 2; 57.1-57.5 against 66.3-66.4 in session 45, three rounds 63.7): each cluster stages
    # once and reads each slice alone.
    if whole_fits(clusters):
        return Schedule(1, True)
    rounds = 1
    if window_bytes > 0:
        slices = max(1, window_bytes // max(1, slice_bytes) - 1)
        window_tiles = max(slices * blocks, clusters * min_range)
        rounds = max(1, ceil_div(num_tiles, window_tiles))
    return Schedule(rounds, whole_fits(clusters * rounds))


@dataclass(frozen=True)
class TileScheduler:
    """The device side of the schedule, read only (so the DSL's loops need not carry it). Tile indices
    are Int32 (2^31 tiles of 32 queries would need terabytes of locations); products are formed in
    64 bits."""

    num_tiles: object
    blocks: object
    clusters: object
    ranges: object
    whole: object
    cluster_id: object
    num_heads: int
    segment_cost: int = 0
    strips: object = None  # KernelConfig.strips: (blocks in strips or 0, rows, blocks a row, 1 / rows), strip_plan's

    @staticmethod
    def create(num_tiles, blocks, clusters, rounds, whole, cluster_id, num_heads: int,
               segment_cost: int = 0, strips=None) -> "TileScheduler":
        return TileScheduler(cutlass.Int32(num_tiles), cutlass.Int32(blocks), cutlass.Int32(clusters),
                             cutlass.Int32(clusters * rounds), whole, cutlass.Int32(cluster_id), num_heads,
                             segment_cost, strips)

    @cute.jit
    def boundary(self, i):
        """Where range i begins: an even split of the tiles, or of the segments when whole."""
        segments = self.num_tiles // self.blocks
        if cutlass.const_expr(self.segment_cost == 0):
            even = cutlass.Int64(i) * self.num_tiles // self.ranges
        else:
            # Each segment counts segment_cost tiles more at its start (its staging): an even split of
            # the longer sequence, mapped back to tiles (a boundary inside a start lands on the segment).
            # The longer sequence fits an Int32 (launch_rules.choose_launch).
            span = self.blocks + self.segment_cost
            v = cutlass.Int64(i) * (cutlass.Int64(self.num_tiles) + self.segment_cost * segments) // self.ranges
            k = cutlass.Int32(v) // span
            even = cutlass.Int64(k * self.blocks + cutlass.max(cutlass.Int32(v) - k * span - self.segment_cost, 0))
            even = cutlass.min(even, cutlass.Int64(self.num_tiles))
        whole = cutlass.Int64(i) * segments // self.ranges * self.blocks
        return cutlass.Int32(cutlass.select_(self.whole != 0, whole, even))

    @cute.jit
    def range_of(self, round_):
        """[begin, end) of this cluster's range in a round."""
        i = round_ * self.clusters + self.cluster_id
        return self.boundary(i), self.boundary(i + 1)

    @cute.jit
    def segment_at(self, t, t_end):
        """The segment starting at tile t: its (image, head) index, its end, the image and the head."""
        nm = t // self.blocks
        end = cutlass.min(t_end, (nm + 1) * self.blocks)
        return nm, end, nm // self.num_heads, nm % self.num_heads

    @cute.jit
    def first_query(self, tile, nm, queries_per_tile: int):
        """First query of a tile of segment nm."""
        place = tile - nm * self.blocks
        if cutlass.const_expr(self.strips is not None):
            place = self.block_of(place)
        return place * queries_per_tile

    @cute.jit
    def block_of(self, place):
        """KernelConfig.strips: the query block a segment's place-th tile takes. Place i of the first level's
        strips is row i % H of column i // H; past them the block is the place. From registers only: a block
        that waits on a shared-memory read cannot be formed ahead of the stage's barrier wait, and ptxas then
        keeps the tile loop's addressing from overlapping the samples (session 35)."""
        strip_blocks, H, row_blocks, inverse = self.strips
        # place < 2^19 (strip_plan): (place + 0.5) / H lies at least 0.5 / H from an integer, and the product with
        # the rounded inverse is within place * 2^-22 / H of it.
        column = cutlass.Int32((cutlass.Float32(place) + 0.5) * inverse)
        strip = (place - column * H) * row_blocks + column
        return cutlass.select_(place < strip_blocks, strip, place)


def strips_on(H, W, first, Lq, tile: int):
    """Whether a segment's first level (H x W pixels from pixel `first`) takes its tiles in strips: it starts at
    pixel 0, its width is a multiple of the tile (more than one), it has more than one row, and the queries (fewer
    than 2^24) cover it. One test for the kernel, on its level table (strip_plan), and for the host, on a table it
    holds (launch_rules.strip_rows)."""
    return (first == 0) & (W % tile == 0) & (W > tile) & (H > 1) & (H * W <= Lq) & (Lq < (1 << 24))


def strip_plan(sizes, starts, Lq, tile: int):
    """KernelConfig.strips: (blocks in strips, rows, blocks a row, 1 / rows) of the first level, whose tiles take
    strips where strips_on; otherwise no block does (0 blocks in strips)."""
    H, W = sizes[0]
    on = strips_on(cutlass.Int64(H), W, starts[0], Lq, tile)  # H * W in 64 bits
    row_blocks = W // tile
    return (cutlass.select_(on, H * row_blocks, 0), H, row_blocks, 1.0 / cutlass.Float32(cutlass.max(H, 1)))
