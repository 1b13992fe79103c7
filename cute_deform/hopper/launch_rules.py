"""The launch rules of the tiled kernel: the static knobs, grid and schedule each launch takes from the problem's size
(choose_launch), the configurations a launch may switch to (launch_variants, which precompile compiles ahead), and
the measurements behind each rule (docs/performance.md names the presets where each wins). Host code only: a change
here keeps the compile cache.
"""
from __future__ import annotations

import dataclasses

from . import tile_scheduler
from .config import KernelConfig, ceil_div, round_up, stage_levels, staged_pixels

# Defaults of the knobs that are not part of the problem (docs/performance.md says where each wins).
TUNING = dict(fine_gather="ldg", num_groups=0, num_stages=2, stage_bytes=96 * 1024, cluster_size=2)
# Launch knobs: the share of L2 that one round of the schedule may spread over (0: one round), and
# the shortest range a cluster takes in a round, in tiles per group. All of L2 since the tile inputs are
# evicted first (seed-b48 3808 / 3806 against 3840 / 3977 us at half, sorted; H100, session 13).
WINDOW_L2_FRACTION = 1.0
# The window of single-CTA launches of fp16/bf16 value (unfused, without the order table) over several
# rounds: half of L2 (batched encoders, H100: N=8 detr shapes 540 -> 471 us against CTA pairs with all of
# L2, 497 with single CTAs and all of L2; N=2 keeps one round).
SINGLE_CTA_WINDOW_L2_FRACTION = 0.5
# ... and at one level (BEVFormer-like self-attention over a BEV grid: no level small enough to stage), a quarter:
# rounds over fewer (image, head) slices, each range still some turns of the groups. Session 29, tune.py, two runs in
# opposite orders, µs, half -> a quarter (H100 / H200): 200x200 N=1 67.5, 67.6 -> 51.4, 50.7 / 55.0, 54.8 -> 46.9,
# 47.2; N=2 109.8, 109.7 -> 93.5, 93.2 / 89.2, 88.4 -> 86.5, 86.4; N=4 210.6, 210.2 -> 177.1, 176.5 / 187.6, 187.7
# -> 170.0, 169.3; 150x150 N=2 74.0, 73.8 -> 58.8, 59.1 / 62.9, 63.2 -> 52.3, 52.3; 100x100 N=4 64.1, 64.7 -> 58.1,
# 58.2 / 53.9, 53.4 -> 50.2, 49.8; 200x200 N=2 with Deformable DETR's initial offsets 105.3, 106.5 -> 92.6, 92.9 /
# 83.8, 82.8 -> 80.5, 80.6; 150x150 N=1 (one round either way) tied. An eighth lost (200x200 N=2 129.8: ranges of
# under two turns a round). At three or four levels a quarter tied or lost (H100: 128x256-32x64 N=1 129.0 -> 126.8,
# 127.6; Mask2Former's 128x128-32x32 N=2 111.7 -> 110.7, 111.6; detr-encoder 126.6 -> 134.2, 135.0). Measured in
# 64-byte head rows; the window counts bytes, so other rows take the same share of L2.
ONE_LEVEL_WINDOW_L2_FRACTION = 0.25
# Launches through the order table (fp16/bf16 value in 64-byte head rows, fused or not: _table_rounds_measured)
# ask L2 for whole lines (line_prefetch) and take rounds by the segments, not by L2: the fewest rounds giving k
# ranges a segment or up to this much more (tile_scheduler.aligned_rounds), k = 1 where it can. With every
# query's neighbours in its tile the slices need not fit L2; what pays is the clusters on one image's heads
# (which share 128-byte lines and DRAM pages) reaching the same place in them together. Swept by rounds on both GPUs (session 27, docs/performance.md), 1.03
# ranges a segment was the fastest of the 5-9 round counts measured on each of the four shapes that have it;
# about 2 lost 2-3% (H100), 1.2-1.8 lost 2-8%, fewer than one 1-9%. Against v45's 0.9 of L2, one run, two orders, µs:
#   H100: seed-b48 3468.3 / 3465.6 -> 3401.2 / 3402.6, -shuffled 3479.2 / 3481.6 -> 3416.9 / 3412.9, N=32 seed shapes
#   shuffled 2336.5 / 2339.1 -> 2293.6 / 2292.5, N=24 detr encoders shuffled 1416.3 / 1419.1 -> 1378.2 / 1376.6,
#   N=64 around reference points 4627.8 / 4621.8 -> 4533.9 / 4542.2, N=20 (k = 2: 5 rounds either way) tied.
#   H200: seed-b48 3539.6 / 3537.1 -> 3382.8 / 3385.0, -shuffled 3552.7 / 3554.1 -> 3395.8 / 3389.1, N=32
#   2380.4 / 2376.2 -> 2277.9 / 2275.6, N=24 1398.6 / 1399.1 -> 1360.3 / 1362.3, N=64 4739.1 / 4742.6 -> 4508.5 /
#   4505.0, N=20 1501.0 / 1500.6 -> 1471.3 / 1469.1.
#   The fused op, fp16, N=48 seed shapes around random reference points (H100): 10 rounds (all of L2) 3745 / 3748,
#   6 aligned rounds 3665 / 3663, with whole lines 3639 / 3639.
TABLE_RANGE_TOLERANCE = 0.1
MIN_TILES_PER_GROUP = 2
# Calls with at least this many samples (N*Lq*M*L*P) sort each image's queries by position first and
# run the kernel through that order (reorder_queries="auto"): the order table (order.py, two launches) and
# the table's per-row copies only pay on large problems (docs/performance.md).
REORDER_MIN_SAMPLES = 1 << 26
# Single-CTA launches (choose_launch) take one producer warp for all groups, and this many groups and
# setup (KernelConfig.split_setup), by kernel (docs/performance.md, sessions 7 and 8; H100):
# - fp16/bf16 value, up to 16 samples a query: seven groups, every thread its own setup (detr-encoder
#   137.9 against 144.3 us split);
# - fp16/bf16 value, more samples a query: four groups, the setup split (dcnv4-test 90.9 against 97.3
#   at seven groups unsplit);
# - the fused kernel, and fp32 value: six groups (the fused kernel spills at seven), every thread its own
#   setup (the fp16 layer's kernel: 139.7 against 151.6 us split; fp32 detr-encoder 204.7 against 212.4
#   at seven groups).
SINGLE_CTA_FEW_SAMPLES = dict(num_groups=7, producers=1, split_setup=False)
SINGLE_CTA_MANY_SAMPLES = dict(num_groups=4, producers=1, split_setup=True)
SINGLE_CTA_SIX = dict(num_groups=6, producers=1, split_setup=False)
# Through the order table each group keeps its own producer warp (its per-row copies are a warp's work):
# six groups fit in 1024 threads.
SINGLE_CTA_GROUPS_OWN_PRODUCER = 6
# One round of single CTAs over short ranges (small decoders: a few images' object queries, each CTA taking a
# few tiles of a segment and staging it for them) takes the decoders' knobs and four groups with a producer warp
# each and the setup split: the chain of a query's samples is the time there, not the CTA's throughput
# (choose_launch has the measurements). Short: up to this many tiles a CTA, in the tiles of 16-byte vectors (32
# queries for fp16/bf16 value in 64-byte rows, 16 for fp32).
SHORT_RANGE_TILES = 8
# The knobs that set a CTA's groups together (the launch rules change all three or none).
GROUP_KNOBS = frozenset({"num_groups", "producers", "split_setup"})
SHORT_RANGES = dict(vector_bytes=8, num_groups=4, producers=0, split_setup=True, finest_evict_first=True,
                    gather_batch=4)
# Tiles a segment's start counts for in one round of single CTAs at up to 16 samples a query (the P = 4
# encoders; KernelConfig.segment_cost, choose_launch has the measurements).
SEGMENT_COST = 4
# KernelConfig.strips: the fewest tiles a range (one a CTA) must take for the rule (choose_launch).
STRIP_RANGE_TILES = 64
# KernelConfig.doubled_coarsest's staging buffer: DETR's last level doubled (2 x 320 rows) beside its third (1088).
DOUBLED_STAGE_BYTES = 108 * 1024
# DRAM this fast (the H200's 4.8 TB/s, not the H100's 3.35) makes the coarser levels' evict-last hint lose on the fp16
# encoders (choose_launch has the measurements).
FAST_DRAM_BYTES_PER_S = 4 * 10**12
# The staging buffer of single CTAs over one whole segment each where it stages one level more than the default's
# (RT-DETR's second level, 40x40, beside its third): choose_launch, which needs the level table on the host.
WIDE_STAGE_BYTES = 128 * 1024


def staged_levels(levels, stage_pixels: int) -> int:
    """How many of the levels ((H, W) pairs) the kernel stages whole in a buffer of stage_pixels pixels a head (its own
    test, config.stage_levels, without doubling)."""
    return sum(stage_levels(levels, stage_pixels, 0, lambda fits, pixels, none: pixels if fits else none)[0])


def strip_rows(levels, starts, Lq: int, tile: int) -> bool:
    """Whether the kernel takes the first level's tiles in strips (tile_scheduler.strips_on, the kernel's own test),
    from a level table the host holds: levels as (H, W) pairs, starts the levels' first pixels, tile the kernel's
    queries a tile."""
    if not levels:
        return False
    H, W = levels[0]
    return bool(tile_scheduler.strips_on(H, W, starts[0], Lq, tile))


def launch_variants(cfg) -> list:
    """The configurations a launch with cfg may run (_launch): the tiled kernel switches to the L1-first
    gather order, one producer warp, batched gathers, finest_evict_first and early_inputs where ranges are
    whole segments (CTA pairs over one segment each also 8-byte vectors, output_evict_first, interleave_ranks and
    prefetch_levels; single CTAs over one each also the launch bound and WIDE_STAGE_BYTES of staging),
    to single CTAs with one producer warp (_single_cta's groups and setup, line_prefetch, and
    output_evict_first at up to 16 samples a query, fused or not, staged_addresses where _staged_addresses_measured,
    stagger_locations and doubled_coarsest (with its staging buffer) where _stagger_taken (for fp16 also
    without coarse_evict_last, the launch on fast DRAM),
    strips at up to three levels) where one round of long ranges runs, and to the order table (batched
    gathers) for large problems. (Rarer combinations compile when first met.)"""
    if not isinstance(cfg, KernelConfig) or cfg.fine_gather != "ldg":
        return [cfg]

    def batch(whole: bool, permuted: bool, one_round: bool = False) -> int:  # a batch the caller chose stays
        return _launch_gather_batch(cfg, whole, permuted, one_round) if cfg.gather_batch == 1 else cfg.gather_batch

    out = [cfg]
    if not cfg.l1_first:
        whole = dict(l1_first=True, gather_batch=batch(True, cfg.permuted))
        if _shared_producer(cfg, cfg.permuted):
            whole["producers"] = 1
        if _hints_measured(cfg, cfg.permuted):  # choose_launch's rules for whole segments
            if cfg.prefetch_inputs:
                whole["early_inputs"] = True
            if cfg.num_levels > 1:
                whole["finest_evict_first"] = True
        out.append(dataclasses.replace(cfg, **whole))
        if cfg.cluster_size > 1 and _half_vectors_measured(cfg, cfg.permuted):  # choose_launch's rules for pairs
            out.append(dataclasses.replace(cfg, vector_bytes=8, **whole))
            # ... over one whole segment each: the output evict-first in L2, the tiles dealt to the CTAs in turn, and
            # the mid-size levels prefetched
            pairs = dict(vector_bytes=8, output_evict_first=True, interleave_ranks=True, **whole)
            out.append(dataclasses.replace(cfg, **pairs))
            out.append(dataclasses.replace(cfg, prefetch_levels=True, **pairs))
        if cfg.cluster_size > 1:  # whole segments in single CTAs (their first tiles L1-first where groups alternate)
            single = dataclasses.replace(cfg, cluster_size=1, **whole)
            single = dataclasses.replace(single, l1_first_tile=True) if single.alternates else single
            if _hints_measured(cfg, cfg.permuted):  # ... with the launch bound
                single = dataclasses.replace(single, launch_bound=True)
            out.append(single)
            if _hints_measured(cfg, cfg.permuted) and cfg.stage_bytes < WIDE_STAGE_BYTES:  # ... with a wider staging
                out.append(dataclasses.replace(single, stage_bytes=WIDE_STAGE_BYTES))
    if cfg.cluster_size > 1:
        single = dict(cluster_size=1, **_single_cta(cfg, cfg.permuted))
        first = len(out)
        one_round = {}  # choose_launch's rules for one round of single CTAs over long ranges
        if _hints_measured(cfg, cfg.permuted):
            single["line_prefetch"] = True  # choose_launch's rule for single CTAs over long ranges
            # ... and over one round, the coarser L1 levels evict-last in L2 (up to 16 samples a query, with
            # each segment's start counted as SEGMENT_COST tiles)
            one_round["coarse_evict_last"] = True
            if cfg.level_points <= 16:
                one_round["segment_cost"] = SEGMENT_COST
            if _short_ranges_measured(cfg, cfg.permuted):  # ... and over short ranges, SHORT_RANGES
                out.append(dataclasses.replace(cfg, **{**single, **one_round, **SHORT_RANGES, "line_prefetch": False}))
            few_levels = batch(False, False, True)
            if few_levels > 1:  # ... and two samples' loads at once at two or three levels
                one_round["gather_batch"] = few_levels
        elif _short_ranges_measured(cfg, cfg.permuted):  # fp32 value and the fused kernel: SHORT_RANGES, without the
            out.append(dataclasses.replace(cfg, **{**single, **SHORT_RANGES}))  # cache-hint rules
        if _output_policy_measured(cfg, cfg.permuted):
            if cfg.level_points <= 16:  # the output evict-first in L2
                one_round["output_evict_first"] = True
            if _staged_addresses_measured(cfg):  # ... and the staged corners' addresses selected
                one_round["staged_addresses"] = True
            if _stagger_taken(dataclasses.replace(cfg, **single, **one_round)):  # ... and the locations swizzled,
                one_round["stagger_locations"] = True  # ... and the last level staged doubled
                one_round.update(doubled_coarsest=True, stage_bytes=DOUBLED_STAGE_BYTES)
        if one_round:
            out.append(dataclasses.replace(cfg, **one_round, **single))
        if _fast_dram_drops_evict_last(dataclasses.replace(cfg, **one_round)):  # ... on fast DRAM, without evict-last
            out.append(dataclasses.replace(cfg, **{**one_round, "coarse_evict_last": False}, **single))
        if cfg.num_levels <= 3 and not cfg.permuted:  # ... and the first level in strips
            out.append(dataclasses.replace(cfg, **one_round, **single, strips=True))
        if not cfg.packed_math and not cfg.l1_first:  # fp32 value takes single CTAs over whole segments too, L1 first
            out.append(dataclasses.replace(cfg, **single, l1_first=True))
        out.append(dataclasses.replace(cfg, **single))
        if cfg.value_dtype == "float16" and _stagger_taken(dataclasses.replace(cfg, **single)):  # ... over rounds
            out.append(dataclasses.replace(cfg, **single, stagger_locations=True))
        if cfg.num_levels == 1 and _unstaged_level_measured(cfg, cfg.permuted):  # ... and no staging buffer
            out += [dataclasses.replace(v, stage_bytes=0) for v in out[first:]]
    if not cfg.permuted:
        table = _table_knobs(cfg)
        if cfg.half_sums:  # a caller's half sums stay
            table.pop("half_sums", None)
        out.append(dataclasses.replace(cfg, permuted=True, gather_batch=batch(False, True), **table))
    return out


def _table_knobs(cfg) -> dict:
    """The static knobs a launch through the order table sets (choose_launch; launch_variants precompiles them):
    whole-line L2 fetches where its rounds follow the segments, and the half sums where they were measured."""
    knobs = dict(line_prefetch=True) if _table_rounds_measured(cfg) else {}
    sums = _table_half_sums(cfg)
    if sums:
        knobs["half_sums"] = sums
    return knobs


def _table_rounds_measured(cfg) -> bool:
    """The kernels whose launches through the order table take rounds by the segments (TABLE_RANGE_TOLERANCE)
    and whole-line L2 fetches: fp16/bf16 value in 64-byte head rows (two heads a 128-byte line), L1 gathers,
    fused or not. With 128-byte rows (fp32 value) a line holds one head, and the window's rounds won there
    (session 27, H100, N=48 seed shapes around random reference points, µs: fused 6909 / 6910 against 7099 /
    7124 aligned, unfused 6565 / 6569 against 6655 / 6653)."""
    return cfg.packed_math and cfg.fine_gather == "ldg" and cfg.head_dim * cfg.itemsize == 64


def _table_half_sums(cfg) -> int:
    """KernelConfig.half_sums of a launch through the order table: fp16/bf16 value, L1 gathers and 8 or more points
    a level fold each sample's attention weight into its corner weights and add up to this many samples' packed
    half corner sums before each fp32 add; 0 elsewhere. Session 28, two runs in opposite orders, µs:
    - unfused, tune.py (H100): fp16 sums of 8 (rel err 4e-4 -> 6e-4): seed-b48 3400.5 / 3403.6 -> 3295.8 / 3287.6,
      -shuffled 3412.6 / 3416.3 -> 3302.2 / 3300.2, N=32 seed shapes shuffled 2287.6 / 2286.8 -> 2215.3 / 2211.6,
      N=64 around reference points 4531.7 / 4532.6 -> 4385.0 / 4386.1 (sums of 4 about a fifth less; H200 seed-b48
      3383.1 -> 3275.8); bf16 sums of 4 (3e-3 -> 4e-3; 5e-3 at 8, against a bound of 8e-3): seed-b48 3411.1 /
      3407.8 -> 3325.5 / 3324.4 (3292.5 / 3293.1 at 8).
    - fused, N=48 seed shapes around reference points (H100, an out/ script): fp16 3635.0 / 3634.8 -> 3431.4 / 3431.2
      at 4 (3453.7 / 3454.1 at 8; 4.2e-4 -> 5.2e-4), bf16 3690.6 / 3688.3 -> 3413.2 / 3414.4 at 4 (3446.2 / 3447.2
      at 8; 3.3e-3 -> 4.1e-3).
    Lost: 4 points a level through the table (N=24 detr encoders shuffled, 1375.1 / 1374.7 -> 1386.6 / 1386.8), the
    single-CTA launches (detr-encoder 126.9 -> 129.8-135.0, dcnv4-test 84.1 -> 90.6-102.0); the decoders tied or
    lost up to 2%. Those keep the fp32 add a sample."""
    if not (cfg.packed_math and cfg.fine_gather == "ldg" and cfg.num_points >= 8):
        return 0
    return 8 if cfg.value_dtype == "float16" and not cfg.fused else 4


def _hints_measured(cfg, permuted: bool) -> bool:
    """The launches the cache-hint rules (line_prefetch, finest_evict_first, coarse_evict_last) were measured
    on: fp16/bf16 value, unfused, L1 gathers, without the order table."""
    return cfg.packed_math and not cfg.fused and cfg.fine_gather == "ldg" and not permuted


def _output_policy_measured(cfg, permuted: bool) -> bool:
    """The kernels output_evict_first was measured on: fp16/bf16 value, L1 gathers, without the order table, fused or
    not."""
    return cfg.packed_math and cfg.fine_gather == "ldg" and not permuted


def _staged_addresses_measured(cfg) -> bool:
    """The kernels whose one round of single CTAs over long ranges staged_addresses won on (choose_launch): fp16/bf16
    value (_output_policy_measured) at up to four points a level and 16 samples a query, and the fused kernel at up to
    32 samples a query (eight points at four levels)."""
    return (cfg.num_points <= 4 and cfg.level_points <= 16) or (cfg.fused and cfg.level_points <= 32)


def _stagger_taken(cfg) -> bool:
    """Whether single CTAs over long ranges with cfg take stagger_locations (choose_launch; in one round also
    doubled_coarsest, over several rounds fp16 only): fp16/bf16 value, unfused, where KernelConfig.staggers_locations
    can act."""
    return (cfg.packed_math and not cfg.fused
            and dataclasses.replace(cfg, stagger_locations=True).staggers_locations)


def _fast_dram_drops_evict_last(cfg) -> bool:
    """Whether one round of single CTAs with cfg (the launch's knobs applied) leaves out coarse_evict_last on DRAM of
    FAST_DRAM_BYTES_PER_S or more (choose_launch): the staggered locations' launch, fp16 value, where it was measured."""
    return cfg.stagger_locations and cfg.value_dtype == "float16"


def _half_vectors_measured(cfg, permuted: bool) -> bool:
    """The kernels 8-byte vectors were measured on (choose_launch's rule for CTA pairs over whole
    segments): the cache-hint launches' kinds (_hints_measured) with 64-byte head rows and
    at most 16 samples a query."""
    return (_hints_measured(cfg, permuted) and cfg.vector_bytes == 16 and cfg.head_dim * cfg.itemsize == 64
            and cfg.level_points <= 16)


def _short_ranges_measured(cfg, permuted: bool) -> bool:
    """The kernels SHORT_RANGES was measured on (choose_launch): fused or not, L1 gathers, without the order table,
    16-byte vectors, up to 16 samples a query, 32 channels a head (64-byte rows of fp16/bf16 value, 128-byte rows
    of fp32)."""
    return (cfg.fine_gather == "ldg" and not permuted and cfg.vector_bytes == 16 and cfg.level_points <= 16
            and cfg.head_dim == 32)


def _unstaged_level_measured(cfg, permuted: bool) -> bool:
    """The kernels a stage-less launch of one level too large to stage was measured on (choose_launch): fused or
    not, L1 gathers, without the order table, 32 channels a head, any value dtype."""
    return cfg.fine_gather == "ldg" and not permuted and cfg.head_dim == 32


def _launch_gather_batch(cfg, whole: bool, permuted: bool, one_round: bool = False) -> int:
    """The samples whose loads a thread issues before it sums any (KernelConfig.gather_batch) that a launch
    of fp16/bf16 value, unfused, takes (H100, session 10): four for whole segments (65.0 / 61.2 / 62.4
    against 68.7 / 64.9 / 64.1 us on detr-decoder / -ref / decoder-b16), two through the order table (4072
    against 4202 us on seed-b48); two for one round of single CTAs over long ranges at two or three levels of up
    to four points (one_round; _few_levels_batch); one elsewhere, where it lost or tied."""
    if not cfg.packed_math or cfg.fused or cfg.fine_gather != "ldg":
        return 1
    if whole:
        return 4
    if permuted:
        return 2
    return 2 if one_round and _few_levels_batch(cfg) else 1


def _few_levels_batch(cfg) -> bool:
    """Whether one round of single CTAs over long ranges (encoders of one or two images) issues two samples' loads at
    once: at two or three levels of up to four points, in 64-byte head rows (four threads a query; the only rows
    measured). Session 29 (H100, tune.py, two runs in opposite orders, µs, batch 1 -> 2): Mask2Former's three levels
    128x128-32x32, N=2, Lq=S, offsets around each query 118.5 / 118.0 -> 111.7 / 111.5, Deformable DETR's initial
    offsets 113.9 / 114.0 -> 109.7 / 110.0; DETR's first three levels (100x167-25x42) 120.4 / 121.0 -> 115.2 / 115.6
    and 115.4 / 114.7 -> 110.9 / 110.9; 64x64-16x16 36.2 / 36.8 -> 35.9 / 35.2; 128x256-32x64 at N=1 (nothing
    staged) 134.4 / 134.4 -> 129.6 / 130.5; two levels (100x167, 50x84) 95.2 / 96.1 -> 90.2 / 89.6. Lost: four
    levels (detr-encoder 126.5 / 126.4 -> 130.7 / 130.3, -init 115.7 / 116.9 -> 122.7 / 122.9; P = 8: dcnv4-test
    84.0 / 84.5 -> 85.5 / 85.7), one level of 200x200 (111.6 / 111.6 -> 114.5 / 114.0), and several rounds
    (Mask2Former's levels at N=8, four rounds: 386.9 / 387.6 -> 415.8 / 416.3; DETR's first three at N=4: 207.9 /
    208.3 -> 216.8 / 216.5)."""
    return 2 <= cfg.num_levels <= 3 and cfg.num_points <= 4 and cfg.head_dim * cfg.itemsize == 64


LAUNCH_KNOBS = ("window_fraction", "reorder_queries")


def static_tuning(tuning: dict) -> dict:
    """The knobs of a tuning dict that pick the compiled configuration (config_for), without the
    launch-time ones (LAUNCH_KNOBS)."""
    return {k: v for k, v in tuning.items() if k not in LAUNCH_KNOBS}


def query_blocks(cfg, Lq: int) -> int:
    """The tiles of one (image, head) segment: blocks of cfg.queries_per_tile queries, the last one partial."""
    return ceil_div(Lq, cfg.queries_per_tile)


def schedule_for(cfg, N: int, Lq: int, S: int, grid: int, l2_bytes: int, window_fraction: float,
                 align: float = 0.0):
    """The tile schedule of one launch of the tiled kernel (tile_scheduler.plan)."""
    blocks = query_blocks(cfg, Lq)
    clusters = grid // cfg.cluster_size
    slice_bytes = S * cfg.head_dim * cfg.itemsize
    return tile_scheduler.plan(
        N * cfg.num_heads * blocks, blocks, clusters, slice_bytes, int(l2_bytes * window_fraction),
        MIN_TILES_PER_GROUP * cfg.num_groups * cfg.cluster_size, cfg.num_groups * cfg.cluster_size // 2, align)


def grid_and_schedule(cfg, N: int, Lq: int, S: int, sms: int, l2_bytes: int, window: float, align: float = 0.0):
    """The grid of a launch of the tiled kernel (whole clusters, at most the CTAs the GPU holds at once)
    and its schedule."""
    grid = min(N * cfg.num_heads * query_blocks(cfg, Lq), sms * cfg.ctas_per_sm)
    grid = round_up(grid, cfg.cluster_size)
    return grid, schedule_for(cfg, N, Lq, S, grid, l2_bytes, window, align)


def _one_segment_per_cta(cfg, N: int, Lq: int, S: int, sms: int, l2_bytes: int, window: float, grid: int,
                         schedule) -> bool:
    """Whether single CTAs can each take one whole segment, with no more tiles than a CTA of a cluster of
    cfg.cluster_size takes in cfg's launch (grid, schedule: whole segments)."""
    segments = N * cfg.num_heads
    blocks = query_blocks(cfg, Lq)
    ranges = grid // cfg.cluster_size * schedule.rounds
    pair_tiles = ceil_div(segments, ranges) * schedule.rounds * blocks / cfg.cluster_size
    single_grid, single_schedule = grid_and_schedule(dataclasses.replace(cfg, cluster_size=1), N, Lq, S, sms,
                                                     l2_bytes, window)
    return segments <= single_grid and single_schedule.whole and blocks <= pair_tiles


def _shared_producer(cfg, permuted: bool) -> bool:
    """Whether one producer warp feeds every group's input ring: where TMA loads the inputs, without the order table
    (whose per-row copies need a warp a group)."""
    return cfg.prefetch_inputs and not permuted


def _single_cta(cfg, permuted: bool) -> dict:
    """The groups, producers and setup of single-CTA launches of cfg: with one producer warp for all groups where
    it can (_shared_producer), SINGLE_CTA_GROUPS_OWN_PRODUCER groups elsewhere."""
    if not _shared_producer(cfg, permuted):
        return dict(num_groups=SINGLE_CTA_GROUPS_OWN_PRODUCER)
    if cfg.fused or not cfg.packed_math:
        return SINGLE_CTA_SIX
    return SINGLE_CTA_FEW_SAMPLES if cfg.level_points <= 16 else SINGLE_CTA_MANY_SAMPLES


def choose_launch(cfg, N: int, Lq: int, S: int, sms: int, l2_bytes: int, window, reorder,
                  fixed: frozenset = frozenset(), first_level_strips: bool | None = None, dram_bytes_per_s: int = 0,
                  levels=None):
    """The static knobs a launch changes from cfg (a dict for dataclasses.replace), its grid and its
    schedule. window: the share of L2 a round may spread over, or None for the launch's default;
    reorder: True, False or "auto"; fixed: the knobs the caller set, which stay; first_level_strips: whether
    the first level's rows are whole tiles (strip_rows), where the caller's level table is on the host, else
    None; dram_bytes_per_s: the device's DRAM bandwidth, 0 where unknown (taken as an H100's); levels: the (H, W)
    pairs where the caller's level table is on the host, else None (a table on the device is not read). Several
    microseconds of Python: _launch asks once per plan and problem size."""
    changes = {}
    given_window = window
    if window is None:
        window = WINDOW_L2_FRACTION
    if reorder == "auto":
        reorder = N * Lq * cfg.num_heads * cfg.level_points >= REORDER_MIN_SAMPLES and Lq > cfg.queries_per_tile
    if reorder and cfg.fine_gather == "ldg" and not cfg.permuted:
        changes["permuted"] = True
    # One producer warp can feed every group's input ring, leaving room for consumer warps; the order
    # table's per-row copies need a warp a group (one warp for all: 5987 against 5241 us on seed-b48, H100).
    permuted = changes.get("permuted", cfg.permuted)
    shared_producer = _shared_producer(cfg, permuted)
    align = 0.0
    if permuted:
        if _table_rounds_measured(cfg) and given_window is None:
            align = TABLE_RANGE_TOLERANCE
        changes.update({knob: v for knob, v in _table_knobs(cfg).items() if knob not in fixed})
    grid, schedule = grid_and_schedule(cfg, N, Lq, S, sms, l2_bytes, window, align)
    single_cta = ((schedule.rounds == 1 and not schedule.whole)
                  or (not permuted and (not schedule.whole or not cfg.packed_math)))
    if single_cta and cfg.cluster_size > 1 and "cluster_size" not in fixed:
        # One round of long ranges (one or two images: encoders): single CTAs, with no cluster barrier
        # at each segment, win (148 against 176 us on detr-encoder, H100), and more so with more groups
        # (_single_cta); for fp16 value multicast staging wins where ranges are short or whole segments
        # (seed-b48, decoders). Without the order table single CTAs also win over several rounds:
        # the fused kernel (the fp32 layer, three rounds: 228 against 337 us), fp16 value (batched
        # encoders: N=8 detr shapes 471 against 540 us, with their own window below) and fp32 value
        # everywhere (fp32 detr-encoder, three rounds: 204.7 against 239.6 us; detr-decoder, whole
        # segments: 97.1 against 120.5).
        changes["cluster_size"] = 1
        if not fixed & GROUP_KNOBS:
            more = _single_cta(cfg, permuted)
            single = dataclasses.replace(cfg, cluster_size=1, **more)
            if single.threads <= 1024 and single.stage_pixels > 0:
                changes.update(more)
        if (cfg.num_levels == 1 and _unstaged_level_measured(cfg, permuted) and "stage_bytes" not in fixed
                and staged_pixels(S) > dataclasses.replace(cfg, **changes).stage_pixels):
            # One level too large to stage (a BEV grid): no staging buffer, so the SM's carveout leaves L1 about
            # 200 KB instead of 60 KB for the gathers. H100, session 30, tune.py, two runs in opposite orders, µs,
            # 96 KB -> none: 200x200 N=1 50.6 / 51.1 -> 49.0 / 48.9, N=2 93.5 / 93.7 -> 89.9 / 89.5, N=4 176.6 /
            # 176.0 -> 168.5 / 167.9, N=2 with Deformable DETR's initial offsets 91.7 / 91.9 -> 88.5 / 88.4,
            # 150x150 N=2 59.6 / 59.1 -> 57.9 / 57.2, 100x100 N=4 57.9 / 57.7 -> 56.8 / 56.6. (Cityscapes' three
            # levels, none staged, gained as much, 129.5 / 128.9 -> 124.7 / 125.1; with several levels the host
            # cannot tell whether one fits, and where one does, less stage loses: Mask2Former's 112.1 -> 118.0.)
            # fp32 value (six groups), calls 18-19, new / old / new / old: 200x200 N=2 202.9 / 239.9 / 203.2 / 240.3,
            # N=1 107.9 / 129.8 / 108.8 / 130.1. The fused kernel (call 21): fp16 200x200 N=2 216.5-218.0 -> 196.4 /
            # 195.9; fp32 tied (257.4-258.6 -> 257.2 / 257.7).
            changes["stage_bytes"] = 0
        if given_window is None and cfg.packed_math and not cfg.fused:
            window = ONE_LEVEL_WINDOW_L2_FRACTION if cfg.num_levels == 1 else SINGLE_CTA_WINDOW_L2_FRACTION
        grid, schedule = grid_and_schedule(dataclasses.replace(cfg, **changes), N, Lq, S, sms, l2_bytes, window,
                                           align)
    short = (changes.get("cluster_size") == 1 and not schedule.whole and schedule.rounds == 1
             and given_window is None and _short_ranges_measured(cfg, permuted)
             and N * cfg.num_heads * query_blocks(cfg, Lq) <= SHORT_RANGE_TILES * grid)
    if short:
        # ... and over short ranges, SHORT_RANGES in one round. H100, session 30, tune.py, two runs in opposite
        # orders, µs, fp16 value around random reference points, the single-CTA launch -> SHORT_RANGES:
        # RT-DETR's levels (80x80-20x20) N=1 Lq=300 16.6 / 16.4 -> 10.6 / 10.5, N=2 18.1 / 17.8 -> 11.7 / 11.4,
        # N=4 20.4 / 19.4 -> 15.7 / 15.2, N=2 Lq=900 18.8 / 18.0 -> 16.6 / 15.6, N=4 Lq=900 28.1 / 27.6 -> 26.0 /
        # 24.9; Deformable DETR's levels N=1 Lq=300 16.4 / 16.7 -> 12.5 / 11.6, N=2 18.4 / 17.5 -> 13.1 / 12.7,
        # N=4 23.1 / 23.6 -> 18.8 / 19.2, N=1 Lq=900 18.2 / 17.4 -> 13.5 / 13.1, N=2 Lq=900 22.8 / 22.5 -> 19.3 /
        # 19.1, uniform N=2 Lq=300 18.3 / 18.6 -> 13.2 / 13.3. Each part counts: seven groups with one producer
        # and the setup unsplit (the single-CTA launch's) took 12.7-16.4 on N=1-2 Lq=300, the setup unsplit at four
        # groups 13.1-16.4, two samples at once 11.7-14.0, and the decoders' knobs in 16-byte vectors at seven
        # groups 17.5-20.2 (one run). fp32 value (128-byte rows; no cache-hint rules), calls 18-19, new / old / new /
        # old: RT-DETR N=4 25.3 / 32.8 / 25.3 / 33.1, DETR N=4 32.2 / 35.9 / 31.9 / 36.2, DETR N=1 18.4 / 18.5 /
        # 17.6 / 17.9. The fused kernel (the layer's; out/ script, call 21, two runs, µs, boxes as reference points):
        # fp16 DETR N=1 18.8 / 18.1 / 18.2 / 18.9 -> 12.4 / 12.4, N=2 19.8-20.4 -> 18.1 / 18.2, RT-DETR N=4 26.0-26.7
        # -> 17.2 / 17.9; fp32 DETR N=2 28.6-29.2 -> 21.4 / 21.4, RT-DETR N=4 28.0-28.2 -> 26.1 / 26.2, N=1 tied.
        # Knobs the caller fixed stay; a fixed one of GROUP_KNOBS keeps the caller's three.
        kept = fixed | GROUP_KNOBS if fixed & GROUP_KNOBS else fixed
        knobs = {k: v for k, v in SHORT_RANGES.items() if k not in kept}
        trial = dataclasses.replace(cfg, **{**changes, **knobs})
        # One round: with four groups the window would cut DETR's levels at N=4 Lq=900 into two (37.5 / 39.4
        # against 34.6 / 34.2 us in one round at seven groups).
        trial_grid, trial_schedule = grid_and_schedule(trial, N, Lq, S, sms, l2_bytes, 0.0)
        short = not trial_schedule.whole
        if short:
            changes.update(knobs)
            grid, schedule = trial_grid, trial_schedule
    if (schedule.whole and cfg.cluster_size > 1 and "cluster_size" not in changes and "cluster_size" not in fixed
            and _one_segment_per_cta(cfg, N, Lq, S, sms, l2_bytes, window, grid, schedule)):
        # More segments than pairs, but no more than CTAs (decoder-b16: 128 segments, 66 pairs, 132 CTAs):
        # each CTA stages and works through one segment instead of a pair staging two in turn, with as
        # many tiles (H100, two runs: decoder-b16 59.6 -> 54.2 us, N=16 Lq=900 117.5 -> 114.1). With
        # fewer segments than pairs (detr-decoder's 64) a pair splits each segment's tiles and single CTAs
        # lost (92 against 61); with two segments a CTA (N=32 Lq=300) they tied (100.9 against 99.8).
        changes["cluster_size"] = 1
        grid, schedule = grid_and_schedule(dataclasses.replace(cfg, **changes), N, Lq, S, sms, l2_bytes, window)
        if dataclasses.replace(cfg, **changes).alternates and "l1_first_tile" not in fixed:
            # ... where every group's first tile gathers the L1 levels while the staging lands (with groups
            # alternating, half of them otherwise wait for it first: a globaltimer build showed those groups
            # ending 2.7 us after the others on decoder-b16). Three runs, H100 (session 25): decoder-b16
            # 53.3 / 53.8 / 53.5 -> 52.5 / 52.4 / 52.7 us. Lost on CTA pairs over whole segments (detr-decoder
            # 57.0 / 57.0 / 57.5 -> 58.0 / 58.1 / 57.6) and on the encoders (125.6-126.0 -> 128.7-129.7).
            changes["l1_first_tile"] = True
        if _hints_measured(cfg, permuted) and "launch_bound" not in fixed:
            # ... with the launch bound: ptxas, told of one CTA an SM, issues the gathers' loads earlier (decoder-b16
            # 59 -> 80 registers, about 67 instructions from a load to its first use against 26). tune.py, two runs in
            # opposite orders, H200 (session 58, kernels of the DSL's CUDA 12 libraries), µs: decoder-b16 43.3 / 43.2
            # -> 41.3 / 41.9, rtdetr-decoder 30.7 / 30.6 -> 29.4 / 30.1. Lost on the order table's launch (seed-b48
            # 3279 / 3280 -> 3406 / 3410) and on one round of short ranges (rtdetr-decoder-b4 14.5 / 14.4 -> 15.0 /
            # 14.9); tied on CTA pairs (detr-decoder 45.3 / 45.9 -> 45.4 / 45.3) and on the encoders.
            changes["launch_bound"] = True
        if levels is not None and _hints_measured(cfg, permuted) and "stage_bytes" not in fixed:
            # ... with a staging buffer of WIDE_STAGE_BYTES where that stages one more whole level (RT-DETR's 40x40
            # beside its 20x20: the level is nearly all read, and staged it is one stream of boxes, not scattered
            # misses). Session 51, tune.py with the table on the host, runs in alternating orders, µs, means, 96 ->
            # 128 KB: rtdetr-decoder (N=16 Lq=300) H100 38.28 -> 36.98 (4 of 4), H200 32.23 -> 31.45 (4 of 4);
            # RT-DETR's levels at N=16 Lq=900 H100 84.45 -> 78.75, H200 71.78 -> 63.98; bf16 (two runs) H100 39.4 ->
            # 37.4 and 86.9 -> 77.6, H200 33.15 -> 31.75 and 73.75 -> 64.25. The sweep before it (fixed 128 KB, H100):
            # where no level more fits it lost (80x80-10x10 at N=16 Lq=300 43.1 -> 44.1: a smaller L1), as 160 KB did
            # everywhere (rtdetr-decoder 42.3, Lq=900 93.6); CTA pairs lost over one segment each (N=8 Lq=300 23.6 ->
            # 25.3) and gained 1% over several (N=32, not taken); RT-DETR's decoder at N=4 (short ranges) tied.
            now = dataclasses.replace(cfg, **changes)
            wide = dataclasses.replace(now, stage_bytes=WIDE_STAGE_BYTES)
            if staged_levels(levels, wide.stage_pixels) > staged_levels(levels, now.stage_pixels):
                changes["stage_bytes"] = WIDE_STAGE_BYTES
    if (schedule.whole and changes.get("cluster_size", cfg.cluster_size) > 1 and _half_vectors_measured(cfg, permuted)
            and "vector_bytes" not in fixed):
        # CTA pairs over whole segments (detr-decoder, -ref): 8-byte vectors, eight threads a query and 16
        # queries a tile. Two runs in opposite orders, H100 (session 19): detr-decoder 59.8 / 59.7 -> 58.4 /
        # 58.8 us, -ref 57.4 / 57.8 -> 55.0 / 54.9; single CTAs over whole segments (decoder-b16) lost
        # (53.4 / 53.3 -> 54.5 / 54.2), an encoder lost 41% (detr-encoder-init, single CTAs, one round).
        # Pairs over several segments each won too (H100, session 21, DETR levels, reference-point
        # locations): N=32 Lq=300 102.8 -> 97.1 and 100.3 -> 97.0, N=64 Lq=300 190.7 -> 176.8, N=32 Lq=100
        # 71.5 -> 54.9; so did N=8 at Lq=100 (22.7 -> 19.3), 300 (29.9 -> 29.4) and 2000 (105.5 -> 100.3).
        trial = dataclasses.replace(cfg, **changes, vector_bytes=8)
        trial_grid, trial_schedule = grid_and_schedule(trial, N, Lq, S, sms, l2_bytes, window)
        if trial_schedule.whole:
            changes["vector_bytes"] = 8
            grid, schedule = trial_grid, trial_schedule
    cluster = changes.get("cluster_size", cfg.cluster_size)
    # CTA pairs over one whole segment each, with 8-byte vectors (detr-decoder, -ref): the two rules below.
    one_segment_pairs = (schedule.whole and cluster > 1 and N * cfg.num_heads <= grid // cluster
                         and changes.get("vector_bytes", cfg.vector_bytes) == 8 and _hints_measured(cfg, permuted))
    if one_segment_pairs and 8 * Lq * cfg.num_points >= S and "prefetch_levels" not in fixed:
        # The mid-size levels prefetched to L2 as the segment starts. The kernel takes a level where its pixels are
        # at most half the segment's corner reads; the launch asks for it where its samples (4 Lq P corners) come to
        # half of S (DETR's second level is a fifth of S). Two runs in opposite orders, H100 (session 22): detr-decoder
        # 58.4 / 58.3 -> 57.7 / 57.1 us, -ref 54.4 / 54.4 -> 53.5 / 53.1, N=8 Lq=2000 99.9 / 99.8 -> 97.9 / 97.9;
        # at N=8 Lq=300, where no level qualifies, the kernel with the prefetch code took 32.1 against 31.5.
        # Lost: single CTAs over whole segments (decoder-b16 53.4-53.8 -> 57.9-58.7, N=16 Lq=900 114.5 / 115.6
        # -> 117.9 / 118.2) and pairs over four segments each (N=32 Lq=300 103.5 -> 119.2, every level
        # prefetched in that run); prefetching before the staging's copies lost (detr-decoder 60.4 / 59.7).
        changes["prefetch_levels"] = True
    if one_segment_pairs and cfg.level_points <= 16 and "output_evict_first" not in fixed:
        # ... and (v61) the output rows stored evict-first in L2, as on the encoders (the reading, not profiled: the
        # stores then push out fewer of the value rows that later samples read again). Session 45, tune.py, runs in
        # alternating orders, µs, means, the launch -> evict-first stores: H100 (six) detr-decoder 57.23 -> 56.97
        # (6 of 6 pairs), -ref 53.53 -> 53.03 (6 of 6); H200 (four) detr-decoder 47.88 -> 47.48 (4 of 4), -ref tied
        # (45.00 -> 45.05). Not taken: single CTAs over whole segments (decoder-b16 52.6 / 52.6 -> 53.1 / 52.6, H100).
        changes["output_evict_first"] = True
    if one_segment_pairs and "interleave_ranks" not in fixed:
        # ... and (v62) the pair takes a segment's tiles in turn, one at a time: of detr-decoder's 57 tiles the first
        # CTA took 30 and the second 27 (the last turn's seven tiles, five and two); now 29 (one of them four
        # queries) and 28. Session 47, tune.py, runs in alternating orders, µs, means: H100 (eight) detr-decoder
        # 57.31 -> 56.89 (6 of 8 pairs), -ref 53.48 -> 52.59 (8 of 8); H200 (three) 47.70 -> 46.80, 44.57 -> 44.03
        # (3 of 3 each). Lost through the order table, where a CTA's neighbouring tiles share L1 (seed-b48 3290 /
        # 3289 -> 3313 / 3316, -shuffled +0.7%, H100).
        changes["interleave_ranks"] = True
    # Single CTAs over long ranges (the encoders), and over one round of them: the cache-policy rules' launches.
    long_ranges = changes.get("cluster_size") == 1 and not schedule.whole
    one_round_long = long_ranges and schedule.rounds == 1
    if long_ranges and not short and _hints_measured(cfg, permuted) and "line_prefetch" not in fixed:
        # Single CTAs over long ranges (encoders, dcnv4-test): whole-line L2 fetches won 1-2.5%
        # (detr-encoder 130.5 -> 129.1, -init 121.0 -> 117.9, dcnv4-test 84.2 -> 83.3 us, two runs,
        # H100); where rows are scattered (decoders) the other half of each line is waste (detr-decoder
        # 64.2 -> 71.6).
        changes["line_prefetch"] = True
    if one_round_long and _hints_measured(cfg, permuted) and "coarse_evict_last" not in fixed:
        # One round of them: the unstaged levels other than the finest stay in L2 (evict-last; over several
        # rounds they would hold L2 against the next round's slices, unmeasured). Four runs, two calls, H100:
        # dcnv4-test 88.0-89.0 -> 85.0-86.0 us; the encoders tied (detr-encoder 128.7-129.6 -> 128.4-129.3,
        # -init 116.5-117.4 -> 116.9-117.6). Where segments are whole (decoders) it tied, through the order
        # table (seed-b48) it lost 0.6%; the finest level evict-first in L2 lost 14-50%.
        changes["coarse_evict_last"] = True
    if one_round_long and not short and _output_policy_measured(cfg, permuted):
        if cfg.level_points <= 16 and "output_evict_first" not in fixed:
            # One round of single CTAs over long ranges at up to 16 samples a query (the encoders, fused or not): the
            # output rows are stored evict-first in L2, so that they do not push out value's lines, which these launches
            # read again. Session 32, tune.py, two calls, each both orders, µs, the launch -> evict-first stores
            # (means): H100: detr-encoder 126.6 -> 126.1, -init 116.0 -> 115.1, mask2former-encoder 112.9 -> 110.7,
            # mask2former-cityscapes 129.3 -> 127.1; bf16 -init 120.4 -> 118.6, mask2former-encoder 115.2 -> 113.9 (one
            # run). H200 (one call): tied (detr-encoder 121.0 -> 121.4, -init 110.9 -> 111.1, mask2former-encoder 103.2
            # -> 103.5, Cityscapes 117.2 -> 116.5). The fused kernel (the layer's; DETR's levels, N=2, Lq=S, out/
            # script, both orders): H100 fp16 137.8 -> 136.2 and 137.8 -> 136.5, bf16 142.3 -> 140.2 and 141.5 -> 140.1;
            # H200 fp16 131.8 -> 130.6, bf16 136.9 -> 135.5. Not taken: P = 8 (dcnv4-test 83.7 -> 84.1 on the H100),
            # short ranges (RT-DETR's decoder at N=4: 15.5 / 15.4 -> 15.6 / 16.2), several rounds (bev-self-attention,
            # one level over a quarter of L2: 88.8 -> 88.1 on the H100, 82.0 -> 82.0 on the H200; not enough to widen
            # the rule) and the launches that tied (decoders, seed-b48).
            changes["output_evict_first"] = True
        if _staged_addresses_measured(cfg) and "staged_addresses" not in fixed:
            # ... and the staged corners' byte addresses selected against the zero pixel's (bitwise the same sums),
            # where _staged_addresses_measured. Session 33, tune.py and out/ scripts for the fused kernel (DETR's
            # levels), both orders, µs, the launch -> staged_addresses: fused N=2 Lq=S, H100 fp16 136.4 / 136.3 -> 130.2
            # / 130.3, bf16 139.6 / 140.0 -> 133.4 / 133.4; H200 fp16 130.1 / 130.7 -> 124.0 / 124.0, bf16 135.6 / 134.8
            # -> 128.3 / 127.8; fused P = 8, N=1 Lq=S, H100 147.0 / 146.8 -> 142.5 / 142.0; unfused, H200: detr-encoder
            # 121.4 / 121.5 -> 121.1 / 120.7, -init 110.5 / 110.8 -> 109.9 / 109.7, mask2former-encoder 103.2 / 103.0 ->
            # 100.5 / 99.9; H100 (six runs): detr-encoder tied (125.9 -> 125.9, means), -init 114.3 -> 114.0,
            # mask2former-encoder 109.9 -> 109.2. Not taken: unfused P = 8 (dcnv4-test 83.8 / 83.7 -> 88.6 / 88.1 on the
            # H100, 83.0 -> 87.1 on the H200), fp32 value (H100: detr-encoder 209.7 -> 219.6, -init 189.7 -> 193.4, the
            # fused kernel tied at 237.2; the Mask2Former encoder 214.6 -> 183.2, with nothing staged: ptxas's schedule,
            # not the staged reads) and whole segments (unfused decoders tied; the fused detr-decoder lost, 62.4 -> 65.3
            # on the H100).
            changes["staged_addresses"] = True
        stagger = _stagger_taken(dataclasses.replace(cfg, **changes))
        if "stagger_locations" not in fixed and stagger:
            # ... and, with fp16/bf16 value where two queries of a quarter-warp read location rows 128 bytes apart
            # (DETR's four levels of 4 points), the location ring swizzled by TMA and read where each half landed (v57).
            # Session 40, tune.py, three runs in alternating orders, µs, means, without -> with it: H200 detr-encoder
            # 120.9 -> 116.4, -init 110.0 -> 107.3; H100 125.8 -> 121.7 and 114.0 -> 111.2. bf16 (session 41, H200,
            # two runs, with doubled_coarsest below): detr-encoder 121.1 / 120.8 -> 116.9 / 117.0, -init tied (111.3 /
            # 110.5 -> 110.6 / 110.9); the doubled level alone 119.2 / 118.7 and 111.4 / 110.6. (v56's form, selects
            # instead of the swizzle, lost in bf16 on the H100.) Several rounds: the rule further down.
            changes["stagger_locations"] = True
        if "doubled_coarsest" not in fixed and stagger:
            # ... and the last level staged doubled (v58), in a staging buffer that holds DETR's doubled beside its
            # third level (the kernel stages it single where that would leave a level out): the staged corners' bank
            # conflicts of that level go, bitwise the same sums. Session 41, tune.py, µs, against the same buffer
            # without it, alternating runs: H200 (three) detr-encoder 116.9 /
            # 116.2 / 116.7 -> 113.8 / 114.5 / 114.4, -init 107.4 / 107.5 / 106.9 -> 106.4 / 106.6 / 106.0; H100 (two)
            # 123.2 / 122.9 -> 120.8 / 121.0 and 113.3 / 113.2 -> 112.8 / 112.1; bf16 above. Not taken on the decoders
            # (H100: tied on detr-decoder and -ref, 57.2-57.5 -> 57.4-58.1; the larger buffer cost decoder-b16 52.5 ->
            # 53.6) or over several rounds (below).
            changes["doubled_coarsest"] = True
            if "stage_bytes" not in fixed:
                changes["stage_bytes"] = DOUBLED_STAGE_BYTES
        if ("coarse_evict_last" not in fixed and dram_bytes_per_s >= FAST_DRAM_BYTES_PER_S
                and _fast_dram_drops_evict_last(dataclasses.replace(cfg, **changes))):
            # ... and on fast DRAM (the H200) without the coarser levels' evict-last hint: the misses it saves cost
            # less there than what it keeps in L2. Session 42, tune.py, four runs in alternating orders, µs, with ->
            # without it: H200 detr-encoder 115.5 / 115.3 / 115.4 / 115.3 -> 114.6 / 114.9 / 114.2 / 115.1, -init 107.8
            # / 107.2 / 107.2 / 107.1 -> 106.5 / 107.2 / 106.7 / 106.3; the H100 keeps it (121.1-121.4 -> 122.5-123.3
            # and 112.0-113.7 -> 113.1-114.0). dcnv4-test and the Mask2Former encoder (not these launches) tied on
            # both; bf16 was not measured.
            changes.pop("coarse_evict_last", None)
    if (long_ranges and not one_round_long and cfg.value_dtype == "float16" and "stagger_locations" not in fixed
            and _stagger_taken(dataclasses.replace(cfg, **changes))):
        # Several rounds of single CTAs over long ranges (batched fp16 encoders): the swizzled location ring alone
        # (v57). Session 41, H200, tune.py, two runs in opposite orders, N=8 DETR encoder shapes, µs: 450.9 / 452.2 ->
        # 443.7 / 443.8; with the last level doubled as well 448.4 / 443.7, not taken (v56's selects lost there, H100).
        changes["stagger_locations"] = True
    if (one_round_long and not short and cfg.num_levels <= 3 and (not cfg.fused or first_level_strips)
            and not permuted and cfg.fine_gather == "ldg" and "strips" not in fixed
            and N * cfg.num_heads * query_blocks(cfg, Lq) >= STRIP_RANGE_TILES * grid):
        # One round of single CTAs over long ranges at up to three levels: where the first level's rows are whole
        # tiles the kernel takes its tiles in column strips (KernelConfig.strips; elsewhere a copy of the tile loop
        # without the map runs). Session 35, H200, tune.py both orders, µs (means), the launch -> strips: fp16
        # mask2former-encoder 100.2 -> 96.9, mask2former-cityscapes 113.9 -> 103.9, the same with Deformable DETR's
        # initial offsets (128x128-32x32, N=2) 90.2 -> 90.0; bf16 105.9 -> 96.9 and 118.6 -> 103.6; fp32 191.9 -> 177.2
        # and 212.6 -> 184.6; where strips are off (rows not whole tiles): DETR's first three levels (N=2) 102.1 ->
        # 102.5, its first two 79.1 -> 79.8, bev-self-attention (several rounds) 82.1 -> 82.1. Not taken: four levels
        # (the copies cost detr-encoder 121.0 -> 123.7, -init 110.3 -> 112.4, dcnv4-test 83.1 -> 85.0), several rounds
        # (128x128-32x32 at N=8: 358.7 -> 390.3), ranges under STRIP_RANGE_TILES tiles (64x64-16x16 at N=2, 20 a range:
        # 31.1 -> 31.9), and the fused kernel unless the host knows that the strips are on (first_level_strips: a level
        # table on the CPU, as transformers' models pass it): out/ script, H200, both orders, on: Mask2Former's and
        # Cityscapes' shapes 8-9% faster in fp16 and bf16, 135.8 -> 124.8 and 137.7 -> 125.5; off: DETR's first
        # three levels, the copies cost 10-12%, 136.8 -> 153.1.
        changes["strips"] = True
    if (one_round_long and _hints_measured(cfg, permuted) and cfg.level_points <= 16 and "segment_cost" not in fixed
            and _segment_cost_fits(N, Lq, cfg, SEGMENT_COST)):
        # One round of them at up to 16 samples a query (detr-encoder, -init): a segment's start counts for
        # four tiles, so the ranges that cross into a new (image, head), which wait there for every group
        # and the new staging, take fewer. H100, session 25, against segment_cost=0, four runs in three calls:
        # detr-encoder 129.5 / 129.4 / 128.2 / 129.5 -> 128.0 / 126.7 / 126.3 / 127.8 us (2-6 tiles within
        # 1%), -init 119.2 / 117.6 / 117.6 / 118.1 -> 117.4 / 116.0 / 116.3 / 116.2. H200, two calls: tied
        # (detr-encoder 121.1 / 121.3 -> 121.1-121.2, -init 112.0 / 111.2 -> 110.8-111.2). Lost: dcnv4-test
        # (P = 8, 84.3 -> 88.8-89.7) and two rounds (N=4 detr-encoder shapes, 245.0 -> 258.1-260.1).
        changes["segment_cost"] = SEGMENT_COST
    if schedule.whole and cfg.fine_gather == "ldg" and not cfg.l1_first and "l1_first" not in fixed:
        # Each cluster starts a segment at once: its first tiles gather the L1 levels while the
        # staging lands (measured 62 -> 55 us on detr-decoder; 4% slower where ranges are long). One
        # producer warp for the five groups: 69.0 / 65.2 / 65.2 against 71.0 / 67.5 / 67.4 us on
        # detr-decoder / detr-decoder-ref / decoder-b16 (H100).
        changes["l1_first"] = True
        if shared_producer and "producers" not in fixed:
            changes["producers"] = 1
    if (schedule.whole and _hints_measured(cfg, permuted) and cfg.num_levels > 1
            and "finest_evict_first" not in fixed):
        # Whole segments (decoders: scattered queries): the finest level's L1 lines, the least shared,
        # evict first. Two runs, H100: detr-decoder 64.8 -> 60.8 us, -ref 60.4 -> 58.7, decoder-b16 tied;
        # H200: 53.8 -> 51.1, 51.5 -> 49.8, 50.2 -> 48.6. ncu: L1 hit rate unchanged, L2 hit rate up and
        # DRAM reads down (89 -> 84 MB). Every level evict-first lost (detr-decoder 67); on the encoders
        # and seed-b48, whose fine level neighbouring queries share, it lost 30-50%.
        changes["finest_evict_first"] = True
    if schedule.whole and _hints_measured(cfg, permuted) and cfg.prefetch_inputs and "early_inputs" not in fixed:
        # Whole segments (decoders): the first tiles' inputs issued before the prologue and no segment
        # barrier before the first segment. Four runs in two calls, H100 (session 18): detr-decoder
        # 60.2-61.2 -> 59.2-60.2 us, -ref 58.5-59.3 -> 57.4-57.9, decoder-b16 54.8-55.0 -> 53.5-54.8. It lost
        # 5% on dcnv4-test and tied on the encoders (single CTAs over one long range).
        changes["early_inputs"] = True
    one_round = changes.get("cluster_size", cfg.cluster_size) == 1 and schedule.rounds == 1
    batch = _launch_gather_batch(cfg, schedule.whole, permuted, one_round)
    if batch > 1 and "gather_batch" not in fixed and "gather_batch" not in changes:
        changes["gather_batch"] = batch
    cost = changes.get("segment_cost", cfg.segment_cost)
    if cost and not _segment_cost_fits(N, Lq, cfg, cost):
        raise ValueError(f"cute_deform: segment_cost={cost} with N={N}, Lq={Lq}: the tile count plus the segments' "
                         "costs must stay below 2^31")
    return changes, grid, schedule


def _segment_cost_fits(N: int, Lq: int, cfg, cost: int) -> bool:
    """Whether the tile sequence with each segment `cost` tiles longer (TileScheduler.boundary) fits an Int32:
    at most N * M * Lq tiles, as many segments."""
    return N * cfg.num_heads * max(Lq, 1) * (1 + cost) < 2**31


# The GPU a launch is planned for where none is at hand (compiling ahead on another machine): an H100 or
# H200 (132 SMs, 50 MB of L2).
PLAN_SMS, PLAN_L2_BYTES = 132, 50 << 20


def launched_config(cfg, N: int, Lq: int, S: int, tuning: dict, sms: int = PLAN_SMS, l2_bytes: int = PLAN_L2_BYTES,
                    levels=None):
    """The configuration a launch of cfg (config_for's, from the same tuning) runs on an (N, Lq, S) problem:
    choose_launch's changes applied (levels: the (H, W) pairs where the caller holds the level table on the host)."""
    if not isinstance(cfg, KernelConfig):
        return cfg
    changes, _, _ = choose_launch(cfg, N, Lq, S, sms, l2_bytes, tuning.get("window_fraction"),
                                  tuning.get("reorder_queries", "auto"), frozenset(static_tuning(tuning)),
                                  levels=levels)
    return dataclasses.replace(cfg, **changes)
