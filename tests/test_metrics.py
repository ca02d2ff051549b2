"""embstore.metrics: every tier's figures exported in Prometheus's text
format from a real HTTP endpoint on loopback, parsed by prometheus_client's
own parser and checked against a dict model of the calls made (hits and
misses), the tables' stats, and the number of lookup calls (the latency
histogram); bad arguments are refused by name."""

from __future__ import annotations

import os
import pathlib
import socket
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import pytest

import embstore
from embstore import metrics, optim

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

DIM = 8


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of one scrape of ``url``."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


class Model:
    """A dict model of a growing table: which keys have rows."""

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.hits = self.misses = 0

    def lookup(self, keys: np.ndarray) -> None:
        for k in keys.tolist():
            if k in self.keys:
                self.hits += 1
            else:
                self.misses += 1
        # A lookup with insert creates every key's row at the end of the call.
        self.keys.update(keys.tolist())


def test_a_live_table_scraped_over_http_reports_its_calls() -> None:
    t = embstore.Table(DIM, optimizer=optim.Adam(lr=0.01), seed=1)
    model = Model()
    rng = np.random.default_rng(0)
    calls = 0
    for _ in range(7):
        k = rng.integers(0, 300, 100)
        t.lookup(k)
        model.lookup(k)
        calls += 1
        t.apply_gradients(k, rng.standard_normal((k.size, DIM)).astype(np.float32))
    ids = rng.integers(0, 300, 40)
    t.lookup_pooled(ids, np.arange(0, 41, 4))
    model.lookup(ids)
    calls += 1
    with metrics.serve(0, tables={"items": t}) as h:
        assert h.url.startswith("http://127.0.0.1:")
        s = scrape(h.url)
    st = t.stats()
    assert value(s, "embstore_lookup_ids_total", table="items") == model.hits + model.misses
    assert value(s, "embstore_lookup_hit_ids_total", table="items") == model.hits
    assert value(s, "embstore_lookup_miss_ids_total", table="items") == model.misses
    assert value(s, "embstore_inserted_rows_total", table="items") == len(model.keys) == len(t)
    assert value(s, "embstore_optimizer_steps_total", table="items") == 7
    assert value(s, "embstore_table_rows", table="items") == len(model.keys)
    assert value(s, "embstore_table_bytes", table="items", tier="memory") == st["bytes"]
    assert value(s, "embstore_evicted_rows_total", table="items") == 0
    assert value(s, "embstore_admission_rejected_keys_total", table="items") == 0
    # One observation per lookup call, in cumulative buckets.
    assert value(s, "embstore_lookup_duration_seconds_count", table="items") == calls
    assert value(s, "embstore_lookup_duration_seconds_bucket", table="items", le="+Inf") == calls
    les = sorted(
        (float(dict(lab)["le"]), v)
        for (n, lab), v in s.items()
        if n == "embstore_lookup_duration_seconds_bucket"
    )
    assert [v for _, v in les] == sorted(v for _, v in les)
    assert 0 < value(s, "embstore_lookup_duration_seconds_sum", table="items") < 60
    # Only the metric set is served: every name is embstore's.
    assert {n.split("_")[0] for n, _ in s} == {"embstore"}


def test_close_frees_the_port() -> None:
    h = metrics.serve(0, tables={"t": embstore.Table(DIM)})
    port = h.port
    h.close()
    with pytest.raises(OSError, match="refused"):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with socket.socket() as sock:  # the port can be bound again
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_eviction_and_admission_counters_follow_the_policy() -> None:
    t = embstore.Table(
        DIM,
        optimizer=optim.SGD(lr=0.1),
        capacity=50,
        admission=embstore.policy.CountFilter(2),
    )
    rng = np.random.default_rng(1)
    for _ in range(5):
        k = rng.integers(0, 1_000, 200)
        t.apply_gradients(k, np.ones((k.size, DIM), np.float32))
    t.evict()
    f = metrics.read({"t": t})["t"]
    st = t.stats()
    assert f.counters["evictions"] == st["evicted"] > 0
    assert f.counters["admission_rejects"] == st["rejected"] > 0


def test_a_disk_table_reports_memory_and_disk_bytes(tmp_path: pathlib.Path) -> None:
    t = embstore.Table(DIM, disk=tmp_path / "d", memory_bytes=20_000)
    k = np.arange(2_000)
    t.lookup(k)
    f = metrics.read({"d": t})["d"]
    st = t.stats()
    assert f.bytes == {"memory": st["bytes"], "disk": st["disk_bytes"]}
    assert st["disk_bytes"] > 0
    assert f.counters["inserts"] == 2_000


def test_a_mapped_table_reports_hits_age_and_refresh(tmp_path: pathlib.Path) -> None:
    t = embstore.Table(DIM, seed=2)
    t.lookup(np.arange(500))
    path = tmp_path / "serve"
    t.save(path, with_optimizer=False)
    m = embstore.MappedTable(path)
    keys = np.arange(300, 900)  # 200 held, 400 not
    m.lookup(keys)
    m.lookup_pooled(np.arange(0, 10), np.array([0, 5, 10]))
    # An old publish: its manifest's time set an hour back.
    old = time.time() - 3_600
    os.utime(path / "manifest.json", (old, old))
    m2 = embstore.MappedTable(path)
    with metrics.serve(0, tables={"m": m, "old": m2}) as h:
        s = scrape(h.url)
    assert value(s, "embstore_lookup_ids_total", table="m") == 610
    assert value(s, "embstore_lookup_hit_ids_total", table="m") == 210
    assert value(s, "embstore_lookup_miss_ids_total", table="m") == 400
    assert value(s, "embstore_lookup_duration_seconds_count", table="m") == 2
    assert value(s, "embstore_table_rows", table="m") == 500
    assert value(s, "embstore_table_bytes", table="m", tier="mapped") > 500 * DIM * 4
    assert 3_599 < value(s, "embstore_snapshot_age_seconds", table="old") < 3_700
    assert value(s, "embstore_snapshot_age_seconds", table="m") < 3_599
    assert value(s, "embstore_refresh_duration_seconds", table="m") > 0
    assert ("embstore_inserted_rows_total", (("table", "m"),)) not in s  # a mapped table has none
    # A publish, refreshed: the age starts again, the refresh is timed.
    t.lookup(np.arange(500, 600))
    t.save(path, with_optimizer=False, incremental=True)
    assert m2.refresh()
    st = m2.stats()
    assert st["version"] == 1
    assert st["rows"] == 600
    assert st["snapshot_age_seconds"] < 60
    assert st["refresh_seconds"] > 0
    assert st["misses"] == st["lookups"] - st["hits"] == 0


def test_a_collection_reports_each_table_and_its_calls() -> None:
    users, items = embstore.Table(DIM), embstore.Table(4)
    c = embstore.Collection({"user": users, "item": items, "item2": items})
    ids = np.arange(6)
    offsets = np.array([0, 3, 6])
    c.lookup_pooled({"user": (ids, offsets), "item": (ids, offsets), "item2": (ids, offsets)})
    f = metrics.read({"c": c})
    assert set(f) == {"c.user", "c.item", "c.item2"}
    assert f["c.user"].counters["lookups"] == 6
    assert f["c.item"].counters["lookups"] == 12
    # The call counted once in each table's histogram, a shared table too.
    assert sum(f["c.user"].latency[1]) == 1
    assert sum(f["c.item"].latency[1]) == 1


def test_caches_on_the_device_report_their_own_hits() -> None:
    from embstore.gpu import DeviceCache

    t = embstore.Table(DIM, optimizer=optim.SGD(lr=0.1))
    cache = DeviceCache(t, 16, xp=np)
    k = np.arange(10)
    cache.lookup(k)
    cache.lookup(k)
    s = cache.stats()
    f = metrics.read({"dc": cache})["dc"]
    assert f.counters["lookups"] == s["lookups"] == 20
    assert f.counters["hits"] == s["hits"]
    assert f.counters["misses"] == s["misses"]
    assert f.bytes["device"] == s["bytes"] - t.stats()["bytes"] > 0
    assert f.bytes["memory"] == t.stats()["bytes"]
    assert sum(f.latency[1]) == 2


def test_a_serving_cache_reports_hits_and_its_tables_age(tmp_path: pathlib.Path) -> None:
    from embstore.gpu import ServingCache

    t = embstore.Table(DIM)
    t.lookup(np.arange(100))
    t.save(tmp_path / "s", with_optimizer=False)
    sc = ServingCache(embstore.MappedTable(tmp_path / "s"), 64, xp=np)
    sc.lookup(np.arange(20))
    sc.lookup(np.arange(20))
    s = sc.stats()
    f = metrics.read({"sc": sc})["sc"]
    assert f.counters["lookups"] == s["lookups"] == 40
    assert f.counters["hits"] == s["hits"] > 0
    assert f.counters["misses"] == 40 - s["hits"]
    assert f.bytes["device"] == s["bytes"] == 64 * DIM * 4  # the cached rows (2 buckets)
    assert f.snapshot_age_seconds is not None
    assert f.snapshot_age_seconds < 60
    assert sum(f.latency[1]) == 2


def test_a_collector_in_an_applications_registry() -> None:
    registry = prometheus_client.CollectorRegistry()
    tables = {"a": embstore.Table(DIM)}
    registry.register(metrics.collector(tables))
    tables["a"].lookup(np.arange(3))
    tables["b"] = embstore.Table(DIM)  # added later: exported from the next scrape
    text = prometheus_client.generate_latest(registry).decode()
    assert 'embstore_lookup_ids_total{table="a"} 3.0' in text
    assert 'embstore_table_rows{table="b"} 0.0' in text
    assert "# TYPE embstore_lookup_duration_seconds histogram" in text
    assert "# TYPE embstore_lookup_ids_total counter" in text


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="tables: expected a mapping"):
        metrics.collector([embstore.Table(DIM)])
    with pytest.raises(TypeError, match="tables: expected non-empty str names"):
        metrics.collector({1: embstore.Table(DIM)})
    with pytest.raises(TypeError, match=r"tables\['x'\]: expected an embstore Table"):
        metrics.collector({"x": {}})
    with pytest.raises(ValueError, match="port: expected an int"):
        metrics.serve(70_000, tables={})


class _Growing(embstore.Table):
    """A table whose every read adds another table to the mapping being
    scraped: what an application's thread does while a scrape runs."""

    def __init__(self, dim: int, tables: dict[str, Any]) -> None:
        super().__init__(dim)
        self._mapping = tables

    def stats(self) -> dict[str, Any]:
        self._mapping[f"t{len(self._mapping)}"] = embstore.Table(DIM)
        return super().stats()


def test_a_scrape_reads_a_snapshot_of_a_mapping_that_grows_meanwhile() -> None:
    tables: dict[str, Any] = {}
    tables["grows"] = _Growing(DIM, tables)
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.collector(tables))  # its first read adds "t1"
    for scrape in range(3):
        text = prometheus_client.generate_latest(registry).decode()
        # Each scrape exported every table the mapping held when it began.
        for name in [n for n in tables if n != f"t{len(tables) - 1}"]:
            assert f'embstore_table_rows{{table="{name}"}}' in text, (scrape, name)


def test_scrapes_beside_a_thread_adding_and_removing_tables_all_succeed() -> None:
    tables: dict[str, Any] = {"a": embstore.Table(DIM)}
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.collector(tables))
    stop = threading.Event()

    def churn() -> None:
        spare = [embstore.Table(DIM) for _ in range(4)]
        i = 0
        while not stop.is_set():
            tables[f"x{i % 64}"] = spare[i % 4]
            tables.pop(f"x{(i + 32) % 64}", None)
            i += 1

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        for _ in range(150):
            assert (
                'embstore_table_rows{table="a"}'
                in prometheus_client.generate_latest(registry).decode()
            )
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_the_names_of_the_last_release_are_exported_beside_for_one_release() -> None:
    """Every series is exported under its Prometheus-style name and, for
    one release, under its earlier name with the same value, the earlier
    one's help naming its replacement (CHANGELOG)."""
    registry = prometheus_client.CollectorRegistry()
    t = embstore.Table(DIM, optimizer=optim.SGD(lr=0.1))
    t.lookup(np.arange(5))
    t.apply_gradients(np.arange(5), np.ones((5, DIM), np.float32))
    registry.register(metrics.collector({"a": t}))
    text = prometheus_client.generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    pairs = {
        "embstore_lookup_ids": "embstore_lookups",
        "embstore_lookup_hit_ids": "embstore_hits",
        "embstore_lookup_miss_ids": "embstore_misses",
        "embstore_inserted_rows": "embstore_inserts",
        "embstore_evicted_rows": "embstore_evictions",
        "embstore_admission_rejected_keys": "embstore_admission_rejects",
        "embstore_optimizer_steps": "embstore_steps",
        "embstore_table_rows": "embstore_rows",
        "embstore_table_bytes": "embstore_bytes",
        "embstore_lookup_duration_seconds": "embstore_lookup_seconds",
    }
    for new, old in pairs.items():
        assert new in families, (new, sorted(families))
        assert old in families, (old, sorted(families))
        assert "Deprecated: use " + new in families[old].documentation
        want = [s.value for s in families[new].samples]
        assert [s.value for s in families[old].samples] == want, (new, old)
    assert families["embstore_optimizer_steps"].samples[0].value == 1.0


def test_the_collector_reads_each_tier_through_its_own_metrics_method() -> None:
    """Anything with a ``metrics()`` (the Observed protocol) is exported by
    its own report, no class named: an application's own tier too."""
    from embstore.protocol import Observed, TableFigures

    class Mine:
        def metrics(self) -> dict[str, TableFigures]:
            return {
                "": TableFigures(counters={"lookups": 7}, rows=3),
                "part": TableFigures(rows=1, bytes={"memory": 64}),
            }

    assert isinstance(Mine(), Observed)
    got = metrics.read({"mine": Mine()})
    assert got["mine"].counters == {"lookups": 7}
    assert got["mine"].rows == 3
    assert got["mine.part"].bytes == {"memory": 64}
    assert not hasattr(metrics, "_table_figures")
