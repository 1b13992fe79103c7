"""Build and call the CUDA C++ baselines in kernels/ (classic, vec, tile2x2, tma, distributed, microbenchmarks).

The extension is built with torch.utils.cpp_extension.load for sm_90a and cached under build/msda_baselines
(ignored by git); a second call reuses it. Also holds the float64 reference used by compare.py and microbench.py.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "kernels"
BUILD_DIR = REPO / "build" / "msda_baselines"
NVCC_FLAGS = ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo"]  # -std comes from torch

# Implementations backed by kernels/ (cute and grid_sample live in compare.py).
KERNEL_IMPLS = ("classic", "vec", "tile2x2", "tma", "distributed")

_ext = None


def sources() -> list[Path]:
    return sorted(KERNELS.glob("*.cu")) + [KERNELS / "bindings.cpp"]


def build(verbose: bool = False, progress: bool = True):
    """Compile (or load from the cache) the baselines extension; shows a tqdm timer while nvcc runs."""
    global _ext
    if _ext is not None:
        return _ext
    from torch.utils.cpp_extension import load

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    result: dict = {}

    def work():
        try:
            result["ext"] = load(
                name="msda_baselines",
                sources=[str(s) for s in sources()],
                extra_cflags=["-O3"],
                extra_cuda_cflags=NVCC_FLAGS,
                extra_include_paths=[str(KERNELS)],
                build_directory=str(BUILD_DIR),
                verbose=verbose,
            )
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=work, daemon=True)
    start = time.time()
    thread.start()
    if progress:
        from tqdm import tqdm

        with tqdm(desc="building kernels/ (sm_90a)", unit="s", bar_format="{desc}: {elapsed}", file=sys.stderr,
                  mininterval=5) as bar:
            while thread.is_alive():
                thread.join(1.0)
                bar.update(1)
    thread.join()
    if "error" in result:
        raise result["error"]
    _ext = result["ext"]
    _ext.build_seconds = time.time() - start
    return _ext


def stream_handle() -> int:
    return torch.cuda.current_stream().cuda_stream


def host_levels(spatial_shapes: torch.Tensor, level_start_index: torch.Tensor) -> tuple[list[int], list[int]]:
    """Host copies of the level table: the tma and distributed baselines size their launch from it."""
    return [int(v) for v in spatial_shapes.cpu().flatten()], [int(v) for v in level_start_index.cpu()]


def launcher(ext, impl: str, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
             cluster_size: int = 0):
    """Returns run(out) that launches the named baseline into out (N, Lq, M*D) of value's dtype."""
    args = (value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    if impl in ("classic", "vec", "tile2x2"):
        fn = getattr(ext, impl)
        return lambda out: fn(*args, out, stream_handle())
    shapes, starts = host_levels(spatial_shapes, level_start_index)  # read once, outside the timed call
    if impl == "tma":
        return lambda out: ext.tma(*args, out, shapes, starts, stream_handle())
    if impl == "distributed":
        return lambda out: ext.distributed(*args, out, shapes, starts, cluster_size, stream_handle())
    raise ValueError(f"unknown baseline {impl!r}")


# ---------------------------------------------------------------------------------------------------------------
# float64 reference


def grid_sample_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                        compute_dtype=torch.float64):
    """MSDA forward through F.grid_sample (bilinear, zeros, align_corners=False), which equals the original
    kernel's rule for finite locations. Returns (N, Lq, M*D) in compute_dtype."""
    N, S, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    grids = 2 * sampling_locations.to(compute_dtype) - 1
    out = torch.zeros(N * M, D, Lq, dtype=compute_dtype, device=value.device)
    for level, ((H, W), start) in enumerate(zip(spatial_shapes.tolist(), level_start_index.tolist())):
        v = value[:, start:start + H * W].to(compute_dtype)
        v = v.reshape(N, H, W, M, D).permute(0, 3, 4, 1, 2).reshape(N * M, D, H, W)
        g = grids[:, :, :, level].permute(0, 2, 1, 3, 4).reshape(N * M, Lq, P, 2)
        sampled = F.grid_sample(v, g, mode="bilinear", padding_mode="zeros", align_corners=False)  # (N*M, D, Lq, P)
        a = attention_weights[:, :, :, level].permute(0, 2, 1, 3).reshape(N * M, 1, Lq, P).to(compute_dtype)
        out += (sampled * a).sum(-1)
        del sampled
    return out.view(N, M, D, Lq).permute(0, 3, 1, 2).reshape(N, Lq, M * D)


def package_reference():
    """cute_deform.reference.ms_deform_attn_reference, or None while the package does not have it."""
    sys.path.insert(0, str(REPO))
    try:
        from cute_deform.reference import ms_deform_attn_reference
    except Exception:
        return None
    return ms_deform_attn_reference


def reference_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """float64 reference output and where it came from. The package's reference is used when it exists; else the
    grid_sample form above (with a note)."""
    ref_fn = package_reference()
    if ref_fn is not None:
        out = ref_fn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                     compute_dtype=torch.float64, out_dtype=torch.float64)
        return out, "cute_deform.reference"
    out = grid_sample_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return out, "grid_sample float64 (cute_deform.reference not importable)"


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/inf anywhere gives inf."""
    out64 = out.to(torch.float64).reshape(ref.shape)
    if not torch.isfinite(out64).all():
        return float("inf")
    return (torch.linalg.vector_norm(out64 - ref) / torch.linalg.vector_norm(ref)).item()


ERROR_BOUND = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}

if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build the CUDA C++ baselines of kernels/ for sm_90a (cached under "
                                     "build/msda_baselines; needs nvcc).")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args()
    ext = build(verbose=args.verbose)
    print(f"built {ext.__file__} in {ext.build_seconds:.1f} s")
