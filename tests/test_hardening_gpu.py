"""Production hardening of torch.ops.cute_deform.forward on an sm_90 GPU (issue 5): CUDA graph capture,
torch.compile(fullgraph=True), side streams, a second device, sizes beyond int32, and hostile inputs
(NaN/inf/far-away locations and weights, GPU-resident level tables inconsistent with value).

Every check is against the float64 reference, on fresh random inputs, with freed allocator memory
poisoned with NaN first so that unwritten outputs show. Skipped without a Hopper GPU (conftest.py).

The hostile inputs run in a child process (a fresh one after any case that loses the CUDA context),
so that an illegal memory access fails its own case, not every test after it. The same file runs
them standalone, e.g. under compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python tests/test_hardening_gpu.py          # exit 0 when every case behaved

(without the caching allocator every tensor is its own allocation, so memcheck sees reads past it).
CUTE_DEFORM_WRITE_DOCS=1 makes test_gpu_section_of_bad_input_table write docs/bad_inputs.md's GPU section.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __name__ == "__main__":  # standalone: the package from this checkout, even if not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest
import torch

from cute_deform import ms_deform_attn_reference
from msda_testing import (check_or_write_doc_section, finite_rel_err, first_line, level_tensors, make_inputs,
                          markdown_table, nonfinite_mismatch, output_on_nan, rel_err)

pytestmark = pytest.mark.gpu

# One kernel configuration for every test but the large-locations one, so the run compiles little:
# value fp16, locations and weights fp32, M=8, L=4, P=4, D=32 (the Deformable DETR decoder's).
LEVELS = [(40, 60), (20, 30), (10, 15), (5, 8)]  # level 0 is too big to stage: both gather paths run
NUM_KEYS = sum(h * w for h, w in LEVELS)  # S = 3190
TRUE_STARTS = [0, 2400, 3000, 3150]
BATCH, QUERIES, HEADS, HEAD_DIM, POINTS = 2, 50, 8, 32, 4  # 50 queries: a full tile and a partial one
VALUE_DTYPE, LOC_DTYPE = torch.float16, torch.float32
BOUND = {torch.float16: 5e-3, torch.float32: 1e-5}
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: work that does not wait for it reads unfilled buffers
NAN = float("nan")


def op(*args) -> torch.Tensor:
    return torch.ops.cute_deform.forward(*args)


def reference(args) -> torch.Tensor:
    return ms_deform_attn_reference(*args, out_dtype=torch.float64)


def cpu_inputs(gen, *, batch=BATCH, queries=QUERIES) -> list[torch.Tensor]:
    return list(make_inputs(gen, LEVELS, batch=batch, queries=queries, heads=HEADS, head_dim=HEAD_DIM,
                            points=POINTS, dtype=VALUE_DTYPE, loc_dtype=LOC_DTYPE, attn_dtype=LOC_DTYPE))


def gpu_inputs(gen, device="cuda", **sizes) -> list[torch.Tensor]:
    return [t.to(device) for t in cpu_inputs(gen, **sizes)]


def cuda_generator(gen, device="cuda") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))


def assert_matches_reference(out, ref, what="output"):
    """Finite everywhere (outputs were poisoned with NaN) and within the dtype's bound of the reference."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: {int((~torch.isfinite(out)).sum())} outputs NaN/inf (unwritten?)"
    err = rel_err(out, ref)
    assert err < BOUND[out.dtype], f"{what}: rel err {err:.2e} >= {BOUND[out.dtype]:.0e}"


# --- CUDA graphs ---------------------------------------------------------------------------------

def capture(static):
    """Warm up on a side stream (compiles or loads the kernel, fills the op's caches), then capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            op(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = op(*static)
    return graph, static_out


def replay_with_new_inputs(gen, graph, static, static_out, devices):
    for round in range(2):  # two rounds: the replay reads the buffers, nothing of round 0 is baked in
        fresh = [t.to(d) for t, d in zip(cpu_inputs(gen), devices)]
        for buf, new in zip(static, fresh):
            buf.copy_(new)
        static_out.fill_(NAN)  # whatever the replay does not write stays NaN
        graph.replay()
        eager = op(*fresh)
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager), f"round {round}: replay differs from eager on the same inputs"
        assert_matches_reference(static_out, reference(fresh), f"round {round}: replay")


def test_cuda_graph_replay_matches_eager_and_reference(gen):
    static = gpu_inputs(gen)
    graph, static_out = capture(static)
    replay_with_new_inputs(gen, graph, static, static_out, ["cuda"] * 5)


def test_cuda_graph_with_level_table_on_the_cpu(gen):
    """spatial_shapes / level_start_index on the CPU are allowed (and checked for free); the op copies
    them to the GPU on every call, which must capture and replay too (pageable host-to-device copies
    are the usual thing that does not)."""
    devices = ["cuda", "cpu", "cpu", "cuda", "cuda"]
    static = [t.to(d) for t, d in zip(cpu_inputs(gen), devices)]
    graph, static_out = capture(static)
    replay_with_new_inputs(gen, graph, static, static_out, devices)


# --- torch.compile -------------------------------------------------------------------------------

class ProjectThenAttend(torch.nn.Module):
    """value_proj then the op, as in Deformable DETR's MSDeformAttn."""

    def __init__(self, channels: int):
        super().__init__()
        self.value_proj = torch.nn.Linear(channels, HEADS * HEAD_DIM)

    def value(self, x):
        return self.value_proj(x).view(x.shape[0], x.shape[1], HEADS, HEAD_DIM)

    def forward(self, x, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return torch.ops.cute_deform.forward(self.value(x), spatial_shapes, level_start_index, sampling_locations,
                                             attention_weights)


def attend(*args):
    return torch.ops.cute_deform.forward(*args)


def test_torch_compile_fullgraph_matches_eager(gen):
    channels = 64
    module = ProjectThenAttend(channels)
    with torch.no_grad():
        module.value_proj.weight.copy_(torch.randn(module.value_proj.weight.shape, generator=gen) / channels**0.5)
        module.value_proj.bias.copy_(torch.randn(module.value_proj.bias.shape, generator=gen))
    module = module.to("cuda", VALUE_DTYPE)
    _, shapes, starts, loc, attn = gpu_inputs(gen)
    x = torch.randn((BATCH, NUM_KEYS, channels), generator=gen).to("cuda", VALUE_DTYPE)
    inputs = (x, shapes, starts, loc, attn)

    with torch.no_grad():
        explanation = torch._dynamo.explain(module)(*inputs)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(module, fullgraph=True)  # fullgraph: a graph break would raise
        compiled_op = torch.compile(attend, fullgraph=True)
        out = output_on_nan(lambda: compiled(*inputs))
        eager = module(*inputs)
        value = module.value(x)
        op_alone = compiled_op(value, shapes, starts, loc, attn)
        op_eager = torch.ops.cute_deform.forward(value, shapes, starts, loc, attn)
    torch.cuda.synchronize()
    ref = reference([value, shapes, starts, loc, attn])
    # The op itself is the same kernel on the same inputs: bit for bit.
    assert torch.equal(op_alone, op_eager), "compiled op differs from eager"
    # Inductor may round the projection's bias add differently (fp16 ulps), hence a bound here.
    assert_matches_reference(eager, ref, "eager module")
    assert_matches_reference(out, ref, "compiled module")
    assert rel_err(out, eager) < BOUND[VALUE_DTYPE]


# --- Streams -------------------------------------------------------------------------------------

def test_side_stream_orders_the_op_after_producers_and_before_consumers(gen):
    """Inputs made by kernels on a non-default stream, immediately followed by the op on that stream,
    then a kernel on it that reads the output. The stream first sleeps, so an op launched on any
    other stream would run before its inputs exist (they start as NaN) and the output would differ."""
    _, shapes, starts, loc0, attn0 = gpu_inputs(gen)
    value = torch.full((BATCH, NUM_KEYS, HEADS, HEAD_DIM), NAN, dtype=VALUE_DTYPE, device="cuda")
    loc = torch.full_like(loc0, NAN)
    attn = torch.full_like(attn0, NAN)
    cuda_gen = cuda_generator(gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the NaN fills and level tables are done
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        torch.randn(value.shape, generator=cuda_gen, out=value)
        torch.rand(loc.shape, generator=cuda_gen, out=loc).mul_(1.4).sub_(0.2)  # some outside every level
        torch.rand(attn.shape, generator=cuda_gen, out=attn)
        out = output_on_nan(lambda: op(value, shapes, starts, loc, attn))  # on this stream's pool
        consumed = out.double() * 2  # a later kernel on the same stream reads the op's output
    torch.cuda.synchronize()
    assert_matches_reference(out, reference([value, shapes, starts, loc, attn]))
    assert torch.equal(consumed, out.double() * 2), "a kernel after the op on its stream read an unfinished output"


# --- Hostile inputs (run in a child process; also the standalone script) -------------------------

@dataclass(frozen=True)
class ValueCase:
    """Valid inputs made hostile in values only; the output must match the reference, non-finite
    exactly where it is: NaN wherever a NaN input reaches a sum; where only inf weights make it
    non-finite, NaN or either inf (half arithmetic decides, see msda_testing.nonfinite_mismatch)."""
    input: str
    spoil: Callable[[list, torch.Generator], None] | None  # edits the CPU inputs in place


@dataclass(frozen=True)
class TableCase:
    """Level tables on the GPU that disagree with value: the host cannot see it without a sync."""
    input: str
    shapes: list
    starts: list
    extra_pixels: int = 0  # value gets S = 3190 + extra_pixels
    shapes_on_cpu: bool = False
    where: str = "device: checked_level"


def sprinkle(t: torch.Tensor, gen, fraction: float, pool) -> torch.Tensor:
    """Replace a random fraction of t's entries with values from pool (in place); returns which."""
    pick = torch.rand(t.shape, generator=gen) < fraction
    choice = torch.tensor(pool, dtype=t.dtype)[torch.randint(len(pool), t.shape, generator=gen)]
    t[pick] = choice[pick]
    return pick


FAR = [1e30, -1e30, 1e10, -1e10, 3e9]  # scaled by H or W, all beyond int32 (and 1e30 beyond fp16)


def _spoil_all(a, gen):
    sprinkle(a[3], gen, 0.05, [NAN, math.inf, -math.inf])
    sprinkle(a[3], gen, 0.1, FAR)
    sprinkle(a[4], gen, 0.02, [NAN, math.inf, -math.inf])


def _nan_location_and_weight(a, gen):
    pick = torch.rand(a[4].shape, generator=gen) < 0.1
    a[3][pick] = NAN
    a[4][pick] = NAN  # a skipped sample ignores its weight: the output stays finite


VALUE_CASES = {
    "loc-nan": ValueCase("10% of location coordinates NaN", lambda a, g: sprinkle(a[3], g, 0.1, [NAN])),
    "loc-inf": ValueCase("10% of location coordinates +-inf", lambda a, g: sprinkle(a[3], g, 0.1, [math.inf, -math.inf])),
    "loc-far": ValueCase("20% of location coordinates in +-1e30, +-1e10, 3e9 (beyond int32 once scaled)",
                         lambda a, g: sprinkle(a[3], g, 0.2, FAR)),
    "attn-nan": ValueCase("2% of attention weights NaN", lambda a, g: sprinkle(a[4], g, 0.02, [NAN])),
    "attn-inf": ValueCase("2% of attention weights +-inf", lambda a, g: sprinkle(a[4], g, 0.02, [math.inf, -math.inf])),
    "loc-nan-attn-nan": ValueCase("NaN location and NaN weight on the same 10% of samples", _nan_location_and_weight),
    "all-at-once": ValueCase("NaN/inf/far locations and NaN/inf weights together", _spoil_all),
}


def _level(i, hw):
    return [hw if j == i else LEVELS[j] for j in range(len(LEVELS))]


def _start(i, s):
    return [s if j == i else TRUE_STARTS[j] for j in range(len(TRUE_STARTS))]


TABLE_CASES = {
    "sum-past-end": TableCase("sum(H*W) > S: last level (6, 8) instead of (5, 8), 8 pixels past the end of value",
                              _level(3, (6, 8)), TRUE_STARTS),
    "sum-overlap": TableCase("sum(H*W) > S, every level inside value: level 0 (41, 60) overlaps level 1",
                             _level(0, (41, 60)), TRUE_STARTS),
    "sum-short": TableCase("sum(H*W) < S: value has 10 pixels that no level covers", LEVELS, TRUE_STARTS,
                           extra_pixels=10),
    "H-zero": TableCase("H = 0 on level 1", _level(1, (0, 30)), TRUE_STARTS),
    "W-negative": TableCase("W = -30 on level 1", _level(1, (20, -30)), TRUE_STARTS),
    "HW-negative": TableCase("H = -5, W = -8 on level 3 (H*W = 40, as the true (5, 8))", _level(3, (-5, -8)),
                             TRUE_STARTS),
    "HW-wraps-int32": TableCase("H = W = 65536 on level 2 (H*W = 2^32 wraps to 0 in int32)",
                                _level(2, (65536, 65536)), TRUE_STARTS),
    "HW-wraps-int64": TableCase("H = W = 2^32 on level 2 (H*W = 2^64 wraps to 0 in int64)",
                                _level(2, (2**32, 2**32)), TRUE_STARTS),
    "start-negative": TableCase("level_start_index -1 on level 1", LEVELS, _start(1, -1)),
    "start-at-S": TableCase("level_start_index 3190 = S on level 3", LEVELS, _start(3, NUM_KEYS)),
    "start-int64-max": TableCase("level_start_index 2^63 - 1 on level 3 (start + H*W wraps in int64)", LEVELS,
                                 _start(3, 2**63 - 1)),
    "starts-all-zero": TableCase("every level starts at pixel 0 (overlapping, all inside value)", LEVELS, [0] * 4),
    "start-past-end-shapes-on-cpu": TableCase(
        "level_start_index 3189 on level 2 on the GPU, spatial_shapes (consistent) on the CPU", LEVELS,
        _start(2, NUM_KEYS - 1), shapes_on_cpu=True, where="host checks S (CPU spatial_shapes); device: checked_level"),
}

SANITY = "valid-after-hostile"  # valid inputs last: the process's CUDA context is still healthy
HOSTILE = [*VALUE_CASES, *TABLE_CASES, SANITY]


def level_table_accepts(shapes, starts, num_keys) -> bool:
    """The kernel's documented rule (cute_deform/hopper/inputs.py, checked_level, used by both kernels) in exact integers: every level
    must fit in value, else the whole output is NaN."""
    return all(h >= 1 and w >= 1 and s >= 0 and s + h * w <= num_keys for (h, w), s in zip(shapes, starts))


def nan_inputs_reach(args) -> torch.Tensor:
    """The outputs that must be NaN: those a NaN input reaches, where the reference with the inf weights set to 0 is
    NaN. Where only inf weights make an output non-finite, its kind is half arithmetic's
    (msda_testing.nonfinite_mismatch)."""
    return torch.isnan(reference([*args[:4], torch.where(torch.isinf(args[4]), 0.0, args[4])]))


def run_value_case(case_id, gen, device) -> tuple[bool, str]:
    args = cpu_inputs(gen)
    if case_id != SANITY:
        VALUE_CASES[case_id].spoil(args, gen)
    args = [t.to(device) for t in args]
    out = output_on_nan(lambda: op(*args))
    torch.cuda.synchronize(device)
    ref = reference(args)
    mismatch = nonfinite_mismatch(out, ref, same_kinds=False, nan_at=nan_inputs_reach(args))
    err = finite_rel_err(out, ref)
    nonfinite = int((~torch.isfinite(out)).sum())
    if mismatch:
        return False, f"differs from the float64 reference: {mismatch}"
    return err < BOUND[out.dtype], (f"{nonfinite} of {out.numel()} outputs NaN/inf as in the reference, "
                                    f"rel err {err:.1e} on the rest")


def run_table_case(case_id, gen, device) -> tuple[bool, str]:
    case = TABLE_CASES[case_id]
    value, _, _, loc, attn = cpu_inputs(gen)
    if case.extra_pixels:
        value = torch.cat([value, torch.randn(value[:, :case.extra_pixels].shape, generator=gen).to(value.dtype)], 1)
    shapes = torch.tensor(case.shapes, dtype=torch.int64)
    starts = torch.tensor(case.starts, dtype=torch.int64)
    args = [value.to(device), shapes if case.shapes_on_cpu else shapes.to(device), starts.to(device),
            loc.to(device), attn.to(device)]
    out = output_on_nan(lambda: op(*args))
    torch.cuda.synchronize(device)  # an out-of-bounds access would surface here
    if level_table_accepts(case.shapes, case.starts, value.shape[1]):
        err = rel_err(out, reference(args)) if torch.isfinite(out).all() else math.inf
        if err < BOUND[out.dtype]:
            return True, f"no error; equals the float64 reference for the same level table (rel err < {BOUND[out.dtype]:.0e})"
        return False, f"no error; differs from the float64 reference for the same level table (rel err {err:.1e})"
    nan = int(torch.isnan(out).sum())
    if nan == out.numel():
        return True, f"no error; all {nan} outputs NaN"
    return False, f"no error; {nan} of {out.numel()} outputs NaN (expected all: a level does not fit in value)"


def case_generator(seed: int, case_id: str) -> torch.Generator:
    """Each case's inputs depend only on the seed and the case: `python tests/test_hardening_gpu.py
    --seed S CASE` replays one, and a fresh process after a lost context changes nothing."""
    return torch.Generator().manual_seed((seed + zlib.crc32(case_id.encode())) % 2**63)


def run_hostile_case(case_id, gen, device="cuda") -> tuple[bool, str]:
    if case_id in TABLE_CASES:
        return run_table_case(case_id, gen, device)
    return run_value_case(case_id, gen, device)


def context_is_healthy(device="cuda") -> bool:
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).item() == 1.0
    except Exception:
        return False


CONTEXT_LOST = 3  # exit status: a case broke the CUDA context, the rest need a fresh process


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run the hostile-input cases once; exit 0 if all behaved.")
    parser.add_argument("cases", nargs="*", metavar="CASE", help=f"cases to run (default: all): {', '.join(HOSTILE)}")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--report", type=Path, default=None, help="append one JSON line per case here")
    options = parser.parse_args(argv)
    unknown = [c for c in options.cases if c not in HOSTILE]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(HOSTILE)}")
    seed = secrets.randbits(63) if options.seed is None else options.seed
    print(f"hostile inputs on {torch.cuda.get_device_name()}, seed {seed}", flush=True)

    def emit(record):
        if options.report:
            with options.report.open("a") as f:
                f.write(json.dumps(record) + "\n")

    failed = 0
    for case_id in options.cases or HOSTILE:
        emit({"case": case_id, "started": True})
        try:
            ok, outcome = run_hostile_case(case_id, case_generator(seed, case_id))
        except Exception as exc:
            ok, outcome = False, f"`{first_line(exc)}`"
        emit({"case": case_id, "ok": ok, "outcome": outcome})
        print(f"{'ok  ' if ok else 'FAIL'} {case_id}: {outcome}", flush=True)
        failed += not ok
        if not ok and not context_is_healthy():
            print(f"the CUDA context is lost after {case_id}; later cases need a fresh process", flush=True)
            return CONTEXT_LOST
    print(f"{len(options.cases or HOSTILE) - failed} behaved, {failed} did not", flush=True)
    return 1 if failed else 0


@pytest.fixture(scope="module")
def hostile_results(tmp_path_factory):
    """{case: {"ok", "outcome"}} from child processes: a fresh one after a case that lost the context,
    died or hung."""
    seed = int(os.environ.get("CUTE_DEFORM_SEED", secrets.randbits(63)))
    print(f"hostile inputs: seed {seed}")
    report = tmp_path_factory.mktemp("hostile") / "report.jsonl"
    results: dict[str, dict] = {}
    remaining = list(HOSTILE)
    while remaining:
        report.unlink(missing_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--seed", str(seed), "--report", str(report),
                   *remaining]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
            tail = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()][-3:]
            why = f"process exited {proc.returncode}: {' / '.join(tail)[-400:]}"
        except subprocess.TimeoutExpired as exc:
            why = f"process hung (killed after {exc.timeout} s)"
        started = None
        for line in report.read_text().splitlines() if report.exists() else []:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
            if record.get("started"):
                started = record["case"]
            else:
                results[record["case"]] = record
                started = None
        if started is not None:  # died or hung inside this case
            results[started] = {"ok": False, "outcome": why}
        now_remaining = [c for c in remaining if c not in results]
        if len(now_remaining) == len(remaining):  # no progress: the process cannot start
            for c in remaining:
                results[c] = {"ok": False, "outcome": f"not run: {why}"}
            break
        remaining = now_remaining
    return seed, results


@pytest.mark.parametrize("case_id", HOSTILE)
def test_hostile_input_on_gpu(hostile_results, case_id):
    """NaN/inf/far locations and weights match the reference; GPU level tables that do not fit value
    give an all-NaN output and no error (then synchronize succeeds); ones that fit give the reference's
    answer for that table; valid inputs after all of them are still right."""
    seed, results = hostile_results
    assert results[case_id]["ok"], f"{case_id} (seed {seed}): {results[case_id]['outcome']}"


def render_gpu_section(results) -> str:
    rows = [(case.input, case.where, results.get(case_id, {}).get("outcome", "not run"))
            for case_id, case in TABLE_CASES.items()]
    levels = ", ".join(map(str, LEVELS))
    intro = (
        "## Level tables on the GPU (sm_90 kernel)\n\n"
        "Written by `tests/test_hardening_gpu.py` (`test_gpu_section_of_bad_input_table`). spatial_shapes and "
        "level_start_index on the GPU are never read by the host (that would be a sync), so none of the host "
        "checks above sees these. The kernels' `checked_level` (cute_deform/hopper/inputs.py) replaces a level that does "
        "not fit in value (H or W < 1, start < 0, start + H*W > S) by a 1x1 level at pixel 0, so nothing is read "
        "out of bounds, and writes the whole output as NaN; levels that fit are used as given, even overlapping. "
        "Each case ran in a process apart from the other GPU tests and ended with `torch.cuda.synchronize()`. "
        f"Valid inputs: N={BATCH}, Lq={QUERIES}, M={HEADS}, D={HEAD_DIM}, P={POINTS}, levels {levels} "
        f"(S={NUM_KEYS}), value fp16, locations and weights fp32, all on the GPU.\n\n"
    )
    return intro + markdown_table(("input", "where checked", "outcome"), rows)


def test_gpu_section_of_bad_input_table(hostile_results):
    """docs/bad_inputs.md's GPU section is what the table cases did (CUTE_DEFORM_WRITE_DOCS=1 rewrites it)."""
    _, results = hostile_results
    check_or_write_doc_section("gpu", render_gpu_section(results))


# --- Sizes beyond int32 --------------------------------------------------------------------------

def skip_unless_free(nbytes: int):
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes + 2**30:
        pytest.skip(f"needs {nbytes / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


def test_value_beyond_int32_elements(gen):
    """value with 2.28e9 elements (4.6 GB): the last images start past 2^31 elements and 2^32 bytes."""
    levels = [(100, 167), (50, 84), (25, 42), (13, 21)]  # Deformable DETR's, S = 22223
    batch, queries = 400, 64
    shapes, starts = level_tensors(levels, "cuda")
    per_image = sum(h * w for h, w in levels) * HEADS * HEAD_DIM
    assert batch * per_image > 2**31 and (batch - 2) * per_image > 2**31
    skip_unless_free(batch * per_image * 2)
    cuda_gen = cuda_generator(gen)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    value = torch.randn((batch, per_image // (HEADS * HEAD_DIM), HEADS, HEAD_DIM), generator=cuda_gen,
                        dtype=VALUE_DTYPE, device="cuda")
    loc = torch.rand((batch, queries, HEADS, len(levels), POINTS, 2), generator=cuda_gen, device="cuda")
    loc.mul_(1.4).sub_(0.2)
    attn = torch.rand(loc.shape[:-1], generator=cuda_gen, device="cuda")
    out = output_on_nan(lambda: op(value, shapes, starts, loc, attn))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "outputs left unwritten"
    first_past = -(-2**31 // per_image)  # the first image that starts past 2^31 elements
    for n in (0, first_past - 1, first_past, batch - 2, batch - 1):
        ref = reference([value[n:n + 1], shapes, starts, loc[n:n + 1], attn[n:n + 1]])
        assert_matches_reference(out[n:n + 1], ref, f"image {n} (starts at element {n * per_image})")
    assert torch.cuda.max_memory_allocated() - before < 20 * 2**30


def test_locations_beyond_int32_elements(gen):
    """N*Lq*M*L*P = 2.15e9 samples: offsets into attention_weights pass 2^31 elements, into
    sampling_locations 2^32 elements (8.6 GB). Its own configuration (fp16 everywhere, M=2, D=8: the
    least output per sample) keeps the test at 15 GB."""
    heads, head_dim, batch, queries = 2, 8, 2, 33_600_000
    per_query = heads * len(LEVELS) * POINTS  # samples
    samples = batch * queries * per_query
    assert samples > 2**31
    skip_unless_free(samples * 2 * 2 + samples * 2 + batch * queries * heads * head_dim * 2)
    shapes, starts = level_tensors(LEVELS, "cuda")

    def inputs(batch, queries, cuda_gen):
        value = torch.randn((batch, NUM_KEYS, heads, head_dim), generator=cuda_gen, dtype=torch.float16, device="cuda")
        loc = torch.rand((batch, queries, heads, len(LEVELS), POINTS, 2), generator=cuda_gen, dtype=torch.float16,
                         device="cuda")
        loc.mul_(1.4).sub_(0.2)
        attn = torch.rand(loc.shape[:-1], generator=cuda_gen, dtype=torch.float16, device="cuda")
        return value, loc, attn

    cuda_gen = cuda_generator(gen)
    # The same configuration at a small size first, so that a failure below is about the size.
    value, loc, attn = inputs(2, 300, cuda_gen)
    assert_matches_reference(op(value, shapes, starts, loc, attn), reference([value, shapes, starts, loc, attn]),
                             "small problem, same configuration")

    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    value, loc, attn = inputs(batch, queries, cuda_gen)
    out = output_on_nan(lambda: op(value, shapes, starts, loc, attn))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "outputs left unwritten"
    # Queries (image, first, last) around where the offsets pass 2^31, and at both ends.
    windows = []
    for elements_per_query in (per_query * 2, per_query):  # sampling_locations, attention_weights
        n, q = divmod(2**31 // elements_per_query, queries)
        windows.append((n, max(0, q - 32), min(queries, q + 32)))
    windows += [(0, 0, 64), (batch - 1, queries - 64, queries)]
    for n, first, last in windows:
        ref = reference([value[n:n + 1], shapes, starts, loc[n:n + 1, first:last], attn[n:n + 1, first:last]])
        assert_matches_reference(out[n:n + 1, first:last], ref, f"image {n}, queries {first}..{last - 1}")
    assert torch.cuda.max_memory_allocated() - before < 20 * 2**30


# --- A second device (last: a launch on the wrong device could break the CUDA context) -----------

def test_second_device(gen):
    """Tensors on cuda:1 while the current device is cuda:0 (as in a process that never calls
    set_device): the output is on cuda:1 and right. cuda:1's stream sleeps before the inputs are
    filled, so a kernel launched on cuda:0's stream (or cuda:1's default one) would read NaN."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, this machine has {torch.cuda.device_count()}: not run")
    device = torch.device("cuda", 1)
    assert torch.cuda.current_device() != 1
    src = gpu_inputs(gen, device)
    with torch.cuda.device(device):
        bufs = [torch.full_like(t, NAN) if t.is_floating_point() else t for t in src]
        torch.cuda._sleep(SLEEP_CYCLES)
        for buf, t in zip(bufs, src):
            if buf is not t:
                buf.copy_(t)
    out = output_on_nan(lambda: op(*bufs))
    assert out.device == device
    torch.cuda.synchronize(device)
    assert_matches_reference(out, reference(src), "cuda:1 from current device cuda:0")
    with torch.cuda.device(device):
        again = op(*bufs)
    torch.cuda.synchronize(device)
    assert torch.equal(again, out), "cuda:1 as the current device gives another answer"


if __name__ == "__main__":
    sys.exit(main())
