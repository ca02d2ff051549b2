"""embstore: an embedding store for huge sparse features.

Sharded int64-keyed tables of learned rows with native sparse optimizers,
callable from any training loop (NumPy, PyTorch, CuPy).
"""

from __future__ import annotations

from embstore import init, optim, policy
from embstore._core import __version__
from embstore.collection import Collection
from embstore.exceptions import CheckpointError, EmbstoreError
from embstore.store import Table

__all__ = [
    "CheckpointError",
    "Collection",
    "EmbstoreError",
    "Table",
    "__version__",
    "init",
    "optim",
    "policy",
]
