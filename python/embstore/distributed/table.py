"""One table across processes and machines over MPI (mpi4py) or
torch.distributed (gloo): every exchange goes through a
:class:`embstore.distributed.transport.Transport`.

Every rank owns the keys the partitioner gives it and keeps their rows in a
local :class:`embstore.Table`. Each collective call deduplicates the caller's
keys, sends them to their owners with ``Alltoallv`` (counts first), lets the
owners look up or apply, and returns values in the caller's order. Keys and
rows travel as contiguous NumPy buffers, never as pickled objects.

Failure handling: every collective first checks its input on every rank and
agrees on the outcome (a refused input raises on every rank, nothing
changes, nothing hangs); and every collective runs under a watchdog that
aborts the whole MPI job if it does not finish within ``timeout`` seconds
(a rank that died or raised between collectives would otherwise leave the
others waiting forever).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import ops
from embstore._convert import (
    as_bags,
    as_keys,
    as_rows,
    check_bool,
    check_int,
    check_name,
    to_numpy,
)
from embstore._deps import require
from embstore._latency import histogram, timed
from embstore.config import TableConfig
from embstore.distributed import ahead, wire
from embstore.distributed.agreement import DEFAULT_TIMEOUT, Agreement, check_timeout
from embstore.distributed.partition import Partition
from embstore.distributed.transport import Transport, transport_of
from embstore.exceptions import CheckpointError
from embstore.protocol import LocalTier, TableFigures, observed
from embstore.store import Table, next_seed

__all__ = ["ShardedTable"]


#: The id the next ShardedTable built in this process proposes; the ranks
#: agree on the largest proposal (see ShardedTable._setup).
_NEXT_TABLE_ID = 0


def _fspath(path: Any) -> str:
    """A checkpoint path as a string, or TypeError naming ``path``."""
    try:
        where = os.fspath(path)
    except TypeError:
        where = None
    if not isinstance(where, str):
        raise TypeError(f"path: expected a str or os.PathLike of str, got {type(path).__name__}")
    return where


def _snapshot(value: Any) -> Any:
    """An array argument copied (NumPy and anything it reads; a device
    array or tensor as it is, cloned where it can be)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    clone = getattr(value, "clone", None) or getattr(value, "copy", None)
    if callable(clone) and not isinstance(value, (str, bytes)):
        try:
            return clone()
        except Exception:
            return value
    return value


def _partition_of(partition: str | Partition, key_space: int | None, size: int) -> Partition:
    """The partition a ShardedTable of ``size`` ranks is given: a kind (with
    ``key_space``) or a :class:`Partition` (over this job's ranks)."""
    if isinstance(partition, Partition):
        if key_space is not None and key_space != partition.key_space:
            raise ValueError("key_space: expected none beside a Partition (it has its own)")
        return partition if partition.world_size == size else partition.resized(size)
    if partition != "bucket":
        check_name("partition", "partitions", partition)
    return Partition(partition, size, None if key_space is None else int(key_space))


class ShardedTable(Agreement):
    """A table whose rows are spread over the ranks of an MPI communicator
    or a torch.distributed process group.

    Parameters
    ----------
    dim:
        Columns per row.
    comm:
        The ranks: an MPI communicator (default ``MPI.COMM_WORLD``), or
        ``"torch"`` / a torch.distributed ProcessGroup (gloo on CPU) for a
        job torchrun launched; every call runs the same over either
        (:mod:`embstore.distributed.transport`).
    partition:
        "hash" (a mixing hash of the key, the default: even for sequential
        keys or keys sharing their low bits), "mod" (key mod world size),
        "div" (contiguous ranges of ``[0, key_space)``) or "bucket" (keys
        hashed into buckets assigned to ranks: a reshard moves whole buckets,
        no more than it must); or a
        :class:`embstore.distributed.Partition` of those (its
        ``world_size`` is this job's). :attr:`partitioning` is the value
        every exchange plans with and a checkpoint records.
    key_space:
        Required with "div": keys lie in ``[0, key_space)``.
    local:
        What each rank keeps its rows in (an
        :class:`embstore.protocol.LocalTier`): a Table, or a DeviceCache over
        one (``local=DeviceCache(Table(dim, ...), rows)`` serves and trains
        each rank's hottest rows on the device); or a factory called with
        the seed every rank agrees on (rank 0's draw of the default seed
        sequence), e.g. ``lambda seed: DeviceCache(Table(dim, seed=seed,
        optimizer=opt), 4096)``. Default: a Table built from
        ``table_kwargs``. The ShardedTable reaches it only through that
        protocol; every rank's configuration must agree.
    timeout:
        Seconds a collective call may take before the whole job is aborted.
    wire_dtype:
        How rows and gradients travel between ranks: "float32" (as they
        are), "bfloat16" or "float16" (half the bytes), "int8" (8-bit codes
        and a float32 scale and offset a row); each rank's rows stay in
        their own dtype (:mod:`embstore.distributed.wire`).
    **table_kwargs:
        Passed to each rank's local :class:`embstore.Table` (optimizer,
        initializer, seed, num_shards, dtype, admission, ttl_steps,
        ttl_seconds, capacity, capacity_bytes, eviction); they must agree on
        all ranks. Policies act on each rank's
        rows: ``capacity`` bounds each rank's table; TTL, ProbabilityFilter
        and CountFilter decide exactly as one Table would (admission counts a
        key once per call); LFU touch counts see a key once per sending rank
        per call, because batches are deduplicated before the exchange.
    """

    def __init__(
        self,
        dim: int,
        *,
        comm: Any = None,
        partition: str | Partition = "hash",
        key_space: int | None = None,
        local: LocalTier | Callable[[int], LocalTier] | None = None,
        timeout: float | None = None,
        wire_dtype: str = "float32",
        **table_kwargs: Any,
    ) -> None:
        self._setup(comm, partition, key_space, timeout, wire_dtype)
        given = isinstance(local, LocalTier)
        seed = None if given else table_kwargs.pop("seed", None)
        # Every rank that needs a default seed draws from its own sequence
        # (keeping them in step); all use rank 0's draw, so every rank
        # initializes a key alike. The broadcast is unconditional: a rank
        # whose arguments differ must not leave the others waiting in it.
        need = seed is None and not given
        drawn = next_seed() if need else None
        with self._watch("ShardedTable() seed"):
            agreed = self._t.bcast(drawn, root=0)
        if need:
            seed = agreed
        tier: LocalTier | None = None
        error: BaseException | None = None
        try:
            if need and seed is None:
                raise ValueError(
                    "local: rank 0 passed a built tier and this rank none; every rank "
                    "must pass the same kind of local"
                )
            if given:
                if table_kwargs:
                    raise TypeError(
                        f"table_kwargs: expected none with a built local tier, got "
                        f"{sorted(table_kwargs)}"
                    )
                tier = local  # type: ignore[assignment]
            elif local is None:
                tier = Table(dim, seed=seed, **table_kwargs)
            elif callable(local):
                if table_kwargs:
                    raise TypeError(
                        f"table_kwargs: expected only seed with a local factory, got "
                        f"{sorted(table_kwargs)}"
                    )
                tier = local(int(seed))  # type: ignore[arg-type]
                if not isinstance(tier, LocalTier):
                    raise TypeError(
                        "local: expected the factory to return a Table or a DeviceCache, "
                        f"got {type(tier).__name__}"
                    )
            else:
                raise TypeError(
                    "local: expected a Table, a DeviceCache or a factory of one, "
                    f"got {type(local).__name__}"
                )
            assert tier is not None
            if tier.dim != check_int("dim", dim, 1, 1 << 20):
                raise ValueError(f"dim: expected the local tier's dim {tier.dim}, got {dim}")
        except Exception as e:
            error = e
        self._agree("ShardedTable()", error)
        assert tier is not None
        self.local: LocalTier = tier
        self._check_config()

    # -- set-up ---------------------------------------------------------------

    def _setup(
        self,
        comm: Any,
        partition: str | Partition,
        key_space: int | None,
        timeout: float | None,
        wire_dtype: str = "float32",
    ) -> None:
        self._t: Transport = transport_of(comm)
        #: The communicator (MPI) or process group (torch.distributed) given.
        self.comm = getattr(self._t, "comm", getattr(self._t, "group", None))
        self.rank = self._t.rank
        self.size = self._t.size
        self.timeout = DEFAULT_TIMEOUT
        self.last_call: dict[str, int] = {"sent_bytes": 0, "received_bytes": 0}
        #: Seconds the last call spent in MPI exchanges (waiting included).
        self.last_exchange_seconds = 0.0
        # The last inserting lookup's keys (a copy), plan and route.
        self._last: tuple[Any, ...] | None = None
        #: What the reshard that made this table moved and took
        #: (:func:`embstore.distributed.reshard`; None otherwise).
        self.last_reshard: dict[str, Any] | None = None
        self.total_sent_bytes = 0
        self.total_received_bytes = 0
        error: BaseException | None = None
        chosen = Partition(world_size=self.size)
        #: How rows and gradients travel between ranks.
        self.wire_dtype = "float32"
        try:
            self.wire_dtype = wire.check_wire_dtype(wire_dtype)
            chosen = _partition_of(partition, key_space, self.size)
            if timeout is not None:
                self.timeout = check_timeout(timeout, "timeout")
        except Exception as e:
            error = e
        self._agree("ShardedTable()", error)
        self._use(chosen)
        # An id agreed by every rank, named in every later call's agreement:
        # ranks that call different tables stop with an error instead of
        # exchanging one table's rows into another.
        global _NEXT_TABLE_ID
        with self._watch("ShardedTable()"):
            self._id = self._t.allreduce_max(_NEXT_TABLE_ID)
        _NEXT_TABLE_ID = self._id + 1

    def _use(self, partitioning: Partition) -> None:
        #: How keys are spread over the ranks: what every exchange plans
        #: with and what :meth:`save` records in the manifest.
        self.partitioning = partitioning
        #: The partition's kind and key space (as given before there was a
        #: :class:`Partition`).
        self.partition = partitioning.kind
        self.key_space = partitioning.key_space

    def _config(self) -> dict[str, Any]:
        return {
            **self.local.config(),
            "partition": self.partition,
            "key_space": self.key_space,
            "buckets": self.partitioning.buckets,
            "wire_dtype": self.wire_dtype,
        }

    # -- exchange -----------------------------------------------------------------

    def _alltoallv(
        self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray, width: int
    ) -> np.ndarray:
        """Exchange rows of ``width`` items: ``send`` holds rank 0's rows, then rank 1's..."""
        sc = (send_counts * width).astype(np.int64)
        rc = (recv_counts * width).astype(np.int64)
        if max(int(sc.sum()), int(rc.sum())) >= 2**31:
            raise ValueError("batch too large for one exchange (2**31 items); split it")
        t0 = time.perf_counter()
        recv = self._t.alltoallv(np.ascontiguousarray(send).reshape(-1), sc, rc)
        self.last_exchange_seconds += time.perf_counter() - t0
        item = send.dtype.itemsize
        self.last_call["sent_bytes"] += int((sc.sum() - sc[self.rank]) * item)
        self.last_call["received_bytes"] += int((rc.sum() - rc[self.rank]) * item)
        return recv

    def _plan(
        self, keys: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The batch's distinct keys grouped by owner, each position's index
        among them, and the count each rank owns (one native pass; a key
        outside a "div" key space is refused here, before any exchange)."""
        return self.partitioning.plan(keys)

    def _route(
        self, uniq: npt.NDArray[np.int64], counts: npt.NDArray[np.int64]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Send distinct keys (grouped by owner, ``counts`` a rank) to their
        owners: (send_counts, recv_counts, recv_keys)."""
        send_counts = np.ascontiguousarray(counts, dtype=np.int64)
        t0 = time.perf_counter()
        recv_counts = self._t.alltoall(send_counts)
        self.last_exchange_seconds += time.perf_counter() - t0
        self.last_call["sent_bytes"] += 8 * (self.size - 1)
        self.last_call["received_bytes"] += 8 * (self.size - 1)
        recv_keys = self._alltoallv(uniq, send_counts, recv_counts, 1)
        return send_counts, recv_counts, recv_keys

    def _begin(self) -> None:
        self.total_sent_bytes += self.last_call["sent_bytes"]
        self.total_received_bytes += self.last_call["received_bytes"]
        self.last_call = {"sent_bytes": 0, "received_bytes": 0}
        self.last_exchange_seconds = 0.0

    def _fetch_unique(
        self, uniq: npt.NDArray[np.int64], counts: npt.NDArray[np.int64], insert: bool
    ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """Rows of distinct keys (grouped by owner, ``counts`` a rank), from
        their owners, in ``uniq``'s order; and the route taken (for a step on
        the same keys to send its gradients along)."""
        dim, w = self.local.dim, self.wire_dtype
        route = self._route(uniq, counts)
        sc, rc, recv_keys = route
        rows = wire.encode(to_numpy(self.local.lookup(recv_keys, insert=insert)), w)
        return wire.decode(self._alltoallv(rows, rc, sc, rows.shape[1]), w, dim), route

    def _fetch_found(
        self, uniq: npt.NDArray[np.int64], counts: npt.NDArray[np.int64]
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_fetch_unique` without inserting, with each key's found
        flag from its owner as one more float column of the rows sent back."""
        dim, w = self.local.dim, self.wire_dtype
        sc, rc, recv_keys = self._route(uniq, counts)
        rows, found = self.local.lookup(recv_keys, insert=False, return_found=True)
        if w != "float32":  # the flag as one byte more of each encoded row
            coded = wire.encode(to_numpy(rows), w)
            width = coded.shape[1] + 1
            buf = np.empty((recv_keys.shape[0], width), np.uint8)
            buf[:, :-1] = coded
            buf[:, -1] = to_numpy(found)
            got = self._alltoallv(buf, rc, sc, width).reshape(-1, width)
            return wire.decode(got[:, :-1], w, dim), got[:, -1] > 0
        packed = np.empty((recv_keys.shape[0], dim + 1), np.float32)
        packed[:, :dim] = to_numpy(rows)
        packed[:, dim] = to_numpy(found)
        back = self._alltoallv(packed, rc, sc, dim + 1).reshape(-1, dim + 1)
        return np.ascontiguousarray(back[:, :dim]), back[:, dim] > 0

    def _push_unique(
        self,
        uniq: npt.NDArray[np.int64],
        counts: npt.NDArray[np.int64],
        grads: np.ndarray,
        route: tuple[np.ndarray, ...] | None = None,
    ) -> None:
        """Send summed gradients of distinct keys (grouped by owner) to their
        owners; one step everywhere. ``route``: the one a lookup of the same
        keys took, agreed by every rank (the owners have the keys already:
        only gradients move)."""
        dim, w = self.local.dim, self.wire_dtype
        sc, rc, recv_keys = self._route(uniq, counts) if route is None else route
        coded = wire.encode(grads, w)
        sent = self._alltoallv(coded, sc, rc, coded.shape[1])
        self.local.apply_gradients(recv_keys, wire.decode(sent, w, dim))

    # -- the batch protocol (collective) ---------------------------------------------

    @property
    def writable(self) -> bool:
        """Whether the table stores rows and takes steps: True (see
        :class:`embstore.protocol.ReadTier`)."""
        return True

    @property
    def dim(self) -> int:
        """Columns per row."""
        return self.local.dim

    @property
    def step(self) -> int:
        """Optimizer steps taken (the same on every rank)."""
        return self.local.step

    @property
    def optimizer(self) -> Any:
        """The optimizer (every rank's is the same)."""
        return self.local.optimizer

    @timed
    def lookup(self, keys: Any, *, insert: bool = True, return_found: bool = False) -> Any:
        """Rows of this rank's ``keys (n,)``: float32 ``(n, dim)``. Collective.
        ``return_found=True`` (with ``insert=False``, on every rank) returns
        ``(rows, found)``, ``found`` bool ``(n,)`` from each key's owner, as
        :meth:`embstore.Table.lookup`'s; the flags travel with the rows (one
        column more in the same exchange)."""
        self._begin()

        def prep() -> tuple[bool, bool, np.ndarray, np.ndarray, np.ndarray]:
            ins = check_bool("insert", insert)
            found = check_bool("return_found", return_found)
            if found and ins:
                raise ValueError(
                    "return_found: needs insert=False (a lookup that inserts finds every key)"
                )
            return (ins, found, *self._plan(as_keys(keys)))

        ins, found, uniq, inv, counts = self._prepare(
            "lookup", prep, lambda r: (("insert", r[0]), ("return_found", r[1]))
        )
        self._last = None
        with self._watch("lookup"):
            if found:
                rows, flags = self._fetch_found(uniq, counts)
                return rows[inv], flags[inv]
            rows, route = self._fetch_unique(uniq, counts, ins)
        if ins:
            # A step on this batch next (its backward) reuses the plan, and,
            # where every rank does, the route: only gradients move.
            self._last = (np.array(keys, dtype=np.int64, copy=True), uniq, inv, counts, route)
        out: npt.NDArray[np.float32] = rows[inv]
        return out

    def lookup_async(self, keys: Any, *, insert: bool = True) -> ahead.Pending[np.ndarray]:
        """Starts :meth:`lookup` of ``keys`` and returns at once; ``.wait()``
        returns its rows. The exchange runs on a thread of this
        communicator's own while the caller computes (the next batch's
        lookup during this batch's dense work, as TorchRec's pipeline
        overlaps its input distribution). Collective, in the order started:
        every other collective call on the communicator waits for the calls
        started before it, so ``apply_gradients`` of this batch, then
        ``lookup_async`` of the next, trains exactly as the same calls made
        in turn. Bad input raises from ``wait()`` on every rank."""
        return ahead.start(self.comm, "lookup", self._ahead(self.lookup, keys, insert=insert))

    def lookup_pooled_async(
        self,
        ids: Any,
        offsets: Any,
        *,
        combiner: str = "sum",
        weights: Any = None,
        insert: bool = True,
    ) -> ahead.Pending[np.ndarray]:
        """:meth:`lookup_pooled` started ahead, as :meth:`lookup_async`."""
        fn = self._ahead(
            self.lookup_pooled, ids, offsets, combiner=combiner, weights=weights, insert=insert
        )
        return ahead.start(self.comm, "lookup_pooled", fn)

    def _ahead(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
        """``method(*args, **kwargs)`` to run ahead, its arrays copied now
        (the caller may reuse its buffers meanwhile)."""
        if self._t.name == "MPI":
            mpi = require("mpi4py.MPI", "mpi")
            if mpi.Query_thread() < mpi.THREAD_SERIALIZED:
                raise RuntimeError(
                    "lookup_async: MPI was initialized without thread support; "
                    "initialize it with MPI_THREAD_SERIALIZED or more (mpi4py's default)"
                )
        copied = [_snapshot(a) for a in args]
        return lambda: method(*copied, **{k: _snapshot(v) for k, v in kwargs.items()})

    def contains(self, keys: Any) -> npt.NDArray[np.bool_]:
        """Whether each of this rank's keys has a row anywhere. Collective."""
        self._begin()
        uniq, inv, counts = self._prepare("contains", lambda: self._plan(as_keys(keys)))
        with self._watch("contains"):
            sc, rc, recv_keys = self._route(uniq, counts)
            found = to_numpy(self.local.contains(recv_keys)).astype(np.uint8)
            back = self._alltoallv(found, rc, sc, 1)
        out: npt.NDArray[np.bool_] = back.astype(bool)[inv]
        return out

    def apply_gradients(self, keys: Any, grads: Any) -> None:
        """One optimizer step over every rank's batch: this rank's ``keys (n,)``
        and ``grads (n, dim)``. Gradients of a key are summed across ranks; its
        owner applies them. Collective."""
        self._begin()

        def prep() -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
            if self.local.optimizer is None:
                raise ValueError("optimizer: this table was built with optimizer=None")
            k = as_keys(keys)
            g = as_rows(grads, k.shape[0], self.dim, "grads")
            if not np.isfinite(g).all():
                raise ValueError("grads: expected only finite values")
            last = self._last
            same = last is not None and np.array_equal(k, last[0])
            uniq, inv, counts = last[1:4] if same and last is not None else self._plan(k)
            offsets = np.arange(len(k) + 1, dtype=np.int64)
            summed = ops.spread_pooled(g, inv, offsets, len(uniq))
            return uniq, counts, summed, same

        (uniq, counts, summed, _), every = self._prepare_voted(
            "apply_gradients", prep, vote=lambda r: r[3]
        )
        route = self._last[4] if every and self._last is not None else None
        with self._watch("apply_gradients"):
            self._push_unique(uniq, counts, summed, route)

    def _bags(self, ids: Any, offsets: Any, weights: Any, combiner: str) -> tuple[Any, ...]:
        i, o, w, c = as_bags(ids, offsets, weights, combiner)
        batch = ops.check_bags(i, o, w, c)
        uniq, inv, counts = self._plan(i)
        return i, o, w, c, batch, uniq, inv, counts

    @timed
    def lookup_pooled(
        self,
        ids: Any,
        offsets: Any,
        *,
        combiner: str = "sum",
        weights: Any = None,
        insert: bool = True,
    ) -> npt.NDArray[np.float32]:
        """Pooled rows of this rank's bags (CSR as :meth:`Table.lookup_pooled`). Collective."""
        self._begin()
        ins, (_, o, w, c, _, uniq, inv, counts) = self._prepare(
            "lookup_pooled",
            lambda: (check_bool("insert", insert), self._bags(ids, offsets, weights, combiner)),
            lambda r: (("insert", r[0]),),
        )
        with self._watch("lookup_pooled"):
            rows, _ = self._fetch_unique(uniq, counts, ins)
        return ops.pool_rows(rows, inv, o, w, c)

    def apply_pooled_gradients(
        self, ids: Any, offsets: Any, grads: Any, *, combiner: str = "sum", weights: Any = None
    ) -> None:
        """Backward of :meth:`lookup_pooled` and one optimizer step over every
        rank's batch. Collective."""
        self._begin()

        def prep() -> tuple[Any, ...]:
            if self.local.optimizer is None:
                raise ValueError("optimizer: this table was built with optimizer=None")
            _, o, w, c, batch, uniq, inv, counts = self._bags(ids, offsets, weights, combiner)
            g = as_rows(grads, batch, self.dim, "grads")
            if not np.isfinite(g).all():
                raise ValueError("grads: expected only finite values")
            return uniq, counts, ops.spread_pooled(g, inv, o, len(uniq), w, c)

        uniq, counts, summed = self._prepare("apply_pooled_gradients", prep)
        with self._watch("apply_pooled_gradients"):
            self._push_unique(uniq, counts, summed)

    def __len__(self) -> int:
        """Rows on all ranks. Collective."""
        self._agree("len", None)
        total = np.array([len(self.local)], np.int64)
        with self._watch("len"):
            out = self._t.allreduce_sum(total)
        return int(out[0])

    def state_dict(self, *, with_optimizer: bool = True) -> dict[str, Any]:
        """This rank's shard as arrays (its local Table's
        :meth:`embstore.Table.state_dict`), for ``torch.save`` of a model's
        ``state_dict()`` by each rank (the embstore.torch modules over this
        table put it in theirs). Local: nothing collective runs, so each rank
        saves when it likes. :meth:`load_state_dict` restores it on the same
        number of ranks under the same partition; for another number of
        ranks, :meth:`save` and :meth:`load`."""
        export = getattr(self.local, "state_dict", None)
        if export is None:
            raise TypeError(
                f"state_dict: the local tier is a {type(self.local).__name__}, which has no "
                "state_dict; save the table with save(path)"
            )
        out: dict[str, Any] = export(with_optimizer=check_bool("with_optimizer", with_optimizer))
        return out

    def load_state_dict(self, state: Any) -> None:
        """Replace this rank's shard with :meth:`state_dict`'s ``state``, saved
        by this rank of a job of as many ranks under the same partition.
        Collective, whole or not at all: every rank checks its state (its
        keys all its own under :attr:`partitioning`, the same step on every
        rank) and builds the new shard aside; only if every rank succeeded
        does any take it."""

        def prep() -> tuple[Table, int]:
            if not isinstance(self.local, Table) or self.local.table_config.disk is not None:
                raise TypeError(
                    "state: load_state_dict needs a local Table in memory; for another tier, "
                    "load with ShardedTable.load(path)"
                )
            if not hasattr(state, "get") or state.get("keys") is None:
                raise ValueError("state: expected a ShardedTable.state_dict() with 'keys'")
            keys = np.asarray(to_numpy(state["keys"]), dtype=np.int64).reshape(-1)
            owners = self.partitioning.owners(keys)
            stray = np.flatnonzero(owners != self.rank)
            if len(stray):
                raise ValueError(
                    f"state: key {int(keys[stray[0]])} belongs to rank {int(owners[stray[0]])} "
                    f"under {self.partitioning}, not to rank {self.rank} ({len(stray)} such "
                    "keys): a state dict saved by another rank or another number of ranks; "
                    "use save(path) and ShardedTable.load(path) to change the ranks"
                )
            fresh = Table.from_config(self.local.table_config)
            fresh.load_state_dict(state)
            return fresh, fresh.step

        fresh, _ = self._prepare("load_state_dict", prep, lambda r: (("step", r[1]),))
        self.local = fresh
        self._last = None

    def evict(self, *, with_rows: bool = False) -> Any:
        """Run the eviction policy on this rank's rows (see :meth:`Table.evict`);
        returns the keys this rank evicted (and their rows with
        ``with_rows``). Local: no communication."""
        return self.local.evict(with_rows=check_bool("with_rows", with_rows))

    def metrics(self) -> dict[str, TableFigures]:
        """This rank's shard's figures for :mod:`embstore.metrics` (read
        locally: nothing collective runs), with the latency of this
        table's own lookup calls."""
        figures = observed(self.local, "local")[""]
        figures.latency = histogram(self).read()
        return {"": figures}

    def stats(self) -> dict[str, Any]:
        """This rank's table stats plus global figures: rows and bytes per rank,
        bytes this rank sent and received in its last call and in all, and
        ``reshard``: what the reshard that made this table took (its pause,
        in seconds, and the rows and bytes this rank sent and received), None
        for a table made otherwise. Collective."""
        self._agree("stats", None)
        local = self.local.stats()
        mine = np.array(
            [
                local["rows"],
                local["bytes"],
                self.last_call["sent_bytes"],
                self.last_call["received_bytes"],
            ],
            np.int64,
        )
        with self._watch("stats"):
            every = self._t.allgather_rows(mine)
        return {
            **local,
            "rank": self.rank,
            "size": self.size,
            "partition": self.partition,
            "global_rows": int(every[:, 0].sum()),
            "rows_per_rank": every[:, 0].tolist(),
            "bytes_per_rank": every[:, 1].tolist(),
            "last_call_sent_bytes_per_rank": every[:, 2].tolist(),
            "last_call_received_bytes_per_rank": every[:, 3].tolist(),
            "sent_bytes": self.total_sent_bytes + self.last_call["sent_bytes"],
            "received_bytes": self.total_received_bytes + self.last_call["received_bytes"],
            "reshard": self.last_reshard,
        }

    # -- checkpoints (collective) -------------------------------------------------------

    def save(self, path: str | os.PathLike[str], *, with_optimizer: bool = True) -> dict[str, Any]:
        """Every rank writes its rows to ``path`` (a directory on a file system
        all ranks share), then rank 0 publishes one manifest. The result is an
        ordinary checkpoint: it loads on any number of ranks and into a single
        :meth:`embstore.Table.load`. Collective."""
        where, wo = self._prepare(
            "save",
            lambda: (_fspath(path), check_bool("with_optimizer", with_optimizer)),
            lambda r: (("path", r[0]), ("with_optimizer", r[1])),
        )
        with self._watch("save"):
            ckpt_id = self._t.bcast(self.local.new_checkpoint_id() if self.rank == 0 else None)
            part: str | None = None
            error = None
            try:
                part = self.local.save_part(where, f"{ckpt_id}-r{self.rank:04d}", with_optimizer=wo)
            except (CheckpointError, OSError) as e:
                error = f"rank {self.rank}: {e}"
            total = self._t.allreduce_sum(np.array([len(self.local)], np.int64))
            gathered = self._t.gather((part, error), root=0)
            manifest: dict[str, Any] | None = None
            if self.rank == 0:
                assert gathered is not None
                errors = [e for _, e in gathered if e]
                if not errors:
                    try:
                        parts = [p for p, _ in gathered if p is not None]
                        manifest = self.local.publish_parts(
                            where,
                            ckpt_id,
                            parts,
                            int(total[0]),
                            with_optimizer=wo,
                            partition=self.partitioning.to_record(),
                        )
                    except (CheckpointError, OSError) as e:
                        errors.append(f"rank 0 publishing: {e}")
                outcome = "; ".join(errors) if errors else None
            else:
                outcome = None
            outcome = self._t.bcast(outcome, root=0)
            manifest = self._t.bcast(manifest, root=0)
        if outcome:
            # Nothing was published: each rank removes what it wrote.
            self.local.remove_part(where, f"{ckpt_id}-r{self.rank:04d}")
            raise CheckpointError(f"checkpoint {where}: not saved: {outcome}")
        assert manifest is not None
        return manifest

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        comm: Any = None,
        partition: str | Partition | None = None,
        key_space: int | None = None,
        num_shards: int | None = None,
        timeout: float | None = None,
        disk: str | os.PathLike[str] | None = None,
        memory_bytes: int | None = None,
        wire_dtype: str = "float32",
        config: TableConfig | None = None,
        dtype: str | None = None,
    ) -> ShardedTable:
        """Load a checkpoint (written by any number of ranks, or by one Table)
        onto this communicator's ranks: each rank keeps the keys it owns.
        ``partition`` None: the partition the checkpoint records (a
        ShardedTable's save records its own), over this job's ranks; "hash"
        for a checkpoint that records none. With ``disk`` and
        ``memory_bytes``, each rank's table is a disk table keeping at most
        ``memory_bytes`` of its rows in memory (its files in a directory of
        its own under ``disk``), loaded part by part. ``dtype`` and
        ``config`` (instead of ``num_shards``, ``disk``, ``memory_bytes``
        and ``dtype``): as :meth:`embstore.Table.load` takes them.
        ``wire_dtype``: as the constructor's. Collective."""
        self = cls.__new__(cls)
        partition_ = "hash" if partition is None else partition
        self._setup(comm, partition_, key_space, timeout, wire_dtype)
        # Every rank holds the directory's readers' lock before rank 0 reads
        # the manifest, and loads the checkpoint of the manifest text rank 0
        # read: a save publishing meanwhile changes manifest.json but deletes
        # none of that checkpoint's files while any rank holds the lock, so
        # the ranks agree on one checkpoint (not some the old, some the new).
        where = self._prepare("load", lambda: _fspath(path), lambda r: (("path", r),))
        hold = self._prepare("load", lambda: Table.hold_checkpoint(where))
        try:
            with self._watch("load"):
                self._t.barrier()
                text: tuple[str | None, str | None] | None = None
                if self.rank == 0:
                    try:
                        text = (Table.checkpoint_manifest(where), None)
                    except Exception as e:
                        text = (None, f"{type(e).__name__}: {e}")
                manifest, refused = self._t.bcast(text, root=0)
            if refused is not None:
                raise CheckpointError(f"checkpoint {where}: rank 0 could not read it: {refused}")
            recorded = json.loads(manifest).get("partition")
            if partition is None and recorded is not None:
                # Checked by the manifest's parse: the same on every rank.
                self._use(Partition.from_record(recorded).resized(self.size))

            def prep() -> Table:
                return Table.load_owned(
                    where,
                    ranks=self.size,
                    rank=self.rank,
                    partition=self.partition,
                    key_space=self.key_space,
                    num_shards=num_shards,
                    manifest=manifest,
                    disk=disk,
                    memory_bytes=memory_bytes,
                    config=config,
                    dtype=dtype,
                    buckets=None
                    if self.partitioning.buckets is None
                    else list(self.partitioning.buckets),
                )

            local = self._prepare("load", prep)
        finally:
            hold.release()
        self.local = local
        self._check_config()
        expect = int(json.loads(manifest)["rows"])
        total = len(self)
        if total != expect:
            raise CheckpointError(
                f"checkpoint {where}: the ranks loaded {total} rows, the manifest says {expect}"
            )
        return self

    def __repr__(self) -> str:
        return (
            f"ShardedTable(dim={self.dim}, rank={self.rank}/{self.size}, "
            f"partition={self.partition!r}, wire_dtype={self.wire_dtype!r}, "
            f"local_rows={len(self.local)})"
        )
