"""New rows come from zeroed memory: a row created where the arena's
memory was never written needs no write of zeros (an optimizer state
that starts at zero is not written; a large insert maps its pages for
writing), and a row created where removed rows lay is zeroed first.
Checked against a table that never removed a row (the same seed gives a
key the same first row), and by the resident memory of a child
process."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore import optim

OPTIMIZERS = [
    optim.Adam(lr=0.01),
    optim.Adagrad(lr=0.1),
    optim.Adagrad(lr=0.1, initial_accumulator_value=0.25),
    optim.Ftrl(lr=0.1),
    optim.RowWiseAdagrad(lr=0.1),
]


def _create(t: embstore.Table, new: np.ndarray, create: str) -> None:
    """Rows for keys ``new``, by a lookup, a step or an assign."""
    if create == "lookup":
        t.lookup(new)
    elif create == "step":
        t.apply_gradients(new, np.zeros((new.size, 8), np.float32))
    else:
        t.assign(new, np.full((new.size, 8), 0.5, np.float32))


def _churned(opt: optim.Optimizer, create: str) -> tuple[embstore.Table, np.ndarray]:
    """A one-shard table whose rows were trained, then mostly removed (the
    removals move rows into the holes and leave written memory past the
    last row), then new keys created there by ``create``."""
    rng = np.random.default_rng(3)
    t = embstore.Table(8, optimizer=opt, seed=11, num_shards=1)
    old = np.arange(6_000, dtype=np.int64) * 7
    for _ in range(3):
        t.lookup(old)
        t.apply_gradients(old, rng.standard_normal((old.size, 8), dtype=np.float32))
    assert t.remove(old[rng.permutation(old.size)[:4_500]]) == 4_500
    new = np.arange(4_000, dtype=np.int64) * 7 + 100_000
    _create(t, new, create)
    return t, new


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: f"{type(o).__name__}")
@pytest.mark.parametrize("create", ["lookup", "step", "assign"])
def test_rows_created_over_removed_rows_hold_what_a_fresh_tables_rows_hold(
    opt: optim.Optimizer, create: str
) -> None:
    t, new = _churned(opt, create)
    fresh = embstore.Table(8, optimizer=opt, seed=11, num_shards=1)
    # As many steps as the churned table's training (Adam's bias
    # correction counts them), on a key of its own.
    for _ in range(3):
        fresh.apply_gradients([-1], np.zeros((1, 8), np.float32))
    _create(fresh, new, create)
    rows, state = t.lookup_with_state(new, insert=False)
    want_rows, want_state = fresh.lookup_with_state(new, insert=False)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(state, want_state)
    # The optimizer's initial state, which a step then starts from.
    assert state.shape[1] == t.state_len
    g = np.random.default_rng(5).standard_normal((new.size, 8), dtype=np.float32)
    t.apply_gradients(new, g)
    fresh.apply_gradients(new, g)
    np.testing.assert_array_equal(
        t.lookup_with_state(new, insert=False)[1], fresh.lookup_with_state(new, insert=False)[1]
    )
    np.testing.assert_array_equal(t.lookup(new, insert=False), fresh.lookup(new, insert=False))


RSS_CHILD = """
import json
import numpy as np
import embstore
from embstore import optim

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

n, dim = 400_000, 64
t = embstore.Table(dim, optimizer=optim.Adam(lr=0.01), num_shards=4)
keys = np.arange(n, dtype=np.int64)
t.lookup(keys[:1000])
before = rss()
out = t.lookup(keys[1000:])
del out
embstore.free_output_buffers()
print(json.dumps({"looked_up": rss() - before, "weights": n * dim * 4, "state": n * 2 * dim * 4}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_an_inserts_unwritten_zero_state_is_mapped_for_writing() -> None:
    """A large insert into an Adam table writes its rows' weights and not
    their zero state, whose pages it maps for writing all the same (so that
    a step's first read of the state does not map the shared zero page and
    pay a copy on its write): resident memory grows by the weights and the
    state (400,000 rows of dim 64: 102 and 205 MB)."""
    import json

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(
        [sys.executable, "-c", RSS_CHILD], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["looked_up"] >= 0.95 * (r["weights"] + r["state"]), r
