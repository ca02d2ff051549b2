"""Publishing a training table for serving readers: :class:`Publisher`."""

from __future__ import annotations

import threading
import time

import embstore

__all__ = ["Publisher"]


class Publisher:
    """Saves ``table`` incrementally to ``path`` every ``every`` seconds
    from a background thread (on a fixed schedule; at once when the save
    before ran late), as a trainer publishes for serving readers
    (``Table.load(path, mmap=True, follow=...)``): rows only by default.
    The first, full save happens in the constructor (its error raises
    there); a later publish that fails is kept in :attr:`error` and tried
    again at the next period."""

    def __init__(
        self, table: embstore.Table, path: str, every: float, with_optimizer: bool = False
    ) -> None:
        self.table, self.path, self.every = table, path, every
        self.with_optimizer = with_optimizer
        #: Seconds each publish took.
        self.seconds: list[float] = []
        #: The error of the last publish if it failed (the checkpoint at
        #: ``path`` stays the one published before; the next period tries
        #: again), and how many failed.
        self.error: Exception | None = None
        self.failures = 0
        self._stop = threading.Event()
        table.save(path, with_optimizer=with_optimizer)
        self._thread = threading.Thread(target=self._run, name=f"publish {path}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start, n = time.perf_counter(), 0
        while not self._stop.wait(max(0.0, start + (n + 1) * self.every - time.perf_counter())):
            n += 1
            t0 = time.perf_counter()
            try:
                self.table.save(self.path, incremental=True, with_optimizer=self.with_optimizer)
            except Exception as e:
                self.error = e
                self.failures += 1
                continue
            self.error = None
            self.seconds.append(time.perf_counter() - t0)

    def stop(self) -> None:
        """Stops publishing (after the save under way, if any)."""
        self._stop.set()
        self._thread.join()
