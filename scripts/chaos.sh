#!/usr/bin/env bash
# The chaos run of tests/chaos.py, longer than the suite's minute:
#   bash scripts/chaos.sh [SECONDS] [THREADS] [SEED]
# 8 threads mix every public method of Table, Collection (tables shared in
# opposite orders) and DeviceCache with save/load/export/reserve/evict, under
# a watchdog; then exact SGD totals and loadable checkpoints. Prints the seed
# first and the figures (calls, hangs, lost updates) last.
set -euo pipefail
cd "$(dirname "$0")/.."
args=(--seconds "${1:-600}" --threads "${2:-8}")
if [[ -n "${3:-}" ]]; then args+=(--seed "$3"); fi
exec python -m tests.chaos "${args[@]}"
