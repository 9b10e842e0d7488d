#!/usr/bin/env bash
# One full GPU session for anvil_fast (issue 6), run from the repository root on the device machine:
# GPU tests, the difftest table, the near-rank-1 study and the bank benchmark, each logged under $OUT.
# Stages are independent (one failing does not stop the next); each has its own time limit.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/anvil_fast_out}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - T0 )) s"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"
stamp pytest
timeout "${T_PYTEST:-170}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_gram.py tests/test_bank.py tests/test_near_rank1.py tests/test_difftest.py 2>&1 | tee "$OUT/pytest_gpu.log"
stamp difftest
timeout "${T_DIFF:-110}" python3 -m anvil_fast.difftest --shapes "${DIFF_SHAPES:-4x96x96,2x256x768,2x768x768,2x2816x768}" \
  2>&1 | tee "$OUT/difftest.log"
stamp near_rank1
timeout "${T_NR1:-110}" python3 -m anvil_fast.near_rank1 --count "${NR1_COUNT:-500}" 2>&1 | tee "$OUT/near_rank1.log"
stamp bench
timeout "${T_BENCH:-200}" python3 -m anvil_fast.bench bank --rep-ms 100 ${BENCH_ARGS:---sweep --sweep-shapes 8x256x768,64x768x768,24x2816x768} \
  2>&1 | tee "$OUT/bench.log"
stamp done
