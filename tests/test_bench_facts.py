"""The pytest-benchmark suites carry their facts: every result of
``pytest benches --benchmark-json`` names the machine (CPU, cores, SIMD
backend, huge-page mode, versions), and every one that ran on an embstore
table carries that table's stats (a peer, those of the table its workload
was drawn from, where there is one)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import embstore

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_benchmark_result_names_its_machine_and_table(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    # Not an xdist worker's variables: pytest-benchmark in the child would
    # take itself for one and time nothing.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(EMBSTORE_BENCH_VOCAB="3000", EMBSTORE_BENCH_IDS="2000")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:randomly",
            "benches",
            "--benchmark-enable",
            "--benchmark-min-rounds=1",
            "--benchmark-max-time=0.001",
            "--benchmark-warmup=off",
            f"--benchmark-json={out}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["benchmarks"]
    assert len(results) >= 15
    simd = embstore.Table(1).simd
    for r in results:
        facts = r["extra_info"]
        assert facts["simd"] == simd, r["name"]
        assert facts["cores"] == os.cpu_count()
        assert facts["cpu"]
        assert facts["embstore"] == embstore.__version__
        if any(peer in r["name"] for peer in ("torch", "dict", "hash")):
            continue  # a peer (on a workload's table where it ran on one), or strings hashed
        assert "table" in facts, r["fullname"]
        table = facts["table"]
        assert table["rows"] > 0, r["name"]
        assert table["bytes"] > 0
        assert table.get("table", table)["simd"] == simd  # a cache: its table's
    # Each table's own: the policy benchmarks' tables are the policy's.
    evicting = [r for r in results if r["name"].startswith("test_lookup_under_policy")]
    assert evicting
    assert {r["extra_info"]["table"]["rows"] for r in evicting} == {3000}
