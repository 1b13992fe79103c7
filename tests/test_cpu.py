"""The op's CPU kernel (cute_deform/cpu.py) against the float64 reference: border and special
locations, non-finite locations, weights and values, every way of chunking, both index widths."""
import math

import pytest
import torch

from cute_deform import cpu, ms_deform_attn_reference
from msda_testing import draw_nonzero, make_inputs, nonfinite_mismatch, rel_err, sprinkle_special_locations

LEVELS = [(7, 9), (4, 5), (1, 6), (3, 1), (1, 1)]  # 1-pixel rows and columns included


def op(*args):
    return torch.ops.cute_deform.forward(*args)


def fp32_reference(*args):
    """The reference rule in fp32 arithmetic: the same rounding of h = y*H - 0.5 as the kernel, so
    the same samples fall inside (a sample within an ulp of a skip border may fall either side)."""
    return ms_deform_attn_reference(*args, compute_dtype=torch.float32, out_dtype=torch.float64)


def assert_float64_or_fp32_rule(out, ref, ref_fp32, context):
    """out within 1e-5 of the float64 reference ref; or, only where an ulp decides whether a sample is in and the fp32
    rule (ref_fp32) decides it as the op does, within 1e-5 of that rule: with few samples the float64 output can be
    one corner of weight ~1e-8 that fp32 skips (norm ~1e-7), and the error relative to it is then 1."""
    if rel_err(out, ref) >= 1e-5:
        assert (out.double() - ref_fp32).norm() <= 1e-5 * max(ref.norm(), ref_fp32.norm()), context


def random_sizes(gen):
    def pick(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    levels = [(pick(1, 12), pick(1, 12)) for _ in range(pick(1, 5))]
    return levels, dict(batch=pick(1, 3), queries=pick(1, 20), heads=pick(1, 4), head_dim=pick(1, 33),
                        points=pick(1, 8))


@pytest.mark.parametrize("case", range(6))
def test_special_locations_match_the_reference(gen, case):
    """Pixel edges and centres, the skip borders and an ulp either side, NaN, inf and 1e30 locations
    on most samples. The error is fp32 rounding of the positions, no larger than the fp32 reference's."""
    levels, sizes = random_sizes(gen)

    def draw():
        args = list(make_inputs(gen, levels, dtype=torch.float32, **sizes))
        args[3] = sprinkle_special_locations(gen, args[3], levels, fraction=0.7)
        return args

    args, ref = draw_nonzero(draw, ms_deform_attn_reference)
    out = op(*args)
    ref_fp32 = fp32_reference(*args)
    err, err_fp32 = rel_err(out, ref), rel_err(ref_fp32, ref)
    assert torch.isfinite(out).all()
    # Slack for fp32 sums in another order than the fp32 reference's: a few ulps of the sum of the terms' magnitudes
    # (the weights are not negative), which exceeds the output where terms cancel; with a handful of outputs the
    # reference's own error can be far below it (one output once came 4 ulps from the fp32 reference, 2.7e-7).
    magnitude = ms_deform_attn_reference(args[0].abs(), *args[1:]).norm() / ref.norm()
    slack = max(1e-7, 16 * 2.0**-24 * float(magnitude))
    assert err <= 1.5 * err_fp32 + slack, (levels, sizes, err, err_fp32, slack)
    assert_float64_or_fp32_rule(out, ref, ref_fp32, (levels, sizes, err))


@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_realistic_level_sizes(gen, value_dtype):
    """Levels of a few thousand pixels; at positions near 60 an fp32 ulp is 4e-6 of a pixel, hence
    the tolerance (the demo's), and again no worse than the fp32 reference."""
    levels = [(40, 60), (20, 30), (10, 15), (5, 8)]
    args = list(make_inputs(gen, levels, batch=2, queries=300, heads=4, head_dim=16, points=4, dtype=value_dtype,
                            loc_dtype=torch.float32, attn_dtype=torch.float32))
    out = op(*args)
    ref = ms_deform_attn_reference(*args, out_dtype=torch.float64)
    tolerance = max(1e-5, torch.finfo(value_dtype).eps)
    assert out.dtype == value_dtype
    assert rel_err(out, ref) < tolerance
    if value_dtype == torch.float32:
        assert rel_err(out, ref) <= 1.5 * rel_err(fp32_reference(*args), ref) + 1e-7


def _scatter(gen, t, values):
    """t with `values` at random places (the first ones only where t has fewer elements: one query, head, level)."""
    t = t.clone()
    flat = t.view(-1)
    places = torch.randperm(flat.numel(), generator=gen)[: len(values)]
    flat[places] = torch.tensor(values[: len(places)], dtype=t.dtype)
    return t


@pytest.mark.parametrize("case", range(6))
def test_non_finite_weights_values_and_locations(gen, case):
    """NaN and inf attention weights on samples inside and outside their level, NaN and inf in value,
    special locations: NaN and inf outputs exactly where the reference rule (in fp32) has them, with
    the same signs, and the finite outputs within the fp32 tolerance of the float64 reference (or, where an ulp
    decides a sample on a skip border, of the fp32 rule). These rows take the kernel's exact fallback."""
    levels, sizes = random_sizes(gen)
    args = list(make_inputs(gen, levels, dtype=torch.float32, **sizes))
    args[3] = sprinkle_special_locations(gen, args[3], levels, fraction=0.5)
    nan, inf = math.nan, math.inf
    args[4] = _scatter(gen, args[4], [nan, inf, -inf, nan, inf][: 1 + case % 5])
    if case % 2:
        args[0] = _scatter(gen, args[0], [nan, -inf])
    out = op(*args)
    expected = fp32_reference(*args)
    mismatch = nonfinite_mismatch(out, expected)
    assert mismatch is None, mismatch
    ref = ms_deform_attn_reference(*args)
    finite = torch.isfinite(expected) & torch.isfinite(ref)
    if finite.any() and ref[finite].norm() > 0:
        assert_float64_or_fp32_rule(out[finite], ref[finite], expected[finite], (levels, sizes))


@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16])
def test_chunking_does_not_change_the_output(gen, monkeypatch, value_dtype):
    """Chunks of several images (the default here), of one image (a small table bound) and of a few
    queries of one image (not a divisor of Lq) give bit for bit the same output; fp16 value takes the
    fp32 table copy, fp32 value a view."""
    args = make_inputs(gen, LEVELS, batch=3, queries=7, heads=2, head_dim=5, points=3, dtype=value_dtype,
                       loc_dtype=torch.float32, attn_dtype=torch.float32)
    several_images = op(*args)
    monkeypatch.setattr(cpu, "TABLE_BYTES_PER_CHUNK", 1)
    one_image = op(*args)
    monkeypatch.setattr(cpu, "SAMPLES_PER_CHUNK", 2 * 2 * len(LEVELS) * 3)  # 2 queries a chunk
    two_queries = op(*args)
    assert torch.equal(one_image, several_images) and torch.equal(two_queries, several_images)
    assert rel_err(several_images, ms_deform_attn_reference(*args)) < max(1e-6, torch.finfo(value_dtype).eps)


def test_int64_indices_give_the_same_output(gen, monkeypatch):
    """Tables of 2^31 rows or more are indexed with int64 (forced here on a small table)."""
    args = make_inputs(gen, LEVELS, batch=2, queries=9, heads=3, head_dim=4, points=2, dtype=torch.float32)
    int32 = op(*args)
    monkeypatch.setattr(cpu, "INT32_ROWS", 0)
    assert torch.equal(op(*args), int32)
    assert rel_err(int32, ms_deform_attn_reference(*args)) < 1e-6
