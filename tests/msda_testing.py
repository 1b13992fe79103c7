"""Helpers for the tests: random MSDA inputs, a scalar brute-force MSDA, relative error."""
from __future__ import annotations

import difflib
import math
import os
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import compare  # noqa: E402  (run_poisoned)


def raster_cells(xy: torch.Tensor, shapes: torch.Tensor) -> torch.Tensor:
    """The order table's cell of each position (x, y) (cute_deform/hopper/order.py): bands of y, then columns
    of x, order_grid's for the level table `shapes`; NaN counts as 1 and positions outside [0, 1] as the
    nearest edge. Written out here, not taken from the code it checks."""
    pixels = [int(h) * int(w) for h, w in shapes.tolist()]
    H, W = shapes.tolist()[pixels.index(max(pixels))]
    bands = min(max(H // 6, 1), 32768)
    columns = min(max(W * 2 // 5, 1), 32768 // bands)
    unit = xy.float().nan_to_num(nan=1.0).clamp(0, 1)
    band = (unit[..., 1] * bands).long().clamp(max=bands - 1)
    return band * columns + (unit[..., 0] * columns).long().clamp(max=columns - 1)


def level_tensors(levels, device="cpu"):
    """spatial_shapes (L, 2) and level_start_index (L,) for levels given as (H, W) pairs."""
    shapes = torch.tensor(levels, dtype=torch.int64).view(-1, 2)
    pixels = shapes.prod(-1)
    starts = pixels.cumsum(0) - pixels  # each level starts where the previous ones end
    return shapes.to(device), starts.to(device)


def make_inputs(gen, levels, *, batch=2, queries=5, heads=3, head_dim=4, points=2,
                dtype=torch.float64, loc_dtype=None, attn_dtype=None, low=-0.2, high=1.2):
    """Random inputs; locations uniform in [low, high]^2 so some fall outside every level."""
    shapes, starts = level_tensors(levels)
    num_keys = int(shapes.prod(-1).sum())
    L = len(levels)
    value = torch.randn((batch, num_keys, heads, head_dim), generator=gen, dtype=torch.float64).to(dtype)
    loc = low + (high - low) * torch.rand((batch, queries, heads, L, points, 2), generator=gen, dtype=torch.float64)
    attn = torch.rand((batch, queries, heads, L, points), generator=gen, dtype=torch.float64)
    return value, shapes, starts, loc.to(loc_dtype or dtype), attn.to(attn_dtype or dtype)


def special_coordinates(size: int) -> list[float]:
    """Coordinates in [0, 1] units along an axis of `size` pixels that hit the rule's edge cases."""
    coords = [0.0, 1.0, -0.5 / size, (size + 0.5) / size, math.nan, math.inf, -math.inf, 1e30, -1e30]
    coords += [j / size for j in range(size + 1)]  # pixel edges (integer pixel coordinates - 0.5)
    coords += [(j + 0.5) / size for j in range(size)]  # pixel centres
    for border in (-0.5 / size, (size + 0.5) / size, 0.0, 1.0):  # just inside / outside the skip borders
        coords += [math.nextafter(border, -math.inf), math.nextafter(border, math.inf)]
    return coords


def sprinkle_special_locations(gen, loc: torch.Tensor, levels, fraction=0.6) -> torch.Tensor:
    """Replace a random `fraction` of the coordinates with per-level special ones (borders, pixel
    edges and centres, NaN, inf)."""
    loc = loc.clone()
    for level, (height, width) in enumerate(levels):
        for axis, size in ((0, width), (1, height)):
            pool = torch.tensor(special_coordinates(size), dtype=loc.dtype)
            target = loc[..., level, :, axis]
            pick = torch.randint(len(pool), target.shape, generator=gen)
            use = torch.rand(target.shape, generator=gen) < fraction
            loc[..., level, :, axis] = torch.where(use, pool[pick], target)
    return loc


def brute_force_msda(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """The original kernel's rule as a scalar loop over samples in Python floats (IEEE double).

    Written independently of cute_deform.reference, in the original's order of operations, so the
    two agree bit for bit in float64.
    """
    N, S, M, D = value.shape
    Lq, L, P = sampling_locations.shape[1], sampling_locations.shape[3], sampling_locations.shape[4]
    v = value.double().tolist()
    loc = sampling_locations.double().tolist()
    attn = attention_weights.double().tolist()
    shapes = spatial_shapes.tolist()
    starts = level_start_index.tolist()
    out = torch.zeros((N, Lq, M, D), dtype=torch.float64)
    for n in range(N):
        for q in range(Lq):
            for m in range(M):
                col = [0.0] * D
                for l in range(L):
                    H, W = shapes[l]
                    for p in range(P):
                        x, y = loc[n][q][m][l][p]
                        h = y * H - 0.5
                        w = x * W - 0.5
                        if not (h > -1 and w > -1 and h < H and w < W):
                            continue
                        h_low, w_low = math.floor(h), math.floor(w)
                        lh, lw = h - h_low, w - w_low
                        hh, hw = 1 - lh, 1 - lw

                        def pixel(i, j):
                            if 0 <= i <= H - 1 and 0 <= j <= W - 1:
                                return v[n][starts[l] + i * W + j][m]
                            return [0.0] * D

                        v1, v2 = pixel(h_low, w_low), pixel(h_low, w_low + 1)
                        v3, v4 = pixel(h_low + 1, w_low), pixel(h_low + 1, w_low + 1)
                        a = attn[n][q][m][l][p]
                        for d in range(D):
                            val = hh * hw * v1[d] + hh * lw * v2[d] + lh * hw * v3[d] + lh * lw * v4[d]
                            col[d] += val * a
                out[n, q, m] = torch.tensor(col, dtype=torch.float64)
    return out.view(N, Lq, M * D)


def strided_copies(value, shapes, starts, loc, attn):
    """The same inputs as non-contiguous views."""
    return [
        value.transpose(1, 2).contiguous().transpose(1, 2),  # stored as (N, M, S, D)
        shapes.t().contiguous().t(),  # column-major
        torch.stack([starts, starts], -1)[:, 0],  # stride 2
        torch.cat([-loc, loc], -1)[..., 2:],  # every other pair of a wider tensor
        attn.transpose(-1, -2).contiguous().transpose(-1, -2),
    ]


def stand_in_hopper_interface(monkeypatch, **entry_points) -> types.ModuleType:
    """Put a module with these entry points where the op imports cute_deform.hopper.interface from (package and
    module in sys.modules; monkeypatch undoes it), for tests of the ops' CUDA paths on machines without the kernel."""
    interface = types.ModuleType("cute_deform.hopper.interface")
    for name, function in entry_points.items():
        setattr(interface, name, function)
    package = types.ModuleType("cute_deform.hopper")
    package.interface = interface
    monkeypatch.setitem(sys.modules, "cute_deform.hopper", package)
    monkeypatch.setitem(sys.modules, "cute_deform.hopper.interface", interface)
    return interface


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def draw_nonzero(draw, reference, tries: int = 50):
    """(args, reference(*args)) for the first args = draw() whose reference is not all zero. A small random
    problem can have every sample outside its level; its output is then zero, and ||out - ref|| / ||ref||
    is 0/0, a comparison of nothing."""
    for _ in range(tries):
        args = draw()
        ref = reference(*args)
        if ref.double().norm() > 0:
            return args, ref
    raise AssertionError(f"{tries} draws of inputs all gave a zero reference")


def fused_inputs(gen, levels, *, batch=2, queries=5, heads=3, head_dim=4, points=2, ref_dims=2):
    """Random inputs of the fused op, in float64: reference points (x, y) in [-0.1, 1.1] (boxes with
    sizes in (0, 0.5]), offsets of a few pixels (box units for boxes), logits N(0, 2)."""
    value, shapes, starts, _, _ = make_inputs(gen, levels, batch=batch, queries=1, heads=heads, head_dim=head_dim,
                                              points=points)
    L = len(levels)
    ref = -0.1 + 1.2 * torch.rand((batch, queries, L, ref_dims), generator=gen, dtype=torch.float64)
    if ref_dims == 4:
        ref[..., 2:] = 0.5 * torch.rand((batch, queries, L, 2), generator=gen, dtype=torch.float64) + 1e-3
    offsets = 3.0 * torch.randn((batch, queries, heads, L, points, 2), generator=gen, dtype=torch.float64)
    logits = 2.0 * torch.randn((batch, queries, heads, L, points), generator=gen, dtype=torch.float64)
    return value, shapes, starts, ref, offsets, logits


def fused_sampling(spatial_shapes, reference_points, sampling_offsets, attention_logits):
    """Deformable DETR's module, in float64: locations from reference points and offsets, and the
    softmax of the logits over levels and points."""
    N, Lq, M, L, P, _ = sampling_offsets.shape
    ref = reference_points.double()[:, :, None, :, None, :]
    offsets = sampling_offsets.double()
    if reference_points.shape[-1] == 2:
        size = spatial_shapes.flip(-1).to(device=offsets.device, dtype=torch.float64)  # (W, H)
        locations = ref + offsets / size[None, None, None, :, None, :]
    else:
        locations = ref[..., :2] + offsets / P * ref[..., 2:] * 0.5
    weights = attention_logits.double().reshape(N, Lq, M, L * P).softmax(-1).view(N, Lq, M, L, P)
    return locations, weights


def fused_reference(value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits):
    """The fused op's result in float64."""
    locations, weights = fused_sampling(spatial_shapes, reference_points, sampling_offsets, attention_logits)
    return ms_deform_attn_reference_f64(value, spatial_shapes, level_start_index, locations, weights)


def ms_deform_attn_reference_f64(*args):
    from cute_deform import ms_deform_attn_reference

    return ms_deform_attn_reference(*args, out_dtype=torch.float64)


# --- Hardening tests (tests/test_hardening*.py): non-finite aware comparison, GPU poisoning, and
# docs/bad_inputs.md, whose sections are generated and checked by different tests.


def nonfinite_mismatch(out: torch.Tensor, ref: torch.Tensor, *, same_kinds: bool = True,
                       nan_at: torch.Tensor | None = None) -> str | None:
    """None when out is non-finite exactly where ref is; else what differs.

    same_kinds: also NaN where ref is NaN and the same signed inf where ref is inf. Without it, out must
    be NaN at nan_at (by default wherever ref is NaN), and elsewhere may be NaN or either inf where ref is
    not finite. Half-precision arithmetic decides the kind there: with fp16/bf16 value the Hopper kernel
    sums the four corners in half precision, where a bilinear weight below half's range is 0 (0 * inf is
    NaN where the original's tiny weight * inf is inf), and a corner sum within half's rounding of zero
    may take either sign (an inf weight then gives the opposite inf, and two inf weights whose products
    cancel to NaN in float64 may add up to one inf). Callers pass as nan_at the outputs that NaN inputs
    reach: where a reference with the inf weights set to 0 is NaN."""
    out, ref = out.double(), ref.double()
    finite_out, finite_ref = torch.isfinite(out), torch.isfinite(ref)
    if not torch.equal(finite_out, finite_ref):
        return (f"{int((finite_out & ~finite_ref).sum())} outputs finite where the reference is not, "
                f"{int((~finite_out & finite_ref).sum())} non-finite where the reference is finite")
    if same_kinds or nan_at is None:
        nan_at = torch.isnan(ref)
    if not torch.isnan(out[nan_at]).all():
        return "an output is +-inf where it must be NaN"
    infinite = torch.isinf(ref)
    if same_kinds and not torch.equal(out[infinite], ref[infinite]):
        return "an output is NaN or the opposite inf where the reference is +-inf"
    return None


REFERENCE, EMPTY, ZEROS, ACCEPTED = "reference", "empty", "zeros", "accepted"


def case_outcome(run, args: dict, reference, tolerance: float, what: str) -> tuple[str, str]:
    """(kind, outcome) of one bad or hostile input for the tables of docs/bad_inputs.md: kind is the
    exception's type name, or ACCEPTED / EMPTY / ZEROS / REFERENCE / "differs" for how run(args)'s output
    compares with reference() (named `what` in the outcome text)."""
    try:
        out = run(args)
    except Exception as exc:
        return type(exc).__name__, f"`{first_line(exc)}`"
    if out is None:
        return ACCEPTED, "accepted"
    if out.device.type == "meta":
        return ACCEPTED, f"no error on the host: output of shape {tuple(out.shape)} on meta (no data, no check)"
    if out.numel() == 0:
        return EMPTY, f"empty output of shape {tuple(out.shape)}"
    ref = reference()
    if out.shape != ref.shape:
        return "differs", f"output shape {tuple(out.shape)}, the reference's {tuple(ref.shape)}"
    mismatch = nonfinite_mismatch(out, ref)
    if mismatch:
        return "differs", f"differs from the {what}: {mismatch}"
    err = finite_rel_err(out, ref)
    if err >= tolerance:
        return "differs", f"differs from the {what}: rel err {err:.1e}"
    if not ref.any() and not out.any():
        return ZEROS, f"all-zero output, as the {what} (an empty sum)"
    nonfinite = int((~torch.isfinite(out)).sum())
    if nonfinite:
        return REFERENCE, (f"matches the {what}: the same {nonfinite} of {out.numel()} outputs "
                           f"NaN/inf, rel err < {tolerance:.0e} on the rest")
    return REFERENCE, f"equals the {what} (rel err < {tolerance:.0e})"


def finite_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """rel_err over the entries where the reference is finite (0.0 when that part of ref is 0)."""
    keep = torch.isfinite(ref)
    out, ref = out[keep].double(), ref[keep].double()
    if ref.norm() == 0:
        return 0.0 if out.norm() == 0 else math.inf
    return rel_err(out, ref)


def output_on_nan(run, attempts: int = 4) -> torch.Tensor:
    """The output of run(), a call that allocates its output, written over memory filled with NaN: an element the
    kernel forgets to write comes back as NaN, never as a right answer an earlier call left in a reused block.
    scripts/compare.py's run_poisoned does the work (it retries until the output lands on a block it poisoned);
    this fails the test where it never does. Without torch's caching allocator (PYTORCH_NO_CUDA_MEMORY_CACHING=1, the
    compute-sanitizer runs of scripts/gpu_all.sh) a freed block goes back to the driver and nothing can be poisoned:
    there the call runs once, unpoisoned."""
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        return run()
    out, poisoned = compare.run_poisoned(run, attempts)
    assert poisoned, "the output never landed on a block filled with NaN: its unwritten elements would pass unseen"
    return out


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


BAD_INPUTS_DOC = Path(__file__).resolve().parent.parent / "docs" / "bad_inputs.md"
# Each section belongs to one test, which (re)writes it with CUTE_DEFORM_WRITE_DOCS=1 and otherwise
# checks it; a test never looks at another's section, so CPU CI checks only the CPU one.
DOC_SECTIONS = {
    "cpu": "CUTE_DEFORM_WRITE_DOCS=1 python -m pytest -q tests/test_hardening.py",
    "gpu": "CUTE_DEFORM_WRITE_DOCS=1 python -m pytest -q tests/test_hardening_gpu.py  # on an sm_90 GPU",
    "fused-cpu": "CUTE_DEFORM_WRITE_DOCS=1 python -m pytest -q tests/test_fused_hardening.py",
}
DOC_HEADER = """\
# Bad and hostile inputs

Every bad or hostile input tried against `torch.ops.cute_deform.forward` and
`torch.ops.cute_deform.forward_fused` (last section), and what happened. This file is generated:
each section is written by the test named in it when `CUTE_DEFORM_WRITE_DOCS=1`, and compared with
what that test observes otherwise, so it stays true. Do not edit it by hand.

- **where checked**: `host` is Python before any launch (`cute_deform/_checks.py`), on every path,
  torch.compile's fake tensors included; `host, CPU level table` reads spatial_shapes /
  level_start_index, so it runs only when spatial_shapes lives on the CPU (reading a GPU tensor
  would be a host sync); `host (dispatcher, op schema)` is torch's check of the op's schema before any of
  cute_deform's code runs: a RuntimeError naming the argument for anything but a tensor or None (the
  drop-in function and the reference functions raise a TypeError there, and None reaches the op's own
  checks); `device: sampling rule` needs no check: the original kernel's rule (a sample outside
  (-1, H) x (-1, W), NaN included, adds 0 and ignores its weight) decides, on every path;
  `device: checked_level` is the kernels' own check of GPU-resident level tables.
- **outcome**: the exception with the first line of its message, or how the output compares with
  `cute_deform.ms_deform_attn_reference(..., out_dtype=torch.float64)`; rel err is
  ||out - ref|| / ||ref|| over the finite entries, given as the bound the test asserts.
"""


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- BEGIN {name} section: generated by `{DOC_SECTIONS[name]}` -->", f"<!-- END {name} section -->"


def _placeholder(name: str) -> str:
    return f"Not generated yet: run `{DOC_SECTIONS[name]}`.\n"


def doc_sections(text: str) -> dict[str, str]:
    """The body of every section found in the file's text (missing ones are left out)."""
    found = {}
    for name in DOC_SECTIONS:
        begin, end = _markers(name)
        if begin in text and end in text.split(begin, 1)[1]:
            found[name] = text.split(begin, 1)[1].split(end, 1)[0].strip("\n") + "\n"
    return found


def render_doc(sections: dict[str, str]) -> str:
    parts = [DOC_HEADER]
    for name in DOC_SECTIONS:
        begin, end = _markers(name)
        parts.append(f"{begin}\n{sections.get(name) or _placeholder(name)}{end}\n")
    return "\n".join(parts)


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def case_table(cases: dict, run_case, seed: int) -> str:
    """The (input, where checked, outcome) table of a hardening file's cases, each run on inputs drawn
    from `seed` (fixed, so the table does not change from run to run)."""
    rows = []
    for case_id, case in cases.items():
        _, outcome = run_case(torch.Generator().manual_seed(seed), case_id)
        rows.append((case.input, case.where, outcome))
    return markdown_table(("input", "where checked", "outcome"), rows)


def sizes_text(sizes: dict) -> str:
    """make_inputs-style sizes as the tables name them: N=.., Lq=.., M=.., D=.., P=..."""
    return ", ".join(f"{k}={v}" for k, v in dict(N=sizes["batch"], Lq=sizes["queries"], M=sizes["heads"],
                                                 D=sizes["head_dim"], P=sizes["points"]).items())


def check_or_write_doc_section(name: str, body: str, *, path: Path = BAD_INPUTS_DOC, write: bool | None = None) -> None:
    """Write section `name` of the doc (keeping the others as they are) when CUTE_DEFORM_WRITE_DOCS=1,
    else assert that the file is exactly what writing would give."""
    if write is None:
        write = os.environ.get("CUTE_DEFORM_WRITE_DOCS") == "1"
    current = path.read_text() if path.exists() else ""
    sections = doc_sections(current)
    sections[name] = body
    expected = render_doc(sections)
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(expected)
        return
    if current != expected:
        diff = "".join(difflib.unified_diff(current.splitlines(True), expected.splitlines(True), str(path), "observed"))
        raise AssertionError(f"{path} ({name} section) differs from what the test observes; if the change is "
                             f"intended, regenerate it with `{DOC_SECTIONS[name]}`:\n{diff[:6000]}")


# --- The fused op (tests/test_fused*.py, tests/test_nn.py): reference points, raw offsets and logits.


def make_fused_inputs(gen, levels, *, batch=2, queries=5, heads=3, head_dim=4, points=2, ref_dim=2,
                      dtype=torch.float64, ref_dtype=None, offset_dtype=None, logit_dtype=None, spread=2.0):
    """Random inputs of torch.ops.cute_deform.forward_fused: reference points in [0, 1] (boxes of size
    0.05..0.65), offsets ~ N(0, spread^2) pixels (2-d) or box units (4-d), so some samples land outside
    their level; logits ~ N(0, 4)."""
    shapes, starts = level_tensors(levels)
    num_keys = int(shapes.prod(-1).sum())
    L = len(levels)

    def randn(*size):
        return torch.randn(size, generator=gen, dtype=torch.float64)

    def rand(*size):
        return torch.rand(size, generator=gen, dtype=torch.float64)

    value = randn(batch, num_keys, heads, head_dim).to(dtype)
    if ref_dim == 2:
        ref = rand(batch, queries, L, 2)
    else:
        ref = torch.cat([rand(batch, queries, L, 2), 0.05 + 0.6 * rand(batch, queries, L, 2)], -1)
    offsets = spread * randn(batch, queries, heads, L, points, 2)
    logits = 2 * randn(batch, queries, heads, L, points)
    return (value, shapes, starts, ref.to(ref_dtype or dtype), offsets.to(offset_dtype or dtype),
            logits.to(logit_dtype or dtype))


def unfused_locations_and_weights(spatial_shapes, reference_points, sampling_offsets, attention_logits):
    """Deformable DETR's module formula in float64, written per level and axis (independently of
    cute_deform.reference.fused_sampling_inputs); the softmax as exp(x - max) / sum."""
    ref = reference_points.double()
    offsets = sampling_offsets.double()
    N, Lq, M, L, P, _ = offsets.shape
    locations = torch.empty_like(offsets)
    for level, (height, width) in enumerate(spatial_shapes.tolist()):
        for axis, size in ((0, width), (1, height)):
            centre = ref[:, :, None, level, None, axis]  # (N, Lq, 1, 1)
            offset = offsets[:, :, :, level, :, axis]
            if ref.shape[-1] == 2:  # offsets in pixels of this level
                locations[:, :, :, level, :, axis] = centre + offset / size
            else:  # P offsets span half the box
                box = ref[:, :, None, level, None, 2 + axis]
                locations[:, :, :, level, :, axis] = centre + offset / P * box * 0.5
    logits = attention_logits.double().reshape(N, Lq, M, L * P)
    weights = torch.exp(logits - logits.amax(-1, keepdim=True))
    weights = (weights / weights.sum(-1, keepdim=True)).reshape(N, Lq, M, L, P)
    return locations, weights
