"""Serving latency under a writer: 128-key serving lookups (``insert=False``)
from one thread while another thread trains, with lookup + Adam batches of
1M ids, the same table or another one of the same size (the same CPU load).
A serving lookup takes no lock (``docs/ARCHITECTURE.md``, "What waits for
what"), so its p99 next to a writer of its own table should stay near its
p99 next to a writer of another table. The same again on tables with a
capacity (LRU, as large as the table: nothing is evicted), whose serving
reads also count as touches without waiting for the writer."""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import numpy as np

import embstore
from embstore import optim


def _serve(
    reader: embstore.Table,
    writer: embstore.Table | None,
    vocab: int,
    write_ids: int,
    seconds: float,
) -> dict[str, Any]:
    """Latencies of 128-key serving lookups on `reader` for `seconds`, while
    a thread trains `writer` (None: no writer)."""
    rng = np.random.default_rng(1)
    keys = [rng.integers(0, vocab, 128) for _ in range(256)]
    stop = threading.Event()
    steps = [0]

    def train() -> None:
        assert writer is not None
        wr = np.random.default_rng(2)
        g = np.full((write_ids, writer.dim), 1e-3, np.float32)
        while not stop.is_set():
            ids = wr.integers(0, vocab, write_ids)
            writer.lookup(ids)
            writer.apply_gradients(ids, g)
            steps[0] += 1

    th = threading.Thread(target=train, daemon=True) if writer is not None else None
    if th is not None:
        th.start()
        time.sleep(0.2)
    lat: list[float] = []
    end = time.perf_counter() + seconds
    i = 0
    while (now := time.perf_counter()) < end:
        reader.lookup(keys[i % len(keys)], insert=False)
        lat.append(time.perf_counter() - now)
        i += 1
    stop.set()
    if th is not None:
        th.join()
    a = np.asarray(lat) * 1e6
    return {
        "calls": len(a),
        "p50_us": float(np.percentile(a, 50)),
        "p99_us": float(np.percentile(a, 99)),
        "max_us": float(a.max()),
        "writer_steps": steps[0],
    }


def reader_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Reader p50/p99 with no writer, a writer of another table, and a
    writer of the same table; ratios same/other."""
    vocab = args.vocab
    write_ids = min(1_000_000, args.batch * 16)
    seconds = 0.5 if args.quick else 5.0

    def filled(capacity: int | None) -> embstore.Table:
        t = embstore.Table(
            args.dim, optimizer=optim.Adam(lr=1e-3), capacity=capacity, eviction="lru"
        )
        for lo in range(0, vocab, 1 << 20):
            t.lookup(np.arange(lo, min(vocab, lo + (1 << 20))))
        return t

    res: dict[str, Any] = {
        "vocab": vocab,
        "dim": args.dim,
        "write_ids": write_ids,
        "seconds": seconds,
    }
    for suffix, capacity in (("", None), ("_lru", vocab)):
        a, b = filled(capacity), filled(capacity)
        if not suffix:
            res["alone"] = _serve(a, None, vocab, write_ids, seconds)
        res["other_table_writer" + suffix] = _serve(a, b, vocab, write_ids, seconds)
        res["same_table_writer" + suffix] = _serve(a, a, vocab, write_ids, seconds)
        same, other = res["same_table_writer" + suffix], res["other_table_writer" + suffix]
        res["p99_ratio_same_to_other" + suffix] = same["p99_us"] / other["p99_us"]
        res["calls_ratio_same_to_other" + suffix] = same["calls"] / max(1, other["calls"])
        del a, b
    return res


def report_readers(res: dict[str, Any]) -> str:
    lines = [
        f"serving latency: 128-key lookups (insert=False) on a {res['vocab']:,}-row "
        f"dim-{res['dim']} Adam table, {res['seconds']:.0f} s each, while a thread "
        f"trains {res['write_ids']:,}-id lookup + Adam batches",
        f"{'writer':<24}{'calls':>9}{'p50 us':>9}{'p99 us':>10}{'max us':>11}{'steps':>7}",
    ]
    for name in (
        "alone",
        "other_table_writer",
        "same_table_writer",
        "other_table_writer_lru",
        "same_table_writer_lru",
    ):
        v = res[name]
        lines.append(
            f"{name:<24}{v['calls']:>9,}{v['p50_us']:>9.1f}{v['p99_us']:>10.1f}"
            f"{v['max_us']:>11.1f}{v['writer_steps']:>7}"
        )
    for suffix, what in (("", "plain tables"), ("_lru", "LRU-capacity tables")):
        lines.append(
            f"same-table / other-table writer, {what}: "
            f"p99 x{res['p99_ratio_same_to_other' + suffix]:.2f}, "
            f"calls x{res['calls_ratio_same_to_other' + suffix]:.2f}"
        )
    return "\n".join(lines)
