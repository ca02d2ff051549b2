"""`python -m embstore bench --serving` (embstore.bench.serving): the
freshness bookkeeping against hand-made records, and a small real run of
both parts (reader processes and threads; a trainer publishing deltas to
follower processes) whose figures hold together."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pathlib
import time

import numpy as np
import pytest

from embstore.bench import serving as S


def test_freshness_is_the_last_follower_to_serve_each_publish() -> None:
    """Publish 1 returned at 10.0, seen at 10.2 and 10.5: served by all
    0.5 s after; publish 2 seen by one follower only through publish 3's
    row (a later publish serves it too), by the other never: missed, and
    the verdict fails. Calls before the first publish are steady; calls
    from a save's return to the last follower serving it are during a
    refresh; calls during a save are apart; others are neither."""
    marks = [
        {"publish": 1, "start": 9.5, "returned": 10.0},
        {"publish": 2, "start": 11.0, "returned": 11.2},
    ]
    f1 = (
        [(1.0, 1e-4), (9.6, 5e-4), (10.9, 9e-4), (10.1, 6e-4)],
        [(1, 10.2, 0.01, 100), (3, 11.4, 0.02, 200)],
    )
    f2 = ([(2.0, 2e-4), (10.4, 7e-4)], [(1, 10.5, 0.03, 300)])
    res = S._freshness(marks, [f1, f2], 0.0, 5.0, 1000, 10, 1.0)
    p1, p2 = res["publishes"]
    assert p1["served_by_all_s"] == pytest.approx(0.5)
    assert p1["save_s"] == pytest.approx(0.5)
    assert math.isinf(p2["served_by_all_s"])
    assert res["missed_publishes"] == 1
    assert res["verdicts"]["freshness_p99_at_most_1s"] is False
    assert res["steady"]["calls"] == 2  # the calls at 1.0 and 2.0
    assert res["during_refresh"]["calls"] == 2  # 10.1 and 10.4; 10.9 is between windows
    assert res["during_save"]["calls"] == 1  # 9.6
    assert res["refresh_s_max"] == pytest.approx(0.03)
    assert res["overlay_bytes_max"] == 300
    # Both followers serve publish 2 in time: met.
    f2[1].append((2, 11.9, 0.01, 300))
    res = S._freshness(marks, [f1, f2], 0.0, 5.0, 1000, 10, 1.0)
    assert res["publishes"][1]["served_by_all_s"] == pytest.approx(0.7)
    assert res["verdicts"]["freshness_p99_at_most_1s"] is True


def test_the_np_take_peer_reads_the_rows_the_mapped_reader_reads(tmp_path: pathlib.Path) -> None:
    """The many-readers peer (np.take from a mapped .npy) answers each key
    with the row the mapped table serves for it."""
    import embstore

    t = embstore.Table(8, seed=3)
    t.lookup(np.arange(1_000, dtype=np.int64))
    path = str(tmp_path / "r")
    t.save(path, with_optimizer=False)
    peer = S._NpyTake(S._write_peer(t, 1_000, path))
    keys = np.random.default_rng(0).integers(0, 1_000, 500)
    np.testing.assert_array_equal(peer.lookup(keys), embstore.MappedTable(path).lookup(keys))


def test_a_bench_process_that_dies_fails_the_bench_at_once() -> None:
    """A reader process that ends with exit code 3 before sending its
    results fails the collection within seconds, naming the code, instead
    of waiting out the timeout; one that sends them is collected."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    dies = ctx.Process(target=os._exit, args=(3,))
    sends = ctx.Process(target=q.put, args=("rows",))
    for p in (dies, sends):
        p.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exit code 3"):
        S._results(q, [dies, sends], timeout=60)
    assert time.monotonic() - t0 < 30
    for p in (dies, sends):
        p.join(timeout=30)
    q2 = ctx.Queue()
    ok = ctx.Process(target=q2.put, args=("rows",))
    ok.start()
    assert S._results(q2, [ok], timeout=60) == ["rows"]
    ok.join(timeout=30)


@pytest.mark.slow
def test_a_small_serving_run_holds_together(tmp_path: pathlib.Path) -> None:
    """Both parts at small sizes: every reader configuration made calls at
    positive rates with ordered percentiles; every publish was served by
    both followers, none before its save began (a follower may serve one
    just before the save returns: the manifest's rename commits it, the
    directory's sync comes after), with a refresh time and an overlay
    recorded; the report names the targets."""
    readers = S.many_readers(5_000, [16], 2, 0.3, str(tmp_path))
    d = readers["dims"]["16"]
    for name in ("one", "cores", "np_take_cores", "processes", "threads"):
        x = d[name]
        assert x["calls"] > 0
        assert x["rows_per_s"] > 0
        assert x["p50_us"] <= x["p99_us"] <= x["p999_us"]
    assert d["processes"]["readers"] == 2
    assert d["threads"]["threads"] is True
    fresh = S.large_deltas(20_000, 2_000, 2, 0.3, str(tmp_path))
    assert fresh["missed_publishes"] == 0
    for p in fresh["publishes"]:
        assert -p["save_s"] <= p["served_by_all_s"] < 30
    assert fresh["refresh_s_max"] is not None
    assert fresh["overlay_bytes_max"] > 0
    assert fresh["steady"]["calls"] > 0
    text = S.report_serving({"readers": readers, "deltas": fresh, "hps": S.HPS})
    assert "target p99 <= 1 s" in text
    assert "HugeCTR HPS" in text
    assert "np.take from a mapped .npy" in text
    assert np.isfinite(fresh["freshness_max_s"])
