#!/usr/bin/env bash
# One GPU session for the training-step benchmark and the cost model, from the repository root, on
# one H200 or more: the GPU tests of both, the cost model's pieces (one GPU; collectives on every
# world size the GPUs allow), the training step at every world size the GPUs allow (with and without
# CUDA graphs), and the model's predictions checked against what was measured. Each stage is logged
# under $OUT with its own time limit.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/multigpu_out}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - T0 )) s"; }
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
WORLDS=$(python3 -c "print(','.join(str(w) for w in (1, 2, 4, 8) if w <= $NGPU))")
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.device_count())"; } 2>&1 | tee "$OUT/env.txt"
stamp pytest
timeout "${T_PYTEST:-180}" python3 -m pytest -q -s -m gpu -p no:cacheprovider -rs tests/test_train_step.py \
  tests/test_cost_model.py 2>&1 | tee "$OUT/pytest_multigpu.log"
stamp measure
timeout "${T_MEASURE:-420}" python3 -m anvil_fast.studies.cost_model measure --worlds 1,2,4,8 --out "$OUT/cost_model_h200.json" \
  2>&1 | tee "$OUT/measure.log"
stamp train_step
timeout "${T_TRAIN:-300}" python3 -m anvil_fast.studies.train_step --worlds "$WORLDS" --out "$OUT/train_step_h200.md" \
  2>&1 | tee "$OUT/train_step.log"
stamp train_step_graphs
timeout "${T_TRAIN:-300}" python3 -m anvil_fast.studies.train_step --worlds "$WORLDS" --graphs --profile "$OUT/profile" \
  --out "$OUT/train_step_h200_graphs.md" 2>&1 | tee "$OUT/train_step_graphs.log"
if [ -n "$ORDERS" ]; then  # e.g. ORDERS="forward mixed": the other work orders, with CUDA graphs
  for order in $ORDERS; do
    stamp "train_step_$order"
    timeout "${T_TRAIN:-300}" python3 -m anvil_fast.studies.train_step --worlds "$WORLDS" --graphs --work-order "$order" \
      --out "$OUT/train_step_h200_graphs_$order.md" 2>&1 | tee "$OUT/train_step_graphs_$order.log"
  done
fi
stamp predict
python3 -m anvil_fast.studies.cost_model predict --data "$OUT/cost_model_h200.json" \
  --validate results/anvil_optimizer_h200/run4/scaling_gpu_2ranks.json results/anvil_optimizer_h200/run5/scaling_gpu_2ranks.json \
  --validate-train "$OUT/train_step_h200.json" --out "$OUT/cost_model_predictions.md" 2>&1 | tee "$OUT/predict.log"
stamp done
