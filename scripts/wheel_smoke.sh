#!/usr/bin/env bash
# Installs a built wheel into a fresh virtual environment whose PATH has no
# Rust toolchain (nothing can be compiled there), then runs the README's
# quick example in it. Usage: bash scripts/wheel_smoke.sh WHEEL
set -euo pipefail
cd "$(dirname "$0")/.."
wheel="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
venv=$(mktemp -d)/venv
python -m venv "$venv"
# PATH without cargo/rustc: only the venv and the system's own directories.
export PATH="$venv/bin:/usr/local/bin:/usr/bin:/bin"
if command -v cargo >/dev/null || command -v rustc >/dev/null; then
  echo "wheel_smoke: a Rust toolchain is still on PATH" >&2
  exit 1
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel"
# The README's first example, as written.
example=$(python - <<'PY'
import re, pathlib
blocks = re.findall(r"```python\n(.*?)```", pathlib.Path("README.md").read_text(), re.S)
print(blocks[0])
PY
)
cd "$(dirname "$venv")"
"$venv/bin/python" -c "$example"
"$venv/bin/python" -c "import embstore, sys; print('wheel smoke test passed:', embstore.__version__, embstore.Table(4).simd, sys.version.split()[0])"
