#!/usr/bin/env bash
# The prepared check for a machine with one GPU (<= 8 minutes): environment facts, `pytest -m cuda`, then
# the GPU benchmarks, each as JSON plus one markdown summary (experiments/gpu/check.py says what runs).
#
#   bash experiments/gpu/check.sh [--out DIR]     # on the GPU machine; results in DIR (default $OUT or
#                                                 # experiments/gpu/results)
#   bash experiments/gpu/check.sh --smoke         # the same steps on the CPU, tiny, in under a minute
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python experiments/gpu/check.py "$@"
