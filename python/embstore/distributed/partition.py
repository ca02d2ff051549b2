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

__all__ = ["BUCKETS", "Partition"]

#: Buckets of a "bucket" partition by default: whole buckets move in a
#: reshard, so a rank's share is within 1 / BUCKETS of even.
BUCKETS = 1024


@dataclasses.dataclass(frozen=True)
class Partition:
    """Keys spread over ``world_size`` ranks by ``kind``: "hash" (a mixing
    hash of the key, even for sequential keys), "mod" (key mod world size),
    "div" (contiguous ranges of ``[0, key_space)``, which it needs), or
    "bucket": keys hashed into ``len(buckets)`` buckets (default
    :data:`BUCKETS`), ``buckets[b]`` the rank of bucket ``b`` (default:
    contiguous runs of buckets), so that a reshard moves whole buckets and
    no more of them than it must (:meth:`resized`). ``version`` is the
    record's format (1). Checked when made; a bad field raises naming it."""

    kind: str = "hash"
    world_size: int = 1
    key_space: int | None = None
    version: int = 1
    buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind != "bucket":
            check_name("partition", "partitions", self.kind)
        check_int("world_size", self.world_size, 1, 1 << 30)
        if self.kind == "bucket":
            b = self.buckets
            if b is None:
                b = tuple(i * self.world_size // BUCKETS for i in range(BUCKETS))
            b = tuple(int(r) for r in b)
            if not 1 <= len(b) <= 1 << 20:
                raise ValueError(f"buckets: expected 1 to 2^20 buckets, got {len(b)}")
            if any(not 0 <= r < self.world_size for r in b):
                raise ValueError(
                    f"buckets: expected ranks in [0, {self.world_size}), got "
                    f"{next(r for r in b if not 0 <= r < self.world_size)}"
                )
            object.__setattr__(self, "buckets", b)
        elif self.buckets is not None:
            raise ValueError(f'buckets: only with partition="bucket", not {self.kind!r}')
        if self.key_space is not None:
            check_int("key_space", self.key_space, 1, 2**63 - 1)
        if self.kind == "div" and self.key_space is None:
            raise ValueError('key_space: expected key_space > 0 with partition="div"')
        if self.version != 1:
            raise ValueError(f"version: expected 1, got {self.version!r}")

    def owners(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
        """The rank that owns each key (-1: outside a "div" key space)."""
        if self.buckets is not None:
            of = ops.partition_owners(keys, len(self.buckets), "hash", None)
            out: npt.NDArray[np.int32] = np.asarray(self.buckets, np.int32)[of]
            return out
        return ops.partition_owners(keys, self.world_size, self.kind, self.key_space)

    def plan(
        self, keys: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """:func:`embstore.ops.plan_exchange` of ``keys`` under this partition:
        the distinct keys grouped by owner, each key's index among them, the
        count each rank owns."""
        if self.buckets is None:
            return ops.plan_exchange(keys, self.world_size, self.kind, self.key_space)
        uniq, inv = ops.unique_inverse(keys)
        owners = self.owners(uniq)
        order = np.argsort(owners, kind="stable")
        where = np.empty(len(order), np.int64)
        where[order] = np.arange(len(order), dtype=np.int64)
        counts = np.bincount(owners, minlength=self.world_size).astype(np.int64)
        return uniq[order], where[inv], counts

    def resized(self, world_size: int, keep: Mapping[int, int] | None = None) -> Partition:
        """The same partition over ``world_size`` ranks (a checkpoint loaded
        onto another number of ranks, a reshard). "bucket": as few buckets
        move as can, to ``len(buckets) / world_size`` a rank (within one):
        a bucket stays where its rank goes on, ``keep`` mapping an old rank
        to its new one (default: rank r stays rank r where both exist); the
        rest go to the ranks short of their share, in order."""
        check_int("world_size", world_size, 1, 1 << 30)
        if self.buckets is None:
            return dataclasses.replace(self, world_size=world_size)
        if keep is None:
            keep = {r: r for r in range(min(self.world_size, world_size))}
        n = len(self.buckets)
        share = [n // world_size + (1 if r < n % world_size else 0) for r in range(world_size)]
        held = [0] * world_size
        new = [-1] * n
        for b, r in enumerate(self.buckets):
            q = keep.get(r)
            if q is not None and 0 <= q < world_size and held[q] < share[q]:
                new[b], held[q] = q, held[q] + 1
        q = 0
        for b in range(n):
            if new[b] < 0:
                while held[q] >= share[q]:
                    q += 1
                new[b], held[q] = q, held[q] + 1
        return dataclasses.replace(self, world_size=world_size, buckets=tuple(new))

    def to_record(self) -> dict[str, Any]:
        """The record a manifest holds (``key_space`` only when set)."""
        record = dataclasses.asdict(self)
        if record["key_space"] is None:
            del record["key_space"]
        if record["buckets"] is None:
            del record["buckets"]
        else:
            record["buckets"] = list(record["buckets"])
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
            buckets=None if record.get("buckets") is None else tuple(record["buckets"]),
        )
