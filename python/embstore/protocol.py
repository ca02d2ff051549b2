"""The batch protocol every tier offers, and what a tier needs of the one below.

::

    ShardedTable(dim, local=DeviceCache(Table(dim, ...), rows))

is the one way to stack the tiers: a :class:`DeviceCache` is built on a
:class:`StateTier` (a Table), and a :class:`ShardedTable` on a
:class:`LocalTier` (a Table, or a DeviceCache over one), through these
protocols alone. Each is ``runtime_checkable``; mypy checks that every
tier implements its protocol (``embstore/_tiers.py``, never imported).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "BatchTier",
    "LocalTier",
    "Observed",
    "ReadTier",
    "StateTier",
    "TableFigures",
    "cache_metrics",
    "observed",
    "table_figures",
    "takes_default",
]


@dataclass
class TableFigures:
    """What the metrics report of one table at one moment (``None``: the
    tier has no such figure); each tier makes its own (``metrics()``)."""

    counters: dict[str, int | None] = field(default_factory=dict)
    rows: int | None = None
    #: Bytes held by tier ("memory", "disk", "mapped", "device").
    bytes: dict[str, int] = field(default_factory=dict)
    snapshot_age_seconds: float | None = None
    refresh_seconds: float | None = None
    #: (bucket bounds, calls per bucket with one more above them, total seconds).
    latency: tuple[list[float], list[int], float] | None = None
    #: A replica's: seconds from its source's last publish to its own.
    lag_seconds: float | None = None


@runtime_checkable
class Observed(Protocol):
    """What :mod:`embstore.metrics` reads of anything given to it: every
    tier, and the collections of tables (a :class:`embstore.Collection`, a
    ``ShardedCollection``). ``metrics()`` maps a label suffix to figures:
    ``""`` for the tier itself, a feature's name for each table a
    collection holds (exported as ``name.feature``). Read locally: nothing
    collective runs. Kept apart from :class:`ReadTier`, so that a tier of
    an application's own that has no ``metrics()`` is still a tier."""

    def metrics(self) -> dict[str, TableFigures]: ...


@runtime_checkable
class ReadTier(Protocol):
    """What a front end (a :class:`embstore.Collection`, the torch modules)
    reads rows through: every tier, the read-only
    :class:`embstore.MappedTable` included. ``writable`` says whether it
    stores rows and takes steps (a module over a tier that is not is
    frozen); a front end checks it, never a tier's class."""

    @property
    def dim(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def writable(self) -> bool: ...
    @property
    def optimizer(self) -> Any: ...
    def lookup(self, keys: Any, *, insert: bool = True, return_found: bool = False) -> Any: ...
    def lookup_pooled(
        self,
        ids: Any,
        offsets: Any,
        *,
        combiner: str = "sum",
        weights: Any = None,
        insert: bool = True,
    ) -> Any: ...
    def contains(self, keys: Any) -> Any: ...
    def __len__(self) -> int: ...


@runtime_checkable
class BatchTier(ReadTier, Protocol):
    """The batch calls of every tier that trains (the reads of
    :class:`ReadTier`, and steps): one call is one batch; one
    ``apply_gradients`` call is one optimizer step; duplicate keys are summed
    first; a refused call changes nothing."""

    def apply_gradients(self, keys: Any, grads: Any) -> None: ...
    def apply_pooled_gradients(
        self, ids: Any, offsets: Any, grads: Any, *, combiner: str = "sum", weights: Any = None
    ) -> None: ...
    def save(self, path: str | os.PathLike[str], *, with_optimizer: bool = True) -> Any: ...
    def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class LocalTier(BatchTier, Protocol):
    """A tier that lives in this process (a Table, or a DeviceCache over
    one): what each rank of a ShardedTable keeps its rows in."""

    def config(self) -> dict[str, Any]: ...
    def evict(self, *, with_rows: bool) -> Any: ...
    def new_checkpoint_id(self) -> str: ...
    def remove_part(self, path: str | os.PathLike[str], part: str) -> None: ...
    def save_part(
        self, path: str | os.PathLike[str], part: str, *, with_optimizer: bool = True
    ) -> str: ...
    def publish_parts(
        self,
        path: str | os.PathLike[str],
        checkpoint_id: str,
        parts: list[str],
        rows: int,
        *,
        with_optimizer: bool = True,
        partition: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]: ...


@runtime_checkable
class StateTier(LocalTier, Protocol):
    """A tier that hands out rows with their optimizer state and takes them
    back (a Table): what a DeviceCache is built on."""

    @property
    def state_len(self) -> int: ...
    @property
    def dtype(self) -> str:
        """Row storage ("float32", "bfloat16", "float16"): a tier holding
        rows for this one rounds them as it does."""
        ...

    @property
    def admission(self) -> Any: ...
    @property
    def ttl_steps(self) -> int | None: ...
    @property
    def ttl_seconds(self) -> int | None: ...
    @property
    def capacity(self) -> int | None: ...
    @property
    def capacity_bytes(self) -> int | None: ...
    def lookup_with_state(
        self, keys: Any, *, insert: bool = True, out: Any = None
    ) -> tuple[Any, Any]: ...
    def write_back(self, keys: Any, rows: Any, state: Any) -> None: ...
    def take_step(self) -> int: ...
    def apply_gradients(self, keys: Any, grads: Any, *, step: int | None = None) -> None: ...


@functools.cache
def _lookup_takes_default(cls: type) -> bool:
    return "default" in inspect.signature(getattr(cls, "lookup")).parameters  # noqa: B009


def takes_default(tier: ReadTier) -> bool:
    """Whether a tier's lookups take ``default=`` (what a missing key reads
    as: a Table's and a MappedTable's do; a DeviceCache's and a
    ShardedTable's read it as the initializer's row): a front end asks
    this, not the tier's class."""
    return _lookup_takes_default(type(tier))


def observed(tier: Any, what: str) -> dict[str, TableFigures]:
    """``tier.metrics()``, or TypeError naming ``what`` where ``tier`` has
    no such method (a tier of an application's own)."""
    if not isinstance(tier, Observed):
        raise TypeError(
            f"{what}: expected a tier with metrics() (embstore.protocol.Observed), "
            f"got {type(tier).__name__}"
        )
    return tier.metrics()


def table_figures(s: Mapping[str, Any], latency: Any) -> TableFigures:
    """A table's figures from its ``stats()`` (in memory; a disk table's
    disk bytes too) and its lookup latency."""
    nbytes = {"memory": int(s["bytes"])}
    if "disk_bytes" in s:
        nbytes["disk"] = int(s["disk_bytes"])
    counters: dict[str, int | None] = {
        "lookups": s["lookups"],
        "hits": s["hits"],
        "misses": s["misses"],
        "inserts": s["inserts"],
        "evictions": s["evicted"],
        "admission_rejects": s["rejected"],
        "steps": s["step"],
    }
    return TableFigures(counters=counters, rows=int(s["rows"]), bytes=nbytes, latency=latency)


def cache_metrics(cache: Any) -> dict[str, TableFigures]:
    """The ``metrics()`` of a cache in front of a table (a DeviceCache, a
    ServingCache): the figures of ``cache.table``, with the cache's own
    lookups, hits, misses and evictions (from its ``stats()``), its device
    bytes and the latency of its own lookup calls."""
    from embstore._latency import histogram

    s = cache.stats()
    f = observed(cache.table, "table")[""]
    misses = s.get("misses", s["lookups"] - s["hits"])
    f.counters.update(lookups=s["lookups"], hits=s["hits"], misses=misses)
    if "evictions" in s:  # a DeviceCache's rows written back to its table
        f.counters["evictions"] = (f.counters.get("evictions") or 0) + s["evictions"]
    own = s["table"]["bytes"] if isinstance(s.get("table"), Mapping) else 0
    f.bytes["device"] = int(s["bytes"] - own)
    f.latency = histogram(cache).read()
    return {"": f}
