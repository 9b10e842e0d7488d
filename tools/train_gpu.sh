#!/usr/bin/env bash
# Training evidence on one H200 (python -m papers.train), one stage per device command, from the
# repository root; each stage stays within 9 minutes including process start (its --time-budget-s
# stops starting runs in time, and every finished run's JSON is written at once):
#   STAGE=calib   ~3 min: every contender, 60 steps, seed 0: the step times that size the rest
#   STAGE=sweep   the AdamW and Muon lr sweeps (small, 1 seed, 8 runs)
#   STAGE=small   SEEDS="0 1 2" (or a subset): all contenders, lrs from results/train/small/sweep;
#                 runs already kept in results/train/small are skipped, so a cut stage resumes
#   STAGE=medium  SEEDS="0 1 2": adamw, muon, anvil at size medium, lrs from the small sweep
# Results land under $OUT/train/... (calib under $OUT/train_calib, outside results/train: it is a
# different setup); copy them into results/ with this file's command line.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/train_out}
STEPS=${STEPS:-1000}
BUDGET=${BUDGET:-480}
SEEDS=${SEEDS:-0 1 2}
mkdir -p "$OUT/train"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"; } > "$OUT/env.txt" 2>&1
echo "STAGE=$STAGE STEPS=$STEPS BUDGET=$BUDGET SEEDS=\"$SEEDS\" bash tools/train_gpu.sh" > "$OUT/command.txt"
case "$STAGE" in
  calib)  python3 -m papers.train --size small --steps 60 --eval-every 60 --seeds 0 \
            --out "$OUT/train_calib" --time-budget-s "$BUDGET" 2>&1 | tee "$OUT/train_calib.log" ;;
  sweep)  python3 -m papers.train --size small --steps "$STEPS" --sweep adamw muon \
            --out "$OUT/train/small/sweep" --time-budget-s "$BUDGET" 2>&1 | tee "$OUT/train_small_sweep.log" ;;
  small)  python3 -m papers.train --size small --steps "$STEPS" --seeds $SEEDS \
            --tuned-from results/train/small/sweep --skip-existing results/train/small \
            --out "$OUT/train/small" --time-budget-s "$BUDGET" 2>&1 | tee "$OUT/train_small_seeds${SEEDS// /}.log" ;;
  medium) python3 -m papers.train --size medium --steps "$STEPS" --contenders adamw muon anvil --seeds $SEEDS \
            --tuned-from results/train/small/sweep --tuned-size small \
            --out "$OUT/train/medium" --time-budget-s "$BUDGET" 2>&1 | tee "$OUT/train_medium.log" ;;
  *) echo "STAGE must be calib, sweep, small or medium" >&2; exit 2 ;;
esac
