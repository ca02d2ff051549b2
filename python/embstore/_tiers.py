"""For mypy only (never imported): every tier implements its protocol.

Kept out of :mod:`embstore.protocol`, which the tiers import, so that no
import circle exists, not even one of type-only imports.
"""

from __future__ import annotations

from embstore.distributed.table import ShardedTable
from embstore.gpu.cache import DeviceCache
from embstore.protocol import BatchTier, LocalTier, ReadTier, StateTier
from embstore.serving.mapped import MappedTable
from embstore.store import Table


def _tiers(t: Table, c: DeviceCache, s: ShardedTable) -> tuple[StateTier, LocalTier, BatchTier]:
    return t, c, s


def _read(m: MappedTable, t: Table, c: DeviceCache, s: ShardedTable) -> tuple[ReadTier, ...]:
    return m, t, c, s
