"""How a sharded table spreads its keys over its ranks: one
:class:`Partition` value, what every exchange plans with and what a
sharded checkpoint records (its manifest's ``partition``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import ops
from embstore._convert import check_int, check_name

__all__ = ["Partition"]


@dataclasses.dataclass(frozen=True)
class Partition:
    """Keys spread over ``world_size`` ranks by ``kind``: "hash" (a mixing
    hash of the key, even for sequential keys), "mod" (key mod world size)
    or "div" (contiguous ranges of ``[0, key_space)``, which it needs).
    ``version`` is the record's format (1). Checked when made; a bad field
    raises naming it."""

    kind: str = "hash"
    world_size: int = 1
    key_space: int | None = None
    version: int = 1

    def __post_init__(self) -> None:
        check_name("partition", "partitions", self.kind)
        check_int("world_size", self.world_size, 1, 1 << 30)
        if self.key_space is not None:
            check_int("key_space", self.key_space, 1, 2**63 - 1)
        if self.kind == "div" and self.key_space is None:
            raise ValueError('key_space: expected key_space > 0 with partition="div"')
        if self.version != 1:
            raise ValueError(f"version: expected 1, got {self.version!r}")

    def owners(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
        """The rank that owns each key (-1: outside a "div" key space)."""
        return ops.partition_owners(keys, self.world_size, self.kind, self.key_space)

    def plan(
        self, keys: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """:func:`embstore.ops.plan_exchange` of ``keys`` under this partition."""
        return ops.plan_exchange(keys, self.world_size, self.kind, self.key_space)

    def resized(self, world_size: int) -> Partition:
        """The same partition over ``world_size`` ranks (a checkpoint loaded
        onto another number of ranks)."""
        return dataclasses.replace(self, world_size=world_size)

    def to_record(self) -> dict[str, Any]:
        """The record a manifest holds (``key_space`` only when set)."""
        record = dataclasses.asdict(self)
        if record["key_space"] is None:
            del record["key_space"]
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Partition:
        """A partition from a manifest's record, checked."""
        if not isinstance(record, Mapping):
            raise TypeError(f"partition: expected a mapping, got {type(record).__name__}")
        return cls(
            kind=record.get("kind", ""),
            world_size=record.get("world_size", 0),
            key_space=record.get("key_space"),
            version=record.get("version", 0),
        )
