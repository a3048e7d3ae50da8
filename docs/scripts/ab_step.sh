#!/bin/bash
# A/B of one module in one call on one machine: the optimizer step with the previous and the new
# lwjax/step.py, alternating (new, old, new, old). Put the two versions in .old/ first:
#   git show <base>:lwjax/step.py > .old/step_old.py; cp lwjax/step.py .old/step_new.py
# then run (extra arguments go to lwjax bench): bash docs/scripts/ab_step.sh [--pipeline-muon ...]
set -e
export PYTHONPATH=.
for v in new old new old; do
  cp ".old/step_$v.py" lwjax/step.py
  echo "=== $v $*"
  python3 -c 'import sys; from lwjax.tools.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench --workload 1b --dp 4 --no-baselines --json "$@" | grep -E '"step_ms"|"back_to_back_ms"'
done
cp .old/step_new.py lwjax/step.py
