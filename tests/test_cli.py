"""The command line: the peer comparison runs end to end on small sizes."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_bench_quick_runs_and_reports_every_measure() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "embstore", "bench", "--quick"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    for measure in ("torch.index_select", "SparseAdam", "new keys", "2 threads", "resident"):
        assert measure in out
    assert "lookup result equal to torch.index_select: True" in out


def test_unknown_command_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "embstore", "frobnicate"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "usage: python -m embstore" in proc.stderr
