"""Peer implementations built from their own sources on the GPU machine, for compare.py.

DCNv4's `flash_deform_attn` forward (the fastest public MSDA kernel we know), from the DCNv4==1.0.0.post2
source distribution: point --dcnv4-src (or $DCNV4_SRC) at the extracted sdist. Nothing of it is kept in
this repository. Only its forward is built (with torch.utils.cpp_extension, for sm_90a), from a copy
under build/dcnv4 with the changes current torch needs:
    x.type().is_cuda() -> x.is_cuda(),  x.data<T>() -> x.data_ptr<T>(),  THC/THCAtomics.cuh -> ATen/cuda/Atomic.cuh
Only the forward is compiled, for fp16 and bf16 value (its backward and its fp32/fp64 instantiations took
most of the 369 s the whole file took on the H100). It takes one packed input per (query, head),
[L*P (x, y), L*P logits] in value's dtype, and applies the softmax itself; its block shape comes from
the rule of its Python wrapper (findspec).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BUILD_DIR = REPO / "build" / "dcnv4"

HALF_ONLY = r"""
#undef AT_DISPATCH_FLOATING_TYPES_AND2
#define AT_DISPATCH_FLOATING_TYPES_AND2(T1, T2, TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(T1, __VA_ARGS__) AT_DISPATCH_CASE(T2, __VA_ARGS__))
"""
BINDING = r"""
#include <torch/extension.h>
at::Tensor flash_deform_attn_cuda_forward(const at::Tensor &value, const at::Tensor &spatial_shapes,
    const at::Tensor &level_start_index, const at::Tensor &sampling_loc_attn, const int im2col_step,
    const int K, const int d_stride, const int block_thread);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("forward", &flash_deform_attn_cuda_forward); }
"""


def dcnv4_source(explicit: str | None) -> Path | None:
    src = explicit or os.environ.get("DCNV4_SRC") or str(REPO / ".peers" / "DCNv4-1.0.0.post2")
    path = Path(src)
    return path if (path / "src" / "cuda" / "flash_deform_attn_cuda.cu").is_file() else None


def build_dcnv4(src: Path, verbose: bool = False):
    """The forward of DCNv4's flash_deform_attn as an extension (cached under build/dcnv4)."""
    from torch.utils.cpp_extension import load

    work = BUILD_DIR / "cuda"  # its sources include "cuda/..."
    sources = {}
    for path in (src / "src" / "cuda").glob("*"):
        text = path.read_text()
        text = text.replace(".type().is_cuda()", ".is_cuda()").replace("THC/THCAtomics.cuh", "ATen/cuda/Atomic.cuh")
        sources[path.name] = re.sub(r"\.data<(\w+)>\(\)", r".data_ptr<\1>()", text)
    # Build time (369 s on the H100 for the whole file): keep only the forward, for fp16 and bf16.
    text = sources["flash_deform_attn_cuda.cu"]
    text = text.split("std::vector<at::Tensor>\nflash_deform_attn_cuda_backward(")[0]
    text = text.replace('#include "cuda/flash_deform_col2im_cuda.cuh"\n', "")
    sources["flash_deform_attn_cuda.cu"] = text.replace("#include <torch/torch.h>\n", "#include <torch/torch.h>\n" + HALF_ONLY, 1)
    sources["binding.cpp"] = BINDING
    work.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():  # unchanged files keep their times: a second call reuses the build
        path = work / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
    return load(name="dcnv4_forward", sources=[str(work / "flash_deform_attn_cuda.cu"), str(work / "binding.cpp")],
                extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], extra_include_paths=[str(BUILD_DIR)],
                build_directory=str(BUILD_DIR), verbose=verbose)


def _findspec(B: int, Q: int, G: int, C: int) -> tuple[int, int]:
    """DCNv4's launch shape rule: 8 channels a thread, up to 64 queries and 512 threads a block."""
    d_stride = 8
    multiplier = 1
    for m in range(1, B * Q + 1):
        if (B * Q) % m == 0 and m <= 64 and m * G * C // d_stride <= 512:
            multiplier = m
    return d_stride, multiplier * G * C // d_stride


def dcnv4_launcher(ext, value, spatial_shapes, level_start_index, sampling_locations, logits):
    """run() for DCNv4 on our inputs: locations and logits packed into its input in value's dtype."""
    N, Lq, M, L, P, _ = sampling_locations.shape
    packed = torch.cat([sampling_locations.reshape(N, Lq, M, L * P * 2), logits.reshape(N, Lq, M, L * P)], -1)
    packed = packed.to(value.dtype).contiguous()
    d_stride, threads = _findspec(N, Lq, M, value.shape[3])
    return (lambda: ext.forward(value, spatial_shapes, level_start_index, packed, 64, P, d_stride, threads)), packed


def dcnv4_inputs_as_seen(sampling_locations, logits, dtype):
    """The locations and softmax weights DCNv4 computes with: its packed inputs are rounded to value's dtype."""
    loc = sampling_locations.to(dtype).float()
    N, Lq, M, L, P, _ = sampling_locations.shape
    weights = logits.to(dtype).float().reshape(N, Lq, M, L * P).softmax(-1).view(N, Lq, M, L, P)
    return loc, weights


if __name__ == "__main__":
    import argparse
    import sys
    import time

    parser = argparse.ArgumentParser(description="Build DCNv4's forward from its sdist for compare.py's dcnv4 peer "
                                     "(cached under build/dcnv4).")
    parser.add_argument("src", nargs="?", help="the extracted DCNv4==1.0.0.post2 sdist (default: $DCNV4_SRC, "
                        "then .peers/)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args()
    src = dcnv4_source(args.src)
    if src is None:
        sys.exit("no DCNv4 source: pass the extracted DCNv4==1.0.0.post2 sdist, set $DCNV4_SRC, or unpack it "
                 "into .peers/")
    t0 = time.time()
    ext = build_dcnv4(src, verbose=args.verbose)
    print(f"built {ext.__file__} in {time.time() - t0:.1f} s")
