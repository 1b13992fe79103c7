"""Every bad or hostile input of torch.ops.cute_deform.forward_fused, on the CPU: each case behaves as
declared (an error naming the argument, the float64 fused reference's answer, an empty or all-zero
output), through the op, its fake implementation (torch.compile's view), the Python function and the
reference; and the table of outcomes in docs/bad_inputs.md (fused-cpu section) is what the cases do.

Regenerate the doc after an intended change: CUTE_DEFORM_WRITE_DOCS=1 python -m pytest -q tests/test_fused_hardening.py"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_deform import fused_reference, ms_deform_attn_fused
from cute_deform._checks import FUSED_NAMES
from msda_testing import (ACCEPTED, EMPTY, REFERENCE, ZEROS, case_outcome, case_table, check_or_write_doc_section,
                          make_fused_inputs, sizes_text)

LEVELS = [(3, 4), (2, 2)]  # S = 16
SIZES = dict(batch=2, queries=3, heads=2, head_dim=4, points=2)
TOLERANCE = 2e-6  # fp32 arithmetic against the float64 fused reference
DOC_SEED = 0  # the table is rendered from fixed inputs

HOST = "host"
HOST_LEVELS = "host, CPU level table"
HOST_SCHEMA = "host (dispatcher, op schema)"
HOST_AUTOGRAD = "host (autograd)"
NO_LAUNCH = "host: nothing to compute, no launch"
RULE = "device: module formula, then sampling rule"

QUERY_HEAD = (1, 2, 0)  # (n, q, m) the hostile logit cases aim at
SAMPLE = QUERY_HEAD + (1, 0)  # (n, q, m, level, point)


def valid_inputs(gen, ref_dim=2) -> dict:
    args = make_fused_inputs(gen, LEVELS, **SIZES, ref_dim=ref_dim, dtype=torch.float32)
    return dict(zip(FUSED_NAMES, args))


def replaced(t: torch.Tensor, index, new) -> torch.Tensor:
    t = t.clone()
    t[index] = torch.as_tensor(new, dtype=t.dtype)
    return t


def run_op(args: dict):
    return torch.ops.cute_deform.forward_fused(*args.values())


def run_function(args: dict):
    return ms_deform_attn_fused(*args.values())


def run_backward(args: dict):
    logits = args["attention_logits"].detach().requires_grad_()
    torch.ops.cute_deform.forward_fused(*list(args.values())[:5], logits).sum().backward()


@dataclass(frozen=True)
class Case:
    input: str  # what is wrong, as the table says it
    where: str  # where it is caught or handled
    change: Callable[[dict], dict]  # replacements for some of the valid inputs
    expect: type | str  # the exception type, or REFERENCE / EMPTY / ZEROS / ACCEPTED
    run: Callable[[dict], object] = run_op
    ref_dim: int = 2
    argument: str | None = None  # the argument an error must name (cases that raise from our checks)


def _no_levels(a):
    return dict(spatial_shapes=a["spatial_shapes"][:0], level_start_index=a["level_start_index"][:0],
                value=a["value"][:, :0], reference_points=a["reference_points"][:, :, :0],
                sampling_offsets=a["sampling_offsets"][:, :, :, :0], attention_logits=a["attention_logits"][:, :, :, :0])


def _aimed_inside(a, **logits) -> dict:
    """The QUERY_HEAD's samples all inside their level (its query's reference points at the centre,
    its offsets 0.25 pixel), so its softmax shows in the output; plus the given replacements."""
    ref = replaced(a["reference_points"], QUERY_HEAD[:2], 0.5)
    return dict(reference_points=ref, sampling_offsets=replaced(a["sampling_offsets"], QUERY_HEAD, 0.25), **logits)


def _wider(t, dim):
    return torch.cat([t, t.narrow(dim, 0, 1)], dim)


CASES = {
    # Ranks and sizes that disagree.
    "value-rank": Case("value with 3 dims", HOST, lambda a: dict(value=a["value"][0]), ValueError, argument="value"),
    "shapes-3-columns": Case("spatial_shapes with 3 columns", HOST, lambda a: dict(
        spatial_shapes=_wider(a["spatial_shapes"], 1)), ValueError, argument="spatial_shapes"),
    "starts-rank": Case("level_start_index with 2 dims", HOST,
                        lambda a: dict(level_start_index=a["level_start_index"][None]), ValueError,
                        argument="level_start_index"),
    "L-starts": Case("L disagrees: level_start_index has 1 level, spatial_shapes 2", HOST,
                     lambda a: dict(level_start_index=a["level_start_index"][:1]), ValueError,
                     argument="level_start_index"),
    "ref-rank": Case("reference_points with 3 dims", HOST,
                     lambda a: dict(reference_points=a["reference_points"][:, :, 0]), ValueError,
                     argument="reference_points"),
    "ref-last-dim-3": Case("reference_points with last dim 3", HOST,
                           lambda a: dict(reference_points=_wider(a["reference_points"], 3)), ValueError,
                           argument="reference_points"),
    "ref-last-dim-1": Case("reference_points with last dim 1", HOST,
                           lambda a: dict(reference_points=a["reference_points"][..., :1]), ValueError,
                           argument="reference_points"),
    "ref-N": Case("N disagrees: reference_points has 1 image, value 2", HOST,
                  lambda a: dict(reference_points=a["reference_points"][:1]), ValueError, argument="reference_points"),
    "ref-L": Case("L disagrees: reference_points has 1 level, spatial_shapes 2", HOST,
                  lambda a: dict(reference_points=a["reference_points"][:, :, :1]), ValueError,
                  argument="reference_points"),
    "ref-L-boxes": Case("L disagrees: 4-d reference_points has 3 levels, spatial_shapes 2", HOST,
                        lambda a: dict(reference_points=_wider(a["reference_points"], 2)), ValueError,
                        ref_dim=4, argument="reference_points"),
    "off-rank": Case("sampling_offsets with 5 dims", HOST,
                     lambda a: dict(sampling_offsets=a["sampling_offsets"][..., 0]), ValueError,
                     argument="sampling_offsets"),
    "off-flat": Case("sampling_offsets as the Linear gives it, (N, Lq, M*L*P*2), not viewed", HOST,
                     lambda a: dict(sampling_offsets=a["sampling_offsets"].flatten(2)), ValueError,
                     argument="sampling_offsets"),
    "off-last-dim-4": Case("sampling_offsets with last dim 4", HOST,
                           lambda a: dict(sampling_offsets=torch.cat([a["sampling_offsets"]] * 2, -1)), ValueError,
                           argument="sampling_offsets"),
    "off-N": Case("N disagrees: sampling_offsets has 1 image, value 2", HOST,
                  lambda a: dict(sampling_offsets=a["sampling_offsets"][:1]), ValueError, argument="sampling_offsets"),
    "off-Lq": Case("Lq disagrees: sampling_offsets has 1 query, reference_points 3", HOST,
                   lambda a: dict(sampling_offsets=a["sampling_offsets"][:, :1]), ValueError,
                   argument="sampling_offsets"),
    "off-M": Case("M disagrees: sampling_offsets has 1 head, value 2", HOST,
                  lambda a: dict(sampling_offsets=a["sampling_offsets"][:, :, :1]), ValueError,
                  argument="sampling_offsets"),
    "off-L": Case("L disagrees: sampling_offsets has 1 level, spatial_shapes 2", HOST,
                  lambda a: dict(sampling_offsets=a["sampling_offsets"][:, :, :, :1]), ValueError,
                  argument="sampling_offsets"),
    "logits-rank": Case("attention_logits with 4 dims (the softmax's (N, Lq, M, L*P) view)", HOST,
                        lambda a: dict(attention_logits=a["attention_logits"].flatten(3)), ValueError,
                        argument="attention_logits"),
    "logits-N": Case("N disagrees: attention_logits has 1 image, value 2", HOST,
                     lambda a: dict(attention_logits=a["attention_logits"][:1]), ValueError,
                     argument="attention_logits"),
    "logits-Lq": Case("Lq disagrees: attention_logits has 1 query, reference_points 3", HOST,
                      lambda a: dict(attention_logits=a["attention_logits"][:, :1]), ValueError,
                      argument="attention_logits"),
    "logits-M": Case("M disagrees: attention_logits has 1 head, value 2", HOST,
                     lambda a: dict(attention_logits=a["attention_logits"][:, :, :1]), ValueError,
                     argument="attention_logits"),
    "logits-L": Case("L disagrees: attention_logits has 1 level, spatial_shapes 2", HOST,
                     lambda a: dict(attention_logits=a["attention_logits"][:, :, :, :1]), ValueError,
                     argument="attention_logits"),
    "logits-P": Case("P disagrees: attention_logits has 1 point, sampling_offsets 2", HOST,
                     lambda a: dict(attention_logits=a["attention_logits"][..., :1]), ValueError,
                     argument="attention_logits"),
    # Level tables that disagree with value (read for free on the CPU).
    "S-short": Case("S = sum(H*W) - 1: value one pixel short", HOST_LEVELS,
                    lambda a: dict(value=a["value"][:, :-1]), ValueError, argument="value"),
    "S-long": Case("S = sum(H*W) + 1: value one pixel long", HOST_LEVELS,
                   lambda a: dict(value=_wider(a["value"], 1)), ValueError, argument="value"),
    "starts-reversed": Case("level_start_index not the running sum (reversed)", HOST_LEVELS,
                            lambda a: dict(level_start_index=a["level_start_index"].flip(0)), ValueError,
                            argument="level_start_index"),
    "H-zero": Case("H = 0 on level 1", HOST_LEVELS,
                   lambda a: dict(spatial_shapes=replaced(a["spatial_shapes"], (1, 0), 0)), ValueError,
                   argument="spatial_shapes"),
    "HW-both-negative": Case("H = W = -2 on level 1 (H*W = 4, the same S as the true (2, 2))", HOST_LEVELS,
                             lambda a: dict(spatial_shapes=replaced(a["spatial_shapes"], 1, [-2, -2])), ValueError,
                             argument="spatial_shapes"),
    "HW-wraps-int64": Case("H = W = 2^32 on level 1 (H*W wraps to 0 in int64)", HOST_LEVELS,
                           lambda a: dict(spatial_shapes=replaced(a["spatial_shapes"], 1, [2**32, 2**32])), ValueError,
                           argument="value"),
    # Dtypes.
    "int-value": Case("int32 value", HOST, lambda a: dict(value=a["value"].int()), TypeError, argument="value"),
    "float64-ref": Case("float64 reference_points (the reference takes it, the op does not)", HOST,
                        lambda a: dict(reference_points=a["reference_points"].double()), TypeError,
                        argument="reference_points"),
    "int-offsets": Case("int64 sampling_offsets", HOST,
                        lambda a: dict(sampling_offsets=a["sampling_offsets"].long()), TypeError,
                        argument="sampling_offsets"),
    "bool-logits": Case("bool attention_logits", HOST,
                        lambda a: dict(attention_logits=a["attention_logits"] > 0), TypeError,
                        argument="attention_logits"),
    "float-shapes": Case("float32 spatial_shapes", HOST,
                         lambda a: dict(spatial_shapes=a["spatial_shapes"].float()), TypeError,
                         argument="spatial_shapes"),
    "int32-starts": Case("int32 level_start_index", HOST,
                         lambda a: dict(level_start_index=a["level_start_index"].int()), TypeError,
                         argument="level_start_index"),
    # Not tensors.
    "none-ref-op": Case("reference_points None", HOST, lambda a: dict(reference_points=None), TypeError,
                        argument="reference_points"),
    "list-shapes-op": Case("spatial_shapes as a Python list", HOST_SCHEMA,
                           lambda a: dict(spatial_shapes=a["spatial_shapes"].tolist()), RuntimeError),
    "none-ref-function": Case("reference_points None, through cute_deform.ms_deform_attn_fused", HOST,
                              lambda a: dict(reference_points=None), TypeError, run_function,
                              argument="reference_points"),
    "list-logits-function": Case("attention_logits as a Python list, through cute_deform.ms_deform_attn_fused", HOST,
                                 lambda a: dict(attention_logits=a["attention_logits"].tolist()), TypeError,
                                 run_function, argument="attention_logits"),
    # Devices: meta stands in for a second device.
    "ref-device": Case("reference_points on another device than value (meta for cuda)", HOST,
                       lambda a: dict(reference_points=a["reference_points"].to("meta")), ValueError,
                       argument="reference_points"),
    "offsets-device": Case("sampling_offsets on another device than value", HOST,
                           lambda a: dict(sampling_offsets=a["sampling_offsets"].to("meta")), ValueError,
                           argument="sampling_offsets"),
    "logits-device": Case("attention_logits on another device than value", HOST,
                          lambda a: dict(attention_logits=a["attention_logits"].to("meta")), ValueError,
                          argument="attention_logits"),
    "starts-device": Case("level_start_index on a device (meta) that is neither value's nor the CPU", HOST,
                          lambda a: dict(level_start_index=a["level_start_index"].to("meta")), ValueError,
                          argument="level_start_index"),
    "S-short-off-cpu": Case("S = sum(H*W) - 1 with every tensor off the CPU (meta for cuda)",
                            "device (the host cannot read the level table)", lambda a: {
                                name: (t[:, :-1] if name == "value" else t).to("meta") for name, t in a.items()},
                            ACCEPTED),
    # Layouts and empty sizes: not errors.
    "non-contiguous": Case("every input a non-contiguous view", HOST, lambda a: dict(
        value=a["value"].transpose(1, 2).contiguous().transpose(1, 2),
        reference_points=torch.cat([a["reference_points"]] * 2, -1)[..., 2:],
        sampling_offsets=torch.cat([a["sampling_offsets"]] * 2, -1)[..., 2:],
        attention_logits=a["attention_logits"].transpose(-1, -2).contiguous().transpose(-1, -2)), REFERENCE),
    "N-0": Case("N = 0", NO_LAUNCH, lambda a: {k: (v[:0] if v.dim() >= 4 else v) for k, v in a.items()}, EMPTY),
    "Lq-0": Case("Lq = 0", NO_LAUNCH, lambda a: {k: v[:, :0] for k, v in a.items() if k not in FUSED_NAMES[:3]},
                 EMPTY),
    "D-0": Case("D = 0", NO_LAUNCH, lambda a: dict(value=a["value"][..., :0]), EMPTY),
    "L-0": Case("L = 0 (no levels, S = 0)", NO_LAUNCH, _no_levels, ZEROS),
    "P-0": Case("P = 0", NO_LAUNCH, lambda a: dict(sampling_offsets=a["sampling_offsets"][..., :0, :],
                                                     attention_logits=a["attention_logits"][..., :0]), ZEROS),
    # Hostile values: the module formula and the sampling rule decide.
    "off-nan": Case("NaN sampling_offsets (both coordinates of one sample)", RULE,
                    lambda a: dict(sampling_offsets=replaced(a["sampling_offsets"], SAMPLE, math.nan)), REFERENCE),
    "off-inf": Case("+inf x offset on one sample, -inf y on another", RULE, lambda a: dict(
        sampling_offsets=replaced(replaced(a["sampling_offsets"], SAMPLE + (0,), math.inf), (0, 0, 1, 0, 1, 1),
                                  -math.inf)), REFERENCE),
    "off-1e30": Case("offset 1e30 pixels on every level-0 point-0 sample (outside)", RULE,
                     lambda a: dict(sampling_offsets=replaced(a["sampling_offsets"], (..., 0, 0, 0), 1e30)), REFERENCE),
    "off-1e10-boxes": Case("offset 1e10 on every point-1 sample, box reference points", RULE,
                           lambda a: dict(sampling_offsets=replaced(a["sampling_offsets"], (..., 1, slice(None)), 1e10)),
                           REFERENCE, ref_dim=4),
    "ref-nan": Case("NaN reference point (x of one query's level 0)", RULE,
                    lambda a: dict(reference_points=replaced(a["reference_points"], (0, 1, 0, 0), math.nan)), REFERENCE),
    "ref-inf-box": Case("box width +inf on one query's level 1 (x offset * inf: +-inf or NaN locations)", RULE,
                        lambda a: dict(reference_points=replaced(a["reference_points"], (1, 0, 1, 2), math.inf)),
                        REFERENCE, ref_dim=4),
    "ref-zero-box": Case("box of size 0 on every query (every sample at the box centre)", RULE,
                         lambda a: dict(reference_points=replaced(a["reference_points"], (..., slice(2, 4)), 0.0)),
                         REFERENCE, ref_dim=4),
    "ref-negative-box": Case("box of negative size on every query (offsets mirrored)", RULE,
                             lambda a: dict(reference_points=replaced(a["reference_points"], (..., slice(2, 4)), -0.3)),
                             REFERENCE, ref_dim=4),
    "logit-nan": Case("NaN logit on one sample: its (query, head) softmax is NaN", RULE,
                      lambda a: _aimed_inside(a, attention_logits=replaced(a["attention_logits"], SAMPLE, math.nan)),
                      REFERENCE),
    "logit-inf": Case("+inf logit on one sample: its (query, head) softmax is NaN (inf - inf)", RULE,
                      lambda a: _aimed_inside(a, attention_logits=replaced(a["attention_logits"], SAMPLE, math.inf)),
                      REFERENCE),
    "logit-minus-inf": Case("-inf logit on one sample: weight 0", RULE,
                            lambda a: _aimed_inside(a, attention_logits=replaced(a["attention_logits"], SAMPLE, -math.inf)),
                            REFERENCE),
    "logits-all-minus-inf": Case("-inf on every logit of one (query, head): softmax 0/0 = NaN", RULE,
                                 lambda a: _aimed_inside(a, attention_logits=replaced(a["attention_logits"], QUERY_HEAD,
                                                                                 -math.inf)), REFERENCE),
    "logits-1e30": Case("logits +-1e30 (exp overflows without the max subtraction)", RULE, lambda a: dict(
        attention_logits=replaced(replaced(a["attention_logits"], SAMPLE, 1e30), (0, 0, 1, 0, 0), -1e30)), REFERENCE),
    # Forward only.
    "backward": Case("attention_logits.requires_grad, then backward()", HOST_AUTOGRAD, lambda a: {}, RuntimeError,
                     run_backward),
}


def case_inputs(gen, case_id: str) -> dict:
    case = CASES[case_id]
    args = valid_inputs(gen, case.ref_dim)
    args.update(case.change(args))
    return args


def run_case(gen, case_id: str) -> tuple[str, str]:
    """(kind, outcome): kind is the exception's type name or REFERENCE / EMPTY / ZEROS / ACCEPTED /
    "differs", outcome the table's text."""
    args = case_inputs(gen, case_id)
    return case_outcome(CASES[case_id].run, args, lambda: fused_reference(*args.values(), out_dtype=torch.float64),
                        TOLERANCE, "float64 fused reference")


def expected_kind(case: Case) -> str:
    return case.expect if isinstance(case.expect, str) else case.expect.__name__


@pytest.mark.parametrize("case_id", CASES)
def test_case_behaves_as_declared(gen, case_id):
    kind, outcome = run_case(gen, case_id)
    assert kind == expected_kind(CASES[case_id]), outcome


NAMED = [c for c in CASES if CASES[c].argument is not None]


@pytest.mark.parametrize("case_id", NAMED)
def test_errors_name_the_argument(gen, case_id):
    case = CASES[case_id]
    with pytest.raises(case.expect, match=rf"^cute_deform: {case.argument}: expected "):
        case.run(case_inputs(gen, case_id))


@pytest.mark.parametrize("case_id", [c for c in NAMED if CASES[c].where == HOST and CASES[c].run is run_op
                                     and "device" not in c])
def test_fake_implementation_raises_the_same(gen, case_id):
    """What torch.compile sees while tracing: shape and dtype errors surface at trace time."""
    case = CASES[case_id]
    args = case_inputs(gen, case_id)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args.values()]
        with pytest.raises(case.expect, match=rf"^cute_deform: {case.argument}: expected "):
            torch.ops.cute_deform.forward_fused(*fake)


@pytest.mark.parametrize("case_id", [c for c in NAMED if CASES[c].where in (HOST, HOST_LEVELS)])
def test_fused_reference_raises_the_same(gen, case_id):
    case = CASES[case_id]
    args = case_inputs(gen, case_id)
    if case_id == "float64-ref":  # the reference takes float64
        assert fused_reference(*args.values()).shape == (2, 3, 8)
        return
    with pytest.raises(case.expect, match=rf"^cute_deform: {case.argument}: expected "):
        fused_reference(*args.values())


@pytest.mark.parametrize("position", range(6))
def test_any_argument_that_is_not_a_tensor_is_named(gen, position):
    """None: a TypeError from our checks, through the op too (the dispatcher lets None through as an
    undefined tensor). Another type: the Python function's TypeError, the dispatcher's RuntimeError."""
    name = FUSED_NAMES[position]
    args = list(valid_inputs(gen).values())
    args[position] = None
    for run in (ms_deform_attn_fused, torch.ops.cute_deform.forward_fused):
        with pytest.raises(TypeError, match=rf"^cute_deform: {name}: expected a torch.Tensor, got NoneType"):
            run(*args)
    args[position] = 3
    with pytest.raises(TypeError, match=rf"^cute_deform: {name}: expected a torch.Tensor, got int"):
        ms_deform_attn_fused(*args)
    with pytest.raises(RuntimeError, match=rf"Expected a value of type 'Tensor' for argument '{name}'"):
        torch.ops.cute_deform.forward_fused(*args)


def test_hostile_cases_really_are_hostile():
    """The logit cases make their (query, head) NaN in the reference, and the 1e30 offsets push every
    level-0 point-0 sample outside."""
    for case_id in ("logit-nan", "logit-inf", "logits-all-minus-inf"):
        ref = fused_reference(*case_inputs(torch.Generator().manual_seed(DOC_SEED), case_id).values())
        nan = torch.isnan(ref.view(2, 3, 2, 4))
        assert nan[QUERY_HEAD].all() and nan.sum() == 4, case_id
    ref = fused_reference(*case_inputs(torch.Generator().manual_seed(DOC_SEED), "logits-1e30").values())
    assert torch.isfinite(ref).all()
    args = case_inputs(torch.Generator().manual_seed(DOC_SEED), "off-1e30")
    locations = args["reference_points"][:, :, None, 0, 0] + args["sampling_offsets"][..., 0, 0, 0] / 4
    assert (locations > 2).all()


def render_fused_section() -> str:
    sizes = sizes_text(SIZES)
    intro = (
        "## The fused op, every path (run on the CPU)\n\n"
        "Written by `tests/test_fused_hardening.py`, which runs each case through "
        "`torch.ops.cute_deform.forward_fused` on the CPU (or `cute_deform.ms_deform_attn_fused` where the row says "
        "so). Its host checks (`cute_deform/_checks.py`, `validate_fused`) are the same on every device. Hostile "
        "values meet the module formula (locations, softmax over L*P in fp32) and then the sampling rule, and are "
        "compared with `cute_deform.fused_reference(..., out_dtype=torch.float64)`. Valid inputs the cases start "
        f"from: {sizes}, levels {', '.join(map(str, LEVELS))} (S=16), 2-d reference points unless the row says "
        "box, fp32, all on the CPU.\n\n"
    )
    return intro + case_table(CASES, run_case, DOC_SEED)


def test_bad_input_table_is_up_to_date():
    """docs/bad_inputs.md's fused-cpu section is what the cases do now (CUTE_DEFORM_WRITE_DOCS=1 rewrites it)."""
    check_or_write_doc_section("fused-cpu", render_fused_section())
