"""Prometheus metrics of embstore's tables: one metric set for every tier.

Every table given by name (a :class:`embstore.Table` in memory or on disk,
a :class:`embstore.MappedTable`, a :class:`embstore.Collection` (each of
its tables as ``name.feature``), a ``ShardedTable`` or ``ShardedCollection``
(this rank's shard: nothing collective runs at a scrape), a
``DeviceCache`` or a ``ServingCache``) is read at each scrape and exported
with the label ``table="name"``:

- counters: ``embstore_lookups_total`` (ids looked up),
  ``embstore_hits_total`` (looked-up ids that had a row, or were cached),
  ``embstore_misses_total``, ``embstore_inserts_total`` (rows created),
  ``embstore_evictions_total`` (rows removed by TTL, capacity or a cache),
  ``embstore_admission_rejects_total`` (keys whose gradients the admission
  filter dropped), ``embstore_steps_total`` (optimizer steps);
- gauges: ``embstore_rows``, ``embstore_bytes`` (by ``tier``: memory,
  disk, mapped, device), and for mapped tables
  ``embstore_snapshot_age_seconds`` (since the version served was
  published) and ``embstore_refresh_seconds`` (what the last refresh that
  swapped a version in took);
- a histogram, ``embstore_lookup_seconds``: the latency of lookup calls
  (lookups and pooled lookups).

A tier that has no such figure leaves the series out (a mapped table has no
inserts). ``prometheus_client`` is an optional dependency:
``pip install prometheus-client`` (from a clone, ``pip install ".[metrics]"``).

Serving the endpoint::

    handle = embstore.metrics.serve(9100, tables={"items": items})
    # scrape http://HOST:9100/metrics
    handle.close()

or registering with an application's own registry::

    registry.register(embstore.metrics.collector({"items": items}))
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from embstore._deps import require
from embstore._latency import histogram

__all__ = ["MetricsServer", "TableFigures", "collector", "read", "serve"]

_COUNTERS = {
    "lookups": "Ids looked up.",
    "hits": "Looked-up ids that had a row (for a cache: that were cached).",
    "misses": "Looked-up ids that had no row (for a cache: that were not cached).",
    "inserts": "Rows created.",
    "evictions": "Rows removed by TTL or capacity eviction, or evicted from a cache.",
    "admission_rejects": "Keys whose gradients the admission filter dropped.",
    "steps": "Optimizer steps taken.",
}


@dataclass
class TableFigures:
    """What the metrics report of one table at one moment (``None``: the
    tier has no such figure)."""

    counters: dict[str, int | None] = field(default_factory=dict)
    rows: int | None = None
    #: Bytes held by tier ("memory", "disk", "mapped", "device").
    bytes: dict[str, int] = field(default_factory=dict)
    snapshot_age_seconds: float | None = None
    refresh_seconds: float | None = None
    #: (bucket bounds, calls per bucket with one more above them, total seconds).
    latency: tuple[list[float], list[int], float] | None = None


def _table_figures(s: dict[str, Any], latency: Any) -> TableFigures:
    """The figures of an ``embstore.Table`` (memory or disk) from its stats."""
    bytes_ = {"memory": int(s["bytes"])}
    if "disk_bytes" in s:
        bytes_["disk"] = int(s["disk_bytes"])
    return TableFigures(
        counters={
            "lookups": s["lookups"],
            "hits": s["hits"],
            "misses": s["misses"],
            "inserts": s["inserts"],
            "evictions": s["evicted"],
            "admission_rejects": s["rejected"],
            "steps": s["step"],
        },
        rows=int(s["rows"]),
        bytes=bytes_,
        latency=latency,
    )


def _mapped_figures(t: Any) -> TableFigures:
    s = t.stats()
    return TableFigures(
        counters={"lookups": s["lookups"], "hits": s["hits"], "misses": s["misses"]},
        rows=int(s["rows"]),
        bytes={"mapped": int(s["mapped_bytes"]), "memory": int(s["bytes"])},
        snapshot_age_seconds=s["snapshot_age_seconds"],
        refresh_seconds=s["refresh_seconds"],
        latency=t._inner.lookup_latency(),
    )


def _figures(name: str, t: Any) -> Iterator[tuple[str, TableFigures]]:
    """``(label, figures)`` of each table ``t`` stands for."""
    # Imported here: the device and MPI tiers import optional packages.
    from embstore.collection import Collection
    from embstore.serving.mapped import MappedTable
    from embstore.store import Table

    if isinstance(t, Table):
        yield name, _table_figures(t.stats(), t._inner.lookup_latency())
        return
    if isinstance(t, MappedTable):
        yield name, _mapped_figures(t)
        return
    if isinstance(t, Collection):
        for feature, table in t.tables.items():
            yield from _figures(f"{name}.{feature}", table)
        return
    kind = type(t).__name__
    module = type(t).__module__
    if module.startswith("embstore.distributed") and kind == "ShardedTable":
        # This rank's shard, read locally: a scrape runs nothing collective.
        f = next(iter(_figures(name, t.local)))[1]
        f.latency = histogram(t).read()
        yield name, f
        return
    if module.startswith("embstore.distributed") and kind == "ShardedCollection":
        seen: set[int] = set()
        for feature in t.features:
            table = t._features[feature]
            if id(table) not in seen:
                seen.add(id(table))
                yield from _figures(f"{name}.{feature}", table)
        return
    if module.startswith("embstore.gpu") and kind == "DeviceCache":
        s = t.stats()
        f = next(iter(_figures(name, t.table)))[1]
        f.counters.update(
            lookups=s["lookups"],
            hits=s["hits"],
            misses=s["misses"],
            evictions=(f.counters.get("evictions") or 0) + s["evictions"],
        )
        f.bytes["device"] = int(s["bytes"] - s["table"]["bytes"])
        f.latency = histogram(t).read()
        yield name, f
        return
    if module.startswith("embstore.gpu") and kind == "ServingCache":
        s = t.stats()
        f = _mapped_figures(t._table)
        f.counters = {
            "lookups": s["lookups"],
            "hits": s["hits"],
            "misses": s["lookups"] - s["hits"],
        }
        f.bytes["device"] = int(s["bytes"])
        f.latency = histogram(t).read()
        yield name, f
        return
    raise TypeError(
        f"tables[{name!r}]: expected an embstore Table, MappedTable, Collection, "
        f"ShardedTable, ShardedCollection, DeviceCache or ServingCache, got {kind}"
    )


def _check_tables(tables: Any) -> list[tuple[str, Any]]:
    """The mapping's items now (:func:`_snapshot`), their names checked."""
    if not isinstance(tables, Mapping):
        raise TypeError(f"tables: expected a mapping of name -> table, got {type(tables).__name__}")
    items = _snapshot(tables)
    for name, _ in items:
        if not isinstance(name, str) or not name:
            raise TypeError(f"tables: expected non-empty str names, got {name!r}")
    return items


def _snapshot(tables: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The mapping's items as they are now. A scrape reads this copy, never
    the caller's mapping itself, which the application may change while
    the scrape runs (a table added: "dictionary changed size during
    iteration"). A ``dict``'s copy is one step under the GIL; another
    mapping's iteration that meets a change is taken again, from the start."""
    if type(tables) is dict:
        return list(tables.copy().items())
    for _ in range(_SNAPSHOT_TRIES - 1):
        try:
            return list(tables.items())
        except RuntimeError:
            continue
    return list(tables.items())


# A mapping changed under a scrape's copy this many times in a row is
# copied once more, and that copy's error goes to the scrape.
_SNAPSHOT_TRIES = 8


def read(tables: Mapping[str, Any]) -> dict[str, TableFigures]:
    """The figures the metrics export, by label, read now (what a scrape
    reads; for logs or tests without ``prometheus_client``)."""
    out: dict[str, TableFigures] = {}
    for name, t in _check_tables(tables):
        for label, f in _figures(name, t):
            out[label] = f
    return out


class _Collector:
    """A ``prometheus_client`` collector over named tables (read at each
    ``collect``: a table added to the mapping later is exported from then)."""

    def __init__(self, tables: Mapping[str, Any]) -> None:
        for name, t in _check_tables(tables):
            list(_figures(name, t))  # refuses what it cannot read, now
        self._tables = tables

    def describe(self) -> list[Any]:
        # No description: the registry calls collect() once to learn the
        # names, as for any collector whose series come and go.
        return []

    def collect(self) -> Iterator[Any]:
        m = require("prometheus_client", "metrics").metrics_core
        figures = read(self._tables)  # a snapshot of the mapping
        counters = {
            key: m.CounterMetricFamily(f"embstore_{key}", doc, labels=["table"])
            for key, doc in _COUNTERS.items()
        }
        rows = m.GaugeMetricFamily("embstore_rows", "Rows held.", labels=["table"])
        nbytes = m.GaugeMetricFamily(
            "embstore_bytes",
            "Bytes held, by tier (memory, disk, mapped, device).",
            labels=["table", "tier"],
        )
        age = m.GaugeMetricFamily(
            "embstore_snapshot_age_seconds",
            "Seconds since the version a mapped table serves was published.",
            labels=["table"],
        )
        refresh = m.GaugeMetricFamily(
            "embstore_refresh_seconds",
            "Seconds the last refresh of a mapped table that swapped a version in took.",
            labels=["table"],
        )
        latency = m.HistogramMetricFamily(
            "embstore_lookup_seconds",
            "Latency of lookup calls (lookups and pooled lookups).",
            labels=["table"],
        )
        for label, f in figures.items():
            for key, v in f.counters.items():
                if v is not None:
                    counters[key].add_metric([label], float(v))
            if f.rows is not None:
                rows.add_metric([label], float(f.rows))
            for tier, b in f.bytes.items():
                nbytes.add_metric([label, tier], float(b))
            if f.snapshot_age_seconds is not None:
                age.add_metric([label], f.snapshot_age_seconds)
            if f.refresh_seconds is not None:
                refresh.add_metric([label], f.refresh_seconds)
            if f.latency is not None:
                bounds, counts, total = f.latency
                cumulative, buckets = 0, []
                for le, c in zip([*map(_le, bounds), "+Inf"], counts, strict=True):
                    cumulative += c
                    buckets.append((le, float(cumulative)))
                latency.add_metric([label], buckets, sum_value=total)
        yield from counters.values()
        yield from (rows, nbytes, age, refresh, latency)


def _le(bound: float) -> str:
    """A bucket bound as Prometheus's clients write it (``1e-06``, ``0.5``)."""
    return repr(float(bound))


def collector(tables: Mapping[str, Any]) -> Any:
    """A collector of the tables' metrics, to register in an application's
    own ``prometheus_client`` registry (``registry.register(...)``). The
    mapping is read at each scrape, so tables added to it later appear."""
    require("prometheus_client", "metrics")
    return _Collector(tables)


class MetricsServer:
    """The endpoint :func:`serve` started; :meth:`close` stops it."""

    def __init__(self, server: Any, thread: threading.Thread, registry: Any) -> None:
        self._server = server
        self._thread = thread
        #: The ``prometheus_client`` registry the endpoint serves.
        self.registry = registry

    @property
    def port(self) -> int:
        """The port it listens on (the one given, or the one chosen for 0)."""
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = self._server.server_address[0]
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (waits for the serving thread)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(port: int, tables: Mapping[str, Any], *, addr: str = "127.0.0.1") -> MetricsServer:
    """Start an HTTP endpoint at ``http://addr:port/metrics`` exporting the
    tables' metrics (port 0: any free port, see ``handle.port``), on a
    daemon thread; returns a handle whose ``close()`` stops it. ``addr``
    defaults to loopback: pass ``"0.0.0.0"`` to be scraped from elsewhere."""
    prometheus_client = require("prometheus_client", "metrics")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port: expected an int in [0, 65535], got {port!r}")
    registry = prometheus_client.CollectorRegistry(auto_describe=True)
    registry.register(_Collector(tables))
    server, thread = prometheus_client.start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, thread, registry)
