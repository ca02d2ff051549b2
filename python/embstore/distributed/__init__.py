"""Sharding across processes and machines over MPI (needs mpi4py:
``pip install "embstore[mpi]"``, which also brings Open MPI from PyPI).

Importing this package does not import mpi4py; building a
:class:`ShardedTable` does.
"""

from __future__ import annotations

from embstore.distributed.mpi import Collection, ShardedTable

__all__ = ["Collection", "ShardedTable"]
