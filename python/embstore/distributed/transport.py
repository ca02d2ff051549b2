"""How the sharded tier talks to the other ranks: one small set of collective
operations (:class:`Transport`), implemented over an MPI communicator
(mpi4py) and over a torch.distributed process group (gloo on CPU, as
launched by torchrun). ShardedTable and ShardedCollection call nothing else,
so one code path (the plan, the exchange, the agreement, the watchdog)
serves both."""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import time
import weakref
from typing import Any, NoReturn, Protocol

import numpy as np

from embstore._deps import require


class Transport(Protocol):
    """The collective operations of the sharded tier. Every rank calls each
    in the same order; arrays are NumPy, one-dimensional unless said."""

    rank: int
    size: int
    #: What the transport is, for messages ("MPI", "torch.distributed gloo").
    name: str

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        ...

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Rank ``root``'s ``obj`` on every rank."""
        ...

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on rank ``root`` (None elsewhere)."""
        ...

    def allreduce_max(self, value: int) -> int:
        """The largest ``value`` of any rank."""
        ...

    def allreduce_sum(self, a: np.ndarray) -> np.ndarray:
        """The element-wise sum of every rank's int64 ``a``."""
        ...

    def allgather_rows(self, a: np.ndarray) -> np.ndarray:
        """Every rank's int64 ``a`` (the same length everywhere), stacked: (size, len)."""
        ...

    def alltoall(self, send: np.ndarray) -> np.ndarray:
        """int64 ``send[r]`` goes to rank r; returns what each rank sent here."""
        ...

    def alltoallv(
        self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray
    ) -> np.ndarray:
        """Items ``send`` (rank 0's ``send_counts[0]`` first, then rank 1's...)
        to their ranks; returns the ``recv_counts`` items each rank sent here,
        rank by rank."""
        ...

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        ...

    def abort(self, code: int) -> NoReturn:
        """Ends the whole job (every rank), now."""
        ...


class MpiTransport:
    """:class:`Transport` over an mpi4py communicator."""

    def __init__(self, comm: Any = None) -> None:
        self._mpi = require("mpi4py.MPI", "mpi")
        self.comm = comm if comm is not None else self._mpi.COMM_WORLD
        self.rank = int(self.comm.Get_rank())
        self.size = int(self.comm.Get_size())
        self.name = "MPI"

    def allgather(self, obj: Any) -> list[Any]:
        return list(self.comm.allgather(obj))

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.comm.bcast(obj, root=root)

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        out = self.comm.gather(obj, root=root)
        return None if out is None else list(out)

    def allreduce_max(self, value: int) -> int:
        return int(self.comm.allreduce(int(value), op=self._mpi.MAX))

    def allreduce_sum(self, a: np.ndarray) -> np.ndarray:
        out = np.empty_like(a)
        self.comm.Allreduce(np.ascontiguousarray(a), out)
        return out

    def allgather_rows(self, a: np.ndarray) -> np.ndarray:
        out = np.empty((self.size, len(a)), a.dtype)
        self.comm.Allgather(np.ascontiguousarray(a), out)
        return out

    def alltoall(self, send: np.ndarray) -> np.ndarray:
        recv = np.empty_like(send)
        self.comm.Alltoall(np.ascontiguousarray(send), recv)
        return recv

    def arrive(self) -> None:
        """Returns once every rank has called it, sleeping (not spinning)
        meanwhile: a rank that waits long for the others before a
        collective leaves the cores to them (Open MPI polls while it
        waits, and ranks sharing cores slow each other)."""
        req = self.comm.Ibarrier()
        while not req.Test():
            time.sleep(0.0005)

    def alltoallv(
        self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray
    ) -> np.ndarray:
        mpi = self._mpi
        mtype = {
            np.dtype(np.int64): mpi.INT64_T,
            np.dtype(np.float32): mpi.FLOAT,
            np.dtype(np.uint8): mpi.UINT8_T,
        }[send.dtype]
        sc, rc = send_counts.astype(np.int64), recv_counts.astype(np.int64)
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
        recv = np.empty(int(rc.sum()), send.dtype)
        self.comm.Alltoallv(
            [
                np.ascontiguousarray(send).reshape(-1),
                (sc.astype(np.int32), sd.astype(np.int32)),
                mtype,
            ],
            [recv, (rc.astype(np.int32), rd.astype(np.int32)), mtype],
        )
        return recv

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, code: int) -> NoReturn:
        self._mpi.COMM_WORLD.Abort(code)
        os._exit(code)  # Abort does not return; should it, the process still ends


def _release_groups() -> None:
    """At exit, before the interpreter's teardown: every torch transport
    lets go of its process group, so that a group the job destroyed is
    freed now (its threads joined while the interpreter still runs), not
    by the teardown's collection in an order nobody chose."""
    for t in list(_LIVE_TORCH):
        t.group = None


_LIVE_TORCH: weakref.WeakSet[TorchTransport] = weakref.WeakSet()
atexit.register(_release_groups)


#: Bytes of a rank's pickle that :meth:`TorchTransport.allgather` sends in
#: one collective (larger ones go as all_gather_object sends them).
_SLOT = 1016


class TorchTransport:
    """:class:`Transport` over a torch.distributed process group (gloo on
    CPU; the default group where ``group`` is None), as torchrun starts."""

    def __init__(self, group: Any = None) -> None:
        torch = require("torch", "torch")
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "comm: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group('gloo') first (torchrun sets "
                "the environment it reads)"
            )
        self._torch = torch
        self._dist = dist
        self.group = group
        self.rank = int(dist.get_rank(group))
        self.size = int(dist.get_world_size(group))
        _LIVE_TORCH.add(self)
        self.name = f"torch.distributed {dist.get_backend(group)}"

    def allgather(self, obj: Any) -> list[Any]:
        # One all_gather of fixed-size slots where every rank's pickle fits
        # (a call's agreement: a few hundred bytes), where
        # all_gather_object makes two (the sizes, then the bytes): 0.6 ms
        # a call between two hosts instead of 1.3.
        data = pickle.dumps(obj)
        slot = np.zeros(8 + _SLOT, np.uint8)
        slot[:8] = np.array([len(data)], np.int64).view(np.uint8)
        if len(data) <= _SLOT:
            slot[8 : 8 + len(data)] = np.frombuffer(data, np.uint8)
        mine = self._torch.from_numpy(slot)
        parts = [self._torch.empty_like(mine) for _ in range(self.size)]
        self._dist.all_gather(parts, mine, group=self.group)
        slots = [p.numpy() for p in parts]
        sizes = [int(p[:8].view(np.int64)[0]) for p in slots]
        if max(sizes) > _SLOT:
            out: list[Any] = [None] * self.size
            self._dist.all_gather_object(out, obj, group=self.group)
            return out
        return [pickle.loads(p[8 : 8 + n].tobytes()) for p, n in zip(slots, sizes, strict=True)]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._global(root), group=self.group)
        return box[0]

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == root else None
        self._dist.gather_object(obj, out, dst=self._global(root), group=self.group)
        return out

    def allreduce_max(self, value: int) -> int:
        t = self._torch.tensor([int(value)], dtype=self._torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        return int(t[0])

    def allreduce_sum(self, a: np.ndarray) -> np.ndarray:
        t = self._torch.from_numpy(np.array(a, dtype=np.int64))
        self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM, group=self.group)
        out: np.ndarray = t.numpy()
        return out

    def allgather_rows(self, a: np.ndarray) -> np.ndarray:
        t = self._torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        parts = [self._torch.empty_like(t) for _ in range(self.size)]
        self._dist.all_gather(parts, t, group=self.group)
        return np.stack([p.numpy() for p in parts])

    def alltoall(self, send: np.ndarray) -> np.ndarray:
        t = self._torch.from_numpy(np.ascontiguousarray(send, dtype=np.int64))
        out = self._torch.empty_like(t)
        self._dist.all_to_all_single(out, t, group=self.group)
        result: np.ndarray = out.numpy()
        return result

    def alltoallv(
        self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray
    ) -> np.ndarray:
        # Every receive is posted before any send, then the parts move over
        # point-to-point operations: gloo's all_to_all_single (which posts
        # each send before its receive) moved 3.8 MB each way between two
        # hosts on a 1 Gbit/s link in 56-58 ms, one direction after the
        # other; posted receives first, 28-30 ms, the link's rate
        # (benches/RESULTS.md "Training across hosts").
        send = np.ascontiguousarray(send).reshape(-1)
        sc = np.asarray(send_counts, dtype=np.int64)
        rc = np.asarray(recv_counts, dtype=np.int64)
        s_at = np.concatenate([[0], np.cumsum(sc)])
        r_at = np.concatenate([[0], np.cumsum(rc)])
        out = np.empty(int(r_at[-1]), send.dtype)
        src, dst = self._torch.from_numpy(send), self._torch.from_numpy(out)
        peers = [(self.rank + i) % self.size for i in range(1, self.size)]
        dist, group = self._dist, self.group
        work = [
            dist.irecv(dst[r_at[p] : r_at[p + 1]], src=self._global(p), group=group)
            for p in peers
            if rc[p]
        ]
        work += [
            dist.isend(src[s_at[p] : s_at[p + 1]], dst=self._global(p), group=group)
            for p in peers
            if sc[p]
        ]
        me = self.rank
        out[r_at[me] : r_at[me + 1]] = send[s_at[me] : s_at[me + 1]]
        for w in work:
            w.wait()
        return out

    def _global(self, rank: int) -> int:
        """The default group's rank of this group's ``rank`` (what
        point-to-point calls name)."""
        if self.group is None:
            return rank
        return int(self._dist.get_global_rank(self.group, rank))

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def abort(self, code: int) -> NoReturn:
        # torchrun's agent ends the other ranks when one exits with an error.
        sys.stderr.flush()
        os._exit(code)


def transport_of(comm: Any) -> Transport:
    """The transport for ``comm``: an MPI communicator (None: COMM_WORLD), a
    torch.distributed ProcessGroup, the string "torch" (the default process
    group), or a Transport already."""
    if isinstance(comm, (MpiTransport, TorchTransport)):
        return comm
    if isinstance(comm, str):
        if comm != "torch":
            raise ValueError(
                f'comm: expected an MPI communicator, a ProcessGroup or "torch", got {comm!r}'
            )
        return TorchTransport(None)
    if comm is not None and type(comm).__module__.startswith("torch"):
        return TorchTransport(comm)
    return MpiTransport(comm)
