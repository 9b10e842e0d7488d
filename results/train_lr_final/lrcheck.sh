#!/usr/bin/env bash
# the final horizon's learning-rate neighbours: ANVIL and torch Muon at lr x1/2 and x2 of their tuned values,
# 4000 steps, seeds 0 1 2, every other value as the protocol chose (--tuned-from); each setting in its own process
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"
  echo "ANVIL_COMMIT ${ANVIL_COMMIT}"; } > "$OUT/env.txt" 2>&1
run() {  # NAME LR
  timeout "${T_LR:-500}" python3 -m papers.train --contenders "$1" --tuned-from results/train/protocol --lr "$1=$2" \
    --steps 4000 --seeds ${LR_SEEDS:-0 1 2} --jobs 3 --timing-steps 0 --out "$OUT/lr_check/$1-$2${LR_TAG:-}" --time-budget-s $(( ${T_LR:-500} - 15 )) \
    > "$OUT/lr_$1_$2.log" 2>&1
  echo "$1 $2 rc $?" >> "$OUT/lr_status.txt"
}
for s in ${LR_SETTINGS}; do run ${s%=*} ${s#*=} & done
wait
cat "$OUT/lr_status.txt"; grep -h "final\|val" "$OUT"/lr_*.log | tail -20
cd "$OUT" && tar czf all.tgz --exclude=env.txt --exclude=lr_status.txt lr_check lr_*.log && rm -rf lr_check lr_*.log
