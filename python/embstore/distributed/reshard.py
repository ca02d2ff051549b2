"""Online resharding: a live ShardedTable moves from N ranks to M, its rows,
optimizer state and policy metadata going rank to rank, not through files
(:func:`reshard`).

Every process of ``via`` (a communicator or process group holding the old
ranks and the new) calls ``reshard(table, comm, via=via)`` with its part of
the table (None where it holds none) and the new ranks' communicator (None
where it leaves). The old ranks agree on the table's configuration; each
sends every row whose owner changes to its new owner under the same
partition kind over the new ranks (all-to-alls over ``via``), each row as
the table stores it (8-bit rows are never quantized again) with its
optimizer state and touch metadata. A process that stays keeps its Table
(the rows that left removed once every rank has put what it got, the
rows that came added); a process that joins builds one from what it
received, with the old step, seed and call clock. The result equals the table saved
on the old ranks and loaded on the new bit for bit (rows, optimizer state,
touch metadata); training on equals one Table fed the same global batches,
as N ranks always do.

Tiers come along: a disk table's rows move a batch at a time (a round of
all-to-alls moves at most a quarter of the smallest ``memory_bytes`` into
any process), never all in memory at once, and each new rank's part is a
disk table of its process's own settings (a joining process takes the
first old rank's); a DeviceCache in front is flushed first and the new
part gets one of the same settings (``local=`` builds another).

Not moved, as a checkpoint does not keep them: an admission filter's
counts of keys that have no row yet (a process that stays keeps its
filter; a joining one starts an empty one).
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from embstore.config import TableConfig
from embstore.distributed.agreement import DEFAULT_TIMEOUT, check_timeout, watched
from embstore.distributed.partition import Partition
from embstore.distributed.table import ShardedTable
from embstore.distributed.transport import transport_of
from embstore.protocol import LocalTier
from embstore.store import Table
from embstore.table_state import (
    call_clock,
    held_keys,
    record_widths,
    restore_stored,
    take_records,
)

__all__ = ["reshard"]


# A process's own settings, not the table's: they may differ between ranks.
_OWN = ("num_shards", "disk", "memory_bytes")
# Bytes one process sends another in one round of a reshard of tables in
# memory: every field's items below 2**31 (MPI counts are 32-bit), and a
# bound on the copies a round makes.
_ROUND_BYTES = 1 << 30


def _base_of(tier: Any) -> tuple[Table | None, dict[str, Any] | None]:
    """The Table under ``tier`` (a Table, or a DeviceCache over one, flushed
    here) and the DeviceCache's settings (None for a Table)."""
    if isinstance(tier, Table):
        return tier, None
    base = getattr(tier, "table", None)
    if isinstance(base, Table) and callable(getattr(tier, "flush", None)):
        tier.flush()
        return base, {
            "rows": int(tier.capacity),
            "xp": str(tier.xp.__name__).removeprefix("array_api_compat."),
            "policy": tier.policy,
            "admit_after": int(tier.admit_after),
        }
    return None, None


def _cached(settings: dict[str, Any]) -> Callable[[Table], LocalTier]:
    """A DeviceCache of ``settings`` (``_base_of``'s) in front of a Table."""
    from embstore.gpu import DeviceCache

    xp = importlib.import_module(settings["xp"])
    rest = {k: v for k, v in settings.items() if k != "xp"}

    def wrap(t: Table) -> LocalTier:
        made: LocalTier = DeviceCache(t, xp=xp, **rest)
        return made

    return wrap


def reshard(
    table: ShardedTable | None,
    comm: Any,
    *,
    via: Any,
    local: Callable[[Table], LocalTier] | None = None,
    timeout: float | None = None,
) -> ShardedTable | None:
    """Moves ``table`` (this process's part, or None) onto the ranks of
    ``comm`` (None where this process leaves); every process of ``via``
    calls it. Returns this process's part of the new table (None where it
    leaves). ``stats()["reshard"]`` of the new table reports the pause
    (seconds), the rows and bytes this rank sent, the rows it received and
    the rounds it took (the old table's ``last_reshard`` too, where this
    process leaves).

    ``local``: builds this process's new local tier from its new Table
    (None: a DeviceCache of the old part's settings where the old parts
    had one in front, this process's own where it held one, else the Table
    itself). Where this process stays, the new part is built on the old
    part's Table (use the returned table, not the old one, from then on);
    where it leaves, the old part is left as it was (a DeviceCache in front
    flushed). On any error, on any rank, every rank raises and nothing
    moved (rows a kept Table got are taken back). ``timeout``: seconds each
    phase (the agreement, each round of moves, the end) may take before the
    job is aborted, as a ShardedTable's calls are (None: its default,
    ``EMBSTORE_MPI_TIMEOUT`` or 600). Collective over ``via``."""
    t0 = time.perf_counter()
    limit = DEFAULT_TIMEOUT if timeout is None else check_timeout(timeout, "timeout")
    t = transport_of(via)
    old = table if isinstance(table, ShardedTable) else None
    if table is not None and old is None:
        raise TypeError(f"table: expected a ShardedTable or None, got {type(table).__name__}")
    if local is not None and not callable(local):
        raise TypeError(f"local: expected a callable or None, got {type(local).__name__}")
    base, cache = _base_of(old.local) if old is not None else (None, None)
    refusal = None
    if old is not None and base is None:
        refusal = (
            f"rank {t.rank}: the local tier is a {type(old.local).__name__} (reshard moves "
            "a Table, or a DeviceCache over one)"
        )
    new_t = transport_of(comm) if comm is not None else None
    own = None if base is None else json.loads(base.table_config._to_core())
    mine = {
        "old": None
        if old is None or base is None or own is None
        else {
            "config": own,
            "partition": old.partitioning.to_record(),
            "step": int(old.step),
            "seed": int(base.seed),
            "clock": call_clock(base),
            "old_size": old.size,
            "old_rank": old.rank,
            "wire_dtype": old.wire_dtype,
            "widths": record_widths(base),
            "cache": cache,
        },
        "new_rank": None if new_t is None else new_t.rank,
        "new_size": None if new_t is None else new_t.size,
        "refusal": refusal,
    }
    with watched(t, "reshard (the agreement)", limit):
        every = t.allgather(mine)
    refusals = [e["refusal"] for e in every if e["refusal"]]
    olds = [e["old"] for e in every if e["old"] is not None]
    news = {e["new_rank"]: r for r, e in enumerate(every) if e["new_rank"] is not None}

    def shared(o: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in o["config"].items() if k not in _OWN}

    problem = None
    if refusals:
        problem = refusals[0]
    elif not olds:
        problem = "table: no process passed a table"
    elif any(
        shared(o) != shared(olds[0])
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
    ww, sl, meta_w = spec["widths"]
    # A rank that goes on keeps what it can ("bucket": its buckets, up to
    # its new share): the old rank of each process to its new rank.
    keep = {
        e["old"]["old_rank"]: e["new_rank"]
        for e in every
        if e["old"] is not None and e["new_rank"] is not None
    }
    new_partition = Partition.from_record(spec["partition"]).resized(m, keep)
    # This process's rows, ordered by the process that will own them.
    counts = np.zeros(t.size, np.int64)
    keys = np.zeros(0, np.int64)
    # A process that stays keeps its table: only the rows whose owner
    # changes leave it (removed once every rank has put what it got).
    kept = base is not None and comm is not None
    leaving = np.zeros(0, np.int64)
    if base is not None:
        keys = held_keys(base)
        owners = new_partition.owners(keys).astype(np.int64)
        to_via = np.array([news[r] for r in range(m)], np.int64)[owners]
        if kept:
            moves = to_via != t.rank
            keys, to_via = keys[moves], to_via[moves]
            leaving = keys
        order = np.argsort(to_via, kind="stable")
        counts = np.bincount(to_via, minlength=t.size).astype(np.int64)
        keys = np.ascontiguousarray(keys[order])
    # Rounds: a disk table anywhere (old or new) bounds what one round
    # brings into a process to a quarter of the smallest memory_bytes.
    row_bytes = 8 + 4 * (ww + sl) + 8 * meta_w
    budgets = [
        int(e["old"]["config"]["memory_bytes"])
        for e in every
        if e["old"] is not None and e["old"]["config"].get("memory_bytes")
    ]
    quota = max(1, _ROUND_BYTES // row_bytes)
    if budgets:
        quota = min(quota, max(64, min(budgets) // (4 * row_bytes) // t.size))
    rounds = int(max(1, -(-int(counts.max(initial=0)) // quota)))
    with watched(t, "reshard (the agreement)", limit):
        rounds = t.allreduce_max(rounds)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    recv_total = 0
    fresh: Table | None = base if kept else None
    failure: str | None = None
    if comm is not None and not kept:
        config = TableConfig._from_core(json.dumps(spec["config"]))
        try:
            fresh = Table.from_config(config)  # the old tables' seed
        except Exception as e:  # every rank must learn of it, or the others wait
            failure = f"rank {t.rank}: {e}"
    clock = max(o["clock"] for o in olds)
    # Before the collectives that follow local work (a round's take, the
    # puts), a rank done early waits without spinning where the transport
    # can (MPI).
    arrive: Callable[[], None] = getattr(t, "arrive", lambda: None)
    # A kept table's clock moves only once the reshard succeeds.
    put_clock = call_clock(base) if kept and base is not None else clock
    received: list[np.ndarray] = []

    def give_back(why: str) -> NoReturn:
        """Raises on every rank (each calls it with the first failure), a
        kept table first taking back the rows it got: it is as it was (its
        rows, state, clock and step; a restore never changes the step)."""
        if kept and fresh is not None and received:
            fresh.remove(np.concatenate(received))
        raise RuntimeError(f"reshard: {why}; nothing moved (the old tables are as they were)")

    for r in range(rounds):
        lo = np.minimum(counts, r * quota)
        hi = np.minimum(counts, (r + 1) * quota)
        send_counts = hi - lo
        idx = (
            np.concatenate(
                [np.arange(s + a, s + b) for s, a, b in zip(starts, lo, hi, strict=True)]
            )
            if base is not None
            else np.zeros(0, np.int64)
        )
        piece = keys[idx.astype(np.int64)]
        parts: dict[str, np.ndarray] = {}
        if base is not None and failure is None:
            try:
                words, state, meta = take_records(base, piece)
                parts = {
                    "keys": piece,
                    "words": words,
                    "state": state,
                    "meta": meta.astype(np.int64),
                }
            except Exception as e:  # every rank must learn of it, or the others wait
                failure = f"rank {t.rank}: {e}"
        with watched(t, f"reshard (round {r + 1} of {rounds})", limit):
            arrive()
            failures = [f for f in t.allgather(failure) if f]
            if failures:
                give_back(failures[0])
            recv_counts = t.alltoall(send_counts)
            got: dict[str, np.ndarray] = {}
            for f, width, dtype in (
                ("keys", 1, np.int64),
                ("words", ww, np.float32),
                ("state", sl, np.float32),
                ("meta", meta_w, np.int64),
            ):
                if width == 0:
                    continue
                send = parts.get(f, np.zeros((0, width), dtype))
                got[f] = t.alltoallv(
                    np.ascontiguousarray(send, dtype).reshape(-1),
                    send_counts * width,
                    recv_counts * width,
                ).reshape(-1, width)
        n = int(recv_counts.sum())
        recv_total += n
        if fresh is not None and failure is None and n:
            try:
                restore_stored(
                    fresh,
                    got["keys"].reshape(-1),
                    got["words"],
                    got["state"] if sl else None,
                    got["meta"].astype(np.uint32) if meta_w else np.zeros((0, 4), np.uint32),
                    put_clock,
                    int(spec["step"]),
                )
                received.append(got["keys"].reshape(-1))
            except Exception as e:  # every rank must learn of it, or the others wait
                failure = f"rank {t.rank}: {e}"
    with watched(t, "reshard (the end)", limit):
        arrive()
        failures = [f for f in t.allgather(failure) if f]
    if failures:
        give_back(failures[0])
    if kept and fresh is not None and len(leaving):
        fresh.remove(leaving)
    result: ShardedTable | None = None
    if fresh is not None:
        restore_stored(
            fresh,
            np.zeros(0, np.int64),
            np.zeros((0, ww), np.float32),
            None,
            np.zeros((0, 4), np.uint32),
            clock,
            int(spec["step"]),
        )
        settings = spec["cache"] if cache is None and base is None else cache
        make = local if local is not None else None if settings is None else _cached(settings)
        tier: LocalTier = make(fresh) if make is not None else fresh
        result = ShardedTable(
            int(spec["config"]["dim"]),
            comm=comm,
            partition=new_partition,
            local=tier,
            wire_dtype=spec["wire_dtype"],
        )
    moved_rows = int(counts.sum())
    figures = {
        "seconds": time.perf_counter() - t0,
        "sent_rows": moved_rows,
        "sent_bytes": moved_rows * row_bytes,
        "received_rows": recv_total,
        "rounds": rounds,
    }
    # Reported by stats()["reshard"] of the new table, and kept on the old
    # one too (a leaving rank's only record of what it sent).
    for t_ in (result, old):
        if t_ is not None:
            t_.last_reshard = dict(figures)
    return result
