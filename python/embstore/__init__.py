"""embstore: an embedding store for huge sparse features.

Sharded int64-keyed tables of learned rows with native sparse optimizers,
callable from any training loop (NumPy, PyTorch, CuPy).
"""

from __future__ import annotations

from embstore import init, optim, policy
from embstore._core import __version__
from embstore._core import free_output_buffers as _free_output_buffers
from embstore._core import output_buffer_stats as _output_buffer_stats
from embstore.collection import Collection
from embstore.config import TableConfig
from embstore.exceptions import CheckpointError, EmbstoreError, ReadOnlyError
from embstore.serving.mapped import MappedTable
from embstore.store import Table, manual_seed
from embstore.strings import hash_keys

__all__ = [
    "CheckpointError",
    "Collection",
    "EmbstoreError",
    "MappedTable",
    "ReadOnlyError",
    "Table",
    "TableConfig",
    "__version__",
    "free_output_buffers",
    "hash_keys",
    "init",
    "manual_seed",
    "optim",
    "output_buffers",
    "policy",
]


def free_output_buffers() -> int:
    """Give the kept output buffers back to the OS; returns their bytes.

    Large outputs (4 MiB and up) of ``lookup``, ``lookup_pooled`` and
    ``Collection.lookup_pooled`` live in buffers that are kept when their
    array is freed (at most 4 buffers, 2 GiB) and reused by the next call of
    about the same size, so a training step writes into memory that is
    already mapped instead of faulting in fresh pages. Call this to release
    them, e.g. after training, before a memory-hungry phase.
    """
    return _free_output_buffers()


def output_buffers() -> dict[str, int]:
    """The kept output buffers (see :func:`free_output_buffers`): memory
    that no table's ``stats()`` counts, since no table owns it.

    Returns ``{"buffers": n, "bytes": b, "max_buffers": 4, "max_bytes":
    2**31}``: ``bytes`` stays resident until :func:`free_output_buffers`
    (or until a later call of another size displaces a buffer); it never
    exceeds ``max_bytes``.
    """
    n, b, max_n, max_b = _output_buffer_stats()
    return {"buffers": n, "bytes": b, "max_buffers": max_n, "max_bytes": max_b}
