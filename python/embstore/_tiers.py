"""For mypy only (never imported): every tier implements its protocol.

Kept out of :mod:`embstore.protocol`, which the tiers import, so that no
import circle exists, not even one of type-only imports.
"""

from __future__ import annotations

from embstore.collection import Collection
from embstore.distributed.collection import ShardedCollection
from embstore.distributed.table import ShardedTable
from embstore.gpu.cache import DeviceCache
from embstore.gpu.serving import ServingCache
from embstore.protocol import BatchTier, LocalTier, Observed, ReadTier, StateTier
from embstore.serving.mapped import MappedTable
from embstore.store import Table


def _tiers(t: Table, c: DeviceCache, s: ShardedTable) -> tuple[StateTier, LocalTier, BatchTier]:
    return t, c, s


def _read(m: MappedTable, t: Table, c: DeviceCache, s: ShardedTable) -> tuple[ReadTier, ...]:
    return m, t, c, s


def _observed(
    t: Table,
    m: MappedTable,
    c: DeviceCache,
    s: ShardedTable,
    col: Collection,
    sc: ShardedCollection,
    serving: ServingCache,
) -> tuple[Observed, ...]:
    return t, m, c, s, col, sc, serving
