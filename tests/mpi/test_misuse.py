"""Under mpirun (issue 13, case 10): ranks that enter different collective
calls, or refuse their input with any exception, all raise, agreed, and the
table is unchanged; watchdog timeouts are validated on every rank."""

from __future__ import annotations

import math

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
    with pytest.raises(RuntimeError, match=r"lookup\(insert=True\).*lookup\(insert=False\)"):
        t.lookup(np.arange(5), insert=RANK != SIZE - 1)
    assert len(t) == 20


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
