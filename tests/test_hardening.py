"""Every bad or hostile input, run through torch.ops.cute_deform.forward on the CPU: each case behaves
as declared (a named error, the float64 reference's answer, an empty or all-zero output), and the
table of outcomes in docs/bad_inputs.md (CPU section) is exactly what the cases do.

Regenerate the doc after an intended change: CUTE_DEFORM_WRITE_DOCS=1 python -m pytest -q tests/test_hardening.py
(the GPU section is tests/test_hardening_gpu.py's and is left as it is)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from cute_deform import ms_deform_attn_reference
from msda_testing import (EMPTY, REFERENCE, ZEROS, case_outcome, case_table, check_or_write_doc_section, doc_sections,
                          make_inputs, nonfinite_mismatch, render_doc, sizes_text, strided_copies)

LEVELS = [(3, 4), (2, 2)]  # S = 16
SIZES = dict(batch=2, queries=3, heads=2, head_dim=4, points=2)
# The CPU path computes in fp32: on these small levels its outputs are within this of float64.
TOLERANCE = 1e-6
DOC_SEED = 0  # the table is rendered from fixed inputs, so it does not change from run to run

# Where the GPU path catches or handles each input (the legend is in the doc's header).
HOST = "host"
HOST_LEVELS = "host, CPU level table"
HOST_SCHEMA = "host (dispatcher, op schema)"
HOST_AUTOGRAD = "host (autograd)"
NO_LAUNCH = "host: nothing to compute, no launch"
RULE = "device: sampling rule"

# Outcomes a case may declare besides an exception type.

# Samples the hostile cases aim at, as (n, q, m, level, point).
SAMPLE_A = (0, 1, 0, 0, 0)
SAMPLE_B = (1, 2, 1, 1, 1)
INSIDE = (0.3, 0.6)  # on level 0 (3x4): w = 0.7, h = 1.3, all four corners inside the level
OUTSIDE = (1.5, 1.5)  # w = 5.5 > W: skipped on every level


def valid_inputs(gen) -> dict:
    value, shapes, starts, loc, attn = make_inputs(gen, LEVELS, dtype=torch.float32, **SIZES)
    return dict(value=value, spatial_shapes=shapes, level_start_index=starts, sampling_locations=loc,
                attention_weights=attn)


def replaced(t: torch.Tensor, index, new) -> torch.Tensor:
    t = t.clone()
    t[index] = torch.as_tensor(new, dtype=t.dtype)
    return t


def run_op(args: dict):
    return torch.ops.cute_deform.forward(*args.values())


def run_backward(args: dict):
    value = args["value"].detach().requires_grad_()
    torch.ops.cute_deform.forward(value, *list(args.values())[1:]).sum().backward()


@dataclass(frozen=True)
class Case:
    input: str  # what is wrong, as the table says it
    where: str  # where the GPU path catches or handles it
    change: Callable[[dict], dict]  # replacements for some of the valid inputs
    expect: type | str  # the exception type, or REFERENCE / EMPTY / ZEROS
    run: Callable[[dict], object] = run_op


def _no_levels(a):
    return dict(spatial_shapes=a["spatial_shapes"][:0], level_start_index=a["level_start_index"][:0],
                value=a["value"][:, :0], sampling_locations=a["sampling_locations"][:, :, :, :0],
                attention_weights=a["attention_weights"][:, :, :, :0])


CASES = {
    # Ranks and sizes that disagree.
    "value-rank": Case("value with 3 dims", HOST, lambda a: dict(value=a["value"][0]), ValueError),
    "shapes-rank": Case("spatial_shapes with 1 dim", HOST,
                        lambda a: dict(spatial_shapes=a["spatial_shapes"].flatten()), ValueError),
    "shapes-3-columns": Case("spatial_shapes with 3 columns", HOST, lambda a: dict(
        spatial_shapes=torch.cat([a["spatial_shapes"], a["spatial_shapes"][:, :1]], 1)), ValueError),
    "starts-rank": Case("level_start_index with 2 dims", HOST,
                        lambda a: dict(level_start_index=a["level_start_index"][None]), ValueError),
    "loc-rank": Case("sampling_locations with 5 dims", HOST,
                     lambda a: dict(sampling_locations=a["sampling_locations"][..., 0]), ValueError),
    "loc-last-dim-3": Case("sampling_locations with last dim 3", HOST, lambda a: dict(
        sampling_locations=torch.cat([a["sampling_locations"]] * 2, -1)[..., :3]), ValueError),
    "attn-rank": Case("attention_weights with 4 dims", HOST,
                      lambda a: dict(attention_weights=a["attention_weights"][..., 0]), ValueError),
    "N-loc": Case("N disagrees: sampling_locations has 1 image, value 2", HOST,
                  lambda a: dict(sampling_locations=a["sampling_locations"][:1]), ValueError),
    "N-attn": Case("N disagrees: attention_weights has 1 image, value 2", HOST,
                   lambda a: dict(attention_weights=a["attention_weights"][:1]), ValueError),
    "M-loc": Case("M disagrees: sampling_locations has 1 head, value 2", HOST,
                  lambda a: dict(sampling_locations=a["sampling_locations"][:, :, :1]), ValueError),
    "M-attn": Case("M disagrees: attention_weights has 1 head, value 2", HOST,
                   lambda a: dict(attention_weights=a["attention_weights"][:, :, :1]), ValueError),
    "L-loc": Case("L disagrees: sampling_locations has 1 level, spatial_shapes 2", HOST,
                  lambda a: dict(sampling_locations=a["sampling_locations"][:, :, :, :1]), ValueError),
    "L-attn": Case("L disagrees: attention_weights has 1 level, spatial_shapes 2", HOST,
                   lambda a: dict(attention_weights=a["attention_weights"][:, :, :, :1]), ValueError),
    "L-starts": Case("L disagrees: level_start_index has 1 level, spatial_shapes 2", HOST,
                     lambda a: dict(level_start_index=a["level_start_index"][:1]), ValueError),
    "P-attn": Case("P disagrees: attention_weights has 1 point, sampling_locations 2", HOST,
                   lambda a: dict(attention_weights=a["attention_weights"][..., :1]), ValueError),
    "Lq-attn": Case("Lq disagrees: attention_weights has 1 query, sampling_locations 3", HOST,
                    lambda a: dict(attention_weights=a["attention_weights"][:, :1]), ValueError),
    # Level tables that disagree with value (checked for free when they live on the CPU).
    "S-short": Case("S = sum(H*W) - 1: value one pixel short", HOST_LEVELS,
                    lambda a: dict(value=a["value"][:, :-1]), ValueError),
    "S-long": Case("S = sum(H*W) + 1: value one pixel long", HOST_LEVELS,
                   lambda a: dict(value=torch.cat([a["value"], a["value"][:, :1]], 1)), ValueError),
    "starts-reversed": Case("level_start_index not the running sum (reversed)", HOST_LEVELS,
                            lambda a: dict(level_start_index=a["level_start_index"].flip(0)), ValueError),
    "starts-negative": Case("level_start_index -1 on level 1", HOST_LEVELS,
                            lambda a: dict(level_start_index=replaced(a["level_start_index"], 1, -1)), ValueError),
    "starts-past-S": Case("level_start_index 16 = S on level 1 (past the end of value)", HOST_LEVELS,
                          lambda a: dict(level_start_index=replaced(a["level_start_index"], 1, 16)), ValueError),
    "H-zero": Case("H = 0 on level 1", HOST_LEVELS,
                   lambda a: dict(spatial_shapes=replaced(a["spatial_shapes"], (1, 0), 0)), ValueError),
    "W-negative": Case("W = -4 on level 1", HOST_LEVELS,
                       lambda a: dict(spatial_shapes=replaced(a["spatial_shapes"], (1, 1), -4)), ValueError),
    "HW-both-negative": Case("H = W = -2 on level 1 (H*W = 4, the same S as the true (2, 2))", HOST_LEVELS,
                             lambda a: dict(spatial_shapes=replaced(a["spatial_shapes"], 1, [-2, -2])), ValueError),
    "HW-wraps-int64": Case("H = W = 2^32 on level 1 (H*W wraps to 0 in int64)", HOST_LEVELS,
                           lambda a: dict(spatial_shapes=replaced(a["spatial_shapes"], 1, [2**32, 2**32])), ValueError),
    # Dtypes.
    "int-value": Case("int32 value", HOST, lambda a: dict(value=a["value"].int()), TypeError),
    "float64-value": Case("float64 value (the reference takes it, the op does not)", HOST,
                          lambda a: dict(value=a["value"].double()), TypeError),
    "int-loc": Case("int64 sampling_locations", HOST,
                    lambda a: dict(sampling_locations=a["sampling_locations"].long()), TypeError),
    "bool-attn": Case("bool attention_weights", HOST,
                      lambda a: dict(attention_weights=a["attention_weights"] > 0.5), TypeError),
    "float-shapes": Case("float32 spatial_shapes", HOST,
                         lambda a: dict(spatial_shapes=a["spatial_shapes"].float()), TypeError),
    "int32-starts": Case("int32 level_start_index", HOST,
                         lambda a: dict(level_start_index=a["level_start_index"].int()), TypeError),
    "list-shapes": Case("spatial_shapes as a Python list", HOST_SCHEMA,
                        lambda a: dict(spatial_shapes=a["spatial_shapes"].tolist()), RuntimeError),
    "float-value": Case("value as a Python float", HOST_SCHEMA, lambda a: dict(value=1.0), RuntimeError),
    # None where a tensor belongs reaches the op's checks (the dispatcher passes it on).
    **{f"{name}-None": Case(f"{name} None", HOST, lambda a, name=name: {name: None}, TypeError)
       for name in ("value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights")},
    "all-None": Case("every tensor argument None (no tensor to dispatch on)", HOST,
                     lambda a: dict.fromkeys(a), TypeError),
    "value-sparse": Case("value a sparse COO tensor", HOST, lambda a: dict(value=a["value"].to_sparse()),
                         NotImplementedError),
    "shapes-sparse": Case("spatial_shapes a sparse COO tensor", HOST,
                          lambda a: dict(spatial_shapes=a["spatial_shapes"].to_sparse()), NotImplementedError),
    # Devices: meta stands in for a second device.
    "loc-device": Case("sampling_locations on another device than value (meta for cuda)", HOST,
                       lambda a: dict(sampling_locations=a["sampling_locations"].to("meta")), ValueError),
    "value-device": Case("value on another device (meta), the rest on the CPU", HOST,
                         lambda a: dict(value=a["value"].to("meta")), ValueError),
    "shapes-device": Case("spatial_shapes on a device (meta) that is neither value's nor the CPU", HOST,
                          lambda a: dict(spatial_shapes=a["spatial_shapes"].to("meta")), ValueError),
    # value on a device (meta) with the level table on the CPU: the meta kernel reads the table too.
    "S-short-meta-value": Case("S = sum(H*W) - 1 with value, sampling_locations, attention_weights on meta and "
                               "the level table on the CPU", HOST_LEVELS, lambda a: {
                                   name: (t[:, :-1] if name == "value" else t).to("meta")
                                   for name, t in a.items() if name in ("value", "sampling_locations",
                                                                        "attention_weights")}, ValueError),
    "starts-reversed-meta-value": Case("level_start_index reversed with value, sampling_locations, attention_weights "
                                       "on meta and the level table on the CPU", HOST_LEVELS, lambda a: dict(
                                           level_start_index=a["level_start_index"].flip(0),
                                           **{name: a[name].to("meta") for name in ("value", "sampling_locations",
                                                                                    "attention_weights")}),
                                       ValueError),
    # The host cannot read a level table on the GPU: it passes, and the kernel decides.
    "S-short-off-cpu": Case("S = sum(H*W) - 1 with every tensor off the CPU (meta for cuda)",
                            "device: level_table (GPU section)", lambda a: {
                                name: (t[:, :-1] if name == "value" else t).to("meta") for name, t in a.items()},
                            "accepted"),
    # Layouts and empty sizes: not errors.
    "non-contiguous": Case("every input a non-contiguous view", HOST,
                           lambda a: dict(zip(a, strided_copies(*a.values()))), REFERENCE),
    "N-0": Case("N = 0", NO_LAUNCH, lambda a: dict(value=a["value"][:0], sampling_locations=a["sampling_locations"][:0],
                                                     attention_weights=a["attention_weights"][:0]), EMPTY),
    "Lq-0": Case("Lq = 0", NO_LAUNCH, lambda a: dict(sampling_locations=a["sampling_locations"][:, :0],
                                                       attention_weights=a["attention_weights"][:, :0]), EMPTY),
    "M-0": Case("M = 0", NO_LAUNCH, lambda a: dict(value=a["value"][:, :, :0],
                                                     sampling_locations=a["sampling_locations"][:, :, :0],
                                                     attention_weights=a["attention_weights"][:, :, :0]), EMPTY),
    "D-0": Case("D = 0", NO_LAUNCH, lambda a: dict(value=a["value"][..., :0]), EMPTY),
    "L-0": Case("L = 0 (no levels, S = 0)", NO_LAUNCH, _no_levels, ZEROS),
    "P-0": Case("P = 0", NO_LAUNCH, lambda a: dict(sampling_locations=a["sampling_locations"][..., :0, :],
                                                     attention_weights=a["attention_weights"][..., :0]), ZEROS),
    # Hostile values: the sampling rule decides, no check is needed.
    "loc-nan": Case("NaN sampling_locations (both coordinates of one sample, x of another)", RULE, lambda a: dict(
        sampling_locations=replaced(replaced(a["sampling_locations"], SAMPLE_A, [math.nan, math.nan]),
                                    SAMPLE_B + (0,), math.nan)), REFERENCE),
    "loc-inf": Case("+inf x on one sample, -inf y on another", RULE, lambda a: dict(
        sampling_locations=replaced(replaced(a["sampling_locations"], SAMPLE_A + (0,), math.inf),
                                    SAMPLE_B + (1,), -math.inf)), REFERENCE),
    "loc-1e30": Case("x = 1e30 on every level-0 point-0 sample (x*W overflows int32)", RULE,
                     lambda a: dict(sampling_locations=replaced(a["sampling_locations"], (..., 0, 0, 0), 1e30)),
                     REFERENCE),
    "loc-minus-1e30": Case("y = -1e30 on every level-1 point-1 sample", RULE,
                           lambda a: dict(sampling_locations=replaced(a["sampling_locations"], (..., 1, 1, 1), -1e30)),
                           REFERENCE),
    "loc-1e10": Case("x = y = 1e10 on every point-0 sample (x*W - 0.5 = 4e10 > 2^31)", RULE,
                     lambda a: dict(sampling_locations=replaced(a["sampling_locations"], (..., 0, slice(None)), 1e10)),
                     REFERENCE),
    "attn-nan-inside": Case("NaN attention weight on a sample inside its level", RULE, lambda a: dict(
        sampling_locations=replaced(a["sampling_locations"], SAMPLE_A, INSIDE),
        attention_weights=replaced(a["attention_weights"], SAMPLE_A, math.nan)), REFERENCE),
    "attn-inf-inside": Case("+inf attention weight on a sample inside its level", RULE, lambda a: dict(
        sampling_locations=replaced(a["sampling_locations"], SAMPLE_A, INSIDE),
        attention_weights=replaced(a["attention_weights"], SAMPLE_A, math.inf)), REFERENCE),
    "attn-minus-inf-inside": Case("-inf attention weight on a sample inside its level", RULE, lambda a: dict(
        sampling_locations=replaced(a["sampling_locations"], SAMPLE_A, INSIDE),
        attention_weights=replaced(a["attention_weights"], SAMPLE_A, -math.inf)), REFERENCE),
    "attn-nan-outside": Case("NaN attention weight on a sample outside every level", RULE, lambda a: dict(
        sampling_locations=replaced(a["sampling_locations"], SAMPLE_A, OUTSIDE),
        attention_weights=replaced(a["attention_weights"], SAMPLE_A, math.nan)), REFERENCE),
    "loc-nan-attn-inf": Case("NaN location with an inf weight on the same sample", RULE, lambda a: dict(
        sampling_locations=replaced(a["sampling_locations"], SAMPLE_A, [math.nan, math.nan]),
        attention_weights=replaced(a["attention_weights"], SAMPLE_A, math.inf)), REFERENCE),
    # Any head dim runs, on every path (on Hopper the generic kernel takes rows that are not whole
    # 16-byte vectors).
    "D-3": Case("head dim D = 3, fp32 value", "none: every D runs", lambda a: dict(value=a["value"][..., :3]), REFERENCE),
    # Forward only.
    "backward": Case("value.requires_grad, then backward()", HOST_AUTOGRAD, lambda a: {}, RuntimeError, run_backward),
}


def case_inputs(gen, case_id: str) -> dict:
    args = valid_inputs(gen)
    args.update(CASES[case_id].change(args))
    return args


def run_case(gen, case_id: str) -> tuple[str, str]:
    """(kind, outcome): kind is the exception's type name or REFERENCE / EMPTY / ZEROS / "differs",
    outcome the table's text."""
    args = case_inputs(gen, case_id)
    return case_outcome(CASES[case_id].run, args, lambda: ms_deform_attn_reference(*args.values(), out_dtype=torch.float64),
                        TOLERANCE, "float64 reference")


def expected_kind(case: Case) -> str:
    return case.expect if isinstance(case.expect, str) else case.expect.__name__


@pytest.mark.parametrize("case_id", CASES)
def test_case_behaves_as_declared(gen, case_id):
    """On fresh random inputs, each bad input gives its declared error, and each hostile one the
    reference's answer (NaN and inf exactly where the reference has them) or an empty/zero output."""
    kind, outcome = run_case(gen, case_id)
    assert kind == expected_kind(CASES[case_id]), outcome


@pytest.mark.parametrize("case_id", [c for c in CASES if CASES[c].where in (HOST, HOST_LEVELS)
                                     and not isinstance(CASES[c].expect, str)])
def test_our_errors_name_the_argument(gen, case_id):
    """Errors raised by cute_deform's own checks say which argument is wrong (check_supported's
    messages have no "cute_deform: " prefix)."""
    with pytest.raises(CASES[case_id].expect, match=r"^(cute_deform: )?(value|spatial_shapes|level_start_index|"
                                                    r"sampling_locations|attention_weights): "):
        CASES[case_id].run(case_inputs(gen, case_id))


def test_hostile_cases_really_are_hostile():
    """The hostile inputs are what their rows claim: coordinates whose scaled values pass 2^31, and
    samples aimed inside / outside the level."""
    args = case_inputs(torch.Generator().manual_seed(DOC_SEED), "loc-1e10")
    W = int(args["spatial_shapes"][:, 1].min())
    assert (args["sampling_locations"][..., 0, 0] * W - 0.5 > 2**31).all()
    H, W = LEVELS[0]
    for (x, y), inside in ((INSIDE, True), (OUTSIDE, False)):
        h, w = y * H - 0.5, x * W - 0.5
        assert (0 <= math.floor(h) and math.floor(h) + 1 <= H - 1 and 0 <= math.floor(w) and math.floor(w) + 1 <= W - 1) \
            == inside
        assert (-1 < h < H and -1 < w < W) == inside


def render_cpu_section() -> str:
    sizes = sizes_text(SIZES)
    intro = (
        "## Every path (run on the CPU)\n\n"
        "Written by `tests/test_hardening.py`, which runs each case through `torch.ops.cute_deform.forward` on "
        "the CPU. The host checks are the same on every device; on a GPU the hostile values "
        "meet the kernel's sampling rule instead of the reference's (see the GPU tests). Valid inputs the "
        f"cases start from: {sizes}, levels {', '.join(map(str, LEVELS))} (S=16), fp32, all on the CPU.\n\n"
    )
    return intro + case_table(CASES, run_case, DOC_SEED)


def test_bad_input_table_is_up_to_date():
    """docs/bad_inputs.md's CPU section is what the cases do now (CUTE_DEFORM_WRITE_DOCS=1 rewrites it)."""
    check_or_write_doc_section("cpu", render_cpu_section())


def test_doc_sections_are_written_independently(tmp_path):
    """Writing one section leaves the other as it was, and checking one ignores the other."""
    path = tmp_path / "bad_inputs.md"
    check_or_write_doc_section("gpu", "gpu table\n", path=path, write=True)
    check_or_write_doc_section("cpu", "cpu table\n", path=path, write=True)
    sections = doc_sections(path.read_text())
    assert sections["cpu"] == "cpu table\n" and sections["gpu"] == "gpu table\n"
    path.write_text(render_doc({"cpu": "cpu table\n", "gpu": "edited by hand\n"}))
    check_or_write_doc_section("cpu", "cpu table\n", path=path, write=False)
    with pytest.raises(AssertionError, match="cpu section"):
        check_or_write_doc_section("cpu", "another cpu table\n", path=path, write=False)


def test_the_gpu_hostile_rule_frees_the_kind_only_where_inf_weights_meet():
    """The GPU hostile cases require NaN where a NaN input reaches a sum (nan_inputs_reach: the reference with inf
    weights set to 0 is NaN there) and leave the kind free where only inf weights make an output non-finite. The
    inputs are those of the GPU run whose kernel gave +inf where the reference had NaN (H100, seed
    290317586888140466): head (0, 16, 3) meets a +inf weight and a -inf one whose corner sum at channel 11 is 3.7e-5
    in float64, within fp16's rounding of zero; summed in half precision it can take either sign, and both products
    then give +inf."""
    import test_hardening_gpu as hostile

    seed = 290317586888140466
    gen = hostile.case_generator(seed, "all-at-once")  # the case's own draws, as run_value_case makes them
    args = hostile.cpu_inputs(gen)
    hostile.VALUE_CASES["all-at-once"].spoil(args, gen)
    ref = hostile.reference(args)
    nan_at = hostile.nan_inputs_reach(args)
    cancelled = torch.isnan(ref) & ~nan_at  # NaN only from opposite inf products
    assert nan_at.any() and cancelled.any() and bool((nan_at <= torch.isnan(ref)).all())
    where = (0, 16, 3 * hostile.HEAD_DIM + 11)
    assert cancelled[where]
    flipped = ref.clone()
    flipped[where] = math.inf
    assert nonfinite_mismatch(flipped, ref, same_kinds=False, nan_at=nan_at) is None
    assert nonfinite_mismatch(flipped, ref, same_kinds=False) == "an output is +-inf where it must be NaN"
    # A NaN weight's NaN is still required, and a finite output where the reference is not finite still fails.
    lost_nan = ref.clone()
    lost_nan[tuple(nan_at.nonzero()[0].tolist())] = -math.inf
    assert nonfinite_mismatch(lost_nan, ref, same_kinds=False, nan_at=nan_at) == \
        "an output is +-inf where it must be NaN"
    finite = ref.clone()
    finite[where] = 0.0
    assert "finite where the reference is not" in nonfinite_mismatch(finite, ref, same_kinds=False, nan_at=nan_at)
