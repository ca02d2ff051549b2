"""No call aborts the process when memory is short: every array whose size
comes from the input (outputs, work arrays, a list's items) is allocated
fallibly, and a call that cannot get it raises MemoryError naming the
argument, with nothing changed. Each case runs in a child process under
RLIMIT_AS (an abort there is a signal, not a Python exception)."""

from __future__ import annotations

import pytest

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
