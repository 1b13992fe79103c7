#!/usr/bin/env bash
# One GPU call for the baselines: build, checks, microbenchmarks, the comparison on all presets, ncu, sanitizers.
# On the device machine:  source .device/activate.sh && bash scripts/gpu_check_baselines.sh
# Writes $OUT/gpu_check.log (everything), $OUT/compare.csv, $OUT/compare.png, $OUT/tiles.csv; prints the summary
# last. Each step gets what is left of a BUDGET-second total (default 570) so the call ends inside its limit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
STEP_LOGS=/tmp/gpu_check_steps
mkdir -p "$STEP_LOGS"
: >"$LOG"
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-570}
START=$(date +%s)
STEPS=()

left() { echo $((BUDGET - ($(date +%s) - START))); }
step() {  # name max_seconds command...
    local name=$1 max=$2; shift 2
    local t=$(left)
    [ "$t" -gt "$max" ] && t=$max
    if [ "$t" -lt 20 ]; then
        STEPS+=("$name: SKIPPED (budget)"); echo "== $name: skipped, budget spent" | tee -a "$LOG"; return
    fi
    echo "== $name (limit ${t}s): $*" | tee -a "$LOG"
    local s=$(date +%s)
    timeout -s KILL "$t" "$@" >"$STEP_LOGS/$name.log" 2>&1
    local rc=$?
    cat "$STEP_LOGS/$name.log" >>"$LOG"
    STEPS+=("$name: rc=$rc in $(( $(date +%s) - s ))s")
    echo "== $name: rc=$rc" | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv >>"$LOG" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" >>"$LOG" 2>&1

step build 300 python3 scripts/baselines.py
step cluster-watchdog 150 python3 scripts/microbench.py --sections cluster --watchdog 30
step microbench 150 python3 scripts/microbench.py --sections tma,tiles --csv "$OUT/tiles.csv"
step compare 240 python3 scripts/compare.py --no-progress --csv "$OUT/compare.csv" --png "$OUT/compare.png" \
    --impls classic-fp32,classic,vec,tile2x2,tma,distributed,grid_sample
# then everything, cute included (default implementations), in one table: run second so that a kernel that
# hangs cannot cost the baselines' table
step compare-all 150 python3 scripts/compare.py --no-progress --csv "$OUT/compare_all.csv" --png "$OUT/compare_all.png"
# other value dtypes, and odd shapes (H or W = 1, one level, P = 1, D = 64, locations past the borders)
step dtypes 100 bash -c 'for dt in fp32 bf16; do python3 scripts/compare.py --no-progress --dtype $dt \
    --presets dcnv4-test,detr-decoder --impls classic,vec,tile2x2,tma,distributed || exit 1; done'
step odd-shapes 100 bash -c 'set -e; for dt in fp32 fp16 bf16; do
    python3 scripts/compare.py --no-progress --no-time --dtype $dt --levels 1x1,1x7,5x1,3x3 --N 3 --Lq 50 --P 5 \
        --locations uniform --impls classic,vec,tile2x2,tma,distributed
    python3 scripts/compare.py --no-progress --no-time --dtype $dt --levels 33x17 --N 2 --Lq 300 --P 1 \
        --impls classic,vec,tile2x2,tma,distributed
    python3 scripts/compare.py --no-progress --no-time --dtype $dt --levels 20x30,10x15,5x8,3x4,2x2 --N 2 --Lq 97 \
        --P 16 --impls classic,vec,tile2x2,tma,distributed
    python3 scripts/compare.py --no-progress --no-time --dtype $dt --levels 12x13,6x7 --N 2 --Lq 64 --P 4 --D 64 \
        --M 3 --impls classic,vec; done'
step ncu 120 python3 scripts/compare.py --presets dcnv4-test --ncu classic,vec,tile2x2,tma,distributed
step memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/compare.py --no-progress \
    --no-time --levels 9x11,5x6,1x3 --N 2 --Lq 70 --P 3 --impls classic,vec,tile2x2,tma,distributed
# racecheck: tile2x2 and tma, then distributed with clusters of 1 (no remote reads) and 2 (reads through DSMEM)
step racecheck 120 bash -c 'rc=0; for run in "tile2x2,tma 0" "distributed 1" "distributed 2"; do set -- $run
    echo "racecheck run: impls $1 cluster size $2"
    compute-sanitizer --tool racecheck --error-exitcode 9 python3 scripts/compare.py --no-progress --no-time \
        --levels 9x11,5x6 --N 1 --Lq 40 --P 2 --impls $1 --cluster-size $2 || rc=9; done; exit $rc'

{
    echo
    echo "================ summary ================"
    printf '%s\n' "${STEPS[@]}"
    echo "---- sanitizers"
    grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY|racecheck run|Race reported|MISMATCH|FAILED" "$STEP_LOGS/memcheck.log" \
        "$STEP_LOGS/racecheck.log" 2>/dev/null
    echo "---- ncu (dcnv4-test)"
    grep -E "profiling|msda_|gpu__time_duration|dram__|l1tex__throughput|lts__throughput|sm__throughput|==ERROR" \
        "$STEP_LOGS/ncu.log" 2>/dev/null | sed -E "s/\(const .*\)/(...)/" | head -60
    echo "---- distributed under the watchdog"
    grep -E "cluster +[0-9]+ CTAs|HANG|FAILED|microbench:" "$STEP_LOGS/cluster-watchdog.log" 2>/dev/null
    echo "---- microbench"
    grep -E "exact match|XOR of all|microbench:" "$STEP_LOGS/microbench.log" 2>/dev/null
    sed -n '/^tile copy summary/,/^microbench:/p' "$STEP_LOGS/microbench.log" 2>/dev/null
    echo "---- compare, baselines"
    grep -E "^\[|reference" "$STEP_LOGS/compare.log" 2>/dev/null | head -8
    grep -E "^(dcnv4-test|detr-encoder|detr-decoder|seed-b48) " "$STEP_LOGS/compare.log" 2>/dev/null
    echo "---- other dtypes and odd shapes"
    grep -h -E "^(dcnv4-test|detr-decoder) " "$STEP_LOGS/dtypes.log" 2>/dev/null | cut -c1-120
    echo "odd shapes: $(grep -c -E '^custom .* ok ' "$STEP_LOGS/odd-shapes.log" 2>/dev/null) checks ok; others:"
    grep -E "^custom " "$STEP_LOGS/odd-shapes.log" 2>/dev/null | grep -v -E " ok " | cut -c1-120
    echo "---- compare, all implementations (cute included)"
    sed -n '/^results:/,$p' "$STEP_LOGS/compare-all.log" 2>/dev/null
} 2>&1 | tee -a "$LOG"
