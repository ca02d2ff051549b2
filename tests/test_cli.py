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


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "embstore", *args], capture_output=True, text=True, timeout=120
    )


def test_unknown_command_is_refused() -> None:
    proc = cli("frobnicate")
    assert proc.returncode == 2
    assert "usage: python -m embstore" in proc.stderr
    assert "error: unknown command 'frobnicate' (commands: demo, bench" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_help_lists_every_command_with_a_line_each(flag: str) -> None:
    proc = cli(flag)
    assert proc.returncode == 0
    for command in ("demo", "bench", "inspect", "cache-curve"):
        line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith(command))
        assert len(line.split()) > 3, line  # a description follows the name


def test_no_command_prints_the_help_and_exits_2() -> None:
    proc = cli()
    assert proc.returncode == 2
    assert "Commands:" in proc.stderr


def test_version() -> None:
    import embstore

    proc = cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"embstore {embstore.__version__}"
