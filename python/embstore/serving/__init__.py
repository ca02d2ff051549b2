"""The standalone embedding cache: a table served from a checkpoint's files
mapped into memory (:class:`MappedTable`, ``Table.load(path, mmap=True)``),
shared by every process that maps it and following live publishes, and the
trainer's side that publishes to it (:class:`Publisher`)."""

from __future__ import annotations

from embstore.serving.mapped import MappedTable
from embstore.serving.publisher import Publisher

__all__ = ["MappedTable", "Publisher"]
