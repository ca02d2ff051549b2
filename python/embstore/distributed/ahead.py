"""Exchanges started ahead (``ShardedTable.lookup_async``,
``lookup_pooled_async``, ``ShardedCollection.lookup_pooled_async``): the
call runs on a thread of its communicator's own while the caller computes,
and :meth:`Pending.wait` returns its result.

Collective calls must reach every rank in one order. So each communicator
(an MPI communicator, a torch.distributed process group) has one exchange
thread that runs the calls started ahead in the order they were started,
and any other collective call on that communicator, from any table, first
waits until those are done (:func:`drain`). A program that starts the same
calls in the same order on every rank (as it must for any collective call)
keeps that order. The thread is a daemon, started on first use, forgotten
in a forked child.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Pending", "drain", "in_exchange_thread", "start"]

T = TypeVar("T")


class Pending(Generic[T]):
    """A collective call started ahead; :meth:`wait` returns its result (or
    raises its error, on every rank alike, as the call itself would)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def _set(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def done(self) -> bool:
        """Whether the call has finished."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> T:
        """The call's result, once it finished (``timeout`` seconds at most:
        TimeoutError after, the call going on)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.what}: not finished within {timeout} s")
        if self._error is not None:
            raise self._error
        out: T = self._result
        return out

    def __repr__(self) -> str:
        return f"<Pending {self.what} {'done' if self.done() else 'running'}>"


class _Lane:
    """One communicator's exchange thread and what it has still to run."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Pending[Any]]] = queue.SimpleQueue()
        self._pending: list[Pending[Any]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn, pending = self._queue.get()
            try:
                pending._set(fn(), None)
            except BaseException as e:  # the caller's wait() raises it
                pending._set(None, e)
            # Waiting for the next call must not keep this one's table (its
            # bound method) or result alive: a table the program dropped is
            # freed at once.
            del fn, pending

    def submit(self, what: str, fn: Callable[[], T]) -> Pending[T]:
        pending: Pending[T] = Pending(what)
        with self._lock:
            self._pending = [p for p in self._pending if not p.done()]
            self._pending.append(pending)
        self._queue.put((fn, pending))
        return pending

    def drain(self) -> None:
        with self._lock:
            pending = list(self._pending)
            self._pending = []
        for p in pending:
            p._done.wait()

    def current(self) -> bool:
        return threading.current_thread() is self._thread


_LANES: dict[tuple[str, int], _Lane] = {}
_LANES_LOCK = threading.Lock()


def _key(comm: Any) -> tuple[str, int]:
    return (type(comm).__name__, id(comm))


def start(comm: Any, what: str, fn: Callable[[], T]) -> Pending[T]:
    """Runs ``fn`` (a collective call) on ``comm``'s exchange thread, after
    the calls started before it."""
    with _LANES_LOCK:
        lane = _LANES.get(_key(comm))
        if lane is None:
            lane = _LANES[_key(comm)] = _Lane(f"embstore-exchange-{len(_LANES)}")
    return lane.submit(what, fn)


def drain(comm: Any) -> None:
    """Waits until the calls started ahead on ``comm`` have finished (a
    no-op on the exchange thread itself, and where none was started)."""
    lane = _LANES.get(_key(comm))
    if lane is not None and not lane.current():
        lane.drain()


def in_exchange_thread(comm: Any) -> bool:
    """Whether the caller is ``comm``'s exchange thread."""
    lane = _LANES.get(_key(comm))
    return lane is not None and lane.current()


def _forget() -> None:
    # A forked child has none of its parent's threads.
    _LANES.clear()


os.register_at_fork(after_in_child=_forget)
