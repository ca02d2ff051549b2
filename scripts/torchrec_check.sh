#!/usr/bin/env bash
# The optional TorchRec group: embstore.torch.EmbeddingBagCollection against
# TorchRec's own EmbeddingBagCollection (tests/test_torchrec.py). TorchRec and
# FBGEMM pin their own torch, so they get a venv of their own:
#   torch 2.14.1 + fbgemm-gpu-cpu 1.9.0 (the CPU build; torchrec's own
#   dependency, the CUDA fbgemm-gpu, would overwrite its files) + torchrec 1.9.2.
# Downloads about 3 GB on first use. Usage: bash scripts/torchrec_check.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-torchrec}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_QUIET=1
[ -x "$venv/bin/python" ] || python -m venv "$venv"
"$venv/bin/pip" install "torch==2.14.1" "fbgemm-gpu-cpu==1.9.0" pytest pyre-extensions \
  tensordict torchmetrics tqdm iopath
"$venv/bin/pip" install --no-deps "torchrec==1.9.2"
"$venv/bin/pip" install --no-deps .
"$venv/bin/pip" install numpy "array-api-compat>=1.11" "array-api-extra>=0.7"
cd tests/..  # tests import as the package "tests"
"$venv/bin/python" -m pytest -q -p no:randomly -p no:cacheprovider -o addopts="" \
  -W ignore tests/test_torchrec.py -rs
