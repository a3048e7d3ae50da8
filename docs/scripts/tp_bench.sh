#!/bin/bash
# The optimizer step at dp x tp against Megatron-Core in one call, one line of JSON per contender:
#   bash docs/scripts/tp_bench.sh DP TP MODE... (run from the repository root; megatron-core and
#   emerging_optimizers importable, e.g. from wheels: see shared/perf/README.md)
# Each mode runs lwjax (tensor_axis="tp", MuonConfig(tp_mode=MODE)) and docs/scripts/megatron_bench.py
# (--tp, --muon-tp-mode MODE) on dp * tp GPUs, 8b workload with 4 layers, clipping idle.
set -e
dp=$1; tp=$2; shift 2
for mode in "$@"; do
  echo "=== dp $dp tp $tp $mode"
  python3 -c 'import sys; from lwjax.tools.cli import main; sys.exit(main(sys.argv[1:]))' \
    bench --workload 8b --layers 4 --dp "$dp" --tp "$tp" --tp-mode "$mode" --iters 10 \
    --grad-std 2e-5 --no-baselines --megatron docs/scripts/megatron_bench.py --json
done
