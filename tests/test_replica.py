"""embstore.serving.Replica and ``python -m embstore replicate``: a serving
host's copy of a trainer's published checkpoint, from a path, an fsspec
memory filesystem or an HTTP server (flaky ones too), checked file by file
before a local manifest names it. The multi-host runs (network namespaces,
rate-limited links) are in test_replica_hosts.py (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import embstore
import embstore.metrics
from embstore import _core
from embstore.serving import Replica, ReplicaError
from embstore.serving.remote import is_url, staging_dir, upload
from tests._http_source import HttpSource

pytest.importorskip("fsspec")


def _trained(n: int = 2000, dim: int = 16) -> embstore.Table:
    t = embstore.Table(dim, optimizer=embstore.optim.Adagrad(lr=0.1), seed=3)
    t.lookup(np.arange(n, dtype=np.int64))
    return t


def _step(t: embstore.Table, keys: np.ndarray) -> None:
    t.apply_gradients(keys, np.full((len(keys), t.dim), 0.5, np.float32))


def _named(path: str) -> set[str]:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return {name for name, _, _ in _core.manifest_files(path, f.read())}


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _checksum(path: str) -> int:
    return int(json.loads(_read(os.path.join(path, "manifest.json")))["checksum"])


def _served_equal(local: str, t: embstore.Table) -> None:
    keys, rows = embstore.Table.load(local, mmap=True).export()
    want_keys, want_rows = t.export()
    order, want = np.argsort(keys), np.argsort(want_keys)
    np.testing.assert_array_equal(keys[order], want_keys[want])
    np.testing.assert_array_equal(rows[order], want_rows[want])


def test_crc32c_is_the_standard_one() -> None:
    # The CRC-32C check value, and a CRC continued across pieces.
    assert _core.crc32c(b"123456789") == 0xE3069283
    assert _core.crc32c(b"56789", _core.crc32c(b"1234")) == 0xE3069283


def test_a_replica_serves_each_publish_and_keeps_only_named_files(tmp_path) -> None:
    src, local = str(tmp_path / "src"), str(tmp_path / "local")
    t = _trained()
    t.save(src)
    with Replica(src, local, start=False) as r:
        reader = embstore.Table.load(src, mmap=True)  # the trainer host's own reader
        assert r.poll() is True
        assert r.poll() is False  # nothing new
        _served_equal(local, t)
        _step(t, np.arange(100, dtype=np.int64))
        t.save(src, incremental=True)
        assert r.poll() is True
        _served_equal(local, t)
        t.save(src)  # a chain rewrite: every file new
        assert r.poll() is True
        _served_equal(local, t)
        files = {e for e in os.listdir(local) if not e.startswith(".")} - {"manifest.json"}
        assert files == _named(src) == _named(local)
        s = r.stats()
        assert s["publishes"] == 3
        assert s["errors"] == 0
        assert s["retries"] == 0
        assert s["version"] == _checksum(src)
        del reader


def test_a_replica_skips_versions_it_missed_and_fetches_only_the_newest(tmp_path) -> None:
    src, local = str(tmp_path / "src"), str(tmp_path / "local")
    t = _trained()
    t.save(src)
    with Replica(src, local, start=False) as r:
        r.poll()
        fetched = r.stats()["bytes_fetched"]
        for k in range(3):  # three publishes while the replica was away
            _step(t, np.arange(k * 10, k * 10 + 10, dtype=np.int64))
            t.save(src, incremental=True)
        assert r.poll() is True
        s = r.stats()
        assert s["publishes"] == 2  # the first and the newest, nothing between
        newest = sum(os.path.getsize(os.path.join(src, n)) for n in _named(src))
        assert s["bytes_fetched"] - fetched < newest - fetched + 1  # no file twice
        _served_equal(local, t)


def test_publishing_to_a_url_and_replicating_from_it(tmp_path, monkeypatch) -> None:
    fsspec = pytest.importorskip("fsspec")
    monkeypatch.setenv("EMBSTORE_STAGING", str(tmp_path / "staging"))
    url = f"memory://embstore-test-{os.getpid()}/ck"
    fs = fsspec.filesystem("memory")
    assert is_url(url)
    assert not is_url(str(tmp_path))
    assert not is_url("file:///x")
    t = _trained()
    t.save(url)
    staging = staging_dir(url)
    assert staging.startswith(str(tmp_path / "staging"))
    _step(t, np.arange(50, dtype=np.int64))
    t.save(url, incremental=True)
    remote = {os.path.basename(p) for p in fs.ls(url.removeprefix("memory://"), detail=False)}
    assert remote == _named(staging) | {"manifest.json"}
    with Replica(url, str(tmp_path / "local"), start=False) as r:
        assert r.poll() is True
        _served_equal(str(tmp_path / "local"), t)
        t.save(url)  # a rewrite: the files of the old chain go from the URL
        remote = {os.path.basename(p) for p in fs.ls(url.removeprefix("memory://"), detail=False)}
        assert remote == _named(staging) | {"manifest.json"}
        assert r.poll() is True
        _served_equal(str(tmp_path / "local"), t)
    fs.rm(url.removeprefix("memory://"), recursive=True)


def test_a_publisher_publishes_to_a_url(tmp_path, monkeypatch) -> None:
    fsspec = pytest.importorskip("fsspec")
    monkeypatch.setenv("EMBSTORE_STAGING", str(tmp_path / "staging"))
    url = f"memory://embstore-pub-{os.getpid()}/ck"
    t = _trained(500)
    p = embstore.serving.Publisher(t, url, every=0.05)
    _step(t, np.arange(20, dtype=np.int64))
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(p.seconds) < 2:
        time.sleep(0.02)
    p.stop()
    assert p.error is None
    assert len(p.seconds) >= 2
    with Replica(url, str(tmp_path / "local"), start=False) as r:
        r.poll()
    _served_equal(str(tmp_path / "local"), t)
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def test_uploading_to_http_is_refused(tmp_path) -> None:
    pytest.importorskip("aiohttp")
    t = _trained(10)
    t.save(str(tmp_path / "ck"))
    with pytest.raises(ValueError, match="read-only"):
        upload(str(tmp_path / "ck"), "http://127.0.0.1:9/ck")


@pytest.mark.parametrize(
    "mirror",
    [
        {},
        {"corrupt_first": True},  # each file's first response has a flipped byte
        {"cut_first": 3000},  # each file's first response stops after 3,000 bytes
        {"cut_first": 3000, "ranges": False},  # ... and no byte ranges served
    ],
    ids=["plain", "corrupting", "cutting", "cutting-no-ranges"],
)
def test_a_replica_over_http_serves_every_version_whole(tmp_path, mirror) -> None:
    pytest.importorskip("aiohttp")
    src, local = str(tmp_path / "src"), str(tmp_path / "local")
    t = _trained(4000, 32)
    t.save(src)
    with HttpSource(src, **mirror) as http, Replica(http.url, local, start=False) as r:
        assert r.poll() is True
        _served_equal(local, t)
        total = sum(os.path.getsize(os.path.join(src, n)) for n in _named(src))
        s = r.stats()
        assert s["error"] is None
        if mirror.get("corrupt_first"):
            assert s["retries"] == len(_named(src))
            assert s["bytes_fetched"] == 2 * total  # each file twice, no more
        elif mirror.get("cut_first") and mirror.get("ranges", True):
            assert s["retries"] == len(_named(src))
            assert s["bytes_fetched"] == total  # resumed: nothing fetched twice
            assert any(start > 0 for _, start, _ in http.server.requests)
        elif mirror.get("cut_first"):
            # No ranges: the resume gets nothing, the next try starts over.
            assert s["bytes_fetched"] > total
        else:
            assert s["retries"] == 0
            assert s["bytes_fetched"] == total
        _step(t, np.arange(0, 4000, 7, dtype=np.int64))
        t.save(src, incremental=True)
        assert r.poll() is True
        _served_equal(local, t)


def test_a_damaged_source_manifest_or_file_is_never_served(tmp_path) -> None:
    src, local = str(tmp_path / "src"), str(tmp_path / "local")
    t = _trained()
    t.save(src)
    with Replica(src, local, start=False, retries=2) as r:
        r.poll()
        before = r.stats()["version"]
        before_text = _read(os.path.join(local, "manifest.json"))
        _step(t, np.arange(10, dtype=np.int64))
        t.save(src, incremental=True)
        manifest = os.path.join(src, "manifest.json")
        good = _read(manifest)
        bad = bytearray(good)
        bad[good.index(b'"step"') + 1] ^= 0x20
        _write(manifest, bytes(bad))
        with pytest.raises(ReplicaError, match="does not hold"):
            r.poll()
        assert r.stats()["error"]
        assert r.stats()["version"] == before
        _write(manifest, good)
        # A file of the new version damaged at the source: fetched, refused,
        # fetched again, refused: the poll fails, nothing is named.
        newest = json.loads(good)["chain"][-1]["files"][0]["name"]
        data = bytearray(_read(os.path.join(src, newest)))
        data[-1] ^= 0xFF
        _write(os.path.join(src, newest), bytes(data))
        with pytest.raises(ReplicaError, match="2 tries failed"):
            r.poll()
        assert _read(os.path.join(local, "manifest.json")) == before_text
        assert r.stats()["retries"] == 1
        assert r.stats()["errors"] == 2
        data[-1] ^= 0xFF
        _write(os.path.join(src, newest), bytes(data))
        assert r.poll() is True
        assert r.stats()["error"] is None
        _served_equal(local, t)


def test_a_restarted_replica_resumes_a_partial_file(tmp_path) -> None:
    src, local = str(tmp_path / "src"), str(tmp_path / "local")
    t = _trained(20000, 32)
    t.save(src)
    names = sorted(_named(src))
    os.makedirs(os.path.join(local, ".embstore-replica"))
    # A replica killed mid-fetch left half of one file and all of another.
    data = _read(os.path.join(src, names[0]))
    with open(os.path.join(local, ".embstore-replica", names[0] + ".part"), "wb") as f:
        f.write(data[: len(data) // 2])
    with open(os.path.join(local, names[1]), "wb") as f:
        f.write(_read(os.path.join(src, names[1])))
    with Replica(src, local, start=False) as r:
        assert r.poll() is True
        total = sum(os.path.getsize(os.path.join(src, n)) for n in names)
        done = len(data) // 2 + os.path.getsize(os.path.join(src, names[1]))
        assert r.stats()["bytes_fetched"] == total - done
    _served_equal(local, t)
    assert os.listdir(os.path.join(local, ".embstore-replica")) == ["lock"]


def test_one_replica_per_directory_and_bad_arguments(tmp_path) -> None:
    src = str(tmp_path / "src")
    _trained(10).save(src)
    with (
        Replica(src, str(tmp_path / "l"), start=False),
        pytest.raises(ValueError, match="local: another replica"),
    ):
        Replica(src, str(tmp_path / "l"), start=False)
    for kwargs, what in (
        ({"period": 0}, "period"),
        ({"workers": 0}, "workers"),
        ({"retries": 1.5}, "retries"),
        ({"timeout": -1}, "timeout"),
    ):
        with pytest.raises(ValueError, match=what):
            Replica(src, str(tmp_path / "m"), start=False, **kwargs)
    with pytest.raises(TypeError, match="source"):
        Replica(3, str(tmp_path / "m"), start=False)  # type: ignore[arg-type]


def test_a_replica_of_a_replica_and_the_background_thread(tmp_path) -> None:
    src, a, b = (str(tmp_path / n) for n in ("src", "a", "b"))
    t = _trained()
    t.save(src)
    with Replica(src, a, period=0.02) as ra, Replica(a, b, period=0.02) as rb:
        import time

        want = _checksum(src)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and rb.stats()["version"] != want:
            time.sleep(0.02)
        assert ra.stats()["version"] == rb.stats()["version"] == want
        _served_equal(b, t)


def test_old_files_stay_while_a_reader_holds_the_directory(tmp_path) -> None:
    src, local = str(tmp_path / "src"), str(tmp_path / "local")
    t = _trained()
    t.save(src)
    with Replica(src, local, start=False) as r:
        r.poll()
        first = _named(local)
        hold = _core.hold_directory(local)  # a reader opening the version
        t.save(src)
        r.poll()
        assert first <= set(os.listdir(local))  # the reader's files stay
        hold.release()
        t.save(src)
        r.poll()
        left = {e for e in os.listdir(local) if not e.startswith(".")} - {"manifest.json"}
        assert left == _named(local)


def test_metrics_of_a_replica(tmp_path) -> None:
    src = str(tmp_path / "src")
    _trained().save(src)
    with Replica(src, str(tmp_path / "l"), start=False) as r:
        r.poll()
        figures = embstore.metrics.read({"replica": r})["replica"]
        assert figures.counters["replica_publishes"] == 1
        assert figures.counters["replica_fetched_bytes"] == r.stats()["bytes_fetched"] > 0
        assert figures.lag_seconds is not None
        assert figures.lag_seconds >= 0
        prometheus = pytest.importorskip("prometheus_client")
        registry = prometheus.CollectorRegistry()
        registry.register(embstore.metrics.collector({"replica": r}))
        text = prometheus.generate_latest(registry).decode()
        assert 'embstore_replica_publishes_total{table="replica"} 1.0' in text
        assert "embstore_replica_lag_seconds" in text


def test_the_replicate_command(tmp_path) -> None:
    src, local = str(tmp_path / "src"), str(tmp_path / "local")
    t = _trained()
    t.save(src)
    run = [sys.executable, "-m", "embstore", "replicate"]
    out = subprocess.run([*run, src, local, "--once"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("published version")
    _served_equal(local, t)
    bad = subprocess.run([*run, src, local, "--period", "0"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "--period" in bad.stderr
    missing = subprocess.run(
        [*run, str(tmp_path / "nothing"), str(tmp_path / "l2"), "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2
    assert "cannot read the manifest" in missing.stderr


def test_a_fifo_or_a_link_in_either_directory_never_blocks_or_is_followed(tmp_path) -> None:
    src, local = str(tmp_path / "src"), str(tmp_path / "local")
    t = _trained()
    t.save(src)
    victim = tmp_path / "outside"
    victim.write_bytes(b"keep")
    name = sorted(_named(src))[0]
    os.makedirs(os.path.join(local, ".embstore-replica"))
    # A link planted where the partial file goes: replaced, not written through.
    os.symlink(victim, os.path.join(local, ".embstore-replica", name + ".part"))
    data = _read(os.path.join(src, name))
    os.unlink(os.path.join(src, name))
    os.mkfifo(os.path.join(src, name))  # a FIFO where the source's file was
    with Replica(src, local, start=False, retries=2) as r:
        with pytest.raises(ReplicaError, match="2 tries failed"):
            r.poll()  # refused at once, never blocked on the FIFO
        assert victim.read_bytes() == b"keep"
        os.unlink(os.path.join(src, name))
        _write(os.path.join(src, name), data)
        assert r.poll() is True
    assert victim.read_bytes() == b"keep"
    _served_equal(local, t)
