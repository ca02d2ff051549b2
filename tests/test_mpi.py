"""Real ranks under mpirun (oversubscribed on 2 cores), each run under a timeout:
the tests of tests/mpi on 2, 3 and 4 ranks, resharding 4 -> 3 -> 1 ranks and
into a Table, and a failed rank ending the job instead of hanging it. Skipped
only where mpi4py/mpirun are not installed (pip install "embstore[mpi]")."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import embstore
from embstore import optim
from embstore.gpu import _xp as X

HERE = pathlib.Path(__file__).parent
HAVE_MPI = shutil.which("mpirun") is not None
try:
    import mpi4py  # noqa: F401
except ImportError:
    HAVE_MPI = False

pytestmark = pytest.mark.skipif(not HAVE_MPI, reason="mpi4py and mpirun are not installed")


def mpirun(
    n: int, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    e = {
        **os.environ,
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "RAYON_NUM_THREADS": "1",
        "EMBSTORE_MPI_TESTS": "1",
        "EMBSTORE_MPI_TIMEOUT": "120",
        "PYTHONPATH": os.pathsep.join(
            [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        **(env or {}),
    }
    return subprocess.run(
        ["mpirun", "--oversubscribe", "-n", str(n), sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_sharding_suite_under_mpirun(ranks: int) -> None:
    proc = mpirun(
        ranks, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no", str(HERE / "mpi")
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count(" passed") == ranks, proc.stdout[-2000:]
    assert "failed" not in proc.stdout


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not X.gpu_usable()[0], reason=f"no GPU for CuPy: {X.gpu_usable()[1]}")
def test_sharded_device_caches_of_two_ranks_on_one_gpu_equal_one_table() -> None:
    """ShardedTable(local=DeviceCache(..., xp=cupy)) with 2 ranks sharing one
    GPU: the stacked-tier tests of the MPI suite (training equals one Table,
    the checkpoint loads as one Table) on CuPy arrays."""
    proc = mpirun(
        2,
        "-m",
        "pytest",
        "-q",
        "-s",
        "-p",
        "no:cacheprovider",
        "--color=no",
        str(HERE / "mpi" / "test_sharding.py"),
        "-k",
        "stacked",
        env={"EMBSTORE_TEST_XP": "cupy"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count(" passed") == 2, proc.stdout[-2000:]
    assert "cupy" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("dtype", "kind", "tier"),
    [
        ("float32", "bucket", "memory"),
        ("int8", "bucket", "memory"),
        ("float32", "hash", "memory"),
        ("float32", "bucket", "disk"),
    ],
)
def test_an_online_reshard_2_to_4_to_3_equals_the_offline_path(
    dtype: str, kind: str, tier: str
) -> None:
    """tests/mpi/reshard_online.py on 4 ranks: reshard() 2 -> 4 -> 3 with
    training between equals save + load on the new ranks bit for bit (rows,
    optimizer state, touch metadata; 8-bit rows as stored) and one Table;
    it sends exactly the rows whose owner changes, under "bucket" within
    1.1x of those that must move. "disk": every part a disk table with
    memory for about 300 of its 5,000-10,000 rows, moved in rounds."""
    env = {
        "EMBSTORE_RESHARD_DTYPE": dtype,
        "EMBSTORE_RESHARD_PARTITION": kind,
        "EMBSTORE_RESHARD_TIER": tier,
    }
    proc = mpirun(4, str(HERE / "mpi" / "reshard_online.py"), env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("online reshard passed") == 4, proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_online_reshard_flushes_a_device_cache_and_puts_one_in_front_of_each_new_part() -> None:
    """tests/mpi/reshard_cache.py on 4 ranks: parts that are DeviceCaches
    (xp=numpy) holding rows trained only in the cache, resharded 2 -> 4:
    every row as trained reaches the new parts, each a DeviceCache of the
    old settings, serving what one Table serves; then 4 -> 2 with one
    rank's put refused raises on every rank and leaves every part as it
    was (a staying rank takes back the rows it got)."""
    proc = mpirun(4, str(HERE / "mpi" / "reshard_cache.py"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("cache reshard passed") == 4, proc.stdout[-2000:]


def reference(steps: int) -> embstore.Table:
    sys.path.insert(0, str(HERE / "mpi"))
    try:
        from reshard import DIM, global_batch
    finally:
        sys.path.pop(0)
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=4)
    for step in range(steps):
        table.apply_gradients(*global_batch(step))
    return table


def assert_tables_close(a: embstore.Table, b: embstore.Table) -> None:
    ka, ra, sa = a.export(with_state=True)
    kb, rb, sb = b.export(with_state=True)
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_allclose(ra, rb, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sa, sb, rtol=1e-5, atol=1e-7)
    assert a.step == b.step


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resharding_4_to_3_to_1_ranks_and_into_a_table(tmp_path: pathlib.Path) -> None:
    script = str(HERE / "mpi" / "reshard.py")
    four = str(tmp_path / "four")
    proc = mpirun(4, script, "-", four, "0", "10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Written by 4 ranks: one checkpoint, loadable by a plain Table.
    assert_tables_close(embstore.Table.load(four), reference(10))
    # 4 -> 3 ranks, then 3 -> 1 rank, training on between.
    three = str(tmp_path / "three")
    proc = mpirun(3, script, four, three, "10", "15")
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = str(tmp_path / "one")
    proc = mpirun(1, script, three, one, "15", "20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_tables_close(embstore.Table.load(one), reference(20))
    # A plain Table's checkpoint loads onto 3 ranks and trains on.
    ref = reference(12)
    ref.save(tmp_path / "single")
    proc = mpirun(3, script, str(tmp_path / "single"), str(tmp_path / "back"), "12", "20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_tables_close(embstore.Table.load(tmp_path / "back"), reference(20))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_loads_onto_ranks_as_disk_tables_and_trains_on(tmp_path: pathlib.Path) -> None:
    """ShardedTable.load(disk=..., memory_bytes=...): each rank's part a
    disk table with memory for 30 of its rows (reshard.py checks), trained
    on to the rows of one table."""
    script = str(HERE / "mpi" / "reshard.py")
    ref = reference(12)
    ref.save(tmp_path / "single")
    spill = str(tmp_path / "spill")
    proc = mpirun(2, script, str(tmp_path / "single"), str(tmp_path / "back"), "12", "20", spill)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_tables_close(embstore.Table.load(tmp_path / "back"), reference(20))
    # A rank's directory that its exit left (a table in a reference cycle at
    # interpreter exit) is removed by the next disk table made there.
    after = embstore.Table(4, disk=spill, memory_bytes=1 << 20)
    assert len(list(pathlib.Path(spill).iterdir())) == 1, "only the new table's own"
    del after


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("call", ["step", "reshard"])
def test_a_failed_rank_ends_the_job_within_the_timeout(call: str) -> None:
    """A rank stuck before a collective (a step, or a reshard with its own
    timeout) ends the job within the watchdog's seconds, never a hang."""
    t0 = time.perf_counter()
    args = ["reshard"] if call == "reshard" else []
    env = {"EMBSTORE_MPI_TIMEOUT": "5" if call == "step" else "600"}
    proc = mpirun(3, str(HERE / "mpi" / "hang.py"), *args, env=env, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode != 0
    assert "did not finish within 5 s" in proc.stderr
    if call == "reshard":
        assert "reshard (the agreement) did not finish" in proc.stderr, proc.stderr[-2000:]
    assert "unreachable" not in proc.stdout
    assert elapsed < 60, f"took {elapsed:.0f} s"
