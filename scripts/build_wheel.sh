#!/usr/bin/env bash
# Builds the portable wheel: abi3 (one wheel for CPython >= 3.10),
# manylinux2014 (glibc 2.17: RHEL/Rocky 7+, Ubuntu 18.04+, Debian 10+),
# linked with zig from PyPI (no container needed), then checks it with
# auditwheel. Usage: bash scripts/build_wheel.sh [OUT_DIR]   (default dist/)
# Needs a Rust toolchain (rustup); takes about 3 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-dist}"
python -m pip install -q "maturin>=1.9.4,<2" "ziglang>=0.13" "auditwheel>=6"
rm -f "$out"/embstore-*.whl
python -m maturin build --release --zig --compatibility manylinux2014 --out "$out"
wheel=$(ls "$out"/embstore-*.whl)
# auditwheel's report is captured whole, then searched: a `grep -q` in the
# pipe stops reading at the first match, and under pipefail auditwheel's
# EPIPE would then fail a good wheel.
report=$(python -m auditwheel show "$wheel")
echo "$report"
grep -q 'manylinux_2_17_x86_64' <<<"$report" || {
  echo "build_wheel: $wheel is not manylinux_2_17 (manylinux2014)" >&2
  exit 1
}
echo "$wheel"
