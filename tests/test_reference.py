"""cute_deform.reference against an independent scalar loop, hand-derived samples, and grid_sample."""
import math

import pytest
import torch

import cute_deform.reference as reference_module
from cute_deform import ms_deform_attn_grid_sample, ms_deform_attn_reference
from msda_testing import brute_force_msda, make_inputs, rel_err, sprinkle_special_locations, strided_copies

# Powers of two make the special coordinates exact (borders land exactly on h = -1, h = H, ...);
# the others, with H or W == 1, check the layout and the edge handling of thin levels.
LEVEL_SETS = [
    [(4, 8)],
    [(4, 8), (2, 4), (1, 2), (1, 1)],
    [(3, 5), (1, 7), (6, 1), (2, 3)],
    [(5, 4), (3, 3), (1, 1), (2, 2), (1, 3)],
]


@pytest.mark.parametrize("levels", LEVEL_SETS, ids=lambda ls: "-".join(f"{h}x{w}" for h, w in ls))
def test_reference_equals_brute_force_bitwise(gen, levels):
    value, shapes, starts, loc, attn = make_inputs(gen, levels, batch=2, queries=6, heads=3, head_dim=3, points=3)
    loc = sprinkle_special_locations(gen, loc, levels)
    out = ms_deform_attn_reference(value, shapes, starts, loc, attn)
    expected = brute_force_msda(value, shapes, starts, loc, attn)
    assert out.dtype == torch.float64 and out.shape == expected.shape
    assert torch.isfinite(out).all(), "NaN/inf locations must contribute 0"
    assert torch.equal(out, expected), f"max abs diff {(out - expected).abs().max().item()}"


def test_special_locations_are_hit(gen):
    """The sprinkled locations really exercise skipped, border and exact-pixel samples."""
    levels = [(4, 8), (1, 2)]
    _, _, _, loc, _ = make_inputs(gen, levels, batch=2, queries=400, heads=2, points=4)
    loc = sprinkle_special_locations(gen, loc, levels)
    x = loc[..., 0, :, 0]
    w = x * 8 - 0.5
    assert torch.isnan(x).any() and torch.isinf(x).any()
    assert (w == -1).any() or (w == 8).any()  # exactly on a skip border
    assert (w == w.floor()).logical_and(w > -1).logical_and(w < 8).any()  # exactly on a pixel centre


def _single_sample_inputs(gen, levels, points_xy, weights):
    """One query, one head, P=1 per level, chosen locations; D=5 random channels."""
    value, shapes, starts, _, _ = make_inputs(gen, levels, batch=1, queries=1, heads=1, head_dim=5, points=1)
    loc = torch.tensor(points_xy, dtype=torch.float64).view(1, 1, 1, len(levels), 1, 2)
    attn = torch.tensor(weights, dtype=torch.float64).view(1, 1, 1, len(levels), 1)
    return value, shapes, starts, loc, attn


def _pixel(value, starts, levels, level, i, j):
    return value[0, int(starts[level]) + i * levels[level][1] + j, 0]


def test_pixel_centre_reads_that_pixel(gen):
    levels = [(4, 8), (2, 2), (1, 1)]
    picks = [(int(torch.randint(h, (1,), generator=gen)), int(torch.randint(w, (1,), generator=gen))) for h, w in levels]
    xy = [((j + 0.5) / w, (i + 0.5) / h) for (i, j), (h, w) in zip(picks, levels)]
    weights = torch.rand(len(levels), generator=gen, dtype=torch.float64).tolist()
    value, shapes, starts, loc, attn = _single_sample_inputs(gen, levels, xy, weights)
    out = ms_deform_attn_reference(value, shapes, starts, loc, attn)[0, 0]
    expected = torch.zeros(5, dtype=torch.float64)
    for level, (i, j) in enumerate(picks):
        expected += _pixel(value, starts, levels, level, i, j) * weights[level]
    assert torch.equal(out, expected)


def test_pixel_corner_averages_four_pixels(gen):
    levels = [(4, 8)]
    i, j = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 8, (1,), generator=gen))
    weight = float(torch.rand(1, generator=gen))
    value, shapes, starts, loc, attn = _single_sample_inputs(gen, levels, [(j / 8, i / 4)], [weight])
    out = ms_deform_attn_reference(value, shapes, starts, loc, attn)[0, 0]
    four = sum(_pixel(value, starts, levels, 0, a, b) for a in (i - 1, i) for b in (j - 1, j))
    torch.testing.assert_close(out, 0.25 * four * weight, rtol=1e-14, atol=1e-14)


def test_image_border_reads_zero_outside_not_clamped(gen):
    """x = 0 is half a pixel left of column 0's centre: half of column 0, half of a zero column."""
    levels = [(4, 8)]
    i = int(torch.randint(4, (1,), generator=gen))
    value, shapes, starts, loc, attn = _single_sample_inputs(gen, levels, [(0.0, (i + 0.5) / 4)], [1.0])
    out = ms_deform_attn_reference(value, shapes, starts, loc, attn)[0, 0]
    assert torch.equal(out, 0.5 * _pixel(value, starts, levels, 0, i, 0))


@pytest.mark.parametrize("where", ["left", "right", "top", "bottom", "nan", "inf"])
def test_skipped_sample_ignores_its_weight(gen, where):
    """On or past the skip border (w == -1, w == W, ...) or at a NaN/inf location the sample adds
    nothing, even with a NaN attention weight; just inside the border a NaN weight does propagate."""
    H, W = 4, 8
    on_border = {
        "left": (-0.5 / W, 0.5), "right": ((W + 0.5) / W, 0.5),
        "top": (0.5, -0.5 / H), "bottom": (0.5, (H + 0.5) / H),
        "nan": (math.nan, 0.5), "inf": (0.5, math.inf),
    }[where]
    value, shapes, starts, loc, attn = _single_sample_inputs(gen, [(H, W)], [on_border], [math.nan])
    out = ms_deform_attn_reference(value, shapes, starts, loc, attn)
    assert torch.equal(out, torch.zeros_like(out))
    if where in ("nan", "inf"):
        return
    # Step 1/1024 pixel inwards (exact in binary, unlike nextafter, which can round back onto the border).
    step = {
        "left": (1 / 1024 / W, 0.0), "right": (-1 / 1024 / W, 0.0),
        "top": (0.0, 1 / 1024 / H), "bottom": (0.0, -1 / 1024 / H),
    }[where]
    inside = (on_border[0] + step[0], on_border[1] + step[1])
    loc[0, 0, 0, 0, 0] = torch.tensor(inside, dtype=torch.float64)
    assert torch.isnan(ms_deform_attn_reference(value, shapes, starts, loc, attn)).all()


@pytest.mark.parametrize("levels", LEVEL_SETS[1:], ids=lambda ls: "-".join(f"{h}x{w}" for h, w in ls))
def test_grid_sample_formulation_matches_reference(gen, levels):
    value, shapes, starts, loc, attn = make_inputs(gen, levels, batch=3, queries=7, heads=2, head_dim=5, points=4)
    loc = sprinkle_special_locations(gen, loc, levels, fraction=0.3)
    ref = ms_deform_attn_reference(value, shapes, starts, loc, attn)
    out64 = ms_deform_attn_grid_sample(value, shapes, starts, loc, attn, compute_dtype=torch.float64)
    assert out64.dtype == torch.float64 and torch.isfinite(out64).all()
    assert rel_err(out64, ref) < 1e-13
    out32 = ms_deform_attn_grid_sample(value.float(), shapes, starts, loc.float(), attn.float(), out_dtype=torch.float64)
    assert rel_err(out32, ref) < 1e-5


def test_chunking_does_not_change_the_result(gen, monkeypatch):
    levels = [(5, 6), (3, 3), (1, 2)]
    value, shapes, starts, loc, attn = make_inputs(gen, levels, batch=3, queries=7, heads=2, head_dim=4, points=3)
    whole_ref = ms_deform_attn_reference(value, shapes, starts, loc, attn)
    whole_gs = ms_deform_attn_grid_sample(value, shapes, starts, loc, attn, compute_dtype=torch.float64)
    # Chunks of one to a few queries, crossing image boundaries in the flattened N*Lq rows.
    monkeypatch.setattr(reference_module, "_CHUNK_ELEMENTS", 100)
    assert torch.equal(ms_deform_attn_reference(value, shapes, starts, loc, attn), whole_ref)
    chunked_gs = ms_deform_attn_grid_sample(value, shapes, starts, loc, attn, compute_dtype=torch.float64)
    torch.testing.assert_close(chunked_gs, whole_gs, rtol=1e-15, atol=1e-15)


def test_compute_and_output_dtypes(gen):
    levels = [(6, 7), (3, 4)]
    value, shapes, starts, loc, attn = make_inputs(gen, levels, dtype=torch.float16)
    exact = ms_deform_attn_reference(value, shapes, starts, loc, attn, out_dtype=torch.float64)
    assert exact.dtype == torch.float64
    default = ms_deform_attn_reference(value, shapes, starts, loc, attn)
    assert default.dtype == torch.float16
    assert torch.equal(default, exact.half())  # float64 arithmetic, then one rounding
    fp32 = ms_deform_attn_reference(value, shapes, starts, loc, attn, compute_dtype=torch.float32, out_dtype=torch.float32)
    assert fp32.dtype == torch.float32 and 0 < rel_err(fp32, exact) < 1e-6
    with pytest.raises(TypeError, match="compute_dtype"):
        ms_deform_attn_reference(value, shapes, starts, loc, attn, compute_dtype=torch.int32)


def test_reference_accepts_non_contiguous_inputs(gen):
    levels = [(4, 5), (2, 3)]
    args = make_inputs(gen, levels, batch=2, queries=4, heads=3, head_dim=6, points=2)
    strided = strided_copies(*args)
    assert not any(t.is_contiguous() for t in strided)
    assert torch.equal(ms_deform_attn_reference(*strided), ms_deform_attn_reference(*args))


def test_empty_batch_and_queries(gen):
    levels = [(3, 4), (1, 2)]
    for batch, queries in ((0, 4), (2, 0)):
        args = make_inputs(gen, levels, batch=batch, queries=queries, heads=3, head_dim=4)
        out = ms_deform_attn_reference(*args)
        assert out.shape == (batch, queries, 12)
