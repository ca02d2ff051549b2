"""A table as arrays and back: the bodies of :meth:`embstore.Table.state_dict`
and :meth:`embstore.Table.load_state_dict` (the docs are there)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from embstore._convert import as_keys, as_rows, check_bool, check_int

if TYPE_CHECKING:
    from embstore import _core

_I64_MAX = 2**63 - 1


def state_dict(
    inner: _core.Table, has_optimizer: bool, with_optimizer: bool
) -> dict[str, npt.NDArray[Any]]:
    """:meth:`embstore.Table.state_dict` of the native table ``inner``."""
    with_state = check_bool("with_optimizer", with_optimizer) and has_optimizer
    keys, rows, state, words, clock = inner.export(with_state, True)
    out: dict[str, npt.NDArray[Any]] = {"keys": keys, "rows": rows}
    if with_state:
        out["state"] = state
    if words.shape[1] == 4:
        w = words.astype(np.int64)
        out["meta"] = np.stack([w[:, 0] | (w[:, 1] << 32), w[:, 2], w[:, 3]], axis=1)
        out["clock"] = np.array(clock, dtype=np.int64)
    out["step"] = np.array(int(inner.step), dtype=np.int64)
    out["seed"] = np.array(int(inner.seed), dtype=np.uint64).view(np.int64)
    return out


def load_state_dict(
    state: Mapping[str, Any],
    dim: int,
    state_len: int | None,
    new_inner: Callable[[int], _core.Table],
) -> _core.Table:
    """:meth:`embstore.Table.load_state_dict` for a table of ``dim`` columns
    and ``state_len`` floats of optimizer state (None: no optimizer):
    checks ``state`` whole, then returns a native table holding it, made by
    ``new_inner(seed)``."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state: expected a mapping, got {type(state).__name__}")
    missing = [f for f in ("keys", "rows", "step", "seed") if f not in state]
    if missing:
        raise ValueError(f"state: missing {missing}")
    keys = as_keys(state["keys"], "state['keys']")
    rows = as_rows(state["rows"], keys.shape[0], dim, "state['rows']")
    if np.unique(keys).shape[0] != keys.shape[0]:
        raise ValueError("state['keys']: expected distinct keys")
    st = None
    if state.get("state") is not None:
        if state_len is None:
            raise ValueError("state['state']: this table has no optimizer")
        st = as_rows(state["state"], keys.shape[0], state_len, "state['state']")
    step_arr, seed_arr = np.asarray(state["step"]), np.asarray(state["seed"])
    if step_arr.shape != () or step_arr.dtype.kind not in "iu":
        raise ValueError("state['step']: expected an integer scalar")
    if seed_arr.shape != () or seed_arr.dtype.kind not in "iu":
        raise ValueError("state['seed']: expected an integer scalar")
    step = check_int("state['step']", int(step_arr), 0, _I64_MAX)
    seed = int(seed_arr.astype(np.int64).view(np.uint64))
    for name, arr in (("state['rows']", rows), ("state['state']", st)):
        if arr is not None and not np.isfinite(arr).all():
            raise ValueError(f"{name}: expected finite values (NaN or inf found); nothing changed")
    words, clock = _meta_words(state, keys.shape[0])
    inner = new_inner(seed)
    try:
        if keys.shape[0] or clock:
            inner.restore(keys, rows, st, words, clock)
    except ValueError as e:
        # The native check names its own argument; say which entry it was.
        msg = str(e)
        for native, entry in (("state:", "state['state']:"), ("values:", "state['rows']:")):
            if msg.startswith(native):
                raise ValueError(entry + msg[len(native) :]) from None
        raise
    inner.set_step(step)
    return inner


def _meta_words(state: Mapping[str, Any], n: int) -> tuple[npt.NDArray[np.uint32], int]:
    """A state dict's ``meta`` (int64 ``(n, 3)``: tick, step, count) and
    ``clock`` as the native metadata words (4 u32 a row); none given: no
    words (rows restored as freshly assigned)."""
    if state.get("meta") is None:
        return np.zeros((0, 4), np.uint32), 0
    meta = np.asarray(state["meta"])
    if meta.dtype.kind not in "iu" or meta.shape != (n, 3):
        raise ValueError(f"state['meta']: expected an integer array of shape ({n}, 3)")
    meta = meta.astype(np.int64)
    if (meta < 0).any() or (meta[:, 1:] >= 1 << 32).any():
        raise ValueError("state['meta']: expected ticks >= 0 and steps and counts in [0, 2**32)")
    clock_arr = np.asarray(state.get("clock", 0))
    if clock_arr.shape != () or clock_arr.dtype.kind not in "iu" or int(clock_arr) < 0:
        raise ValueError("state['clock']: expected a non-negative integer scalar")
    words = np.empty((n, 4), np.uint32)
    words[:, 0] = meta[:, 0] & 0xFFFFFFFF
    words[:, 1] = meta[:, 0] >> 32
    words[:, 2] = meta[:, 1]
    words[:, 3] = meta[:, 2]
    return words, int(clock_arr)


def restore_stored(
    table: Any,
    keys: npt.NDArray[np.int64],
    words: npt.NDArray[np.float32],
    state: npt.NDArray[np.float32] | None,
    meta: npt.NDArray[np.uint32],
    clock: int,
    step: int,
) -> None:
    """Fills the new, empty ``table`` (an embstore.Table) with rows as a
    table of its configuration stores them (``words``: its
    ``lookup_with_state(stored=True)`` rows as float32 words), their
    optimizer state and metadata words (4 a row, or none), and sets its
    call clock and step: a reshard's rows, never quantized again."""
    table._inner.restore_stored(keys, words, state, meta, clock)
    table._inner.set_step(step)


def held_keys(table: Any) -> npt.NDArray[np.int64]:
    """Every key ``table`` (an embstore.Table) holds, in memory and on
    disk, ascending."""
    keys: npt.NDArray[np.int64] = table._inner.keys()
    return keys


def take_records(
    table: Any, keys: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.uint32]]:
    """The rows of ``keys`` (each held) in ``table`` as it stores them: the
    words :func:`restore_stored` takes, the optimizer state and the
    metadata words (4 a row where the policy tracks touches, else none).
    Touches nothing; a disk table's rows pass through memory for the call."""
    words, state, meta = table._inner.take_records(np.ascontiguousarray(keys, np.int64))
    return words, state, meta


def record_widths(table: Any) -> tuple[int, int, int]:
    """Words a row of ``table`` takes in :func:`take_records`' three
    arrays: stored weights, optimizer state, metadata (4 or 0)."""
    words, state, meta = take_records(table, np.zeros(0, np.int64))
    return int(words.shape[1]), int(state.shape[1]), int(meta.shape[1])


def call_clock(table: Any) -> int:
    """The call clock ``table``'s metadata ticks count in."""
    return int(table._inner.clock)
