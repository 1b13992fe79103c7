#!/usr/bin/env bash
# One GPU call for the Hopper kernel: tuning sweep, the GPU test suite (kernel grid, op, hardening),
# the comparison with the baselines, and compute-sanitizer on the hostile inputs. Each step gets a share
# of a BUDGET-second total so the call ends inside its limit. Logs under $OUT; a summary last.
# On the device machine:  source .device/activate.sh && bash scripts/gpu_all.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_all_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUTE_DEFORM_CACHE_DIR=${CUTE_DEFORM_CACHE_DIR:-$PWD/.kcache}
BUDGET=${BUDGET:-540}
START=$(date +%s)
SUMMARY=()
step() {  # name max_seconds command...
    local name=$1 max=$2; shift 2
    local t=$((BUDGET - ($(date +%s) - START)))
    [ "$t" -gt "$max" ] && t=$max
    if [ "$t" -lt 15 ]; then SUMMARY+=("$name: skipped (budget)"); return; fi
    local s=$(date +%s)
    timeout -s KILL "$t" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    SUMMARY+=("$name: rc=$rc in $(( $(date +%s) - s ))s (limit ${t}s)")
}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader >"$OUT/device.txt"
step sweep 90 python3 scripts/kernel_check.py --skip-correctness --sweep "${SWEEP:-}"
step hardening-tests 150 env CUTE_DEFORM_WRITE_DOCS=1 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_hardening_gpu.py
step kernel-tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_gpu.py tests/test_gpu.py
cp docs/bad_inputs.md "$OUT/bad_inputs.md"
step compare 100 python3 scripts/compare.py --no-progress --csv "$OUT/compare.csv"
step launch-costs 60 python3 scripts/launch_costs.py
step racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 1 --report-api-errors no \
    python3 scripts/kernel_smoke.py
step memcheck 90 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
    --report-api-errors no python3 tests/test_hardening_gpu.py
cat "$OUT/device.txt"
for f in sweep hardening-tests kernel-tests compare launch-costs racecheck memcheck; do
    [ -f "$OUT/$f.log" ] && { echo "== $f"; grep -v "^$" "$OUT/$f.log" | tail -${TAIL:-14}; }
done
printf '%s\n' "${SUMMARY[@]}"
