"""How the ranks of a sharded tier stay in step: every collective call
first agrees on which call, which table and which arguments every rank
entered and whether any refused its input (so a refusal raises on every
rank and changes nothing), and runs under a watchdog that ends the whole
job if another rank failed or stopped calling (:class:`Agreement`)."""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from embstore.distributed import ahead
from embstore.distributed.transport import Transport

__all__ = ["DEFAULT_TIMEOUT", "Agreement", "check_timeout"]


def check_timeout(value: Any, arg: str) -> float:
    """A watchdog timeout in seconds: a finite number > 0 that a timer can
    wait (``threading.TIMEOUT_MAX``); ValueError naming ``arg`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{arg}: expected a number of seconds, got {type(value).__name__}")
    t = float(value)
    if not (math.isfinite(t) and 0 < t <= threading.TIMEOUT_MAX):
        raise ValueError(
            f"{arg}: expected a finite number of seconds in (0, {threading.TIMEOUT_MAX:g}], "
            f"got {value!r}"
        )
    return t


def _env_timeout() -> float:
    raw = os.environ.get("EMBSTORE_MPI_TIMEOUT")
    if raw is None:
        return 600.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"EMBSTORE_MPI_TIMEOUT: expected a number of seconds, got {raw!r}"
        ) from None
    return check_timeout(value, "EMBSTORE_MPI_TIMEOUT")


#: Seconds a collective may take before the watchdog aborts the job
#: (``EMBSTORE_MPI_TIMEOUT``, default 600).
DEFAULT_TIMEOUT = _env_timeout()


class _Watchdog:
    """The watchdog of every collective call in this process: one thread,
    started by the first call, that runs each block's ``fire`` once its
    deadline passes unless the block ended first. (A ``threading.Timer`` a
    call started an OS thread per collective call, and on a busy machine
    cancelled timers were still alive when the interpreter tore down after
    ``destroy_process_group()``: a job that had passed every check could
    end in a C++ terminate.) The thread is stopped and joined when the
    interpreter exits (``atexit``, which runs before its teardown), and a
    forked child starts with a fresh one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[int, tuple[float, Callable[[], None]]] = {}
        self._tickets = 0
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, seconds: float, fire: Callable[[], None]) -> int:
        """Watches a block: ``fire()`` runs in ``seconds`` unless
        :meth:`remove` is called with the returned ticket first."""
        with self._cond:
            self._tickets += 1
            if self._stopped:
                return self._tickets  # the interpreter is exiting: unwatched
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="embstore-watchdog", daemon=True
                )
                self._thread.start()
            self._due[self._tickets] = (time.monotonic() + seconds, fire)
            self._cond.notify()
            return self._tickets

    def remove(self, ticket: int) -> None:
        with self._cond:
            self._due.pop(ticket, None)

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                late = [t for t, (at, _) in self._due.items() if at <= now]
                fires = [self._due.pop(t)[1] for t in late]
                if fires:
                    self._cond.release()
                    try:
                        for fire in fires:
                            fire()
                    finally:
                        self._cond.acquire()
                    continue
                nearest = min((at for at, _ in self._due.values()), default=None)
                self._cond.wait(None if nearest is None else nearest - now)

    def stop(self) -> None:
        """Ends the thread and waits for it (at exit: before the teardown)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def _after_fork(self) -> None:
        # The parent's thread does not exist here, and its condition may
        # have been held by it at the fork.
        self._cond = threading.Condition()
        self._due = {}
        self._thread = None


_WATCHDOG = _Watchdog()
atexit.register(_WATCHDOG.stop)
os.register_at_fork(after_in_child=_WATCHDOG._after_fork)


@contextmanager
def watched(t: Transport, what: str, timeout: float) -> Iterator[None]:
    """Aborts the whole job (every rank: ``t.abort``) if the block does not
    finish within ``timeout`` seconds: a collective another rank never
    enters must not hang this one."""

    def fire() -> None:
        sys.stderr.write(
            f"embstore: rank {t.rank}: {what} did not finish within {timeout:g} s "
            "(another rank failed or stopped calling); aborting the job\n"
        )
        sys.stderr.flush()
        t.abort(70)

    ticket = _WATCHDOG.add(timeout, fire)
    try:
        yield
    finally:
        _WATCHDOG.remove(ticket)


class Agreement:
    """The agreement and watchdog of a sharded tier (a base class:
    ``_t`` is its transport, ``rank`` its rank, ``timeout`` its watchdog's
    seconds, ``_id`` the id its ranks agreed on, ``_config()`` what every
    rank must configure alike)."""

    _t: Transport
    rank: int
    timeout: float

    def _config(self) -> dict[str, Any]:
        raise NotImplementedError

    def _check_config(self) -> None:
        """Every rank must have the same configuration: compare per-field
        checksums; a difference raises on every rank, naming the fields."""
        cfg = self._config()
        names = sorted(cfg)
        mine = np.array(
            [zlib.crc32(json.dumps(cfg[n], sort_keys=True).encode()) for n in names], np.int64
        )
        with self._watch("ShardedTable()"):
            everyone = self._t.allgather_rows(mine)
        differ = [n for j, n in enumerate(names) if (everyone[:, j] != everyone[0, j]).any()]
        if differ:
            raise ValueError(
                f"configuration differs across ranks in {differ} (rank {self.rank}: "
                f"{ {n: cfg[n] for n in differ} }); every rank must pass the same"
            )

    # -- failure handling -------------------------------------------------------

    @contextmanager
    def _watch(self, what: str) -> Iterator[None]:
        """Abort the whole job if the block does not finish in time."""

        def fire() -> None:
            sys.stderr.write(
                f"embstore: rank {self.rank}: {what} did not finish within {self.timeout:g} s "
                "(another rank failed or stopped calling); aborting the MPI job\n"
            )
            sys.stderr.flush()
            self._t.abort(70)

        ticket = _WATCHDOG.add(self.timeout, fire)
        try:
            yield
        finally:
            _WATCHDOG.remove(ticket)

    def _agree(
        self,
        what: str,
        error: BaseException | None,
        args: tuple[Any, ...] | None = (),
        vote: bool = False,
    ) -> bool:
        """Every rank learns which call the others entered (``what``: the
        table's agreed id, the call's name), with which arguments that must
        be the same on every rank (``args``: flags, a checkpoint path; None
        where this rank refused them), and whether any rank refused its
        input; all raise if the calls or arguments differ or any refused.
        Every collective call starts here, before any exchange, so ranks
        that enter different calls, or calls on different tables, stop with
        an error instead of exchanging each other's data. Returns whether
        every rank voted yes (``vote``: a shortcut all must take or none).
        Calls started ahead on this communicator finish first."""
        ahead.drain(getattr(self, "comm", None))
        tag = f"table {self._id}: {what}" if hasattr(self, "_id") else what
        with self._watch(what):
            msgs = self._t.allgather(
                (tag, args, None if error is None else f"{type(error).__name__}: {error}", vote)
            )
        calls = {r: w for r, (w, _, _, _) in enumerate(msgs)}
        if len(set(calls.values())) > 1:
            raise RuntimeError(
                f"{what}: the ranks entered different collective calls "
                f"({', '.join(f'rank {r}: {w}' for r, w in calls.items())}); every rank must "
                "make the same calls on the same tables in the same order; nothing changed"
            )
        given = {r: a for r, (_, a, m, _) in enumerate(msgs) if m is None}
        if len({repr(a) for a in given.values()}) > 1:
            raise ValueError(
                f"{what}: the ranks passed different arguments "
                f"({', '.join(f'rank {r}: {a}' for r, a in given.items())}); every rank must "
                "pass the same; nothing changed"
            )
        bad = {r: m for r, (_, _, m, _) in enumerate(msgs) if m is not None}
        if not bad:
            return all(v for (_, _, _, v) in msgs)
        if error is not None:
            raise error
        first = min(bad)
        raise ValueError(f"{what}: rank {first} refused its input ({bad[first]}); nothing changed")

    def _prepare(
        self,
        what: str,
        fn: Callable[[], Any],
        agreed: Callable[[Any], tuple[Any, ...]] = lambda _: (),
    ) -> Any:
        """Run local checks and preparation; agree across ranks before sending.
        Any exception is agreed (a rank that raised alone would leave the
        others waiting in the exchange), and so are the arguments
        ``agreed(result)`` picks from the result (flags every rank must pass
        alike)."""
        return self._prepare_voted(what, fn, agreed)[0]

    def _prepare_voted(
        self,
        what: str,
        fn: Callable[[], Any],
        agreed: Callable[[Any], tuple[Any, ...]] = lambda _: (),
        vote: Callable[[Any], bool] = lambda _: False,
    ) -> tuple[Any, bool]:
        """:meth:`_prepare`, and whether every rank voted ``vote(result)``."""
        # A call started ahead finishes before this one looks at the table.
        ahead.drain(getattr(self, "comm", None))
        result = None
        args: tuple[Any, ...] | None = None
        error: BaseException | None = None
        yes = False
        try:
            result = fn()
            args = agreed(result)
            yes = bool(vote(result))
        except Exception as e:
            error = e
        return result, self._agree(what, error, args, yes)
