"""The old home of :class:`ShardedTable` and :class:`ShardedCollection`
(now :mod:`embstore.distributed.table` and
:mod:`embstore.distributed.collection`: they run over MPI or
torch.distributed alike). Importing them from here still works for a
release, with a DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = {
    "ShardedTable": "embstore.distributed.table",
    "ShardedCollection": "embstore.distributed.collection",
    "Collection": "embstore.distributed.collection",
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    where = _MOVED[name]
    new = "ShardedCollection" if name == "Collection" else name
    warnings.warn(
        f"embstore.distributed.mpi.{name} is now {where}.{new} (embstore.distributed.{new}); "
        "the old path goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(where), new)
