"""The seeds of tables built without one (:func:`manual_seed`,
:func:`next_seed`)."""

from __future__ import annotations

import threading

from embstore._convert import check_int

__all__ = ["manual_seed", "next_seed"]

_U64_MAX = 2**64 - 1


class _SeedSequence:
    """The seeds of tables built without one: 0, 1, 2, ... in the order the
    process builds them (like torch's global generator: tables differ from
    one another, and a program that builds its tables in the same order gets
    the same rows every run). :func:`embstore.manual_seed` restarts it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0

    def draw(self) -> int:
        with self._lock:
            seed = self._next
            self._next = (self._next + 1) % 2**64
            return seed

    def reset(self, start: int) -> None:
        with self._lock:
            self._next = start


_SEEDS = _SeedSequence()


def manual_seed(seed: int) -> None:
    """Restart the seeds of tables built without ``seed=`` at ``seed``: the
    next such table gets ``seed``, the one after ``seed + 1``, and so on."""
    _SEEDS.reset(check_int("seed", seed, 0, _U64_MAX))


def next_seed() -> int:
    """The seed the next table built without ``seed=`` gets (drawing it)."""
    return _SEEDS.draw()
