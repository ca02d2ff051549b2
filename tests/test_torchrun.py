"""The sharded tier under torchrun with torch.distributed (gloo) instead of
MPI: tests/torchrun/gloo_suite.py on 2 and 3 ranks (equal to one process,
cost-model bytes, resharding save/load, agreement on calls and on refused
input), and the watchdog ending a job whose rank stopped calling."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(
    shutil.which("torchrun") is None, reason="torchrun is not installed (pip install torch)"
)


def torchrun(n: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "RAYON_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "EMBSTORE_MPI_TIMEOUT": "120",
        "PYTHONPATH": os.pathsep.join(
            [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={n}",
            str(HERE / "torchrun" / "gloo_suite.py"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", [2, 3])
def test_the_sharded_suite_under_torchrun_with_gloo(ranks: int) -> None:
    proc = torchrun(ranks)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("gloo suite passed") == ranks, proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_that_stops_calling_ends_the_job_within_the_timeout() -> None:
    proc = torchrun(2, "hang", timeout=120)
    assert proc.returncode != 0
    assert "did not finish within 3 s" in proc.stderr, proc.stderr[-3000:]
