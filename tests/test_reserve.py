"""Table.reserve: room for rows made up front changes no row, counts in
stats()["bytes"], is resident at once, and refuses bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore import optim
from tests.test_policy_memory import probe


def _train(t: embstore.Table, rng: np.random.Generator) -> None:
    for _ in range(5):
        k = rng.integers(-50_000, 50_000, 20_000)
        t.lookup(k[:5_000])
        t.apply_gradients(k, rng.standard_normal((len(k), t.dim), dtype=np.float32))


def test_reserve_changes_no_row_or_state() -> None:
    plain = embstore.Table(8, optimizer=optim.Adam(lr=0.01), seed=4)
    reserved = embstore.Table(8, optimizer=optim.Adam(lr=0.01), seed=4)
    reserved.reserve(70_000)
    assert len(reserved) == 0
    _train(plain, np.random.default_rng(1))
    _train(reserved, np.random.default_rng(1))
    a, b = plain.export(with_state=True), reserved.export(with_state=True)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_reserved_memory_counts_in_stats_bytes_and_inserts_stay_within_it() -> None:
    t = embstore.Table(16, optimizer=optim.Adagrad(lr=0.1), num_shards=4)
    before = t.stats()["bytes"]
    t.reserve(40_000)
    after = t.stats()["bytes"]
    row = 8 + 4 + 4 * (16 + 16)  # key, generation, weights and Adagrad state
    assert after - before >= 40_000 * row
    assert after - before <= 1.25 * 40_000 * row + (1 << 20)  # 4-sigma share + index
    t.assign(np.arange(40_000), np.zeros((40_000, 16), np.float32))
    assert len(t) == 40_000
    assert t.stats()["bytes"] == after, "inserting reserved rows allocates nothing new"


def test_reserved_memory_is_resident_at_once() -> None:
    r = probe("reserve_rss", 1_000_000, 64)
    assert r["rows"] == 1_000_000
    # The reservation maps its memory now (within 5% of what stats counts) ...
    assert abs(r["reserve_rss"] - r["reserve_bytes"]) <= 0.05 * r["reserve_bytes"], r
    # ... so that inserting the reserved rows maps little more.
    assert r["insert_rss"] <= 0.05 * r["reserve_rss"], r
    assert r["insert_bytes"] == 0, r


@pytest.mark.parametrize(
    ("rows", "exc", "match"),
    [
        (-1, ValueError, "rows: expected rows >= 0"),
        (1.5, TypeError, "rows: expected an integer"),
        (True, TypeError, "rows: expected an integer"),
        ("10", TypeError, "rows: expected an integer"),
        (10**15, ValueError, "rows: reserving .* bytes of memory available"),
    ],
)
def test_bad_reserve_raises_and_changes_nothing(rows: object, exc: type, match: str) -> None:
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.1))
    t.lookup([1, 2, 3])
    before = (t.stats()["bytes"], t.export(with_state=True))
    with pytest.raises(exc, match=match):
        t.reserve(rows)  # type: ignore[arg-type]
    after = (t.stats()["bytes"], t.export(with_state=True))
    assert before[0] == after[0]
    for x, y in zip(before[1], after[1], strict=True):
        np.testing.assert_array_equal(x, y)
