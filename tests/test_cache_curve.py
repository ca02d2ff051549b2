"""cache_curve: LRU stack distances against a direct LRU simulation; the
curve against DeviceCache's measured hit rates on a Zipf stream; LFU
against a static cache of the most frequent keys; the CLI."""

from __future__ import annotations

import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
from benches.cache_hit_rate import measure, zipf_stream

import embstore
from embstore.gpu import cache_curve


def lru_hit_rate(keys: np.ndarray, size: int) -> float:
    """An LRU cache, one access after another (OrderedDict)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in keys.tolist():
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        else:
            cache[k] = None
            if len(cache) > size:
                cache.popitem(last=False)
    return hits / len(keys)


def test_lru_curve_is_exact_for_one_access_at_a_time() -> None:
    keys = zipf_stream(2_000, 20_000, 1.0, seed=3)
    curve = cache_curve(keys, [1, 10, 100, 500, 2_000])
    for size, predicted in zip(curve.sizes.tolist(), curve.lru.tolist(), strict=True):
        assert predicted == pytest.approx(lru_hit_rate(keys, size), abs=1e-12)
    counts = np.sort(np.unique(keys, return_counts=True)[1])[::-1]
    assert curve.static[1] == pytest.approx(counts[:10].sum() / len(keys))


def test_curve_predicts_the_cache_and_lfu_nears_the_static_optimum() -> None:
    n_keys = 1_000_000
    keys = zipf_stream(n_keys, 2_000_000, 1.05, seed=0)
    sizes = [n_keys // 200, n_keys // 100, n_keys // 50]
    curve = cache_curve(keys, sizes)
    for size, predicted in zip(sizes, curve.lru.tolist(), strict=True):
        measured = measure(keys, size, "lru", 2_048)
        assert abs(measured - predicted) <= 0.02, (size, measured, predicted)
    lfu = measure(keys, n_keys // 100, "lfu", 2_048)
    assert lfu >= 0.9 * float(curve.static[1]), (lfu, curve.static[1])


@pytest.mark.slow
def test_cli_prints_the_table_and_draws_the_png(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib", reason="the PNG needs matplotlib (embstore[plot])")
    keys = zipf_stream(10_000, 50_000, 1.1, seed=1)
    np.save(tmp_path / "keys.npy", keys)
    png = tmp_path / "curve.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "embstore",
            "cache-curve",
            str(tmp_path / "keys.npy"),
            "--sizes",
            "10",
            "100",
            "1000",
            "--png",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "LRU hit rate" in proc.stdout
    assert len(proc.stdout.splitlines()) == 2 + 3 + 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_cli_refuses_a_pickled_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    proc = subprocess.run(
        [sys.executable, "-m", "embstore", "cache-curve", str(tmp_path / "obj.npy")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "cannot read" in proc.stderr


def test_bad_sizes_and_empty_streams() -> None:
    with pytest.raises(ValueError, match=r"^sizes"):
        cache_curve([1, 2, 3], [0])
    with pytest.raises(ValueError, match=r"^keys"):
        cache_curve(np.zeros(0, np.int64))
    with pytest.raises(TypeError, match=r"^keys"):
        cache_curve([1.5, 2.0])
    assert embstore.gpu.cache_curve is cache_curve
