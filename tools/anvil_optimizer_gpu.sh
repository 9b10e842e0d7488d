#!/usr/bin/env bash
# One GPU session for the fast optimizer on the two-GPU kind, from the repository
# root: the optimizer benchmark (GPU 0), the optimizer's GPU tests (one GPU and two-process NCCL),
# and the two-GPU scaling table. Each stage is logged under $OUT and has its own time limit.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/anvil_optimizer_out}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - T0 )) s"; }
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.device_count())"; } 2>&1 | tee "$OUT/env.txt"
stamp bench
[ -n "$SKIP_BENCH" ] || CUDA_VISIBLE_DEVICES=0 timeout "${T_BENCH:-150}" python3 -m anvil_fast.bench optimizer --rep-ms "${REP_MS:-200}" 2>&1 | tee "$OUT/bench_optimizer.log"
stamp pytest
timeout "${T_PYTEST:-150}" python3 -m pytest -q -s -m gpu -p no:cacheprovider -rs ${PYTEST_K:+-k "$PYTEST_K"} \
  tests/test_distributed.py tests/test_graphs.py tests/test_checkpoint.py tests/test_dropin.py \
  tests/test_transpose.py tests/test_bank_scalars.py tests/test_adam.py 2>&1 | tee "$OUT/pytest_optimizer_gpu.log"
stamp scaling
timeout "${T_SCALING:-190}" python3 -m anvil_fast.studies.scaling gpu --worlds 1,2 ${SCALING_ARGS} --out "$OUT/scaling_gpu_2ranks.md" 2>&1 | tee "$OUT/scaling.log"
stamp done
