#!/usr/bin/env bash
# One GPU call: the peers' builds (in the background), the tuning sweep, the GPU test suite (kernel grid, op,
# hardening), the comparison with the baselines and DCNv4, host costs, and compute-sanitizer. Each step gets a
# share of a BUDGET-second total so the call ends inside its limit. Logs under $OUT; a summary last.
# On the device machine:  source .device/activate.sh && bash scripts/gpu_all.sh
# STEPS picks steps (default: all), e.g. STEPS="sweep compare"; SWEEP, PRESETS, IMPLS and PYTEST_K (a -k
# expression for the test grid) pass through; TUNE_ARGS adds arguments to tune.py (e.g. --custom "...").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_all_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUTE_DEFORM_CACHE_DIR=${CUTE_DEFORM_CACHE_DIR:-$PWD/.kcache}
BUDGET=${BUDGET:-540}
STEPS=${STEPS:-"sweep compare tests-boxes tests-grid tests-op tests-fused hardening host sanitizers layer"}
START=$(date +%s)
SUMMARY=()
step() {  # name max_seconds command...
    local name=$1 max=$2; shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    local t=$((BUDGET - ($(date +%s) - START)))
    [ "$t" -gt "$max" ] && t=$max
    if [ "$t" -lt 15 ]; then SUMMARY+=("$name: skipped (budget)"); return; fi
    local s=$(date +%s)
    timeout -s KILL "$t" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    SUMMARY+=("$name: rc=$rc in $(( $(date +%s) - s ))s (limit ${t}s)")
}
# Kernels compiled on a CPU machine (CUTE_DSL_ARCH=sm_90a) travel as one archive: the .o files load here.
[ -f .kcache.tar.xz ] && mkdir -p "$CUTE_DEFORM_CACHE_DIR" && tar xJf .kcache.tar.xz -C "$CUTE_DEFORM_CACHE_DIR"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader >"$OUT/device.txt"
# The peers build while the CuTe kernels compile and run.
BUILDS=
case " $STEPS " in *" compare "*)
    (python3 scripts/baselines.py >"$OUT/build-baselines.log" 2>&1; python3 scripts/peers.py >"$OUT/build-dcnv4.log" 2>&1) &
    BUILDS=$! ;;
esac
TUNE_EXTRA=()
[ -n "${TUNE_ARGS:-}" ] && eval "TUNE_EXTRA=($TUNE_ARGS)"
step sweep 200 python3 scripts/tune.py --presets "${PRESETS:-$(python3 -c 'import sys; sys.path.insert(0, "scripts"); import compare; print(",".join(compare.PRESETS))')}" --sweep "${SWEEP:-}" "${TUNE_EXTRA[@]}"
[ -n "$BUILDS" ] && wait $BUILDS
step compare 200 python3 scripts/compare.py --no-progress --impls "${IMPLS:-classic-fp32,vec,dcnv4,cute}" --csv "$OUT/compare.csv"
# A kernel fault is sticky for its process: the per-sample box path, the rest of the kernel grid, the op
# tests and the fused tests each run in their own process, so one fault cannot hide the others' results.
PYTEST="python3 -m pytest -q -m gpu -p no:cacheprovider -rfE"
step tests-boxes 90 $PYTEST tests/test_kernel_gpu.py -k "boxes${PYTEST_K:+ and ($PYTEST_K)}"
step tests-grid 200 $PYTEST tests/test_kernel_gpu.py -k "not boxes${PYTEST_K:+ and ($PYTEST_K)}"
step tests-op 120 $PYTEST tests/test_gpu.py tests/test_native_gpu.py ${PYTEST_K:+-k "$PYTEST_K"}
step tests-fused 150 $PYTEST tests/test_fused_gpu.py ${PYTEST_K:+-k "$PYTEST_K"}
step hardening 150 env CUTE_DEFORM_WRITE_DOCS=1 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_hardening_gpu.py
cp docs/bad_inputs.md "$OUT/bad_inputs.md"
# host: first-call compiles its kernel once into an empty cache (about a minute), so the step gets 150 s.
step host 150 bash -c "python3 scripts/overhead.py host && python3 scripts/overhead.py first-call"
step layer 240 python3 scripts/bench_layer.py
step sanitizers 120 bash -c "compute-sanitizer --tool racecheck --error-exitcode 1 --report-api-errors no python3 scripts/overhead.py smoke && PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 --report-api-errors no python3 tests/test_hardening_gpu.py"
cat "$OUT/device.txt"
for f in sweep compare tests-boxes tests-grid tests-op tests-fused hardening host layer sanitizers; do
    [ -f "$OUT/$f.log" ] && { echo "== $f"; grep -v "^$" "$OUT/$f.log" | tail -${TAIL:-14}; }
done
printf '%s\n' "${SUMMARY[@]}"
