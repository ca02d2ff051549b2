"""A disk table's memory holds the bound the README gives under a hard
limit: ``benches/disk_memory.py`` runs a disk table through inserts, one
lookup of 4x ``memory_bytes`` of rows, training, a full and an incremental
save, ``export`` and a load of its checkpoint as a disk table, inside a
cgroup v1 memory group (page cache counted) whose limit is the formula
computed from the settings alone, on 1 and 8 pool threads; the kernel
never kills it. At 0306b22 a save kept a 256 MiB write buffer a pool
thread, a lookup larger than memory brought all its rows in at once, and
``export`` read every record on disk into memory first."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "benches"))

import disk_memory  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
@pytest.mark.parametrize("threads", [1, 8])
def test_a_disk_table_lives_within_the_formula_as_a_hard_limit(
    tmp_path: Path, threads: int
) -> None:
    if (
        not disk_memory.CGROUP_ROOT.is_dir()
        or not (disk_memory.CGROUP_ROOT / "cgroup.procs").exists()
    ):
        pytest.skip("no cgroup v1 memory controller here")
    try:
        probe = disk_memory.CGROUP_ROOT / f"embstore-probe-{os.getpid()}-{threads}"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here (needs root): {e}")
    args = argparse.Namespace(
        memory_mb=32, rows=120_000, steps=3, batch=8_192, limit=True, tmp=str(tmp_path), timeout=500
    )
    got = disk_memory.run(threads, args)
    assert got["rc"] == 0, got  # -9: killed by the limit
    assert got["phases"][-1].startswith("load and train"), got
    assert got["peak_mib"] <= got["formula_mib"], got
