"""benchmarks/gather_ceiling.py on the CPU: the load-only kernel's coordinates from compare.py's real
locations, its XOR reference and its DRAM floor's row count."""
import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
import compare  # noqa: E402
import gather_ceiling  # noqa: E402


def _preset(name, N=1, Lq=300):
    shape = compare.selected_shapes(compare.parse_args(["--presets", name]))[0]
    return dataclasses.replace(shape, N=N, Lq=Lq)


@pytest.mark.parametrize("name", ["detr-decoder-ref", "detr-encoder-init", "seed-b48-shuffled"])
def test_touched_rows_match_compare(name):
    """The rows the load-only kernel's corners read are the rows compare.py's floor counts, outside and
    NaN samples included."""
    shape = _preset(name, N=2)
    (value, _, _, loc, _), _ = compare.make_inputs(shape, torch.float16, torch.Generator().manual_seed(3), device="cpu")
    loc = loc.clone()
    loc[0, :5, 0, 0, 0] = float("nan")
    loc[1, :5, 1, 1, 1] = torch.tensor([1.3, -0.4])
    coords = gather_ceiling.coords_from_locations(loc, shape.levels)
    _, touched = gather_ceiling.reference_xor(value, coords, shape.N, shape.Lq, shape.P, shape.levels)
    assert touched == compare.touched_value_rows(shape, loc)
    assert 0 < touched < shape.N * shape.S * shape.M


def test_outside_samples_load_nothing():
    levels = [(4, 6)] * gather_ceiling.L
    loc = torch.full((1, 1, gather_ceiling.M, gather_ceiling.L, 2, 2), 0.5)
    loc[..., 1, :] = torch.tensor([-0.2, 0.5])  # w = -1.7 < -1: skipped
    coords = gather_ceiling.coords_from_locations(loc, levels).view(1, 1, gather_ceiling.M, gather_ceiling.L, 2)
    assert (coords[..., 1] == ((-2 << 16) | (-2 & 0xFFFF))).all()
    x0, y0 = gather_ceiling.unpack(coords[..., 0])
    assert (x0 == 2).all() and (y0 == 1).all()  # w = 2.5, h = 1.5


def test_dry_run_checks_its_reference():
    """--dry compares the XOR reference with a brute-force gather for every pattern."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gather_ceiling.py"), "--dry", "--presets",
                          "detr-decoder,detr-decoder-ref", "--patterns", "local,uniform,preset"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("dry ")]
    assert len(lines) == 4, out.stdout  # detr-decoder-ref is compare.py's only: the preset pattern alone
    assert all(" OK;" in line for line in lines), out.stdout


def test_skipped_levels_read_no_rows():
    """--gather-levels K: the samples of levels K.. read no row of value, so the load-only time is the gathers of
    the first K levels alone (the time of a kernel that stages the others, less its staging)."""
    shape = _preset("decoder-b16", N=2)
    (value, _, _, loc, _), _ = compare.make_inputs(shape, torch.float16, torch.Generator().manual_seed(5), device="cpu")
    coords = gather_ceiling.coords_from_locations(loc, shape.levels)
    args = (shape.N, shape.Lq, shape.P, shape.levels)
    _, touched_all = gather_ceiling.reference_xor(value, coords, *args)
    kept = torch.zeros_like(value)
    first = shape.levels[0][0] * shape.levels[0][1] + shape.levels[1][0] * shape.levels[1][1]
    kept[:, :first] = value[:, :first]  # the rows of levels 2.. zeroed: their XOR must not change the answer
    fine_loc = loc.clone()
    fine_loc[:, :, :, 2:] = float("nan")  # the original kernel's rule: nothing read
    _, touched_fine = gather_ceiling.reference_xor(value, gather_ceiling.coords_from_locations(fine_loc, shape.levels),
                                                   *args)
    gather_ceiling.skip_levels(coords, shape.N, shape.Lq, shape.P, 2)
    ref, touched = gather_ceiling.reference_xor(value, coords, *args)
    assert touched == touched_fine < touched_all
    assert ref == gather_ceiling.reference_xor(kept, coords, *args)[0]


def test_bulk_bytes_are_what_a_staging_kernel_moves_besides_its_gathers():
    """--bulk: the levels past the gathered ones whole (all heads, fp16), 8 of the 12 input bytes a sample (the
    kernel reads the other 4 as packed coordinates) and the fp16 output."""
    shape = _preset("decoder-b16", N=16, Lq=300)
    read, written = gather_ceiling.bulk_bytes(shape, 2)
    coarse = 16 * (25 * 42 + 13 * 21) * 8 * 32 * 2
    samples = 16 * 300 * 8 * 4 * 4
    assert read == coarse + 8 * samples
    assert written == 16 * 300 * 8 * 32 * 2
    assert shape.floor_bytes(2, 0) == written + 12 * samples  # the floor's inputs and output, no value rows
    assert gather_ceiling.bulk_bytes(shape, 4)[0] == 8 * samples  # nothing staged: the inputs only


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_load_only_kernels_build_with_their_bulk_forms(tmp_path):
    """The .cu builds for sm_90a with every LDG kernel in its four forms (no bulk work, bulk reads after the
    gathers, four words a lane ahead of them, TMA bulk copies), and the level-pass kernel in its two."""
    cubin = tmp_path / "gc.cubin"
    out = subprocess.run([shutil.which("nvcc"), "-std=c++17", "-O3", "-cubin", "-arch=sm_90a", "-o", str(cubin),
                          str(ROOT / "benchmarks" / "gather_ceiling.cu")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    elf = cubin.read_bytes()  # the kernels' mangled names are in its symbol table
    for bk in (0, 1, 2, 3):
        assert f"_Z10ldg_kernelILi4ELi4ELi4ELi0ELi{bk}EEv".encode() in elf
    # --level-major's kernel (items gathered one level a pass), without bulk work and with the bulk four words ahead
    for tpq in (4, 8, 16):
        for bk in (0, 2):
            assert f"_Z16ldg_level_kernelILi4ELi{tpq}ELi4ELi{bk}EEv".encode() in elf


def test_sorted_samples_read_the_same_rows_in_address_order():
    """--sort-samples: each (image, head, level)'s samples go to its queries in address order, with the same rows
    read as often as before (the same XOR and touched rows)."""
    shape = _preset("decoder-b16", N=2, Lq=50)
    (value, _, _, loc, _), _ = compare.make_inputs(shape, torch.float16, torch.Generator().manual_seed(9), device="cpu")
    coords = gather_ceiling.coords_from_locations(loc, shape.levels)
    args = (shape.N, shape.Lq, shape.P, shape.levels)
    before = gather_ceiling.reference_xor(value, coords, *args)
    dealt = coords.clone()
    gather_ceiling.sort_samples(dealt, *args)
    assert gather_ceiling.reference_xor(value, dealt, *args) == before
    c = dealt.view(shape.N, shape.Lq, gather_ceiling.M, gather_ceiling.L, shape.P)
    for level, (H, W) in enumerate(shape.levels):
        s = c[1, :, 3, level, :].reshape(-1)  # image 1, head 3: its samples in (q, p) order
        address = gather_ceiling.address_key(s, W)
        assert (address[1:] >= address[:-1]).all()
    assert not torch.equal(dealt, coords)


def test_samples_sorted_across_heads_go_heads_fastest():
    """--sort-samples heads: each (image, level)'s samples of all heads, in address order, dealt heads fastest (the
    same samples, each image and level a permutation of its own), so a query's point holds neighbouring samples in
    its eight heads and the next point the next ones."""
    shape = _preset("decoder-b16", N=2, Lq=50)
    (_, _, _, loc, _), _ = compare.make_inputs(shape, torch.float16, torch.Generator().manual_seed(5), device="cpu")
    coords = gather_ceiling.coords_from_locations(loc, shape.levels)
    dealt = coords.clone()
    gather_ceiling.sort_samples_across_heads(dealt, shape.N, shape.Lq, shape.P, shape.levels)
    M, L = gather_ceiling.M, gather_ceiling.L
    before = coords.view(shape.N, shape.Lq, M, L, shape.P)
    after = dealt.view(shape.N, shape.Lq, M, L, shape.P)
    for n in range(shape.N):
        for level, (H, W) in enumerate(shape.levels):
            assert torch.equal(before[n, :, :, level].reshape(-1).sort().values,
                               after[n, :, :, level].reshape(-1).sort().values)
            s = after[n, :, :, level, :].permute(0, 2, 1).reshape(-1)  # (q, p, m): heads fastest
            address = gather_ceiling.address_key(s, W)
            assert (address[1:] >= address[:-1]).all()
