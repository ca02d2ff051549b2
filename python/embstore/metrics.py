"""Prometheus metrics of embstore's tables: one metric set for every tier.

Every table given by name (a :class:`embstore.Table` in memory or on disk,
a :class:`embstore.MappedTable`, a :class:`embstore.Collection` (each of
its tables as ``name.feature``), a ``ShardedTable`` or ``ShardedCollection``
(this rank's shard: nothing collective runs at a scrape), a
``DeviceCache`` or a ``ServingCache``: anything with a ``metrics()``
method, :class:`embstore.protocol.Observed`) is read at each scrape and
exported with the label ``table="name"``. Each tier reports its own
figures; this module reads no tier's insides. The names follow
Prometheus' conventions (what is counted, then the unit):

- counters: ``embstore_lookup_ids_total`` (ids looked up),
  ``embstore_lookup_hit_ids_total`` (looked-up ids that had a row, or were
  cached), ``embstore_lookup_miss_ids_total``,
  ``embstore_inserted_rows_total`` (rows created),
  ``embstore_evicted_rows_total`` (rows removed by TTL, capacity or a
  cache), ``embstore_admission_rejected_keys_total`` (keys whose gradients
  the admission filter dropped), ``embstore_optimizer_steps_total``;
- gauges: ``embstore_table_rows``, ``embstore_table_bytes`` (by ``tier``:
  memory, disk, mapped, device), and for mapped tables
  ``embstore_snapshot_age_seconds`` (since the version served was
  published) and ``embstore_refresh_duration_seconds`` (what the last
  refresh that swapped a version in took);
- a histogram, ``embstore_lookup_duration_seconds``: the latency of lookup
  calls (lookups and pooled lookups).

The names of earlier releases (``embstore_lookups_total``,
``embstore_hits_total``, ``embstore_misses_total``,
``embstore_inserts_total``, ``embstore_evictions_total``,
``embstore_admission_rejects_total``, ``embstore_steps_total``,
``embstore_rows``, ``embstore_bytes``, ``embstore_refresh_seconds``,
``embstore_lookup_seconds``) are exported beside them for one release,
their help saying which name replaces them (CHANGELOG).

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
from typing import Any

from embstore._deps import require
from embstore.protocol import Observed, TableFigures

__all__ = ["MetricsServer", "TableFigures", "collector", "read", "serve"]

#: Counter -> (its name, its help, its name in earlier releases if any).
_COUNTERS: dict[str, tuple[str, str, str | None]] = {
    "lookups": ("embstore_lookup_ids", "Ids looked up.", "embstore_lookups"),
    "hits": (
        "embstore_lookup_hit_ids",
        "Looked-up ids that had a row (for a cache: that were cached).",
        "embstore_hits",
    ),
    "misses": (
        "embstore_lookup_miss_ids",
        "Looked-up ids that had no row (for a cache: that were not cached).",
        "embstore_misses",
    ),
    "inserts": ("embstore_inserted_rows", "Rows created.", "embstore_inserts"),
    "evictions": (
        "embstore_evicted_rows",
        "Rows removed by TTL or capacity eviction, or evicted from a cache.",
        "embstore_evictions",
    ),
    "admission_rejects": (
        "embstore_admission_rejected_keys",
        "Keys whose gradients the admission filter dropped.",
        "embstore_admission_rejects",
    ),
    "steps": ("embstore_optimizer_steps", "Optimizer steps taken.", "embstore_steps"),
    # A Replica's (embstore.serving.Replica); new in this release.
    "replica_fetched_bytes": (
        "embstore_replica_fetched_bytes",
        "Bytes a replica fetched from its source.",
        None,
    ),
    "replica_fetched_files": (
        "embstore_replica_fetched_files",
        "Files a replica fetched from its source and checked.",
        None,
    ),
    "replica_retries": (
        "embstore_replica_fetch_retries",
        "Fetches a replica tried again (a cut, or a file that failed its check).",
        None,
    ),
    "replica_errors": (
        "embstore_replica_failed_polls",
        "Polls of a replica that could not bring a version over.",
        None,
    ),
    "replica_publishes": (
        "embstore_replica_publishes",
        "Versions a replica published locally.",
        None,
    ),
}


def _figures(name: str, t: Any) -> Iterator[tuple[str, TableFigures]]:
    """``(label, figures)`` of each table ``t`` stands for, as ``t``'s own
    ``metrics()`` reports them."""
    if not isinstance(t, Observed):
        raise TypeError(
            f"tables[{name!r}]: expected an embstore Table, MappedTable, Collection, "
            f"ShardedTable, ShardedCollection, DeviceCache or ServingCache (a tier with "
            f"metrics()), got {type(t).__name__}"
        )
    for sub, figures in t.metrics().items():
        yield (f"{name}.{sub}" if sub else name), figures


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
    iteration"). A ``dict``'s items are listed in one step under the GIL;
    another mapping's iteration that meets a change is taken again, from
    the start."""
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
        # Each family under its name, and under its earlier release's name
        # (help saying which replaces it) for one release.
        counters = {
            key: [
                m.CounterMetricFamily(new, doc, labels=["table"]),
                *(
                    [m.CounterMetricFamily(old, _deprecated(new + "_total", doc), labels=["table"])]
                    if old
                    else []
                ),
            ]
            for key, (new, doc, old) in _COUNTERS.items()
        }

        def gauges(new: str, old: str, doc: str, labels: list[str]) -> list[Any]:
            return [
                m.GaugeMetricFamily(new, doc, labels=labels),
                m.GaugeMetricFamily(old, _deprecated(new, doc), labels=labels),
            ]

        rows = gauges("embstore_table_rows", "embstore_rows", "Rows held.", ["table"])
        nbytes = gauges(
            "embstore_table_bytes",
            "embstore_bytes",
            "Bytes held, by tier (memory, disk, mapped, device).",
            ["table", "tier"],
        )
        age = [
            m.GaugeMetricFamily(
                "embstore_snapshot_age_seconds",
                "Seconds since the version a mapped table serves was published.",
                labels=["table"],
            )
        ]
        refresh = gauges(
            "embstore_refresh_duration_seconds",
            "embstore_refresh_seconds",
            "Seconds the last refresh of a mapped table that swapped a version in took.",
            ["table"],
        )
        lag = [
            m.GaugeMetricFamily(
                "embstore_replica_lag_seconds",
                "Seconds from a replica's source publishing to the replica publishing it.",
                labels=["table"],
            )
        ]
        doc = "Latency of lookup calls (lookups and pooled lookups)."
        latency = [
            m.HistogramMetricFamily("embstore_lookup_duration_seconds", doc, labels=["table"]),
            m.HistogramMetricFamily(
                "embstore_lookup_seconds",
                _deprecated("embstore_lookup_duration_seconds", doc),
                labels=["table"],
            ),
        ]
        for label, f in figures.items():
            for key, v in f.counters.items():
                if v is not None:
                    for c in counters[key]:
                        c.add_metric([label], float(v))
            if f.rows is not None:
                for g in rows:
                    g.add_metric([label], float(f.rows))
            for tier, b in f.bytes.items():
                for g in nbytes:
                    g.add_metric([label, tier], float(b))
            if f.snapshot_age_seconds is not None:
                age[0].add_metric([label], f.snapshot_age_seconds)
            if f.lag_seconds is not None:
                lag[0].add_metric([label], f.lag_seconds)
            if f.refresh_seconds is not None:
                for g in refresh:
                    g.add_metric([label], f.refresh_seconds)
            if f.latency is not None:
                bounds, counts, total = f.latency
                cumulative, buckets = 0, []
                for le, c in zip([*map(_le, bounds), "+Inf"], counts, strict=True):
                    cumulative += c
                    buckets.append((le, float(cumulative)))
                for h in latency:
                    h.add_metric([label], buckets, sum_value=total)
        for family in counters.values():
            yield from family
        for family in (rows, nbytes, age, refresh, lag, latency):
            yield from family


def _deprecated(new: str, doc: str) -> str:
    """The help of a family under its earlier release's name."""
    return f"Deprecated: use {new} (this name goes in the next release). {doc}"


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
