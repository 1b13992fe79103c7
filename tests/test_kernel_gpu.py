"""The Hopper kernel against the float64 reference over a grid of configurations (issue 3): value
fp32/fp16/bf16 x locations fp32/fp16, L 1..5, P 1/2/4/8/16, D 16/32/64, M 1 and 8, odd level sizes
with H or W = 1, locations outside, on borders and on pixel centres, every variant of the kernel.
Outputs are poisoned before every run. Skipped without a Hopper GPU (tests/conftest.py)."""
import itertools

import pytest
import torch

from cute_deform import ms_deform_attn_reference, msda_fwd
from msda_testing import make_inputs, rel_err, sprinkle_special_locations

pytestmark = pytest.mark.gpu

BOUND = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# The first level is larger than any staging buffer, so it always takes the unstaged path; the
# others are small, odd, and include H = 1 and W = 1.
LEVELS = [(40, 57), (13, 17), (7, 1), (1, 9), (5, 6)]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Kernel variants: the default, per-sample TMA boxes, no multicast, no staging at all, footprint records.
VARIANTS = {
    "default": {},
    "tma": dict(fine_gather="tma", num_groups=3, num_stages=4),
    "nocluster": dict(cluster_size=1),
    "nostage": dict(stage_bytes=0, cluster_size=1),
    "records": dict(footprint_records=True),
}


def cases():
    out = []
    # Every value dtype x location dtype x head dim, with both fine-level gathers.
    for (vname, lname, D), variant in itertools.product(
            itertools.product(("fp32", "fp16", "bf16"), ("fp32", "fp16"), (16, 32, 64)), ("default", "tma")):
        out.append(dict(value=vname, loc=lname, D=D, L=4, P=4, M=8, variant=variant))
    # Every level count x point count, with and without footprint records.
    for (L, P), variant in itertools.product(itertools.product(range(1, 6), (1, 2, 4, 8, 16)), ("default", "records")):
        out.append(dict(value="fp16", loc="fp32", D=32, L=L, P=P, M=1, variant=variant))
    # The remaining variants.
    for variant in ("nocluster", "nostage", "records"):
        for vname in ("fp32", "bf16"):
            out.append(dict(value=vname, loc="fp16", D=32, L=5, P=8, M=8, variant=variant))
    return out


CASES = cases()


def case_id(c):
    return f"{c['variant']}-v{c['value']}-l{c['loc']}-D{c['D']}-L{c['L']}-P{c['P']}-M{c['M']}"


def config_of(c):
    return msda_fwd.KernelConfig(msda_fwd._TORCH_TO_NAME[DTYPES[c["value"]]], msda_fwd._TORCH_TO_NAME[DTYPES[c["loc"]]],
                                 msda_fwd._TORCH_TO_NAME[DTYPES[c["loc"]]], c["M"], c["L"], c["P"], c["D"],
                                 **{**msda_fwd.TUNING, **VARIANTS[c["variant"]]})


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """Compile every configuration of the grid up front, in parallel processes, into the disk cache."""
    msda_fwd.precompile([config_of(c) for c in CASES])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_matches_float64_reference(gen, case):
    levels = LEVELS[:case["L"]]
    vdt, ldt = DTYPES[case["value"]], DTYPES[case["loc"]]
    value, shapes, starts, loc, attn = make_inputs(gen, levels, batch=2, queries=77, heads=case["M"],
                                                   head_dim=case["D"], points=case["P"], dtype=torch.float64)
    loc = sprinkle_special_locations(gen, loc, levels, fraction=0.3)
    value, loc, attn = value.to(vdt).cuda(), loc.to(ldt).cuda(), attn.to(ldt).cuda()
    shapes, starts = shapes.cuda(), starts.cuda()
    assert msda_fwd.config_for(value, loc, attn, **VARIANTS[case["variant"]]) == config_of(case)
    ref = ms_deform_attn_reference(value, shapes, starts, loc, attn, out_dtype=torch.float64)
    for _ in range(2):  # two runs on fresh poison: a race shows as a difference
        torch.full((value.numel() * 4,), float("nan"), device="cuda")  # freed: NaN in the allocator
        out = msda_fwd.msda_forward(value, shapes, starts, loc, attn, **VARIANTS[case["variant"]])
        assert out.dtype == vdt and out.shape == ref.shape
        assert torch.isfinite(out).all(), "output elements left unwritten"
        assert rel_err(out, ref) <= BOUND[vdt]


def test_kernel_on_the_presets_matches_reference(gen):
    """Realistic sizes: several segments per CTA, partial tiles, many CTAs."""
    levels = [(100, 152), (50, 76), (25, 38), (13, 19)]
    value, shapes, starts, loc, attn = make_inputs(gen, levels, batch=2, queries=3001, heads=8, head_dim=32,
                                                   points=8, dtype=torch.float32)
    value, loc, attn = value.half().cuda(), loc.cuda(), attn.cuda()
    shapes, starts = shapes.cuda(), starts.cuda()
    out = msda_fwd.msda_forward(value, shapes, starts, loc, attn)
    ref = ms_deform_attn_reference(value, shapes, starts, loc, attn, out_dtype=torch.float64)
    assert rel_err(out, ref) <= BOUND[torch.float16]
