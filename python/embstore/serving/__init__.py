"""The standalone embedding cache: a table served from a checkpoint's files
mapped into memory (:class:`MappedTable`, ``Table.load(path, mmap=True)``),
shared by every process that maps it and following live publishes, the
trainer's side that publishes to it (:class:`Publisher`), and the copy of
a trainer's publishes on a serving host of its own (:class:`Replica`)."""

from __future__ import annotations

from embstore.serving.mapped import MappedTable
from embstore.serving.publisher import Publisher
from embstore.serving.replica import Replica, ReplicaError

__all__ = ["MappedTable", "Publisher", "Replica", "ReplicaError"]
