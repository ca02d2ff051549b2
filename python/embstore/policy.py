"""Memory policies for :class:`embstore.Table`: which keys get a row.

At billions of ids most keys are seen once and never again. An admission
filter gives a key a row only once it has proven itself; until then its
lookups return the initializer's row without storing it and its gradients
are dropped (counted as ``rejected`` in ``stats()``). Eviction (``ttl_steps``,
``capacity``, ``eviction``) is configured on the Table itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from embstore._convert import NativeConfig

__all__ = ["Admission", "CountFilter", "ProbabilityFilter"]


@dataclass(frozen=True)
class Admission(NativeConfig):
    """Base class of the admission filters, validated natively."""

    _kind = "admission"
    _name: ClassVar[str]

    def _native(self) -> tuple[str, dict[str, float]]:
        return self._name, super()._native()[1]


@dataclass(frozen=True)
class CountFilter(Admission):
    """Admit a key once ``min_count`` gradient calls have held it.

    A sighting is a call of ``apply_gradients`` or ``apply_pooled_gradients``
    whose batch holds the key, however often: a batch deduplicated on its way
    to the table (by a ShardedTable or a DeviceCache) counts the same.
    Lookups do not count. Sightings are counted in a count-min sketch
    of ``depth`` rows of ``width`` 8-bit counters with conservative update,
    split evenly over the table's shards: ``width * depth`` bytes in all and
    nothing per key. In the call where a key's count reaches ``min_count``
    it gets a row and that call's gradients.

    Error bound: a count-min sketch never under-counts, so a key is never
    admitted late. It may over-count and admit a key early: with probability
    at least ``1 - exp(-depth)`` a key's count exceeds its true count by at
    most ``e * n / width_per_shard``, where ``n`` is the number of sightings
    (key, call) of not-yet-admitted keys in the key's shard and ``width_per_shard =
    ceil(width / num_shards)``. For ``min_count=2`` the chance that a key
    seen once is admitted is about ``(1 - exp(-u / width))**depth``, ``u``
    the number of distinct unadmitted keys seen so far: size ``width`` at
    several times the number of one-off keys you expect.
    ``Table.admission_counts(keys)`` shows the sketch's estimates. The sketch
    is not saved in checkpoints: counts of unadmitted keys restart after a load.
    """

    _name = "count"
    min_count: int
    width: int = 1 << 23
    depth: int = 4


@dataclass(frozen=True)
class ProbabilityFilter(Admission):
    """Admit an unadmitted key with probability ``p`` at each gradient sighting.

    The draw is a hash of (table seed, key, optimizer step): the same in
    every run and on every rank of a ShardedTable. A key seen in ``k``
    distinct steps is admitted with probability ``1 - (1 - p)**k``, so
    frequent keys get in quickly and one-off keys rarely.
    """

    _name = "probability"
    p: float
