"""Before/after timings of one build against another, in separate processes
(the figures of "Trust under concurrency and failure" and "Lock-free reads"
in RESULTS.md):

    PYTHONPATH=/path/to/old/python python benches/ab_compare.py   # the old build
    python benches/ab_compare.py                                  # this one

Run them interleaved a few times on an idle machine and compare ranges: on a
noisy VM one run says little. Large calls: a 2M-key Adam table, dim 64,
65,536 x 26 ids (best of 3). Small calls: a 100k-key table (mean of 3,000
calls, best of 5). Checkpoints: a 1M x 64 rows-only checkpoint loaded, and
read mapped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import numpy as np

import embstore
from embstore import optim
from embstore.bench._timing import _best


def best_ms(f: Callable[[], object], reps: int = 3) -> float:
    return _best(f, reps) * 1e3


def mean_us(f: Callable[[], object], calls: int = 3000) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    vocab, batch, fields, dim = 2_000_000, 65_536, 26, 64
    t = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3))
    t.lookup(np.arange(vocab))
    ids = rng.integers(0, vocab, batch * fields)
    g = np.ones((len(ids), dim), np.float32)
    res: dict[str, float] = {"lookup_ms": best_ms(lambda: t.lookup(ids))}
    res["lookup+adam_ms"] = best_ms(lambda: (t.lookup(ids), t.apply_gradients(ids, g)))
    t.lookup(np.arange(10))  # the next step has no lookup of its keys before it
    res["adam_alone_ms"] = best_ms(lambda: t.apply_gradients(ids, g))
    coll = embstore.Collection({f"f{i}": t for i in range(fields)})
    bags = {
        f"f{i}": (ids[i * batch : (i + 1) * batch], np.arange(batch + 1)) for i in range(fields)
    }
    gc = np.ones((batch, fields * dim), np.float32)
    res["collection_forward_ms"] = best_ms(lambda: coll.lookup_pooled(bags))
    res["collection_step_ms"] = best_ms(
        lambda: (coll.lookup_pooled(bags), coll.apply_pooled_gradients(bags, gc))
    )
    res["serve_1.7M_ms"] = best_ms(lambda: t.lookup(ids, insert=False))
    res["pooled_26_per_bag_ms"] = best_ms(
        lambda: t.lookup_pooled(ids, np.arange(0, len(ids) + 1, fields))
    )
    new = np.arange(vocab, vocab + 1_000_000)
    t0 = time.perf_counter()
    t.lookup(new)
    res["insert_1M_ms"] = (time.perf_counter() - t0) * 1e3

    small = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3))
    small.lookup(np.arange(100_000))
    for n in (1, 16, 128, 1024):
        keys = rng.integers(0, 100_000, n)
        gs = np.ones((n, dim), np.float32)
        res[f"lookup_{n}_us"] = min(mean_us(lambda k=keys: small.lookup(k)) for _ in range(5))
        res[f"serve_{n}_us"] = min(
            mean_us(lambda k=keys: small.lookup(k, insert=False)) for _ in range(5)
        )
        res[f"adam_{n}_us"] = min(
            mean_us(lambda k=keys, g=gs: small.apply_gradients(k, g)) for _ in range(5)
        )
    res.update(_checkpoint_rows(rng, dim))
    print(json.dumps({k: round(v, 1) for k, v in res.items()}))


def _checkpoint_rows(rng: np.random.Generator, dim: int) -> dict[str, float]:
    """A 1M-row rows-only checkpoint: its load (warm page cache, best of 3),
    and lookups of a mapped open of it (1,024 keys: mean of 3,000 calls,
    best of 5; 1M keys: best of 3)."""
    import tempfile

    res: dict[str, float] = {}
    t = embstore.Table(dim, optimizer=optim.SGD(lr=0.1))
    t.lookup(np.arange(1_000_000))
    with tempfile.TemporaryDirectory() as d:
        t.save(d, with_optimizer=False)
        del t
        res["load_1M_ms"] = best_ms(lambda: embstore.Table.load(d))
        m = embstore.Table.load(d, mmap=True)
        m.export()  # every file checked once
        keys = rng.integers(0, 1_000_000, 1024)
        res["mapped_1024_us"] = min(mean_us(lambda: m.lookup(keys)) for _ in range(5))
        many = rng.integers(0, 1_000_000, 1_000_000)
        res["mapped_1M_ms"] = best_ms(lambda: m.lookup(many))
    return res


if __name__ == "__main__":
    main()
