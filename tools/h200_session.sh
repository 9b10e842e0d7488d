#!/usr/bin/env bash
# One call on the H200 (device tool), from the repository root: the stages named in STAGES run in
# order, each logged under $OUT with its own time limit, and whatever a stage writes under
# results/ comes back as one tarball (the device returns at most 8 files).
#   suite   the whole gpu-marked test suite (T_SUITE seconds, default 540); SUITE_PART=i/n runs part i of n
#           (tools/suite_part.py: whole files, pytest's order) into pytest_gpu_part<i>of<n>.log; each failure's
#           report also goes to <log>.failures as it happens (kept when the time limit stops the run)
#   bench   python -m anvil_fast.bench dropin (small and medium GPT), with the launch profile
#   train   the paper's training: lone timings of the tuned contenders (results/train/protocol/timing),
#           then the tuning protocol, its longer horizon and its equal-time runs (papers/protocol.py,
#           TRAIN_JOBS runs at once, results/train/protocol);
#           ANVIL_COMMIT (the commit of the tree copied here) goes into every run JSON and logs/
#   timing  the tuned contenders' lone training steps (papers.train --timing-only), TIMING_REPEATS (3) times
#           interleaved, TIMING_STEPS (200) timed steps each, each part of the step timed, into $OUT/timing
#   fingerprint  tools/fingerprint.py (digests of the fast path's bits) and its diff against FP_BEFORE
#   chunk   tools/chunk_independence.py for SAFE and for the Gram side (GRAM_SIDE's bank shapes)
#   gramside  the bank bench with its Gram-side table, difftest and the near-rank-1 study of GRAM_SIDE
#   contenders  TRAIN_CONTENDERS on the small GPT at the drop-in's rates, seeds 0 1 2, 1000 steps, no
#           clipping (the setup of ANVIL's configurations in results/train/small; runs that exist are skipped)
#   engine  the one-process device-decided step first: graphed against eager on the small GPT, bit for
#           bit, then the gpu-marked tests of its kernels and of the drop-in (fail fast)
#   warmup_ab  the drop-in's first step on the small GPT from fresh compiler cache folders (the default tuning), in
#           BASE (as fingerprint_base) and here, alternating, WARMUP_ROUNDS rounds (default 2), each in a fresh
#           process; here with dion's graphed Muon in the same run (.peers carried): warm_<side>_<i>/ (peers.md's
#           "first step s")
#   fingerprint_base  tools/fingerprint.py (tuner off) in BASE (a git archive of the commit to compare
#           with, carried as a folder) and here, and their diff
#   ab      python -m anvil_fast.bench dropin (AB_ARGS, default: small and medium GPT, ANVIL and AdamW, no phase
#           table) in BASE (as fingerprint_base) and here, alternating, AB_ROUNDS rounds (default 2): the step's time
#           before and after a change, side by side on one device (ab_base_<i>.log, ab_head_<i>.log)
#   orthogonalizers  the lines ORTHO_LINES of results/h200_orthogonalizers/commands.txt (the paper's table of
#           other libraries' orthogonalizations, one resumable run per adapter group and shape), ORTHO_JOBS at
#           once (ORTHO_LINES=remaining: those not complete; a 4096x4096 line alone on a card under 120 GB;
#           T_ORTHO seconds per line, ORTHO_DEADLINE seconds for them all from the stage's start):
#           wheels from .whl and .gns, dion from .peers/dion; each JSON into $OUT (copy it to
#           results/h200_orthogonalizers/)
#   nothinglost  SAFE's chunk independence, its near-rank-1 study (fp64 and the fast SAFE path) and
#           python -m anvil_fast.bench optimizer (the GPT-2-small layout against its floor)
#   orthopeers  python -m anvil_fast.bench bank's orthogonalizers table alone (SAFE, GRAM_SIDE, each also split
#           over SPLIT_STREAMS streams (default 2; e.g. 2,3,4), gram-newton-schulz on the GPT-2 small and medium
#           banks, or on PEER_SHAPES; .gns from tools/gns_bundle.sh carried)
#   tunedtable  tools/gram_tuned_table.py: the Gram kernels' shipped tuning decisions for this device, into
#           anvil_fast/kernels/gram_tuned.json here (later stages of the call use it) and $OUT (commit it)
#   pyc     compileall of the installed packages into PYCACHE (an installed environment's bytecode; before warmup)
#   warmup  the drop-in's first step on the small GPT from cold compiler caches (fresh cache folders), in a
#           fresh process: ANVIL_FAST_TUNE=fresh (every candidate compiled) and the default (shipped decisions,
#           with dion's graphed Muon in the same run: .peers carried);
#           then tools/first_step.py (cold, default): that first step's profile
#   nodes   tools/graph_nodes.py for NODES_SIZES (default small medium): the graphed drop-in step's host time
#           per part and its CUDA graph's nodes by kind and kernel (DOT dumps under $OUT/nodes_<size>/)
#   peers   python -m anvil_fast.bench peers (small and medium GPT, every installed peer, each in its own
#           box): installs the wheels carried in .whl first; dion from .peers/dion; writes peers.json,
#           peers.md, command.txt and peers.log into $OUT (PEERS_NOTE: command.txt's first line); PEERS_REPEATS=N
#           makes it N runs in a row, into $OUT/run1 .. runN; PEERS_ARGS_FIRST and T_PEERS_FIRST: the first
#           run's own arguments and time limit (PEERS_ARGS and T_PEERS for the others)
#   costmodel  python -m anvil_fast.studies.cost_model measure: the cost model's per-rank pieces on this one GPU
#           (collectives need several GPUs and are left to the two-rank runs), into $OUT/cost_model_h200.json
#           (copy it to papers/data/ and rebuild the paper)
#   kprofile  tools/kernel_profile.py for NODES_SIZES (default small medium): one graphed step's kernels by time
#           and its timeline by stream (gzipped Chrome traces under $OUT/kprofile/)
#   lrfinal  the final horizon's learning-rate neighbours (papers/lr_final.py): LR_SETTINGS="name=lr[@seed,seed] ...", each a
#           papers.train process at the protocol's chosen values but lr, 4000 steps, seeds LR_SEEDS (default 0 1 2),
#           all at once (T_LR seconds), into $OUT/lr_final/ (copy to results/train_lr_final/)
#   tail    python -m anvil_fast.studies.tail: how many outputs of the Gram side, its eager form and SAFE pass
#           EXPLODED_SIGMA on near-low-rank inputs at the bank shapes (TAIL_SECONDS per shape, TAIL_ARGS), into $OUT/tail.json
#   resident  tools/resident_diff.py on the small GPT (ANVIL, torch's Muon, AdamW): the allocations each holds
#           beyond the model, its gradients and a first forward by where they were made, then the same without that forward
#           (RESIDENT_SIZE: another size; RESIDENT_WHO: other contenders; RESIDENT_FLAGS=--held: the held memory by pool)
# PYCACHE=DIR: Python's bytecode cache in DIR for every process of the call (env.txt says whether the
# image's packages have one of their own).
# STAGES_ELSEWHERE: the stages run instead of STAGES when the card is not an H200 (stages.txt says so).
# TRAIN_ARGS adds arguments to every training stage, PEERS_ARGS to the peers stage; T_<STAGE> overrides a stage's time limit.
# `bash tools/h200_session.sh pack` only packs $OUT (after a run cut short by an outer timeout).
set -o pipefail
# the device returns at most 8 files: past 7, everything but stages.txt travels in one tarball
pack() {
  if [ "$(find "$OUT" -type f | wc -l)" -gt 7 ]; then
    (cd "$OUT" && tar czf /tmp/h200_all.tgz --exclude=stages.txt . && find . -type f ! -name stages.txt -delete \
       && mv /tmp/h200_all.tgz ./all.tgz)
  fi
}
[ "$1" = pack ] && { OUT=${OUT:-/tmp/h200_out}; pack; exit 0; }

# the drop-in's first step on the small GPT from fresh compiler cache folders, in the current folder's tree:
# cold_first_step NAME CONTENDERS NOTE -> $OUT/NAME/ (peers.md: "first step s") and $OUT/NAME.log
cold_first_step() {
  local cold; cold=$(mktemp -d)
  TRITON_CACHE_DIR=$cold/triton TORCHINDUCTOR_CACHE_DIR=$cold/inductor timeout "${T_WARMUP:-200}" \
    python3 -m anvil_fast.bench peers --sizes small --contenders "$2" --out "$OUT/$1" --no-progress \
    --budget-s $(( ${T_WARMUP:-200} - 20 )) --note "cold compiler caches, $3" 2>&1 | tee "$OUT/$1.log" | grep -E "^  |error"
}
# the peers' wheels (.whl) and gram-newton-schulz's bundle (.gns, built by tools/gns_bundle.sh: its large
# libs wheel travels unpacked and xz-compressed) into /tmp/site, once per call
install_peers() {
  [ -n "${PEERS_INSTALLED:-}" ] && return 0
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || echo "the wheels in .whl did not install"
  fi
  # the libs wheel only serves the quack backend: a call that runs no quack kernel may leave it behind
  # (the carried tree's limit), and the pure-PyTorch forms still install
  if ls .gns/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .gns/*.whl || echo "the wheels in .gns did not install"
  fi
  if [ -f .gns/libs_base.tar.xz ]; then
    tar xJf .gns/libs_base.tar.xz -C /tmp/site || echo "the libs in .gns did not unpack"
  fi
  # --target skips .pth files: the cutlass DSL's python packages go on the path by hand
  export PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages
  PEERS_INSTALLED=1
}
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -n "${PYCACHE:-}" ] && mkdir -p "$PYCACHE" && export PYTHONPYCACHEPREFIX=$PYCACHE
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - T0 )) s" | tee -a "$OUT/stages.txt"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"
  # whether imports load bytecode or compile every source (a fresh process's import time; PYCACHE=DIR
  # gives Python a writable bytecode cache there, PYTHONPYCACHEPREFIX, for every later process)
  python3 -c "import importlib.util as u, os, torch._inductor.compile_fx as m
f = m.__file__; c = u.cache_from_source(f)
print('bytecode cache of', f, 'exists' if os.path.exists(c) else 'missing', '- its folder', 'writable' if os.access(os.path.dirname(c) if os.path.isdir(os.path.dirname(c)) else os.path.dirname(f), os.W_OK) else 'read-only',
      '- PYTHONPYCACHEPREFIX', os.environ.get('PYTHONPYCACHEPREFIX'))"
  # the copied tree's commit is the caller's to give (ANVIL_COMMIT=<hash> in the call): git inside the copy
  # may answer with another commit than the tree's (tools that record a commit read ANVIL_COMMIT first)
  echo "ANVIL_COMMIT ${ANVIL_COMMIT:-not given}; git in this copy: $(git rev-parse HEAD 2>/dev/null || echo none)"
  # what was copied, by content: the git tree of every file git does not ignore (a temporary index; blobs
  # go to this copy's object store), equal to `git rev-parse <commit>^{tree}` of the commit the tree is
  idx=$(mktemp -u); tree=$(GIT_INDEX_FILE=$idx git add -A . 2>/dev/null && GIT_INDEX_FILE=$idx git write-tree 2>/dev/null)
  rm -f "$idx"
  given=$(git rev-parse -q --verify "${ANVIL_COMMIT:-none}^{tree}" 2>/dev/null)
  echo "tree ${tree:-unknown}; ANVIL_COMMIT's tree $([ -z "$given" ] && echo "not in this copy's git" \
    || { [ "$given" = "$tree" ] && echo "the same" || echo "$given: ANVIL_COMMIT is not the tree copied"; })"
  # the architecture the Gram kernels' shipped decisions are matched by (a device without its own takes these)
  python3 -c "import torch; from anvil_fast.kernels.gram_tune import device_arch
print('device_arch', device_arch(torch.cuda.get_device_properties(0)))"
  # the peers' sources carried (tools/peers_bundle.sh): which dion, which wheels
  cat .peers/dion/REVISION 2>/dev/null; ls .whl .gns 2>/dev/null | grep -h '\.whl$'; } 2>&1 | tee "$OUT/env.txt"
# STAGES_ELSEWHERE: the stages to run instead of STAGES where the card is not an H200 (a call for an H200
# may be placed on another card; its device time then goes to work whose figures do not depend on the card)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
if [ -n "${STAGES_ELSEWHERE:-}" ] && [[ "$card" != *H200* ]]; then
  echo "card ${card:-unknown} is not an H200: STAGES_ELSEWHERE ($STAGES_ELSEWHERE) instead of STAGES (${STAGES:-suite bench})" \
    | tee -a "$OUT/stages.txt"
  STAGES=$STAGES_ELSEWHERE
fi
for stage in ${STAGES:-suite bench}; do
  stamp "$stage"
  case $stage in
    suite) sel=tests/ log=pytest_gpu
           # SUITE_PART=i/n: part i of n (tools/suite_part.py), one call each where the whole suite does
           # not fit one call (a cold machine compiles every kernel first)
           if [ -n "${SUITE_PART:-}" ]; then
             sel=$(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/ 2>/dev/null \
                   | python3 tools/suite_part.py "$SUITE_PART") || sel=""
             log=pytest_gpu_part${SUITE_PART%/*}of${SUITE_PART#*/}
             echo "suite part $SUITE_PART: ${sel:-no files}" | tee "$OUT/$log.files"
           fi
           [ -n "$sel" ] && ANVIL_TEST_FAILURES="$OUT/$log.failures" timeout "${T_SUITE:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs $sel 2>&1 \
             | tee "$OUT/$log.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -40 ;;
    bench) timeout "${T_BENCH:-200}" python3 -m anvil_fast.bench dropin --sizes small,medium --profile 2>&1 \
             | tee "$OUT/bench_dropin.log" ;;
    train) mkdir -p results/train/logs/protocol
           RAN_TRAIN=1
           # each call's logs keep their own name (its UTC start), so a later chunk never overwrites an earlier one's
           STAMP=$(date -u +%Y%m%dT%H%M%SZ)
           # the device's copy of .git can be a snapshot older than the tree it runs: the caller names the
           # commit (ANVIL_COMMIT=$(git rev-parse HEAD) here, before the call), and without it none is claimed
           echo "${ANVIL_COMMIT:-unknown (ANVIL_COMMIT not given)}" > results/train/logs/protocol_commit.txt
           cp "$OUT/env.txt" results/train/logs/protocol_env.txt
           # microsoft/dion's runs name the source they ran: its commit, written beside the archive by whoever carried it
           cat .peers/dion/COMMIT > results/train/logs/dion_commit.txt 2>/dev/null || echo "no .peers/dion/COMMIT" > results/train/logs/dion_commit.txt
           echo "commit $(cat results/train/logs/protocol_commit.txt); T_TRAIN=${T_TRAIN:-450} TRAIN_JOBS=${TRAIN_JOBS:-8} TRAIN_ARGS=${TRAIN_ARGS}" \
             > "results/train/logs/protocol/$STAMP.log"
           # the lone timings first: on an idle device, and the equal-time runs of this same call need them
           ANVIL_COMMIT=$(cat results/train/logs/protocol_commit.txt) timeout "${T_TIMING:-50}" python3 -m papers.train \
             --timing-only --contenders adamw muon dion normuon anvil anvil_lean --tuned-from results/train/protocol \
             --out results/train/protocol/timing --skip-existing --time-budget-s $(( ${T_TIMING:-50} - 5 )) 2>&1 \
             | tee "results/train/logs/protocol/$STAMP-timing.log" | tail -8
           ANVIL_COMMIT=$(cat results/train/logs/protocol_commit.txt) timeout "${T_TRAIN:-450}" python3 -m papers.train \
             --protocol --jobs "${TRAIN_JOBS:-8}" --out results/train/protocol --skip-existing \
             --time-budget-s $(( ${T_TRAIN:-450} - 10 )) ${TRAIN_ARGS} 2>&1 | tee -a "results/train/logs/protocol/$STAMP.log" \
             | grep -v "^\[" | tail -30 ;;
    timing) # the tuned contenders' lone training steps, TIMING_REPEATS times interleaved (TIMING_STEPS timed
           # steps after TIMING_WARMUP each), every part of the step timed: into $OUT/timing (not the protocol's folder,
           # whose equal-time runs took their step counts from the timings there)
           ANVIL_COMMIT="${ANVIL_COMMIT:-unknown (ANVIL_COMMIT not given)}" timeout "${T_TIMING:-400}" python3 -m papers.train --timing-only \
             --contenders ${TIMING_CONTENDERS:-adamw muon dion normuon anvil anvil_lean} --tuned-from results/train/protocol \
             --timing-repeats "${TIMING_REPEATS:-3}" --timing-steps "${TIMING_STEPS:-200}" \
             --timing-warmup "${TIMING_WARMUP:-20}" --out "$OUT/timing" --time-budget-s $(( ${T_TIMING:-400} - 10 )) 2>&1 \
             | tee "$OUT/timing.log" | grep -E "^\[|FAILED|absent|budget" ;;
    fingerprint) timeout "${T_FINGERPRINT:-150}" python3 tools/fingerprint.py --out "$OUT/fingerprint.txt" 2>&1 \
             | tee "$OUT/fingerprint.log"
             [ -n "$FP_BEFORE" ] && { diff "$FP_BEFORE" "$OUT/fingerprint.txt" > "$OUT/fingerprint_diff.txt" \
               && echo "fingerprint: identical to $FP_BEFORE" || echo "fingerprint: DIFFERS from $FP_BEFORE"; } ;;
    chunk) { timeout "${T_CHUNK:-150}" python3 tools/chunk_independence.py --no-progress 2>&1 | tee "$OUT/chunk_safe.txt"
             timeout "${T_CHUNK:-150}" python3 tools/chunk_independence.py --no-progress --config gram_side \
               --shapes 24x2816x768,24x3072x768,24x768x3072,72x256x768 2>&1 | tee "$OUT/chunk_gram_side.txt"; } | tail -4 ;;
    gramside) timeout "${T_GRAMSIDE_BENCH:-240}" python3 -m anvil_fast.bench bank --rep-ms 50 2>&1 | tee "$OUT/bench_bank.log" | tail -14
             timeout 150 python3 -m anvil_fast.studies.difftest --no-progress --device cuda --configs gram_side,safe \
               --shapes 2x256x768,2x768x768,2x2816x768,2x3072x768,2x768x3072 2>&1 | tee "$OUT/difftest_gram_side.log" | tail -3
             timeout 150 python3 -m anvil_fast.studies.near_rank1 --no-progress --count 500 --shapes 256x768,2816x768,3072x768,768x3072 \
               --paths fp64,fast-safe,fast-gram-side 2>&1 | tee "$OUT/near_rank1_gram_side.log" | tail -8 ;;
    contenders) RAN_TRAIN=1
             timeout "${T_CONTENDERS:-300}" python3 -m papers.train --size small --seeds 0 1 2 --clip 0 \
             --contenders ${TRAIN_CONTENDERS:-anvil_lean} --jobs "${TRAIN_JOBS:-3}" --timing-steps 0 \
             --out results/train/small --skip-existing --time-budget-s $(( ${T_CONTENDERS:-300} - 20 )) ${TRAIN_ARGS} 2>&1 \
             | tee "$OUT/train_contenders.log" | tail -5 ;;
    engine) timeout "${T_ENGINE:-60}" python3 tools/engine_smoke.py 2>&1 | tee "$OUT/engine_smoke.log"
             timeout "${T_ENGINE_TESTS:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs \
               tests/test_device_step.py tests/test_rails.py tests/test_equalizer.py tests/test_adam.py \
               tests/test_bank.py tests/test_update.py tests/test_dropin.py tests/test_step_scalars.py 2>&1 \
             | tee "$OUT/pytest_gpu_engine.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -20 ;;
    ab)    for i in $(seq "${AB_ROUNDS:-2}"); do
             for side in base head; do
               dir=.; [ "$side" = base ] && dir="${BASE:-.base}"
               (cd "$dir" && timeout "${T_AB:-150}" python3 -m anvil_fast.bench dropin \
                 ${AB_ARGS:---sizes small,medium --variants anvil,adamw --no-phases} > "$OUT/ab_${side}_$i.log" 2>&1)
               echo "== $side $i"; grep -E "^\| (small|medium|gpt2medium|small-bf16) " "$OUT/ab_${side}_$i.log"
             done
           done ;;
    warmup_ab) install_peers
           for i in $(seq "${WARMUP_ROUNDS:-2}"); do
             for side in base head; do
               dir=.; who=anvil,dion_graphed; [ "$side" = base ] && { dir="${BASE:-.base}"; who=anvil; }
               echo "== $side $i"
               (cd "$dir" && cold_first_step "warm_${side}_$i" $who "$side, round $i")
             done
           done ;;
    fingerprint_base) (cd "${BASE:-.base}" && ANVIL_FAST_TUNE=0 timeout "${T_FINGERPRINT:-150}" python3 tools/fingerprint.py \
               --out "$OUT/fp_before.txt" > "$OUT/fp_before.log" 2>&1)
             ANVIL_FAST_TUNE=0 timeout "${T_FINGERPRINT:-150}" python3 tools/fingerprint.py --out "$OUT/fp_after.txt" \
               > "$OUT/fp_after.log" 2>&1
             diff "$OUT/fp_before.txt" "$OUT/fp_after.txt" > "$OUT/fp_diff.txt" && echo "fingerprint: identical" \
               || { echo "fingerprint: differs"; cat "$OUT/fp_diff.txt"; } ;;
    orthogonalizers) install_peers
           # the lines ORTHO_LINES (1-based, comment lines not counted) of the table's command list, each
           # resumable: its JSON comes back in $OUT (copy it to results/h200_orthogonalizers/ and run again)
           # ORTHO_JOBS lines at once (the runs time nothing), each with its own log, orthogonalizers_<line>.log
           grep -v '^#' results/h200_orthogonalizers/commands.txt | grep . > /tmp/ortho_cmds.txt
           # ORTHO_LINES=remaining: every line whose JSON is not complete (python -m papers.orthogonalizers)
           [ "${ORTHO_LINES:-}" = remaining ] && ORTHO_LINES=$(python3 -m papers.orthogonalizers --lines)
           ortho_line() {
             local i=$1 cmd json
             cmd=$(sed -n "${i}p" /tmp/ortho_cmds.txt | sed 's/^PYTHONPATH=\.peers\/dion python /python3 /')
             [ -n "$cmd" ] || return 0
             echo "orthogonalizers line $i" > "$OUT/orthogonalizers_$i.log"
             # the JSON lives in $OUT while the run writes it (after every row), seeded with the stored one
             # for --resume: whatever cuts the call short, the rows finished so far come back
             json=$(grep -o -- '--json [^ ;]*' <<< "$cmd" | cut -d' ' -f2)
             [ -f "$json" ] && cp "$json" "$OUT/"
             cmd=$(sed "s|--json $json|--json $OUT/$(basename "$json")|; s|; *cp [^;]*\$OUT/ *\$||" <<< "$cmd")
             # the lines share the machine's cores, each its share of the threads (the host's float64 SVDs and
             # QRs): three lines with a full thread pool each wrote no row in 430 s, one alone 40 rows in 150 s;
             # SIGINT first, so that a line cut at its limit prints where it was
             # ORTHO_DEADLINE: seconds from the stage's start by which every line has stopped (T_ORTHO is
             # per line, and lines queue behind ORTHO_JOBS): a line gets what is left, none under 30 s,
             # so that the call ends inside the device's limit with its logs packed
             local limit=${T_ORTHO:-300}
             if [ -n "${ORTHO_DEADLINE:-}" ]; then
               local left=$(( ORTHO_DEADLINE - ($(date +%s) - ortho_t0) ))
               [ "$left" -lt "$limit" ] && limit=$left
               if [ "$limit" -lt 30 ]; then echo "not started: ${limit} s left before ORTHO_DEADLINE" >> "$OUT/orthogonalizers_$i.log"; return 0; fi
             fi
             PYTHONPATH="$PYTHONPATH:$PWD/.peers/dion" OMP_NUM_THREADS=$ortho_threads \
               timeout -s INT -k 20 "$limit" bash -c "$cmd" >> "$OUT/orthogonalizers_$i.log" 2>&1
             echo "rc=$?" >> "$OUT/orthogonalizers_$i.log"
           }
           ortho_threads=$(( $(nproc) / ${ORTHO_JOBS:-1} )); [ "$ortho_threads" -ge 1 ] || ortho_threads=1
           ortho_t0=$(date +%s)
           # a line at 4096x4096 runs alone on a card under 120 GB: its float64 spectrum probe held 36-54 GB of
           # an H100's 79, and one beside two other lines ran out of memory
           gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
           running=0
           for i in ${ORTHO_LINES:-1}; do
             if [ "${gpu_mib:-0}" -lt 120000 ] && sed -n "${i}p" /tmp/ortho_cmds.txt | grep -q -- '--shapes 1x4096x4096'; then
               wait; running=0
               ortho_line "$i"
               continue
             fi
             ortho_line "$i" &
             running=$((running + 1))
             if [ "$running" -ge "${ORTHO_JOBS:-1}" ]; then wait -n; running=$((running - 1)); fi
           done
           wait
           for i in ${ORTHO_LINES:-1}; do grep -h -E "rows:|^rc=|^not started" "$OUT/orthogonalizers_$i.log" | sed "s/^/line $i: /"; done ;;
    nothinglost) timeout "${T_CHUNK:-90}" python3 tools/chunk_independence.py --no-progress > "$OUT/chunk_safe.txt" 2>&1
             tail -3 "$OUT/chunk_safe.txt"
             timeout "${T_NR1:-150}" python3 -m anvil_fast.studies.near_rank1 --no-progress --device cuda --count 500 \
               --paths fp64,fast-safe 2>&1 | tee "$OUT/near_rank1_safe.log" | tail -6
             timeout "${T_OPTBENCH:-100}" python3 -m anvil_fast.bench optimizer 2>&1 | tee "$OUT/bench_optimizer.log" | tail -10 ;;
    orthopeers) install_peers
           timeout "${T_ORTHOPEERS:-300}" python3 -m anvil_fast.bench bank --shapes '' --gram-side-shapes '' --rep-ms 50 \
             ${PEER_SHAPES:+--peer-shapes "$PEER_SHAPES"} ${SPLIT_STREAMS:+--split-streams "$SPLIT_STREAMS"} --no-progress 2>&1 | tee "$OUT/bench_bank_peers.log" | tail -16 ;;
    tunedtable) timeout "${T_TUNEDTABLE:-300}" python3 tools/gram_tuned_table.py --note "${TUNED_NOTE:-}" 2>&1 \
             | tee "$OUT/gram_tuned_table.log" | grep -v "^    " | tail -40
             cp anvil_fast/kernels/gram_tuned.json "$OUT/" 2>/dev/null ;;
    pyc)   install_peers  # Python's bytecode for every installed package, into PYCACHE (needs PYCACHE): what an installed
           # environment has and this image lacks, so that a later stage's first step is timed without it
           [ -n "${PYCACHE:-}" ] && timeout "${T_PYC:-240}" python3 -m compileall -q -j 0 \
             "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" /tmp/site > "$OUT/pyc.log" 2>&1
           echo "compileall rc $? ($(find "$PYCACHE" -name '*.pyc' | wc -l) files)" | tee -a "$OUT/pyc.log" ;;
    warmup) install_peers
           # the default mode's run has dion's graphed Muon beside it (its first step from the same cold caches)
           for mode in fresh 1; do
             who=anvil; [ "$mode" = 1 ] && who=anvil,dion_graphed
             ANVIL_FAST_TUNE=$mode cold_first_step "warmup_tune_$mode" $who "ANVIL_FAST_TUNE=$mode"
           done
           # where the cold first step's time goes (the default tuning): construction, first step, profile
           cold=$(mktemp -d)
           TRITON_CACHE_DIR=$cold/triton TORCHINDUCTOR_CACHE_DIR=$cold/inductor timeout "${T_WARMUP:-200}" \
             python3 tools/first_step.py --size small --out "$OUT/first_step" 2>&1 | tee "$OUT/first_step.log" | sed -n 1,3p ;;  # sed, not head: head leaves early and its SIGPIPE would cut tee's copy short
    nodes) for size in ${NODES_SIZES:-small medium}; do
             timeout "${T_NODES:-200}" python3 tools/graph_nodes.py --size "$size" --out "$OUT/nodes_$size" 2>&1 \
               | tee "$OUT/graph_nodes_$size.log" | sed -n 1,50p
           done ;;
    kprofile) for size in ${NODES_SIZES:-small medium}; do
             timeout "${T_KPROFILE:-150}" python3 tools/kernel_profile.py --size "$size" --out "$OUT/kprofile" 2>&1 \
               | tee "$OUT/kernel_profile_$size.log" | sed -n 1,25p
           done
           gzip -f "$OUT"/kprofile/trace_*.json 2>/dev/null ;;
    resident) install_peers  # a peer's contender (RESIDENT_WHO) needs its wheels
           for ff in "" --no-forward; do
             for who in ${RESIDENT_WHO:-anvil torch_muon adamw}; do
               timeout "${T_RESIDENT:-60}" python3 tools/resident_diff.py --size "${RESIDENT_SIZE:-small}" --contender $who \
                 $ff ${RESIDENT_FLAGS:-} 2>&1 | tee -a "$OUT/resident_diff.log"
             done
           done ;;
    costmodel) timeout "${T_COSTMODEL:-300}" python3 -m anvil_fast.studies.cost_model measure --no-progress \
               --out "$OUT/cost_model_h200.json" 2>&1 | tee "$OUT/cost_model_measure.log" | tail -20 ;;
    peers) install_peers
           # PEERS_REPEATS > 1: that many whole runs one after another, each into $OUT/run<i> (every contender
           # of each in its own fresh process), T_PEERS seconds each; the first also fills the compile caches
           # PEERS_ARGS_FIRST / T_PEERS_FIRST: the first run's own arguments and limit (every contender once, say,
           # then the fastest of them repeated)
           n=${PEERS_REPEATS:-1}
           for i in $(seq 1 "$n"); do
             dest="$OUT"; [ "$n" -gt 1 ] && { dest="$OUT/run$i"; mkdir -p "$dest"; }
             args=${PEERS_ARGS:-} limit=${T_PEERS:-580}
             [ "$i" = 1 ] && [ -n "${PEERS_ARGS_FIRST:-}" ] && args=$PEERS_ARGS_FIRST
             [ "$i" = 1 ] && [ -n "${T_PEERS_FIRST:-}" ] && limit=$T_PEERS_FIRST
             echo "peers $i/$n: limit $limit s, arguments: ${args:-none}" | tee -a "$OUT/stages.txt"
             timeout "$limit" python3 -m anvil_fast.bench peers --out "$dest" --no-progress \
               --budget-s $(( limit - 30 )) --note "${PEERS_NOTE:-nvidia-h200}${PEERS_REPEATS:+ (run $i of $n)}" \
               $args 2>&1 | tee "$dest/bench_peers.log" | grep -E "^  |stopped|error"
           done ;;
    lrfinal) # the final horizon's learning-rate neighbours (papers/lr_final.py): LR_SETTINGS="name=lr ..." each one
           # process of papers.train at the protocol's chosen values but lr, 4000 steps, seeds LR_SEEDS (0 1 2), all at
           # once; into $OUT/lr_final/<name>-<lr><LR_TAG>/ (copy them to results/train_lr_final/)
           # (a setting may name its own seeds: name=lr@5,6,7)
           for s in ${LR_SETTINGS:?lrfinal needs LR_SETTINGS}; do
             spec=${s%@*} seeds=${LR_SEEDS:-0 1 2}
             [ "$spec" != "$s" ] && seeds=$(echo "${s#*@}" | tr , ' ')
             n=${spec%=*} v=${spec#*=}
             ( ANVIL_COMMIT="${ANVIL_COMMIT:-unknown (ANVIL_COMMIT not given)}" timeout "${T_LR:-500}" python3 -m papers.train \
               --contenders "$n" --tuned-from results/train/protocol --lr "$n=$v" --steps 4000 --seeds $seeds \
               --jobs "$(echo $seeds | wc -w)" --timing-steps 0 --out "$OUT/lr_final/$n-$v${LR_TAG:-}" \
               --time-budget-s $(( ${T_LR:-500} - 15 )) > "$OUT/lr_final_$n-$v${LR_TAG:-}.log" 2>&1; \
               echo "$n $v${LR_TAG:-} seeds $seeds rc $?" >> "$OUT/lr_final_status.txt" ) &
           done
           wait
           cat "$OUT/lr_final_status.txt"
           grep -h "val loss" "$OUT"/lr_final_*.log | sed 's/ -> .*//' ;;
    tail)  # the explosion tail at the bank shapes: every form on the same near-low-rank inputs, TAIL_SECONDS per shape
           timeout "${T_TAIL:-500}" python3 -m anvil_fast.studies.tail --seconds "${TAIL_SECONDS:-100}" ${TAIL_ARGS:-} \
             --json "$OUT/tail.json" 2>&1 | tee "$OUT/tail.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
stamp done
# the training stage writes its runs into the tree's results/train: they come back as one tarball
[ -n "${RAN_TRAIN:-}" ] && tar czf "$OUT/results_train.tgz" results/train
pack
exit 0
