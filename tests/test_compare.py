"""scripts/compare.py's DRAM floor: only the value rows some sample's corner reads count."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import compare  # noqa: E402


def _one_level(points_xy):
    """One image, one 4x6 level (H=4, W=6), two heads, one query, P points at the given (x, y)."""
    shape = compare.Shape("t", N=1, Lq=1, levels=[(4, 6)], P=len(points_xy), M=2, D=8, locations="uniform")
    loc = torch.zeros(1, 1, 2, 1, shape.P, 2)
    loc[0, 0, 0, 0] = torch.tensor(points_xy)  # head 0 samples these; head 1 samples far outside
    loc[0, 0, 1, 0] = 5.0
    return shape, loc


def test_touched_rows_follow_the_corner_rule():
    # x = w + 0.5 pixels: w = 1.25, h = 1.5 -> corners (1..2, 1..2) all in the level: 4 rows of head 0.
    shape, loc = _one_level([[1.75 / 6, 2.0 / 4]])
    assert compare.touched_value_rows(shape, loc) == 4
    # w = -0.5 (inside: > -1) -> only column 0 is in the level; h = 2.5 -> rows 2 and 3: 2 rows.
    shape, loc = _one_level([[0.0, 3.0 / 4]])
    assert compare.touched_value_rows(shape, loc) == 2
    # The same footprint twice, a NaN and a point past the edge (w = 5.5 > W - 1: column 5 only) -> 4 + 2.
    shape, loc = _one_level([[1.75 / 6, 2.0 / 4], [1.75 / 6, 2.0 / 4], [float("nan"), 0.5], [1.0, 2.0 / 4]])
    assert compare.touched_value_rows(shape, loc) == 6
    assert shape.floor_bytes(2, 6) == shape.floor_bytes(2) - (1 * 24 * 2 - 6) * 8 * 2


def test_uniform_decoder_reads_a_third_of_its_value():
    shape = compare.selected_shapes(compare.parse_args(["--presets", "decoder-b16"]))[0]
    shape.N = 2  # the fraction does not depend on the batch
    (_, _, _, loc, _), _ = compare.make_inputs(shape, torch.float16, torch.Generator().manual_seed(0), device="cpu")
    fraction = compare.touched_value_rows(shape, loc) / (shape.N * shape.S * shape.M)
    # Level 0 (16,700 pixels) gets 300 queries x 4 points x 4 corners per head: a quarter of its rows.
    assert 0.33 < fraction < 0.42


def test_model_presets_are_chosen_by_name_or_together_and_not_by_default():
    names = lambda argv: [s.name for s in compare.selected_shapes(compare.parse_args(argv))]  # noqa: E731
    assert names([]) == list(compare.PRESETS)
    assert names(["--presets", "models"]) == list(compare.MODEL_PRESETS)
    assert names(["--presets", "bev-self-attention,detr-encoder"]) == ["bev-self-attention", "detr-encoder"]
    assert names(["--presets", "all,models"]) == list(compare.PRESETS) + list(compare.MODEL_PRESETS)
    bev = compare.selected_shapes(compare.parse_args(["--presets", "bev-self-attention"]))[0]
    assert (bev.N, bev.Lq, bev.S, bev.P) == (2, 40000, 40000, 4)
    with pytest.raises(SystemExit):
        compare.selected_shapes(compare.parse_args(["--presets", "no-such-model"]))


def test_tune_takes_custom_shapes_next_to_presets():
    import tune
    shapes = tune.shapes_of(["decoder-b16"], ["--levels 100x167,50x84 --N 16 --Lq 900 --locations uniform",
                                              "--levels 10x10 --N 2 --P 3 --locations ref"])
    assert [s.name for s in shapes] == ["decoder-b16", "100x167,50x84-N16-Lq900-P4-uniform-sorted",
                                        "10x10-N2-Lq100-P3-ref-sorted"]
    # Shapes that differ only in one level (the finest or another), their order or their heads get rows of their own.
    twins = tune.shapes_of([], ["--levels 80x80 --N 1 --Lq 300", "--levels 100x167 --N 1 --Lq 300",
                                "--levels 80x80 --N 1 --Lq 300 --order shuffled",
                                "--levels 100x167,50x84 --N 1 --Lq 300", "--levels 100x167,18x42 --N 1 --Lq 300",
                                "--levels 80x80 --N 1 --Lq 300 --D 64"])
    assert len({s.name for s in twins}) == 6
    assert twins[-1].name == "80x80-N1-Lq300-P4-M8-D64-local-sorted"
    assert (shapes[1].N, shapes[1].Lq, shapes[1].levels) == (16, 900, [(100, 167), (50, 84)])
    assert tune.shapes_of([], [])[:] == []


def test_ncu_dirty_l2_replays_the_whole_script_without_flushing(monkeypatch):
    calls = []
    monkeypatch.setattr(compare.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    for mode in ("flushed", "dirty"):
        argv = ["--presets", "detr-decoder", "--ncu", "cute", "--ncu-l2", mode]
        assert compare.ncu_parent(compare.parse_args(argv), argv) == 0
    flushed, dirty = calls
    assert flushed[flushed.index("--cache-control") + 1] == "all" and "--replay-mode" not in flushed
    assert dirty[dirty.index("--cache-control") + 1] == "none"
    assert dirty[dirty.index("--replay-mode") + 1] == "application"
    # The child keeps the L2 mode (it zeroes the 256 MB buffer) and profiles what the parent asked for.
    assert dirty[dirty.index("--ncu-l2") + 1] == "dirty" and dirty[dirty.index("--ncu-child") + 1] == "cute"
    assert "--ncu" not in dirty


HEADER = ("device NVIDIA H100 80GB HBM3 (132 SMs), torch 2.11.0+cu130; value fp16, locations fp32; copy bandwidth "
          "3.00 TB/s (read + write); do_bench median, ms warm-up 25 / rep 100")


@pytest.mark.parametrize("panels", [1, 2, 8])
def test_the_chart_title_wraps_to_the_figure(panels):
    text = compare.wrapped_title(HEADER, panels)
    assert text.split() == HEADER.split()  # every word kept, in order
    assert max(map(len, text.splitlines())) <= max(40, 12 * compare.PNG_PANEL_INCHES * panels)
    assert len(text.splitlines()) <= {1: 4, 2: 2, 8: 1}[panels]  # a line for the widest figures, a few for one panel


def test_the_chart_title_stays_inside_the_image(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [compare.Row("seed-b48-shuffled", "vec", "float16", us=6204.7, floor_us=1044.1),
            compare.Row("seed-b48-shuffled", "cute", "float16", us=3299.5, floor_us=1044.1)]
    fig = compare.write_png(rows, str(tmp_path / "chart.png"), HEADER)
    from matplotlib.text import Text

    title, = [t for t in fig.findobj(Text) if t.get_text() == compare.wrapped_title(HEADER, 1)]
    box = title.get_window_extent(fig.canvas.get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.get_size_inches()[0] * fig.dpi
    assert (tmp_path / "chart.png").stat().st_size > 0


class _Blocks:
    """A stand-in for an implementation that allocates its output: each call gets the next block of `schedule` (as
    torch's caching allocator would hand it out) and writes 1.0 to all of it but the last element, as a kernel that
    skips a tile. Every block starts out holding the right answer, as one where an earlier run on the same inputs
    wrote it."""

    def __init__(self, schedule, dtype=torch.float32):
        self.blocks = {name: torch.ones(4, dtype=dtype) for name in set(schedule)}
        self.schedule = list(schedule)

    def __call__(self):
        block = self.blocks[self.schedule.pop(0)]
        block[:-1] = 1.0
        return block


@pytest.mark.parametrize("schedule", ["AA", "ABB"])
def test_run_poisoned_leaves_nan_where_the_kernel_skipped(schedule):
    """The output comes back on a block that was filled with NaN before the call that wrote it, so a skipped element
    shows as NaN, not as a stale right answer; a miss (another block) poisons that block and tries again. Every call
    of the schedule is made, and no more."""
    run = _Blocks(schedule)
    out, poisoned = compare.run_poisoned(run)
    assert poisoned and not run.schedule
    assert torch.equal(out[:-1], torch.ones(3)) and torch.isnan(out[-1])


def test_run_poisoned_says_when_no_block_came_back():
    """Where every call gets a new block, run_poisoned stops after its attempts and says the output is not on
    poisoned memory (check_impl then reports the row unchecked)."""
    run = _Blocks("ABCDE")
    out, poisoned = compare.run_poisoned(run, attempts=4)
    assert not poisoned and not run.schedule
    assert out is run.blocks["E"] and out[-1] == 1.0  # the stale value a check could not have told from a right one


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_run_poisoned_fills_every_float_dtype_with_nan(dtype):
    out, poisoned = compare.run_poisoned(_Blocks("AA", dtype))
    assert poisoned and torch.isnan(out[-1]) and torch.equal(out[:-1], torch.ones(3, dtype=dtype))


def test_run_poisoned_fills_an_integer_output_with_minus_one():
    """An integer output (the order table) is poisoned with -1, which no index or count of the op can be."""
    out, poisoned = compare.run_poisoned(_Blocks("ABB", torch.int64))
    assert poisoned and out[-1] == -1 and torch.equal(out[:-1], torch.ones(3, dtype=torch.int64))


def test_the_tests_fail_where_an_output_never_lands_on_poison():
    """tests/msda_testing.output_on_nan, which every GPU test's output goes through, fails the test where
    run_poisoned cannot land the output on a poisoned block, instead of checking stale memory."""
    import msda_testing

    assert torch.isnan(msda_testing.output_on_nan(_Blocks("AA"))[-1])
    with pytest.raises(AssertionError, match="never landed on a block filled with NaN"):
        msda_testing.output_on_nan(_Blocks("ABCDE"))


def test_without_the_caching_allocator_the_tests_run_once_unpoisoned(monkeypatch):
    """Under PYTORCH_NO_CUDA_MEMORY_CACHING=1 (the sanitizer runs) a freed block is not handed back, so output_on_nan
    makes one call and poisons nothing."""
    import msda_testing

    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    run = _Blocks("AB")
    out = msda_testing.output_on_nan(run)
    assert out is run.blocks["A"] and run.schedule == ["B"] and out[-1] == 1.0
