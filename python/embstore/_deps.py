"""Optional dependencies, imported lazily with an install hint."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise ImportError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{module} is needed for this feature of embstore: "
            f'pip install "embstore[{extra}]" (or pip install {module})'
        ) from e
