#!/usr/bin/env bash
# One GPU session for anvil_fast, run from the repository root on the device machine, every
# stage logged under $OUT and bounded so the whole script ends before DEADLINE seconds:
#   1. GPU tests of the kernels, the bank, the difftest and the near-rank-1 study (kernel candidates
#      compile here; Triton's on-disk cache hands them to the benchmark),
#   2. the bank benchmark (per-shape tuning happens in its warm-up; its decisions are printed),
#      rerun with the v1 kernels (ANVIL_FAST_GRAM=v1) if it fails outright,
#   3. the rest of the GPU suite with whatever time is left.
# DIFF=1 / NR1=1 add the difftest table and the near-rank-1 study before the benchmark.
# Stage budgets: with DEADLINE=395 (results/anvil_fast_h200/run3) stage 1 took 100 s and the benchmark
# 86 s; stage 2 needs about 150 s (90 s ended it inside tests/test_difftest.py).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/anvil_fast_out}
DEADLINE=${DEADLINE:-400}
mkdir -p "$OUT"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
stamp() { echo "== $1 at +$(elapsed) s" | tee -a "$OUT/stages.txt"; }
# budget NAME WANT: seconds for a stage: WANT, but never past DEADLINE minus RESERVE (kept for later stages)
budget() { local left=$(( DEADLINE - $(elapsed) - ${2:-0} )); (( left < $1 )) && echo $(( left > 0 ? left : 1 )) || echo "$1"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"

stamp "pytest kernels"
timeout "$(budget "${T_GRAM:-120}" 260)" python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_gram.py \
  2>&1 | tee "$OUT/pytest_gram_gpu.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
stamp "pytest bank/rails/normalize/equalizer/difftest/near_rank1"
timeout "$(budget "${T_BANK:-150}" 110)" python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_bank.py \
  tests/test_rails.py tests/test_normalize.py tests/test_equalizer.py tests/test_difftest.py tests/test_near_rank1.py 2>&1 | tee "$OUT/pytest_gpu.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
if [[ -n "$DIFF" ]]; then
  stamp difftest
  timeout "$(budget 110 160)" python3 -m anvil_fast.studies.difftest --shapes 4x96x96,2x256x768,2x768x768,2x2816x768 \
    2>&1 | tee "$OUT/difftest.log"
fi
if [[ -n "$NR1" ]]; then
  stamp near_rank1
  timeout "$(budget 110 160)" python3 -m anvil_fast.studies.near_rank1 --count 500 2>&1 | tee "$OUT/near_rank1.log"
fi
stamp bench
timeout "$(budget "${T_BENCH:-200}" 10)" python3 -m anvil_fast.bench bank --rep-ms 100 ${BENCH_ARGS} 2>&1 | tee "$OUT/bench.log"
rc=$?
if (( rc != 0 && rc != 124 && $(elapsed) < DEADLINE - 100 )); then
  stamp "bench with the v1 kernels (the first run failed with rc $rc)"
  ANVIL_FAST_GRAM=v1 timeout "$(budget 200 10)" python3 -m anvil_fast.bench bank --rep-ms 100 2>&1 | tee "$OUT/bench_v1.log"
fi
if (( $(elapsed) < DEADLINE - 30 )); then
  stamp "pytest rest of the GPU suite"
  timeout "$(budget 600 5)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/ --ignore=tests/test_gram.py \
    --ignore=tests/test_bank.py --ignore=tests/test_difftest.py --ignore=tests/test_near_rank1.py \
    --ignore=tests/test_rails.py --ignore=tests/test_normalize.py --ignore=tests/test_equalizer.py -rfEs \
    2>&1 | tee "$OUT/pytest_rest_gpu.log" | tail -15
fi
stamp done
