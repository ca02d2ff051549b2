#!/usr/bin/env bash
# Installs a built wheel into a fresh virtual environment whose PATH has no
# Rust toolchain (nothing can be compiled there) and runs, as written, every
# install command that README.md and the library's ImportError hints name,
# each followed by the example it enables (tests/test_readme.py checks that
# every README command is here or in .ci/run):
#   pip install dist/embstore-*.whl                  -> the README's quick example
#   pip install "$(ls dist/embstore-*.whl)[torch]"   -> the README's torch example
#   pip install <each hint of embstore._deps.EXTRAS> -> mpi: the README's MPI
#     script under mpirun; plot: cache-curve --png; gpu: cupy imports and
#     DeviceCache(xp=cupy) refuses this GPU-less machine with one clear error
#   pip install torch --index-url .../whl/cpu, then the wheel's [torch] ->
#     torch's CPU build kept (where download.pytorch.org resolves; said if not)
# then, in the same venv with cargo back on PATH, the checkout forms
#   pip install ., ".[mpi]", ".[plot]", ".[mpi,plot]", ".[gpu]", ".[torch]",
#   ".[test]" (the forms README.md and the hints name) -> they import
# Usage: bash scripts/wheel_smoke.sh WHEEL   (run from anywhere)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
wheel="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
work=$(mktemp -d)
# The venvs hold torch (gigabytes): removed however this script ends.
trap 'rm -rf "$work"' EXIT
# Nothing downloaded here is cached (the wheels would double the disk used).
export PIP_NO_CACHE_DIR=1
venv=$work/venv
python -m venv "$venv"
readme_block() {  # the README's python block whose text contains $1
  python - "$1" <<'PY'
import pathlib, re, sys
blocks = re.findall(r"```py(?:thon)?\n(.*?)```", pathlib.Path("README.md").read_text(), re.S)
print(next(b for b in blocks if sys.argv[1] in b))
PY
}
quick=$(readme_block "table.reserve(100_000)")
torch_example=$(readme_block "import embstore.torch as et")
mpi_example=$(readme_block "mpirun -n 4 python train.py")
# The README's wheel-with-extras command, as written (it lists dist/).
wheel_extra_cmd=$(grep -o 'pip install "$(ls dist/embstore-\*.whl)\[torch\]"' README.md)

(
  # PATH without cargo/rustc: only the venv and the system's own directories.
  export PATH="$venv/bin:/usr/local/bin:/usr/bin:/bin"
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_QUIET=1
  if command -v cargo >/dev/null || command -v rustc >/dev/null; then
    echo "wheel_smoke: a Rust toolchain is still on PATH" >&2
    exit 1
  fi
  set -x
  # The README's commands run where they say: in a directory whose dist/
  # holds the wheel.
  mkdir -p "$work/w/dist" && cp "$wheel" "$work/w/dist/"
  cd "$work/w"
  pip install dist/embstore-*.whl
  (cd "$work" && python -c "$quick")
  python -c "import embstore, sys; print('wheel:', embstore.__version__, embstore.Table(4).simd, sys.version.split()[0])"

  # The README's wheel-with-extras form, then the README's torch example.
  eval "$wheel_extra_cmd"
  (cd "$work" && python -c "$torch_example")

  # Each hint the library prints for a missing optional dependency.
  for extra in torch mpi plot metrics progress replicate gpu; do
    hint=$(python -c "from embstore._deps import EXTRAS; print(EXTRAS['$extra'])")
    # shellcheck disable=SC2086  # the hint is a list of package names
    pip install $hint
  done
  printf '%s\n' "$mpi_example" > "$work/train.py"
  (cd "$work" && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1 \
    timeout 300 mpirun --oversubscribe -n 2 python train.py)
  test -f "$work/ckpt/manifest.json"
  python -c "import numpy as np; np.save('$work/keys.npy', np.random.default_rng(0).zipf(1.2, 10000) % 3000)"
  # The bench's published schema travels in the wheel.
  python -m embstore bench --schema | python -c "import json, sys; assert json.load(sys.stdin)[\"title\"]"
  python -m embstore cache-curve "$work/keys.npy" --sizes 10 100 1000 --png "$work/curve.png"
  test -s "$work/curve.png"
  # The metrics extra: an endpoint on loopback, scraped.
  python - <<'PY'
import urllib.request, numpy as np, embstore
from embstore import metrics
t = embstore.Table(4)
t.lookup(np.arange(5))
with metrics.serve(0, tables={"t": t}) as h:
    text = urllib.request.urlopen(h.url, timeout=10).read().decode()
assert 'embstore_lookups_total{table="t"} 5.0' in text, text
print("metrics: scraped", h.url)
PY
  # The replicate extra: a checkpoint served by Python's own HTTP server
  # (no byte ranges), copied by a replica, read mapped.
  python - <<'PY'
import functools, http.server, tempfile, threading, numpy as np, embstore
from embstore.serving import Replica
src, local = tempfile.mkdtemp(), tempfile.mkdtemp()
t = embstore.Table(4)
t.lookup(np.arange(100))
t.save(src)
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=src)
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
with Replica(f"http://127.0.0.1:{server.server_address[1]}", local, start=False) as r:
    assert r.poll()
assert np.array_equal(embstore.Table.load(local, mmap=True).lookup(np.arange(100)), t.lookup(np.arange(100)))
server.shutdown()
print("replicate: served over HTTP, copied and read")
PY
  python - <<'PY'
import cupy, numpy as np, embstore
from embstore.gpu import DeviceCache
try:
    DeviceCache(embstore.Table(4), rows=8, xp=cupy)
except RuntimeError as e:
    assert str(e).startswith("xp: cupy was asked for, but "), e
    print("cupy without a GPU refused:", e)
else:
    print("a GPU is usable here: DeviceCache runs on cupy")
PY
)

# torch's CPU build from PyTorch's own index, then the wheel's [torch] on
# top of it (pip keeps that torch), where the index is reachable: the
# machines CI runs on reach PyPI only, and this says so when it cannot run.
if python -c "import socket; socket.getaddrinfo('download.pytorch.org', 443)" 2>/dev/null; then
  (
    python -m venv "$work/cpu"
    export PATH="$work/cpu/bin:/usr/local/bin:/usr/bin:/bin" PIP_DISABLE_PIP_VERSION_CHECK=1
    export PIP_ROOT_USER_ACTION=ignore PIP_QUIET=1
    set -x
    cd "$work/w"
    pip install torch --index-url https://download.pytorch.org/whl/cpu
    eval "$wheel_extra_cmd"
    python -c "import torch; assert torch.version.cuda is None, torch.version.cuda; print('torch CPU build kept:', torch.__version__)"
    (cd "$work" && python -c "$torch_example")
  )
else
  echo "wheel_smoke: download.pytorch.org does not resolve from this machine; the README's CPU-build command was not run"
fi

# The checkout forms, in the same venv with the Rust toolchain back on PATH
# (they build from source; the builds reuse target/). torch is already
# there from the wheel's [torch], so ".[torch]" downloads nothing again.
(
  export PATH="$venv/bin:$PATH" PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
  export PIP_QUIET=1
  set -x
  cd "$repo"
  pip install .
  pip install ".[mpi]"
  pip install ".[plot]"
  pip install ".[metrics]"
  pip install ".[progress]"
  pip install ".[replicate]"
  pip install ".[mpi,plot]"
  pip install ".[gpu]"
  pip install ".[torch]"
  pip install ".[test]"  # the README's test extra (its torch etc. are already here)
  cd "$work"
  python -c "import embstore, mpi4py.MPI, matplotlib, cupy, torch, pytest, xxhash; print('checkout install with every extra:', embstore.__version__)"
  python -c "$torch_example"
)
echo "wheel smoke test passed"
