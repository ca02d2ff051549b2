"""Lookup latency histograms of the tiers written in Python (device caches,
sharded tables), with the native tables' buckets, for `embstore.metrics`."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: Upper bounds of the buckets in seconds, as the native tables'
#: (``embstore-core``'s ``latency::BOUNDS_NS``); a last bucket holds the rest.
BOUNDS_S: tuple[float, ...] = (
    *(m * 10**e / 10**9 for e in range(3, 10) for m in (1, 2.5, 5)),
    10.0,
)


class LatencyHistogram:
    """Calls counted by latency bucket, and their total seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * (len(BOUNDS_S) + 1)
        self._sum = 0.0

    def record(self, seconds: float) -> None:
        """Count one call of ``seconds``."""
        i = bisect.bisect_left(BOUNDS_S, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def read(self) -> tuple[list[float], list[int], float]:
        """(bucket bounds, calls per bucket with one more above the last
        bound, total seconds), as the native tables' ``lookup_latency()``."""
        with self._lock:
            return list(BOUNDS_S), list(self._counts), self._sum


def histogram(tier: Any) -> LatencyHistogram:
    """``tier``'s histogram, made at its first use (a tier built without
    its ``__init__``, as a load builds one, gets one too)."""
    found = tier.__dict__.get("_latency")
    if found is None:
        found = tier.__dict__.setdefault("_latency", LatencyHistogram())
    assert isinstance(found, LatencyHistogram)
    return found


def timed(method: F) -> F:
    """``method`` of a tier, its calls timed into the tier's
    :func:`histogram` (those that raise are not counted)."""

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = method(self, *args, **kwargs)
        histogram(self).record(time.perf_counter() - t0)
        return out

    wrapper.__name__ = method.__name__
    wrapper.__qualname__ = method.__qualname__
    wrapper.__doc__ = method.__doc__
    wrapper.__wrapped__ = method  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
