#!/usr/bin/env bash
# The core's unit tests under Miri (undefined behaviour, data races and
# out-of-bounds accesses in its unsafe code: output buffers written by many
# shard jobs, fallible zeroed allocation, arena rows, SIMD dispatch).
# Needs a nightly toolchain with the miri component:
#   rustup toolchain install nightly --component miri
# Run: the tests of the modules with unsafe code (test names filtered),
# less those of what Miri cannot run (files opened with O_NOFOLLOW /
# O_NONBLOCK, flock, getrlimit, allocations meant to fail past the address
# space) and the long statistical ones (minutes each under Miri).
# Usage: bash scripts/miri.sh [more test-name filters]
set -euo pipefail
cd "$(dirname "$0")/.."
only=(
  zeroed:: simd::tests table::output table::arena table::shard table::memo
  table::lookup table::pooled table::evict table::write table::apply policy::
)
skip=(
  table::pages::tests::available_memory
  zeroed::tests::zeroed_vectors_hold_zeros_and_sizes_past_the_address_space_fail
)
args=("${only[@]}")
for s in "${skip[@]}"; do args+=(--skip "$s"); done
MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation}" \
  cargo +nightly miri test -p embstore-core --lib -- "${args[@]}" "$@"
