"""What a fork does to device caches: every cache's lock is held across it,
so a child never inherits a lock held by a thread it does not have."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

#: Every DeviceCache alive, for the fork handlers below.
LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
#: The locks the forking thread holds from before the fork until after it.
_HELD: list[threading.Lock] = []


def _before_fork() -> None:
    """Waits until no DeviceCache call is running, and holds every cache's
    lock across the fork: a child forked while another thread was inside a
    call would otherwise inherit that lock held, by a thread that does not
    exist there, and its first call would wait forever (the native tier
    does the same for its own calls). Taken in one order (by id)."""
    for cache in sorted(list(LIVE), key=id):
        cache._lock.acquire()
        _HELD.append(cache._lock)


def _after_fork() -> None:
    while _HELD:
        _HELD.pop().release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork
    )
