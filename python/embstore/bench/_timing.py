"""Timing helpers every measure shares: best of repeated runs, per-call
times, calls/s from several threads, resident memory, peer versions."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def _best(fn: Callable[[], object], reps: int) -> float:
    """Best wall time of ``reps`` runs after one warm-up (the peers get the same)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Best of 5 runs of ``calls`` calls, in microseconds per call."""
    return _paired_us({"fn": fn}, calls, rounds=5)["fn"]


def _paired_us(
    fns: dict[str, Callable[[], object]], calls: int, rounds: int = 7
) -> dict[str, float]:
    """:func:`_per_call_us` of several functions measured in turn, round
    after round (best of ``rounds``): on a machine whose speed drifts, a
    ratio of two of them compares the same moments."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return {name: b * 1e6 for name, b in best.items()}


def _calls_per_s(fn: Callable[[], object], threads: int, calls: int) -> float:
    """Calls of ``fn`` per second from ``threads`` Python threads making
    ``calls`` calls each (best of 3)."""
    import threading

    def serve() -> None:
        for _ in range(calls):
            fn()

    best = float("inf")
    for _ in range(3):
        ts = [threading.Thread(target=serve) for _ in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return threads * calls / best


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def _torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:
        return "absent"


def args_dim(c: dict[str, Any]) -> int:
    return int(c.get("dim", 64))


def machine_facts() -> dict[str, Any]:
    """What a figure depends on: the CPU model, cores, the SIMD backend
    embstore picked, the kernel's transparent-huge-page mode, the versions."""
    import os
    import platform

    import numpy as np

    import embstore

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        thp = "unknown"
    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 1,
        "simd": embstore.Table(1).simd,
        "thp": thp,
        "embstore": embstore.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
