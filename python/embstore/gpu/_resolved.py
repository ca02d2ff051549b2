"""What a :class:`embstore.gpu.DeviceCache` call brought into the cache
(:class:`Resolved`), and the thread that writes evicted rows back to the
table while the call fetches its misses (:class:`WriteBack`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

Array = Any


@dataclass
class Resolved:
    """Where a call's distinct keys are, after admissions."""

    uniq: Array  # the call's distinct keys
    inv: Array  # position in ``uniq`` of each key of the call
    slot: Array  # cache slot of each distinct key; -1: served by the table
    served_pos: Array  # positions in ``uniq`` of the table-served keys
    served_keys: np.ndarray  # those keys, on the host
    served_rows: Array | None = None  # rows of the table-served keys (lookups)
    served_grads: np.ndarray | None = None  # their summed gradients, on the host
    served_found: np.ndarray | None = None  # whether the table had each (found lookups)


#: Evicted rows at least this many go back to the table on a thread of their
#: own while the call's misses are fetched. Off (no call evicts this many):
#: on an H200 the DLRM step through a cache was 2-6 ms slower with the
#: thread from 4,096 rows than with every write-back in line (two rounds,
#: benches/HISTORY.md, 2026-11-27); the mechanism stays for a host where
#: the table's writes and the fetch overlap better.
WRITE_BACK_THREAD_MIN = 1 << 62


class WriteBack(threading.Thread):
    """A write-back of evicted rows running beside the fetch of misses;
    :meth:`join` waits for it and raises its error, once."""

    def __init__(self, run: Any) -> None:
        super().__init__(name="embstore-write-back", daemon=True)
        self._run = run
        self._error: BaseException | None = None
        self._joined = False

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # handed to the caller by join()
            self._error = e

    def wait(self) -> None:
        """Waits for the write-back to end, raising nothing."""
        super().join()

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if not self._joined:
            self._joined = True
            if self._error is not None:
                raise self._error
