"""benches/gpu_cache.py at its quick sizes on NumPy (no GPU): the DLRM part
with a dense part between lookup and gradients runs the step with and
without the next batch prefetched during it, through the same cache, and
records both (the figures a GPU run reads)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_dlrm_part_measures_the_step_prefetched_across_a_dense_part(
    tmp_path: pathlib.Path,
) -> None:
    out = tmp_path / "dlrm.json"
    args = ["--quick", "--xp", "numpy", "--parts", "dlrm", "--dense-ms", "5"]
    args += ["--cache-fractions", "0.1", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "gpu_cache.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["dlrm"]
    plain = [r for r in rows if r["dense_ms"] == 0]
    dense = {r["prefetch"]: r for r in rows if r["dense_ms"] == 5}
    assert len(plain) == 1
    assert set(dense) == {False, True}
    for r in dense.values():
        assert r["cache_rows"] == plain[0]["cache_rows"]
        # Each step holds the dense part's 5 ms.
        assert r["step_s"] >= r["dense_s"] >= 0.004
        assert 0 < r["hit_rate"] <= 1
    assert "next batch's misses fetched during the dense part" in run.stdout
