"""Under mpirun (issue 13, case 10): ranks that enter different collective
calls, or refuse their input with any exception, all raise, agreed, and the
table is unchanged; watchdog timeouts are validated on every rank."""

from __future__ import annotations

import math
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from embstore import optim
from embstore.distributed import ShardedTable

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def fresh() -> ShardedTable:
    t = ShardedTable(4, optimizer=optim.SGD(lr=1.0), seed=3)
    t.lookup(np.arange(20))
    return t


def state(t: ShardedTable) -> tuple[int, np.ndarray]:
    return t.step, t.lookup(np.arange(20), insert=False)


def test_ranks_entering_different_calls_all_raise_and_change_nothing() -> None:
    t = fresh()
    before = state(t)
    if RANK == 0:
        call = lambda: t.lookup(np.arange(5))  # noqa: E731
    else:
        call = lambda: t.apply_gradients(np.arange(5), np.ones((5, 4)))  # noqa: E731
    with pytest.raises(RuntimeError, match="the ranks entered different collective calls"):
        call()
    after = state(t)
    assert after[0] == before[0] == 0
    np.testing.assert_array_equal(after[1], before[1])


def test_the_same_call_with_different_flags_is_refused() -> None:
    t = fresh()
    with pytest.raises(
        ValueError, match=r"passed different arguments.*'insert', True.*'insert', False"
    ):
        t.lookup(np.arange(5), insert=RANK != SIZE - 1)
    assert len(t) == 20


def test_a_flag_refused_on_one_rank_raises_on_every_rank() -> None:
    """A bad flag on the last rank only: every rank raises (none waits for
    the watchdog), and nothing changes."""
    t = fresh()
    before = state(t)
    bad = "yes" if RANK == SIZE - 1 else True
    with pytest.raises((TypeError, ValueError), match="insert"):
        t.lookup(np.arange(30), insert=bad)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError), match="insert"):
        t.lookup_pooled(np.arange(30), np.array([0, 30]), insert=bad)  # type: ignore[arg-type]
    after = state(t)
    assert after[0] == before[0]
    np.testing.assert_array_equal(after[1], before[1])
    assert len(t) == 20


def test_a_save_path_refused_on_one_rank_raises_on_every_rank() -> None:
    t = fresh()
    path = COMM.bcast(tempfile.mkdtemp() + "/ck" if RANK == 0 else None)
    with pytest.raises((TypeError, ValueError), match=r"rank|path"):
        t.save(None if RANK == SIZE - 1 else path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="passed different arguments"):
        t.save(path if RANK == 0 else path + "-elsewhere")


@pytest.mark.parametrize("dims", [(4, 4), (4, 6)])
def test_calls_on_different_tables_are_refused_not_crossed(dims: tuple[int, int]) -> None:
    """Rank 0 looks up in one table while the others look up in another of
    the same communicator: every rank raises naming the two tables, and no
    row moves between them (with other dims it was MPI_ERR_TRUNCATE and an
    abort)."""
    t1 = ShardedTable(dims[0], optimizer=optim.SGD(lr=1.0), seed=1)
    t2 = ShardedTable(dims[1], optimizer=optim.SGD(lr=1.0), seed=2)
    t1.lookup(np.arange(10))
    t2.lookup(np.arange(10, 20))
    mine = t1 if RANK == 0 else t2
    with pytest.raises(RuntimeError, match="entered different collective calls"):
        mine.lookup(np.arange(100, 140))
    assert len(t1) == 10
    assert len(t2) == 10
    assert not t1.contains(np.arange(100, 140)).any()
    assert not t2.contains(np.arange(100, 140)).any()


class _Unconvertible:
    """Input whose conversion raises something other than TypeError/ValueError."""

    def __array__(self, *args: object, **kwargs: object) -> np.ndarray:
        raise RuntimeError("simulated: this input cannot be read")


def test_a_refusal_of_any_exception_type_is_agreed() -> None:
    t = fresh()
    keys = _Unconvertible() if RANK == SIZE - 1 else np.arange(5)
    expected = RuntimeError if RANK == SIZE - 1 else ValueError
    with pytest.raises(expected, match=r"simulated|refused its input"):
        t.apply_gradients(keys, np.ones((5, 4)))
    assert t.step == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.0, 1e300])
def test_bad_timeouts_are_refused_on_every_rank(bad: float) -> None:
    with pytest.raises(ValueError, match="timeout: expected a finite number of seconds"):
        ShardedTable(4, optimizer=optim.SGD(lr=1.0), timeout=bad)


def test_a_bad_local_tier_on_one_rank_is_refused_on_every_rank() -> None:
    """local= must be a LocalTier (or a factory of one) of the given dim; a
    rank that passes something else makes every rank raise."""
    import embstore

    last = RANK == SIZE - 1
    local: object = "a table" if last else embstore.Table(4, optimizer=optim.SGD(lr=1.0), seed=3)
    with pytest.raises((TypeError, ValueError), match=r"local: |refused its input"):
        ShardedTable(4, local=local)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dim: expected the local tier's dim 4|refused"):
        ShardedTable(8 if last else 4, local=embstore.Table(4, seed=3))
    with pytest.raises((TypeError, ValueError), match=r"factory to return|refused its input"):
        ShardedTable(
            4, local=(lambda seed: 5) if last else (lambda seed: embstore.Table(4, seed=seed))
        )  # type: ignore[arg-type,return-value]
