"""A progress bar for native calls that take more than a moment."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from embstore import _core

T = TypeVar("T")

#: A bar appears only for calls still running after this many seconds.
DELAY_S = 1.0


def run_with_progress(
    fn: Callable[[_core.Progress], T], total: int, label: str, show: bool | None
) -> T:
    """Run ``fn(progress)`` (a native call that releases the GIL) and, when it
    takes longer than DELAY_S and ``show`` is true (None: stderr is a
    terminal), draw a bar of ``progress.done`` against ``total`` bytes."""
    progress = _core.Progress()
    if show is None:
        show = sys.stderr.isatty()
    if not show or total <= 0:
        return fn(progress)
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(progress))
        except BaseException as e:  # re-raised in the caller's thread
            error.append(e)

    worker = threading.Thread(target=target, name=f"embstore-{label}")
    t0 = time.perf_counter()
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
        elapsed = time.perf_counter() - t0
        if worker.is_alive() and elapsed > DELAY_S:
            frac = min(progress.done / total, 1.0)
            rate = progress.done / elapsed / 2**20
            sys.stderr.write(
                f"\r{label}: [{'=' * int(30 * frac):<30}] {100 * frac:5.1f}% {rate:,.0f} MiB/s"
            )
            sys.stderr.flush()
    elapsed = time.perf_counter() - t0
    if elapsed > DELAY_S and not error:
        sys.stderr.write(
            f"\r{label}: [{'=' * 30}] done in {elapsed:.1f} s, "
            f"{progress.done / 2**20:,.0f} MiB{' ' * 20}\n"
        )
    if error:
        raise error[0]
    return result[0]
