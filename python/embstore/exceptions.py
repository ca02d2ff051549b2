"""embstore's own exceptions (bad arguments raise TypeError/ValueError)."""

from __future__ import annotations

from embstore._core import CheckpointError, EmbstoreError

__all__ = ["CheckpointError", "EmbstoreError", "ReadOnlyError"]


class ReadOnlyError(EmbstoreError):
    """A call that would change rows, on a read-only table (one loaded with
    ``Table.load(path, mmap=True)``): nothing changed."""
