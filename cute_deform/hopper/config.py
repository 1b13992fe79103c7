"""Static parameters of the Hopper kernel and the shared-memory plan they imply.

Everything a compiled kernel depends on is a field of KernelConfig; problem sizes (N, Lq, S, level
sizes) never are, so one compiled kernel serves every size.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

CONSUMER_WARPS = 4  # consumer warps a group; a tile is the queries these 128 threads cover
TARGET_ARCH = "sm_90a"  # every kernel is built for Hopper, whatever GPU (or none) the compiling machine has
STAGE_BOX_PIXELS = 64  # pixels per TMA box when staging a whole level
TENSORMAP_BYTES = 128
MAX_LEVELS = 5  # the tiled kernel unrolls levels; more go to the generic kernel
MAX_POINTS = 16
SMEM_PER_SM = 227 * 1024
# The most shared memory a CTA takes with L1 left 60 KB: the next carveout (228 KB) leaves L1 28 KB, and
# its gathers then miss (seed-b48: 4952 against 3975 us, H100).
SMEM_KEEPING_L1 = 195 * 1024
AUTO_RING_BYTES = 120 * 1024  # the input rings of all groups together, at most (leaves room for staging)
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def ceil_div(x: int, k: int) -> int:
    return (x + k - 1) // k


def round_up(x: int, k: int) -> int:
    return ceil_div(x, k) * k


def tma_step(itemsize: int) -> int:
    """Elements in 16 bytes: what a TMA box's rows are multiples of, and where its first coordinate must lie."""
    return 16 // itemsize


def staged_pixels(pixels):
    """The pixel rows a level of `pixels` pixels takes in the staging buffer: whole boxes of STAGE_BOX_PIXELS."""
    return round_up(pixels, STAGE_BOX_PIXELS)


def stage_levels(sizes, stage_pixels: int, zero, select):
    """Which levels ((H, W) pairs) a staging buffer of stage_pixels pixels a head holds whole, and where: from the
    coarsest on, each level, in boxes of STAGE_BOX_PIXELS pixels, that still fits (a finer one may fit where a coarser
    did not). Returns (staged, offsets, used): a flag and a first pixel a level, and the pixels taken. One test for the
    kernel, on its level table (zero an Int32, select cutlass.select_), and for the host, on a table it holds
    (launch_rules.staged_levels)."""
    staged, offsets, used = [None] * len(sizes), [zero] * len(sizes), zero
    for level in range(len(sizes) - 1, -1, -1):
        H, W = sizes[level]
        pixels = staged_pixels(H * W)
        fits = used + pixels <= stage_pixels
        staged[level] = fits
        offsets[level] = used
        used = used + select(fits, pixels, 0)
    return staged, offsets, used


def tiled_kernel_fits(itemsize: int, head_dim: int, num_levels: int, num_points: int) -> bool:
    """Whether the tiled kernel takes this shape: a query's head is whole 16-byte vectors, at most 128
    of them (the threads of a tile), and few enough levels and points to unroll. The generic kernel
    takes everything else."""
    row = head_dim * itemsize
    return (row % 16 == 0 and row <= 128 * 16 and 1 <= num_levels <= MAX_LEVELS
            and 1 <= num_points <= MAX_POINTS)


@dataclass(frozen=True)
class ProblemConfig:
    """What a problem fixes for every kernel: dtypes, heads, levels, points, head dim. With fused=True a
    kernel reads reference points, sampling offsets and attention logits (the `sampling_offsets` and
    `attention_weights` Linear outputs) and computes the locations and the softmax itself; loc_dtype and
    attn_dtype are then the dtypes of the offsets and the logits."""

    value_dtype: str
    loc_dtype: str
    attn_dtype: str
    num_heads: int
    num_levels: int
    num_points: int
    head_dim: int
    fused: bool = False
    ref_dtype: str = "float32"  # fused: reference points' dtype
    ref_dims: int = 2  # fused: 2 for (x, y) reference points, 4 for (cx, cy, w, h) boxes

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.value_dtype]


@dataclass(frozen=True)
class KernelConfig(ProblemConfig):
    """Static parameters of the tiled kernel: the problem's, and its tuning."""

    num_stages: int = 2  # input-ring (or box-ring) stages per group
    num_groups: int = 0  # groups of four consumer warps per CTA; 0: automatic
    stage_bytes: int = 96 * 1024  # shared memory for whole coarse levels; 0 stages nothing
    cluster_size: int = 2  # 2: CTA pairs share each range and multicast the staged levels
    fine_gather: str = "ldg"  # levels that are not staged: "ldg" 16-byte loads through L1, "tma" 2x2xD boxes
    l1_first: bool = False  # L1 levels before staged ones: a range's first tile starts before its staging
    # (unless the configuration alternates: KernelConfig.alternates)
    # Tiles take their queries through an order table (the host's sort by position): neighbours in a tile
    # share footprints in L1 whatever order the caller's queries come in.
    permuted: bool = False
    # Producer warps that feed the input rings: 0 gives each group its own; k (dividing num_groups) has
    # warp p feed groups p, p + k, ..., which leaves room for more consumer warps in 1024 threads.
    producers: int = 0
    # The T threads of a query split each level's per-sample setup (footprint, bilinear weights, which
    # corners lie in the level; fused: softmax and locations) by point and pass each other the results
    # by warp shuffles, instead of all T computing every sample. Only where T divides a warp.
    split_setup: bool = True
    # Samples of an L1 level whose loads a thread issues before it sums any of them: more loads in
    # flight a warp, for more registers.
    gather_batch: int = 1
    # L1 gathers ask L2 for the whole 128-byte line of each corner's row (ld.global.L2::128B): a fp16 head
    # row is half a line, and the other half is the next head's row of the same pixel. A launch rule
    # (launch_rules.choose_launch), for where it won.
    line_prefetch: bool = False
    # L1 gathers of the level with the most pixels (found at run time) load with L1::evict_first: scattered
    # queries rarely share its lines. A launch rule for whole segments (launch_rules.choose_launch).
    finest_evict_first: bool = False
    # L1 gathers of the levels other than the finest load with the L2 evict-last policy: their lines are
    # the ones a launch reads again. A launch rule (launch_rules.choose_launch), for where it won.
    coarse_evict_last: bool = False
    # The producer warps issue the inputs of round 0's first tiles before the prologue (the level table
    # and the cluster barrier), which they need neither of, and the first segment skips its segment
    # barrier (the prologue's orders its staging). A launch rule for whole segments (launch_rules.choose_launch).
    early_inputs: bool = False
    # Bytes of value a thread loads per corner: 16, or 8 (twice the threads a query, half the queries a
    # tile). A launch rule for CTA pairs over whole segments of 64-byte head rows (launch_rules.choose_launch,
    # which has the measurements), where it won.
    vector_bytes: int = 16
    # At each segment the staging warp asks L2 (TMA prefetch boxes, after the staging's copies) for the head
    # rows of the levels that are neither staged nor the finest and that the segment's samples are expected
    # to read most of (MSDAForward.prefetch_levels): their gathers then wait on L2, not DRAM. A launch rule
    # for CTA pairs over one whole segment each (launch_rules.choose_launch, which has the measurements).
    prefetch_levels: bool = False
    # Tiles a segment's start counts for where the tile sequence is cut into ranges that are not whole
    # segments: a range that crosses into the next (image, head) waits there for every group (the barrier)
    # and for the new staging, and takes that many fewer tiles. A launch rule (launch_rules.choose_launch, which
    # has the measurements).
    segment_cost: int = 0
    # Where groups alternate (KernelConfig.alternates), every group's first tile of a segment gathers the L1
    # levels first, while the staging lands; the tiles after it alternate as before. A launch rule for single
    # CTAs over whole segments (launch_rules.choose_launch, which has the measurements).
    l1_first_tile: bool = False
    # fp16/bf16 value: each sample's attention weight folded into its corner weights, and the packed half corner
    # sums of up to this many samples of a level added in packed half arithmetic before one fp32 add (0: each
    # sample's sum converted and added alone). Fewer instructions a sample, for a larger rounding error; with fp16
    # value a weight times a corner weight must stay in fp16's range (any softmax or sigmoid weight does), as in
    # the original kernel's half arithmetic. A launch rule (launch_rules.choose_launch, which has the measurements).
    half_sums: int = 0
    # The output rows are stored with the L2 evict-first policy: they are not read again, and with the default
    # policy they push value's lines out of L2. A launch rule (launch_rules.choose_launch, which has the measurements).
    output_evict_first: bool = False
    # Staged corners select between their byte address and the zero pixel's, the column step an immediate offset
    # of the load (sampling.staged_corners): the same loads in fewer instructions, which changes how ptxas
    # schedules the loop. A launch rule (launch_rules.choose_launch, which has the measurements).
    staged_addresses: bool = False
    # Where the first level's rows are whole tiles and the queries cover it (an encoder), its tiles are taken in
    # column strips a tile wide, top to bottom, not row by row: a range of tiles is then a tall narrow block of the
    # image, whose footprints L1 holds. Decided in the kernel from the level table (TileScheduler.block_of).
    strips: bool = False
    # Where two queries of a quarter-warp read location rows 128 bytes apart (the same banks), the location ring is
    # loaded with TMA's 128-byte swizzle (row q's 16-byte chunk k lands at chunk k ^ (q % 8)) and each thread reads
    # its halves where they landed: the reads no longer conflict, and the samples keep their order
    # (staggers_locations says where it can act). A launch rule (launch_rules.choose_launch, which has the
    # measurements).
    stagger_locations: bool = False
    # The last level (the coarsest of a model's table), where it is staged, holds each pixel row twice, side by side
    # in one 128-byte line (TMA loads it through a map whose second dimension has stride 0), and a thread reads the
    # copy in its query slot's half of the line: the two queries of a quarter warp then never read the same banks
    # (doubles_coarsest says where it can act). A launch rule (launch_rules.choose_launch, which has the measurements).
    doubled_coarsest: bool = False
    # In a cluster, the tiles of a range go to the CTAs in turn, one at a time (tile k to CTA k % cluster), not in
    # runs of num_groups: where a segment's last turn of tiles does not fill every group of the cluster, its tiles are
    # then shared between the CTAs, not left all on the first. A launch rule (launch_rules.choose_launch, which has
    # the measurements).
    interleave_ranks: bool = False
    # The kernel's launch bound names the CTAs an SM the host plans (ctas_per_sm: PTX .minnctapersm), so ptxas may
    # spend the registers that leaves on loads issued earlier (decoder-b16: 80 registers against 59). A launch rule
    # (launch_rules.choose_launch, which has the measurements).
    launch_bound: bool = False

    def __post_init__(self):
        if not 1 <= self.gather_batch <= MAX_POINTS:
            raise ValueError(f"cute_deform: gather_batch must be in [1, {MAX_POINTS}], got {self.gather_batch!r}")
        if not 0 <= self.half_sums <= MAX_POINTS or (self.half_sums and not self.packed_math):
            raise ValueError(f"cute_deform: half_sums must be in [0, {MAX_POINTS}], and 0 for fp32 value; got "
                             f"{self.half_sums!r}")
        if not 0 <= self.segment_cost <= 1024:
            raise ValueError(f"cute_deform: segment_cost must be in [0, 1024], got {self.segment_cost!r}")
        if self.vector_bytes not in (8, 16) or self.head_dim * self.itemsize % self.vector_bytes:
            raise ValueError(f"cute_deform: vector_bytes must be 8 or 16 and divide a head row "
                             f"({self.head_dim * self.itemsize} bytes), got {self.vector_bytes!r}")
        if self.num_groups == 0:
            object.__setattr__(self, "num_groups", self._auto_groups())
        if self.fine_gather not in ("ldg", "tma"):
            raise ValueError(f"cute_deform: fine_gather must be 'ldg' or 'tma', got {self.fine_gather!r}")
        if self.fused and self.fine_gather != "ldg":
            raise ValueError("cute_deform: the fused kernel gathers through L1 (fine_gather='ldg')")
        if self.strips and (self.permuted or self.early_inputs):
            raise ValueError("cute_deform: strips take neither permuted queries nor early_inputs")
        if self.permuted and self.fine_gather != "ldg":
            raise ValueError("cute_deform: permuted queries need fine_gather='ldg'")
        if self.producers and (self.fine_gather != "ldg" or self.num_groups % self.producers):
            raise ValueError(f"cute_deform: producers={self.producers} must divide num_groups={self.num_groups} "
                             "and needs fine_gather='ldg'")
        if self.threads > 1024:
            raise ValueError(f"cute_deform: {self.num_groups} groups need {self.threads} threads a CTA; at most 1024")
        if self.smem_bytes > SMEM_PER_SM:
            raise ValueError(f"cute_deform: this configuration needs {self.smem_bytes} bytes of shared memory; "
                             f"an SM has {SMEM_PER_SM}")

    # --- sizes of a tile -------------------------------------------------------------------------
    @property
    def channels_per_thread(self) -> int:  # one vector of value per thread and corner
        return self.vector_bytes // self.itemsize

    @property
    def threads_per_query(self) -> int:
        return self.head_dim * self.itemsize // self.vector_bytes

    @property
    def queries_per_tile(self) -> int:
        """Queries of one tile: as many as the 128 consumer threads of a group cover whole (threads past
        the last query idle where the head's vectors do not divide 128)."""
        return CONSUMER_WARPS * 32 // self.threads_per_query

    @property
    def splits_setup(self) -> bool:
        """Whether the threads of a query split the per-sample setup (split_setup, where T > 1 divides 32)."""
        T = self.threads_per_query
        return self.split_setup and 1 < T <= 32 and 32 % T == 0

    @property
    def level_points(self) -> int:
        return self.num_levels * self.num_points

    @property
    def alternates(self) -> bool:
        """Whether groups take a tile's staged levels first or last in turn (by group and tile), so that at
        any time about half the groups are gathering through L1 and the other half from shared memory:
        the kernel's demand on L2 and DRAM is steadier than with every group in the same phase. Measured
        on the unfused fp16 P = 4 launches (H100, session 12): detr-decoder 65.5 -> 64.1 us, -ref 62.0 ->
        60.8, decoder-b16 62.3 -> 60.1, detr-encoder 138.1 -> 135.7, -init 131.1 -> 128.7. It lost at
        P = 8 (dcnv4-test 85.8 -> 111.0, seed-b48 3925 -> 4048); the fused kernel, fp32 value and the
        order table at P = 4 were not measured (bf16 runs the fp16 code). Where it alternates, l1_first has
        no effect."""
        return (self.packed_math and not self.fused and not self.permuted and self.fine_gather == "ldg"
                and self.level_points <= 16)

    @property
    def staggers_locations(self) -> bool:
        """Whether the location ring is swizzled and read staggered (stagger_locations, where it can act): inputs
        in the ring, not split, unfused, dense rows, 4 points a level of fp32 locations (a level is two 16-byte
        halves), four threads a query (two queries a quarter-warp), rows of exactly 128 bytes (4 levels: the
        128-byte swizzle's row)."""
        return (self.stagger_locations and self.prefetch_inputs and not self.fused and not self.splits_setup
                and not self.rows_apart and self.num_points == 4 and self.threads_per_query == 4
                and ITEMSIZE[self.loc_dtype] == 4 and self.loc_row_elems * 4 == 128)

    @property
    def doubles_coarsest(self) -> bool:
        """Whether the last level is staged doubled (doubled_coarsest, where it can act): a staging buffer, 64-byte
        head rows (two make a 128-byte line), L1 gathers."""
        return (self.doubled_coarsest and self.stage_bytes > 0 and self.fine_gather == "ldg"
                and self.head_dim * self.itemsize == 64)

    @property
    def packed_math(self) -> bool:
        """fp16/bf16 value: each sample's four-corner sum in packed half arithmetic, then an fp32 FMA per
        channel (measured 1.2-1.3x faster than fp32 sums on every preset; within the bounds 1e-3 / 8e-3)."""
        return self.value_dtype != "float32"

    # --- the input ring: each tile's locations (or offsets) and weights (or logits) ----------------
    @property
    def _inputs_fit_tma(self) -> bool:
        """A TMA box (or, through the order table, a bulk copy) loads each head's row when it is a multiple of
        16 bytes. Otherwise (half-precision weights of 12 or 4 points a head) a box can still take the heads'
        rows of a query together, as one row, where that is a multiple of 16 bytes: kernel.input_atom."""
        def fits(per_query: int, dtype: str) -> bool:
            row = per_query * ITEMSIZE[dtype]
            return row % 16 == 0 or (not self.permuted and self.num_heads * row % 16 == 0)
        return fits(2 * self.level_points, self.loc_dtype) and fits(self.level_points, self.attn_dtype)

    def _stage_elems(self, row_elems: int, dtype: str) -> int:
        """Elements of one stage of an input ring: G rows of row_elems, padded to 128 bytes."""
        return round_up(self.queries_per_tile * row_elems * ITEMSIZE[dtype], 128) // ITEMSIZE[dtype]

    @property
    def rows_apart(self) -> bool:
        """Whether ring rows leave a gap. Through the order table each row is its own bulk copy. TMA boxes
        get the gap as extra columns, zero filled: it won in the unfused kernel with the setup split and
        more than 16 samples a query (dcnv4-test 86.5 against 91.3 us), and lost with 16 (detr-encoder,
        not split, 145.2 against 137.2; the decoders, split, 1%; H100, docs/performance.md, session 12).
        Other launches were not measured with it and keep dense rows."""
        return self.permuted or (self.level_points > 16 and self.splits_setup and not self.fused)

    def _row_elems(self, per_query: int, per_point: int, dtype: str) -> int:
        """Elements from one query's row to the next in a ring stage. Rows apart leave a gap of what the
        threads of a query read of a row at once (their points' per_point elements each; at least 16
        bytes): with rows of a multiple of 128 bytes back to back, the queries of a warp reading the same
        place of their rows would all hit the same banks."""
        size = ITEMSIZE[dtype]
        elems = per_query
        if self.rows_apart:
            readers = self.threads_per_query if self.splits_setup else 1
            elems += round_up(per_point * size * readers, 16) // size
        step = tma_step(size)
        if per_query % step:
            # A head's row that is not a multiple of 16 bytes comes in a box over the heads' rows (kernel.input_atom),
            # which starts at the 16-byte boundary before it: the row lies up to 16 bytes less one step of
            # gcd(per_query, step) elements into the box, and the box's rows are multiples of 16 bytes.
            elems += step - math.gcd(per_query, step)
        return round_up(elems, step)

    @property
    def loc_row_elems(self) -> int:
        return self._row_elems(2 * self.level_points, 2, self.loc_dtype)

    @property
    def attn_row_elems(self) -> int:
        return self._row_elems(self.level_points, 1, self.attn_dtype)

    @property
    def loc_stage_elems(self) -> int:
        return self._stage_elems(self.loc_row_elems, self.loc_dtype)

    @property
    def attn_stage_elems(self) -> int:
        return self._stage_elems(self.attn_row_elems, self.attn_dtype)

    @property
    def input_stage_bytes(self) -> int:
        return self.loc_stage_elems * ITEMSIZE[self.loc_dtype] + self.attn_stage_elems * ITEMSIZE[self.attn_dtype]

    @property
    def input_bytes(self) -> int:
        """Bytes one tile's inputs deliver: its rows (bulk copies through the order table), or the two TMA
        boxes of whole ring rows (a box wider than a row fills the gap with zeros, and counts it)."""
        G = self.queries_per_tile
        if self.permuted:
            return G * self.level_points * (2 * ITEMSIZE[self.loc_dtype] + ITEMSIZE[self.attn_dtype])
        return G * (self.loc_row_elems * ITEMSIZE[self.loc_dtype] + self.attn_row_elems * ITEMSIZE[self.attn_dtype])

    @property
    def _group_ring_bytes(self) -> int:
        return self.num_stages * self.input_stage_bytes

    @property
    def prefetch_inputs(self) -> bool:
        """With L1 gathers, producer warps load each tile's inputs with two TMA boxes into a ring of
        shared-memory stages, ahead of the consumers. TMA needs rows of a multiple of 16 bytes and the
        rings must leave room for staging; other shapes read their inputs in the consumers."""
        return (self.fine_gather == "ldg" and self._inputs_fit_tma
                and self.num_groups * self._group_ring_bytes <= SMEM_PER_SM - 64 * 1024)

    @property
    def input_slots(self) -> int:
        return self.num_groups * self.num_stages if self.prefetch_inputs else 1

    def _auto_groups(self) -> int:
        """Five groups up to 16 samples a query (faster than four or six on the P=4 presets), four beyond
        (faster on P=8: 122.9 against 134.2 us on dcnv4-test, 5183 against 5662 on seed-b48, 5956 against
        8575 with its queries shuffled; H100, docs/performance.md); fewer where the input rings would
        leave too little shared memory for staging."""
        if self.fine_gather == "tma":
            return 4
        most = 5 if self.level_points <= 16 else 4
        for groups in range(most, 1, -1):
            if not self._inputs_fit_tma or groups * self._group_ring_bytes <= AUTO_RING_BYTES:
                return groups
        return 1

    # --- the box ring (fine_gather="tma"): one 2x2xD box per sample ---------------------------------
    @property
    def box_bytes(self) -> int:
        return 4 * self.head_dim * self.itemsize

    @property
    def box_ring_elems(self) -> int:
        if self.fine_gather != "tma":
            return 8  # never read
        return self.queries_per_tile * 4 * self.head_dim * self.num_stages * self.num_groups

    @property
    def map_slots(self) -> int:
        """Tensor maps a CTA patches on the device: each group's box map of every level."""
        return self.num_levels * self.num_groups if self.fine_gather == "tma" else 1

    # --- warps and CTAs ----------------------------------------------------------------------------
    @property
    def producer_warps(self) -> int:
        """Producer warps feed the rings (one a group, or `producers`); with no ring, one producer warp
        only stages."""
        if self.fine_gather == "tma":
            return self.num_groups
        return (self.producers or self.num_groups) if self.prefetch_inputs else 1

    @property
    def threads(self) -> int:
        return (self.num_groups * CONSUMER_WARPS + self.producer_warps) * 32

    @property
    def ctas_per_sm(self) -> int:
        """CTAs that fit on one SM at once. The block size is the only launch bound, so ptxas may use up
        to 65536 / threads registers a thread: count on at least 64."""
        by_registers = 65536 // (self.threads * 64)
        return max(1, min(SMEM_PER_SM // self.smem_bytes, 2048 // self.threads, by_registers))

    # --- shared memory -----------------------------------------------------------------------------
    @property
    def _smem_without_staging(self) -> int:
        ring = self.box_ring_elems * self.itemsize
        inputs = self.input_slots * self.input_stage_bytes
        maps = self.map_slots * TENSORMAP_BYTES
        barriers = 16 * self.num_stages * self.num_groups * 2
        return ring + inputs + maps + barriers + 1024

    @property
    def stage_pixels(self) -> int:
        """Pixels of one head that the staging buffer holds, in whole staging boxes: stage_bytes, or
        what shared memory has left after the rings; with rows apart, of the shared memory that keeps L1
        60 KB (one pixel more is the zero pixel)."""
        pixel = self.head_dim * self.itemsize
        most = SMEM_KEEPING_L1 if self.rows_apart else SMEM_PER_SM  # measured with rows apart only
        budget = min(self.stage_bytes, most - self._smem_without_staging - pixel)
        return max(0, budget) // pixel // STAGE_BOX_PIXELS * STAGE_BOX_PIXELS

    @property
    def smem_bytes(self) -> int:
        return self._smem_without_staging + (self.stage_pixels + 1) * self.head_dim * self.itemsize
