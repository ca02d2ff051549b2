"""Progress bars for long work: saves, loads and exports (native calls that
count their bytes), the demo's training, the bench's measures.

Drawn by tqdm where it is installed (the ``progress`` extra), else by a
one-line bar of our own; only on a terminal (stderr a TTY), never when
asked not to (``progress=False``, ``--quiet``, or ``EMBSTORE_PROGRESS=0``
for a whole process), and only for work still running after
:data:`DELAY_S` seconds.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from embstore import _core

T = TypeVar("T")

#: A bar appears only for work still running after this many seconds.
DELAY_S = 1.0


def wanted(show: bool | None) -> bool:
    """Whether to draw: ``show`` where given, else stderr is a terminal and
    ``EMBSTORE_PROGRESS`` is not ``0``."""
    if show is not None:
        return bool(show)
    if os.environ.get("EMBSTORE_PROGRESS", "1") == "0":
        return False
    return sys.stderr.isatty()


class Bar:
    """A progress bar of ``done`` out of ``total`` (``unit``: "B" for bytes,
    shown scaled), with a few words after it (:meth:`note`)."""

    def __init__(
        self,
        total: int,
        label: str,
        *,
        unit: str = "it",
        show: bool | None = None,
        delay: float | None = None,
    ) -> None:
        self.total, self.label, self.unit = max(int(total), 1), label, unit
        #: Seconds before anything is drawn (default :data:`DELAY_S`).
        self.delay = DELAY_S if delay is None else delay
        self.on = wanted(show)
        self.t0 = time.perf_counter()
        self.done = 0
        self._tqdm: Any = None
        self._drawn = False
        if self.on:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._tqdm = tqdm(
                total=self.total,
                desc=label,
                unit=unit,
                unit_scale=unit == "B",
                unit_divisor=1024 if unit == "B" else 1000,
                delay=self.delay,
                file=sys.stderr,
                dynamic_ncols=True,
            )

    def update_to(self, done: int, note: str = "") -> None:
        """Show ``done`` (absolute) and ``note``."""
        if not self.on:
            return
        done = min(int(done), self.total)
        if self._tqdm is not None:
            if note:
                self._tqdm.set_postfix_str(note, refresh=False)
            self._tqdm.update(done - self.done)
            self.done = done
            return
        self.done = done
        elapsed = time.perf_counter() - self.t0
        if elapsed < self.delay:
            return
        frac = done / self.total
        rate = done / elapsed
        speed = f"{rate / 2**20:,.0f} MiB/s" if self.unit == "B" else f"{rate:,.1f} {self.unit}/s"
        sys.stderr.write(
            f"\r{self.label}: [{'=' * int(30 * frac):<30}] {100 * frac:5.1f}% {speed} {note}"
        )
        sys.stderr.flush()
        self._drawn = True

    def close(self) -> None:
        """End the bar (a last line where one was drawn)."""
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._drawn:
            elapsed = time.perf_counter() - self.t0
            sys.stderr.write(f"\r{self.label}: [{'=' * 30}] done in {elapsed:.1f} s{' ' * 30}\n")
            sys.stderr.flush()
        self.on = False


def run_with_progress(
    fn: Callable[[_core.Progress], T], total: int, label: str, show: bool | None
) -> T:
    """Run ``fn(progress)`` (a native call that releases the GIL and counts
    its bytes in ``progress.done``) and, where a bar is wanted (see
    :func:`wanted`), draw one of ``total`` bytes while it runs."""
    progress = _core.Progress()
    if not wanted(show) or total <= 0:
        return fn(progress)
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(progress))
        except BaseException as e:  # re-raised in the caller's thread
            error.append(e)

    worker = threading.Thread(target=target, name=f"embstore-{label}")
    bar = Bar(total, label, unit="B", show=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
            bar.update_to(progress.done)
        if not error:
            bar.update_to(total)
    finally:
        bar.close()
    if error:
        raise error[0]
    return result[0]
