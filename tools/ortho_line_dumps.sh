#!/usr/bin/env bash
# One line of results/h200_orthogonalizers/commands.txt (bash tools/ortho_line_dumps.sh LINE SECONDS, on the
# device, from the repository root), its JSON in $OUT, with faulthandler dumping every thread's stack each 35 s:
# where a line spends its time when its rows do not come
eval "$(sed -n '/^install_peers()/,/^}/p' tools/h200_session.sh)"
install_peers
export PYTHONUNBUFFERED=1 PYTHONPATH="$PYTHONPATH:$PWD/.peers/dion"
line=${1:-3}
args=$(grep -v '^#' results/h200_orthogonalizers/commands.txt | grep . | sed -n "${line}p" \
  | sed 's/^PYTHONPATH=\.peers\/dion python -m anvil_fast\.studies\.difftest //; s/; cp.*$//' \
  | sed "s|--json [^ ]*|--json $OUT/l$line.json|")
echo "args: $args"
timeout -s INT "${2:-150}" python3 -c "
import faulthandler, sys, runpy, shlex
faulthandler.dump_traceback_later(35, repeat=True, file=sys.stderr)
sys.argv = ['difftest'] + shlex.split(sys.argv[1])
runpy.run_module('anvil_fast.studies.difftest', run_name='__main__')" "$args" > "$OUT/diag$line.log" 2>&1
echo "rc=$?"
grep -v '^  File "/opt\|^  File "/tmp/site' "$OUT/diag$line.log" | tail -c 7000
