#!/usr/bin/env bash
# The probe in the trees of four commits (git archives under /tmp), into probe.log:
#   bash run_probe.sh > probe.log      (from this folder, in a checkout that has these commits)
set -e
here=$(pwd); root=$(git rev-parse --show-toplevel)
(cd "$root" && python "$here/gram_side_probe.py" make)
for c in 6f04124 b91fd8e d4877b5 a56603b; do
  rm -rf "/tmp/probe_$c" && mkdir "/tmp/probe_$c"
  (cd "$root" && git archive "$c" | tar -x -C "/tmp/probe_$c" --exclude=results)
  (cd "/tmp/probe_$c" && python "$here/gram_side_probe.py" "$c")
done
(cd /tmp/probe_a56603b && python "$here/gram_side_probe.py" detail 12821)
