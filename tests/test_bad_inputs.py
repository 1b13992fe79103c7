"""Every bad input gets a TypeError / ValueError that names the argument and what was expected:
through the drop-in function, through torch.ops directly, through the fake implementation
(torch.compile's view), and through the reference."""
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_deform import ms_deform_attn, ms_deform_attn_grid_sample, ms_deform_attn_reference
from cute_deform._checks import check_inputs
from msda_testing import make_inputs

LEVELS = [(3, 4), (2, 2)]
DROP_IN_NAME = {"spatial_shapes": "value_spatial_shapes", "level_start_index": "value_level_start_index"}


def valid_inputs(gen):
    value, shapes, starts, loc, attn = make_inputs(gen, LEVELS, batch=2, queries=3, heads=2, head_dim=4, points=2,
                                                   dtype=torch.float32)
    return dict(value=value, spatial_shapes=shapes, level_start_index=starts, sampling_locations=loc,
                attention_weights=attn)


@dataclass
class Case:
    argument: str  # the argument the error must name
    error: type
    expected: str  # regex for what the message says was expected
    change: Callable[[dict], object]  # new value of `argument` (or a dict of replacements), from the valid inputs
    reads_values: bool = False  # only detectable by reading spatial_shapes / level_start_index
    via_dispatcher: bool = True  # the dispatcher itself refuses non-tensors before our checks
    reference_accepts: bool = False


CASES = {
    "value-rank": Case("value", ValueError, r"expected 4 dims", lambda a: a["value"][0]),
    "spatial_shapes-rank": Case("spatial_shapes", ValueError, r"expected 2 dims", lambda a: a["spatial_shapes"].flatten()),
    "spatial_shapes-3-columns": Case("spatial_shapes", ValueError, r"expected shape \(L, 2\)",
                                     lambda a: torch.cat([a["spatial_shapes"], a["spatial_shapes"][:, :1]], 1)),
    "level_start_index-rank": Case("level_start_index", ValueError, r"expected 1 dims",
                                   lambda a: a["level_start_index"][None]),
    "sampling_locations-rank": Case("sampling_locations", ValueError, r"expected 6 dims",
                                    lambda a: a["sampling_locations"][..., 0]),
    "sampling_locations-last-dim-3": Case("sampling_locations", ValueError, r"expected last dim 2",
                                          lambda a: torch.cat([a["sampling_locations"]] * 2, -1)[..., :3]),
    "attention_weights-rank": Case("attention_weights", ValueError, r"expected 5 dims",
                                   lambda a: a["attention_weights"][..., 0]),
    "N-locations": Case("sampling_locations", ValueError, r"dim 0 \(N, batch\) to be 2",
                        lambda a: a["sampling_locations"][:1]),
    "N-weights": Case("attention_weights", ValueError, r"dim 0 \(N, batch\) to be 2", lambda a: a["attention_weights"][:1]),
    "M-locations": Case("sampling_locations", ValueError, r"dim 2 \(M, heads\) to be 2",
                        lambda a: a["sampling_locations"][:, :, :1]),
    "M-weights": Case("attention_weights", ValueError, r"dim 2 \(M, heads\) to be 2",
                      lambda a: a["attention_weights"][:, :, :1]),
    "L-locations": Case("sampling_locations", ValueError, r"dim 3 \(L, levels\) to be 2",
                        lambda a: a["sampling_locations"][:, :, :, :1]),
    "L-weights": Case("attention_weights", ValueError, r"dim 3 \(L, levels\) to be 2",
                      lambda a: a["attention_weights"][:, :, :, :1]),
    "L-level_start_index": Case("level_start_index", ValueError, r"dim 0 \(L, levels\) to be 2",
                                lambda a: a["level_start_index"][:1]),
    "P-weights": Case("attention_weights", ValueError, r"dim 4 \(P, points\) to be 2",
                      lambda a: a["attention_weights"][..., :1]),
    "Lq-weights": Case("attention_weights", ValueError, r"dim 1 \(Lq, queries\) to be 3",
                       lambda a: a["attention_weights"][:, :1]),
    "S-not-sum-HW": Case("value", ValueError, r"dim 1 \(S\) to be sum\(H\*W\) = 16", lambda a: a["value"][:, :-1],
                         reads_values=True),
    "level_start_index-not-running-sum": Case("level_start_index", ValueError, r"running sum of H\*W .*\[0, 12\]",
                                              lambda a: a["level_start_index"].flip(0), reads_values=True),
    "empty-level": Case("spatial_shapes", ValueError, r"every \(H, W\) >= 1",
                        lambda a: a["spatial_shapes"] * torch.tensor([[1, 1], [0, 1]]), reads_values=True),
    "integer-value": Case("value", TypeError, r"expected dtype (float64, )?float32, float16, bfloat16, got int32",
                          lambda a: a["value"].int()),
    "float64-value": Case("value", TypeError, r"expected dtype float32, float16, bfloat16, got float64",
                          lambda a: a["value"].double(), reference_accepts=True),
    "integer-locations": Case("sampling_locations", TypeError, r"expected dtype (float64, )?float32",
                              lambda a: a["sampling_locations"].long()),
    "bool-weights": Case("attention_weights", TypeError, r"expected dtype (float64, )?float32", lambda a: a["attention_weights"] > 0.5),
    "floating-spatial_shapes": Case("spatial_shapes", TypeError, r"expected dtype int64, got float32",
                                    lambda a: a["spatial_shapes"].float()),
    "int32-level_start_index": Case("level_start_index", TypeError, r"expected dtype int64, got int32",
                                    lambda a: a["level_start_index"].int()),
    "list-spatial_shapes": Case("spatial_shapes", TypeError, r"expected a torch.Tensor, got list",
                                lambda a: a["spatial_shapes"].tolist(), via_dispatcher=False),
    "locations-on-other-device": Case("sampling_locations", ValueError, r"expected device cpu \(the device of value\)",
                                      lambda a: a["sampling_locations"].to("meta")),
    # None where a tensor belongs: the dispatcher passes it on to the op's checks.
    **{f"None-{name}": Case(name, TypeError, r"expected a torch.Tensor, got NoneType", lambda a: None)
       for name in ("value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights")},
    # Not a tensor at all: torch's dispatcher refuses it before the op's checks (see below).
    **{f"float-{name}": Case(name, TypeError, r"expected a torch.Tensor, got float", lambda a: 1.0,
                             via_dispatcher=False)
       for name in ("value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights")},
    # No tensor at all: the op's kernel for other backends runs the checks.
    "None-everywhere": Case("value", TypeError, r"expected a torch.Tensor, got NoneType",
                            lambda a: dict.fromkeys(a)),
    # value moves, the rest stays on the CPU: the first tensor that disagrees with value is named.
    "value-on-other-device": Case("sampling_locations", ValueError, r"expected device meta \(the device of value\)",
                                  lambda a: {"value": a["value"].to("meta")}, via_dispatcher=False),
}


def bad_inputs(gen, case_id):
    args = valid_inputs(gen)
    case = CASES[case_id]
    change = case.change(args)
    args.update(change if isinstance(change, dict) else {case.argument: change})
    return args, case


def message(case, drop_in=False):
    name = DROP_IN_NAME.get(case.argument, case.argument) if drop_in else case.argument
    return rf"cute_deform: {re.escape(name)}: .*{case.expected}"


@pytest.mark.parametrize("case_id", CASES)
def test_drop_in_function(gen, case_id):
    args, case = bad_inputs(gen, case_id)
    with pytest.raises(case.error, match=message(case, drop_in=True)):
        ms_deform_attn(*args.values())


@pytest.mark.parametrize("case_id", [c for c in CASES if CASES[c].via_dispatcher])
def test_torch_ops_directly(gen, case_id):
    args, case = bad_inputs(gen, case_id)
    with pytest.raises(case.error, match=message(case)):
        torch.ops.cute_deform.forward(*args.values())


@pytest.mark.parametrize("case_id", [c for c in CASES if c.startswith(("float-", "list-"))])
def test_torch_ops_refuses_non_tensors_naming_the_argument(gen, case_id):
    """Through torch.ops, torch checks the op's schema before any of cute_deform's code runs: its error is
    a RuntimeError, which names the argument (the drop-in function raises a TypeError instead)."""
    args, case = bad_inputs(gen, case_id)
    bad = [name for name, t in args.items() if not isinstance(t, torch.Tensor)]
    with pytest.raises(RuntimeError, match=rf"Expected a value of type 'Tensor' for argument '{bad[0]}'"):
        torch.ops.cute_deform.forward(*args.values())


@pytest.mark.parametrize("case_id", [c for c in CASES if CASES[c].via_dispatcher and not CASES[c].reads_values
                                     and "device" not in c])
def test_fake_implementation(gen, case_id):
    """What torch.compile sees while tracing: shape and dtype errors surface at trace time."""
    args, case = bad_inputs(gen, case_id)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args.values()]
        with pytest.raises(case.error, match=message(case)):
            torch.ops.cute_deform.forward(*fake)


@pytest.mark.parametrize("reference", [ms_deform_attn_reference, ms_deform_attn_grid_sample], ids=lambda f: f.__name__)
@pytest.mark.parametrize("case_id", CASES)
def test_reference(gen, case_id, reference):
    args, case = bad_inputs(gen, case_id)
    if case.reference_accepts:
        assert reference(*args.values(), out_dtype=torch.float64).dtype == torch.float64
        return
    with pytest.raises(case.error, match=message(case)):
        reference(*args.values())


def test_level_table_may_stay_on_the_cpu(gen):
    """value on another device (meta stands in for CUDA) with spatial_shapes / level_start_index on
    the CPU is accepted, and S is still checked then, for free: by check_inputs, by the op (whose meta
    kernel is its fake implementation) and by the drop-in function."""
    args = valid_inputs(gen)
    for name in ("value", "sampling_locations", "attention_weights"):
        args[name] = args[name].to("meta")
    shape = check_inputs(*args.values())
    assert (shape.batch, shape.num_keys, shape.num_levels, shape.num_points) == (2, 16, 2, 2)
    assert torch.ops.cute_deform.forward(*args.values()).shape == (2, 3, 8)
    short = dict(args, value=args["value"][:, 1:])
    for run in (check_inputs, torch.ops.cute_deform.forward, ms_deform_attn):
        with pytest.raises(ValueError, match=r"value: .*sum\(H\*W\) = 16"):
            run(*short.values())
    reversed_starts = dict(args, level_start_index=args["level_start_index"].flip(0))
    with pytest.raises(ValueError, match=r"cute_deform: level_start_index: expected the running sum"):
        torch.ops.cute_deform.forward(*reversed_starts.values())


def test_fake_level_tables_are_never_read(gen):
    """Under FakeTensorMode (torch.compile's tracing) the level tables are fake CPU tensors without
    values: the fake implementation leaves them alone (reading one would raise), even where S is wrong."""
    args = valid_inputs(gen)
    args["value"] = args["value"][:, 1:]
    with FakeTensorMode() as mode:
        out = torch.ops.cute_deform.forward(*[mode.from_tensor(t) for t in args.values()])
    assert out.shape == (2, 3, 8)


def test_device_level_table_is_never_read(gen):
    """With every tensor off the CPU the value checks are skipped rather than synchronizing: meta
    tensors have no data, so any attempt to read them would raise here."""
    args = {name: t.to("meta") for name, t in valid_inputs(gen).items()}
    args["value"] = args["value"][:, 1:]  # S is wrong, but only a host read could tell
    shape = check_inputs(*args.values())
    assert shape.num_keys == 15
    out = torch.ops.cute_deform.forward(*args.values())
    assert out.device.type == "meta" and out.shape == (2, 3, 8)


def test_non_int_im2col_step(gen):
    args = valid_inputs(gen)
    with pytest.raises(TypeError, match=r"im2col_step: expected an int, got float"):
        ms_deform_attn(*args.values(), im2col_step=64.0)


@pytest.mark.parametrize("case_id", [c for c in CASES if not CASES[c].reads_values])
def test_fast_path_never_accepts_a_bad_input(gen, case_id):
    """check_inputs' fast path (no messages built) accepts only what its detailed checks accept."""
    from cute_deform._checks import OP_FLOAT_DTYPES, _sizes_if_well_formed

    args, _ = bad_inputs(gen, case_id)
    assert _sizes_if_well_formed(*args.values(), OP_FLOAT_DTYPES) is None


@pytest.mark.parametrize("levels,sizes", [
    (LEVELS, dict(batch=2, queries=3, heads=2, head_dim=4, points=2)),
    ([(1, 1)], dict(batch=1, queries=1, heads=1, head_dim=1, points=1)),
    ([], dict(batch=2, queries=3, heads=2, head_dim=4, points=2)),
    (LEVELS, dict(batch=0, queries=0, heads=3, head_dim=0, points=0)),
])
def test_fast_path_and_detailed_checks_agree_on_valid_inputs(gen, levels, sizes):
    from cute_deform._checks import OP_FLOAT_DTYPES, OP_NAMES, _detailed_checks, _sizes_if_well_formed

    args = make_inputs(gen, levels, dtype=torch.float32, **sizes)
    expected = _detailed_checks(*args, OP_FLOAT_DTYPES, OP_NAMES)
    assert _sizes_if_well_formed(*args, OP_FLOAT_DTYPES) == expected
    assert tuple(check_inputs(*args)) == expected
