#!/usr/bin/env bash
# Compile check of the CUDA C++ baselines in kernels/ for sm_90a, for a CPU-only CI (no GPU needed).
#  1. every kernels/*.cu with nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -c, under the flags that
#     torch.utils.cpp_extension adds (no implicit half/bf16 conversions), plus its PTX for a few instruction checks;
#  2. kernels/bindings.cpp against the installed torch's headers (the .cu files include no torch header, and
#     bindings.cpp includes only torch/extension.h, so a CPU-only torch wheel is enough).
# Exits non-zero on any failure. Without nvcc it says so and skips step 1.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
JOBS=$(nproc 2>/dev/null || echo 2)
FLAGS=(-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Ikernels
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
       -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr -Xcompiler -fPIC)
failed=0

if [ -x "$NVCC" ]; then
    echo "check_kernels: $("$NVCC" --version | tail -1)"
    export NVCC OUT
    export FLAGS_STR="${FLAGS[*]}"
    # shellcheck disable=SC2016
    if ! ls kernels/*.cu | xargs -P "$JOBS" -I{} bash -c '
        f={}; b=$(basename "$f" .cu)
        if "$NVCC" $FLAGS_STR -c "$f" -o "$OUT/$b.o" 2>"$OUT/$b.log" &&
           "$NVCC" $FLAGS_STR -ptx -gencode=arch=compute_90a,code=compute_90a "$f" -o "$OUT/$b.ptx" 2>>"$OUT/$b.log"; then
            echo "  ok      $f"
        else
            echo "  FAILED  $f"; cat "$OUT/$b.log"; exit 255
        fi'; then
        failed=1
    fi
    # The designs must keep their defining instructions.
    expect() {  # file pattern what
        if [ -f "$OUT/$1.ptx" ] && ! grep -q -- "$2" "$OUT/$1.ptx"; then
            echo "  FAILED  kernels/$1.cu: PTX lacks $3 ($2)"; failed=1
        fi
    }
    expect msda_tma "cp.async.bulk.tensor.5d" "TMA box loads"
    expect msda_tma "mbarrier.try_wait.parity" "mbarrier waits"
    expect msda_distributed "mapa" "distributed shared memory mapping"
    expect msda_distributed "barrier.cluster.arrive" "cluster barriers"
    expect msda_vec "ld.global.nc.v4" "16-byte loads"
    expect microbench "cp.async.bulk.tensor.5d" "TMA box loads"
    expect microbench "cp.async.cg.shared.global" "memcpy_async (cp.async)"
else
    echo "check_kernels: SKIPPED the .cu compile: nvcc not found (set NVCC=...)"
fi

# The torch binding, against the installed torch's headers.
if "$PYTHON" -c "import torch" 2>/dev/null; then
    read -r TORCH_INC PY_INC STD < <("$PYTHON" - <<'EOF'
import sysconfig, torch
from torch.utils.cpp_extension import include_paths
major, minor = (int(v) for v in torch.__version__.split(".")[:2])
std = "c++20" if (major, minor) >= (2, 10) else "c++17"  # what cpp_extension passes for this torch
print(include_paths()[0], sysconfig.get_paths()["include"], std)
EOF
)
    if ${CXX:-g++} -std="$STD" -fsyntax-only -w -Ikernels -I"$TORCH_INC" -I"$TORCH_INC/torch/csrc/api/include" \
        -I"$PY_INC" -DTORCH_EXTENSION_NAME=msda_baselines kernels/bindings.cpp 2>"$OUT/bindings.log"; then
        echo "  ok      kernels/bindings.cpp (torch $("$PYTHON" -c 'import torch; print(torch.__version__)'), -std=$STD)"
    else
        echo "  FAILED  kernels/bindings.cpp"; cat "$OUT/bindings.log"; failed=1
    fi
else
    echo "check_kernels: SKIPPED kernels/bindings.cpp: torch is not importable"
fi

if [ "$failed" -ne 0 ]; then
    echo "check_kernels: FAILED"
    exit 1
fi
echo "check_kernels: all passed"
