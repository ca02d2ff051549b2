#!/usr/bin/env bash
# The whole test suite: Rust format, lints and tests, Python lints, the stub
# check of the native module, and pytest. Run after `pip install ".[test]"`.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v cargo >/dev/null || { echo "check.sh: cargo is required (https://rustup.rs)" >&2; exit 1; }
# rustfmt and clippy are rustup components a minimal toolchain lacks.
for comp in rustfmt clippy; do
  if ! rustup component list --installed 2>/dev/null | grep -q "^$comp"; then
    echo "== rustup component add $comp"
    rustup component add "$comp"
  fi
done

step() { echo "== $1 [${SECONDS} s into check.sh]"; }
step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
step "cargo test"
cargo test --workspace
step "ruff"
ruff check python tests benches
ruff format --check python tests benches
# mypy and stubtest use one core for about 40 s; they run beside the loom
# build, and their output is shown, and their status checked, after it.
step "mypy (package) and stubtest (native module against _core.pyi), in the background"
typing_log=$(mktemp)
( python -m mypy &&
  python -m mypy.stubtest embstore._core --allowlist .mypy-stubtest-allowlist ) \
    >"$typing_log" 2>&1 &
typing_pid=$!
# A feature, not RUSTFLAGS="--cfg loom" in a target dir of its own: the
# check reuses every dependency `cargo test` just built and compiles only
# loom's own and the core crate (1 min 1 s here against 1 min 34 s).
# Its build here; its model run (one core, about 40 s) beside pytest below,
# where the two workers' slow tests wait on subprocesses much of the time
# (the run took 129-136 s on its own before pytest, 2026-12-04).
step "loom: the lock-free read protocol and the disk tier's hand-off of a round under every interleaving (--features loom): the build"
cargo test -p embstore-core --features loom --lib --no-run
step "mypy and stubtest: their result"
typing_status=0
wait "$typing_pid" || typing_status=$?
cat "$typing_log"
rm -f "$typing_log"
if [ "$typing_status" -ne 0 ]; then
  echo "check.sh: mypy or stubtest failed (exit $typing_status)" >&2
  exit "$typing_status"
fi
# One pytest run of every test, default and slow, in two worker processes
# (pytest-xdist, work stealing): much of the slow tests' time waits on
# subprocesses, MPI ranks and fixed-length chaos runs, which overlap the
# default tests' CPU work, and no worker idles while the other ends a long
# test. On 2 cores the default run took 123 s alone and 84 s in two
# workers, the slow run 318 s and 196 s (machine E, 2026-11-28); as one
# run of both, see benches/RESULTS.md. PYTEST_WORKERS=1 runs them in this
# process instead; `python -m pytest` alone runs the default set only.
workers=(-n "${PYTEST_WORKERS:-2}" --dist worksteal)
step "loom's model run in the background, and pytest: the default and the slow tests (subprocesses, MPI ranks, the chaos run with a fixed seed), ${PYTEST_WORKERS:-2} workers"
loom_log=$(mktemp)
cargo test -p embstore-core --features loom --lib -- seqlock handoff >"$loom_log" 2>&1 &
loom_pid=$!
pytest_status=0
python -m pytest -q -p no:randomly "${workers[@]}" -m "slow or not slow" \
    --chaos-seed=20261124 --chaos-seconds=20 --durations=15 "$@" || pytest_status=$?
step "loom: its result"
loom_status=0
wait "$loom_pid" || loom_status=$?
cat "$loom_log"
rm -f "$loom_log"
if [ "$loom_status" -ne 0 ] || [ "$pytest_status" -ne 0 ]; then
  echo "check.sh: loom exited $loom_status, pytest $pytest_status" >&2
  exit 1
fi
step "benches, once each with timing off (pytest benches --benchmark-enable times them)"
python -m pytest -q -p no:randomly benches
step "done"
