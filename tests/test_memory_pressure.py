"""No call aborts the process when memory is short: every array whose size
comes from the input (outputs, work arrays, a list's items) is allocated
fallibly, and a call that cannot get it raises MemoryError naming the
argument, with nothing changed. Each case runs in a child process under
RLIMIT_AS (an abort there is a signal, not a Python exception)."""

from __future__ import annotations

import numpy as np
import pytest

import embstore

from . import _child

# Keys made before the limit; each call then needs far more than the limit
# leaves for its output or work arrays.
SETUP = """
t = embstore.Table(4, optimizer=optim.SGD(lr=0.1),
                   admission=policy.CountFilter(min_count=2, width=1024, depth=2))
t.apply_gradients(np.arange(10), np.ones((10, 4), np.float32))
before = (len(t), t.step)
keys = np.zeros(60_000_000, np.int64)
few = np.zeros(900_000, np.int64)  # below the size whose memory is checked up front
few_grads = np.zeros((900_000, 4), np.float32)
words = ["w"] * 30_000_000
"""

CALLS = {
    "contains": "t.contains(keys)",
    "contains_below_the_checked_size": "t.contains(few)",
    "lookup_below_the_checked_size": "t.lookup(few)",
    "apply_below_the_checked_size": "t.apply_gradients(few, few_grads)",
    "admission_counts": "t.admission_counts(keys)",
    "hash_keys_list": "embstore.hash_keys(words)",
    "lookup_serving": "t.lookup(keys, insert=False)",
    "export": "t.export(with_state=True)",
}


@pytest.mark.slow
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_call_sized_beyond_memory_raises_memory_error_not_an_abort(call: str) -> None:
    out = _child.ok(
        SETUP
        + f"""
limit_memory({4 << 20 if "few" in CALLS[call] else 32 << 20})
try:
    {CALLS[call]}
    print("done")
except MemoryError as e:
    print("refused:", e)
assert (len(t), t.step) == before, "a refused call changed the table"
print("unchanged")
"""
    )
    # export is sized by the table (10 rows): it fits and must simply work.
    if call == "export":
        assert "done" in out, out
    else:
        assert "refused:" in out, out
        assert ("keys" in out) or ("values" in out), out
    assert "unchanged" in out, out


@pytest.mark.slow
def test_a_huge_count_filter_is_a_memory_error_not_an_abort() -> None:
    out = _child.ok(
        """
        limit_memory(2 << 30)
        try:
            embstore.Table(8, optimizer=optim.SGD(lr=0.1),
                           admission=policy.CountFilter(min_count=2, width=2**40, depth=16))
        except MemoryError as e:
            print("refused:", e)
        """
    )
    assert "refused: admission:" in out, out


@pytest.mark.slow
@pytest.mark.parametrize(
    "call",
    [
        "t.apply_gradients(keys, grads)",
        "t.lookup_pooled(keys, np.array([0, 10_000, n]))",
        "t.lookup_pooled(keys, np.arange(n + 1))",
        "t.assign(keys, grads)",
        "coll.apply_pooled_gradients("
        "{'a': (keys, np.arange(n + 1)), 'b': (keys, np.arange(n + 1))}, wide)",
    ],
)
def test_running_out_of_memory_mid_call_refuses_it_whole(call: str) -> None:
    # 30,000 new rows of 8 KiB (246 MB) with 4 MB of address space left:
    # far more than any free heap space the process may have kept.
    out = _child.ok(
        f"""
        t = embstore.Table(2048, optimizer=optim.SGD(lr=0.1), num_shards=4)
        small = embstore.Table(4, optimizer=optim.SGD(lr=0.1))
        coll = embstore.Collection({{"a": t, "b": small}})
        t.lookup(np.arange(100))
        n = 30_000
        keys = np.arange(1000, 1000 + n)
        grads = np.ones((n, 2048), np.float32)
        wide = np.ones((n, 2052), np.float32)
        limit_memory(4 << 20)
        try:
            {call}
            print("applied")
        except MemoryError as e:
            print("refused:", e)
        print("rows", len(t), len(small), "step", t.step, small.step)
        """
    )
    assert "refused: keys:" in out or "refused: ids:" in out or "refused: offsets:" in out, out
    assert "rows 100 0 step 0 0" in out, out


@pytest.mark.slow
def test_a_first_parallel_call_under_a_memory_limit_still_runs() -> None:
    # rayon starts its global pool once per process, on first use: a first
    # use where no thread stack can be mapped used to leave the process
    # without a pool, every later call failing as an internal error. The
    # pool now starts at import; the import above ran before the limit.
    out = _child.ok(
        """
        t = embstore.Table(4, optimizer=optim.SGD(lr=0.1), num_shards=8)
        limit_memory(16 << 20)
        try:
            t.lookup(np.arange(200_000))  # spread over the pool
            print("looked up", len(t))
        except MemoryError as e:
            print("refused:", e)
        print("threads", embstore._core.num_threads())
        """
    )
    assert "looked up 200000" in out or "refused: keys:" in out, out
    assert "threads" in out, out


@pytest.mark.slow
def test_an_output_larger_than_memory_is_a_memory_error() -> None:
    out = _child.ok(
        """
        t = embstore.Table(1024, optimizer=optim.SGD(lr=0.1))
        keys = np.arange(1_200_000)  # 4.9 GB of output rows
        limit_memory(1 << 30)
        try:
            t.lookup(keys)
        except MemoryError as e:
            print("refused:", e)
        print("rows", len(t))
        """
    )
    assert "refused: keys:" in out, out
    assert "rows 0" in out, out


def test_kept_output_buffers_are_reported_and_bounded() -> None:
    embstore.free_output_buffers()
    assert embstore.output_buffers()["bytes"] == 0
    t = embstore.Table(64)
    rows = t.lookup(np.arange(100_000))  # 25.6 MB of output
    del rows
    kept = embstore.output_buffers()
    assert kept["buffers"] == 1
    assert kept["bytes"] >= 100_000 * 64 * 4
    assert kept["max_bytes"] == 2 << 30
    assert kept["max_buffers"] == 4
    assert embstore.free_output_buffers() == kept["bytes"]
    assert embstore.output_buffers()["bytes"] == 0


@pytest.mark.parametrize("n", [2**40, 2**60])
def test_a_huge_output_of_the_distributed_helpers_is_a_memory_error(n: int) -> None:
    # spread_pooled's output has n rows, a count it is given: an output
    # NumPy could not allocate used to panic (PanicException, a
    # BaseException) instead of raising MemoryError.
    grads = np.ones((1, 4), np.float32)
    with pytest.raises(MemoryError, match=r"^n: the output of"):
        embstore._core.spread_pooled(grads, np.array([0]), np.array([0, 1]), n)
