"""Online resharding: a live ShardedTable moves from N ranks to M, its rows,
optimizer state and policy metadata going rank to rank, not through files
(:func:`reshard`).

Every process of ``via`` (a communicator or process group holding the old
ranks and the new) calls ``reshard(table, comm, via=via)`` with its part of
the table (None where it holds none) and the new ranks' communicator (None
where it leaves). The old ranks agree on the table's configuration; each
sends every row to its owner under the same partition kind over the new
ranks (an all-to-all over ``via``); each new rank builds its local table
from what it received, with the old step, seed and call clock. The result
equals the table saved on the old ranks and loaded on the new bit for bit
(rows, optimizer state, touch metadata); training on equals one Table fed
the same global batches, as N ranks always do.

Not moved, as a checkpoint does not keep them: an admission filter's
counts of keys that have no row yet (they restart). A local tier other
than a Table in memory (a disk table, a DeviceCache) is refused: save it
and load it on the new ranks.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from embstore.config import TableConfig
from embstore.distributed.partition import Partition
from embstore.distributed.table import ShardedTable
from embstore.distributed.transport import transport_of
from embstore.store import Table
from embstore.table_state import _meta_words, restore_stored

__all__ = ["reshard"]


def reshard(table: ShardedTable | None, comm: Any, *, via: Any) -> ShardedTable | None:
    """Moves ``table`` (this process's part, or None) onto the ranks of
    ``comm`` (None where this process leaves); every process of ``via``
    calls it. Returns this process's part of the new table (None where it
    leaves). ``stats()["reshard"]`` of the new table reports the pause
    (seconds), the rows and bytes this rank sent and the rows it received
    (the old table's ``last_reshard`` too, where this process leaves).
    Collective over ``via``."""
    t0 = time.perf_counter()
    t = transport_of(via)
    old = table if isinstance(table, ShardedTable) else None
    if table is not None and old is None:
        raise TypeError(f"table: expected a ShardedTable or None, got {type(table).__name__}")
    local = old.local if old is not None else None
    refusal = None
    if old is not None and (not isinstance(local, Table) or local.table_config.disk is not None):
        refusal = (
            f"rank {t.rank}: the local tier is a {type(local).__name__} "
            f"{'on disk ' if isinstance(local, Table) else ''}(reshard moves Tables in "
            "memory; save the table and load it on the new ranks)"
        )
    new_t = transport_of(comm) if comm is not None else None
    state: dict[str, Any] = {}
    if old is not None and refusal is None:
        assert isinstance(local, Table)
        state = local.state_dict(with_optimizer=True)
    mine = {
        "old": None
        if old is None or not isinstance(local, Table)
        else {
            "config": json.loads(local.table_config._to_core()),
            "partition": old.partitioning.to_record(),
            "step": int(old.step),
            "seed": int(np.asarray(state.get("seed", 0))),
            "clock": int(np.asarray(state.get("clock", 0))),
            "old_size": old.size,
            "old_rank": old.rank,
            "wire_dtype": old.wire_dtype,
        },
        "new_rank": None if new_t is None else new_t.rank,
        "new_size": None if new_t is None else new_t.size,
        "refusal": refusal,
    }
    every = t.allgather(mine)
    refusals = [e["refusal"] for e in every if e["refusal"]]
    olds = [e["old"] for e in every if e["old"] is not None]
    news = {e["new_rank"]: r for r, e in enumerate(every) if e["new_rank"] is not None}
    problem = None
    if refusals:
        problem = refusals[0]
    elif not olds:
        problem = "table: no process passed a table"
    elif any(
        {k: v for k, v in o["config"].items() if k not in ("num_shards",)}
        != {k: v for k, v in olds[0]["config"].items() if k not in ("num_shards",)}
        or (o["partition"], o["step"], o["seed"], o["wire_dtype"])
        != (olds[0]["partition"], olds[0]["step"], olds[0]["seed"], olds[0]["wire_dtype"])
        for o in olds
    ):
        problem = "table: the old ranks' tables differ (configuration, partition or step)"
    elif len(olds) != olds[0]["old_size"]:
        problem = f"table: {len(olds)} processes passed a part, the table has {olds[0]['old_size']}"
    elif not news or sorted(news) != list(range(len(news))):
        problem = "comm: the new ranks' communicators do not make one group"
    elif any(e["new_size"] not in (None, len(news)) for e in every):
        problem = "comm: the new ranks' communicators differ in size"
    if problem is not None:
        raise ValueError(f"reshard: {problem}; nothing moved")
    m = len(news)
    spec = olds[0]
    # A rank that goes on keeps what it can ("bucket": its buckets, up to
    # its new share): the old rank of each process to its new rank.
    keep = {
        e["old"]["old_rank"]: e["new_rank"]
        for e in every
        if e["old"] is not None and e["new_rank"] is not None
    }
    new_partition = Partition.from_record(spec["partition"]).resized(m, keep)
    # What each process sends: its rows to their owners over the new ranks,
    # each row as the table stores it (8-bit rows are never quantized
    # again), its optimizer state and its touch metadata.
    counts = np.zeros(t.size, np.int64)
    parts: dict[str, np.ndarray] = {}
    if old is not None:
        assert isinstance(local, Table)
        keys = np.asarray(state["keys"], np.int64)
        owners = new_partition.owners(keys).astype(np.int64)
        to_via = np.array([news[r] for r in range(m)], np.int64)[owners]
        order = np.argsort(to_via, kind="stable")
        counts = np.bincount(to_via, minlength=t.size).astype(np.int64)
        keys = np.ascontiguousarray(keys[order])
        stored, _ = local.lookup_with_state(keys, insert=False, stored=True)
        words = np.ascontiguousarray(stored).view(np.float32)
        parts["keys"], parts["words"] = keys, words
        if "state" in state:
            parts["state"] = np.ascontiguousarray(np.asarray(state["state"])[order])
        if "meta" in state:
            meta, _ = _meta_words(state, len(order))
            parts["meta"] = meta[order].astype(np.int64)
    recv_counts = t.alltoall(counts)
    moved_rows = int(counts.sum() - (counts[t.rank] if old is not None else 0))
    received: dict[str, np.ndarray] = {}
    sent_bytes = 0
    dim = int(spec["config"]["dim"])
    widths: dict[str, int | None] = {"keys": 1, "words": None, "state": None, "meta": 4}
    # Which fields travel: agreed from the old ranks' first (all alike).
    present = t.allgather(sorted(parts) if old is not None else None)
    have = next(p for p in present if p is not None)
    for f in have:
        mine_part = parts.get(f)
        width = widths[f]
        if width is None:  # the words' and state's width, from a rank that has it
            width = t.allreduce_max(0 if mine_part is None else int(mine_part.shape[1]))
        dtype = np.int64 if f in ("keys", "meta") else np.float32
        send = (
            np.zeros((0, width), dtype)
            if mine_part is None
            else np.ascontiguousarray(mine_part, dtype).reshape(-1, width)
        )
        got = t.alltoallv(
            send.reshape(-1),
            (counts * width).astype(np.int64),
            (recv_counts * width).astype(np.int64),
        )
        sent_bytes += moved_rows * width * send.itemsize
        received[f] = got.reshape(-1, width) if width > 1 else got
    result: ShardedTable | None = None
    if comm is not None:
        config = TableConfig._from_core(json.dumps(spec["config"]))
        fresh = Table.from_config(config)  # the old tables' seed
        n = len(received["keys"])
        meta = received.get("meta", np.zeros((0, 4), np.int64)).astype(np.uint32)
        restore_stored(
            fresh,
            np.ascontiguousarray(received["keys"], np.int64),
            np.ascontiguousarray(received["words"], np.float32).reshape(n, -1),
            None if "state" not in received else received["state"].reshape(n, -1),
            meta.reshape(-1, 4),
            max(o["clock"] for o in olds),
            int(spec["step"]),
        )
        result = ShardedTable(
            dim,
            comm=comm,
            partition=new_partition,
            local=fresh,
            wire_dtype=spec["wire_dtype"],
        )
    figures = {
        "seconds": time.perf_counter() - t0,
        "sent_rows": moved_rows,
        "sent_bytes": sent_bytes,
        "received_rows": int(recv_counts.sum()),
    }
    # Reported by stats()["reshard"] of the new table, and kept on the old
    # one too (a leaving rank's only record of what it sent).
    for t_ in (result, old):
        if t_ is not None:
            t_.last_reshard = dict(figures)
    return result
