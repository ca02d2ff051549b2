"""How rows and gradients travel between ranks (``ShardedTable(...,
wire_dtype=...)``): the sender encodes float32 rows into bytes, the
receiver decodes them back to float32; the tables keep their own rows in
their own dtype whatever the wire's.

- ``"float32"``: as they are (nothing encoded; the exchange of earlier
  releases, bit for bit).
- ``"bfloat16"``: the upper 16 bits, rounded to nearest even (half the
  bytes; 8 significant bits).
- ``"float16"``: IEEE half, rounded to nearest; values beyond its range
  are sent as +-65504 (half the bytes; 11 significant bits).
- ``"int8"``: per row, 8-bit codes of an affine map, ``lo + code * scale``
  with ``lo`` the row's least value and ``scale`` its range / 255
  (``dim + 8`` bytes a row; each value within ``scale / 2``).

TorchRec's quantized comms (fp16, bf16, fp8 forward and backward) make the
same trade: fewer bytes on the link for rounding each exchanged value once.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

__all__ = ["WIRE_DTYPES", "check_wire_dtype", "decode", "encode", "row_bytes"]

WIRE_DTYPES = ("float32", "bfloat16", "float16", "int8")
_F16_MAX = np.float32(65504.0)


def check_wire_dtype(value: object) -> str:
    """``value`` if it names a wire dtype, else a ValueError naming it."""
    if not isinstance(value, str) or value not in WIRE_DTYPES:
        raise ValueError(
            f'wire_dtype: expected "float32", "bfloat16", "float16" or "int8", got {value!r}'
        )
    return value


def row_bytes(wire: str, dim: int) -> int:
    """Bytes a row of ``dim`` floats takes on the wire."""
    return {"float32": 4 * dim, "bfloat16": 2 * dim, "float16": 2 * dim}.get(wire, dim + 8)


#: Values one pass of :func:`encode` works on: its temporaries stay small
#: (a step's rows are megabytes, and on a VM every fresh megabyte's page
#: faults cost about as much as the arithmetic on it).
_PASS = 1 << 16


def _passes(n: int, dim: int) -> Iterator[slice]:
    """The rows of each of :func:`encode`'s passes over ``n`` rows."""
    step = max(1, _PASS // max(dim, 1))
    for a in range(0, n, step):
        yield slice(a, a + step)


def encode(rows: npt.NDArray[np.float32], wire: str) -> np.ndarray:
    """``rows (n, dim)`` float32 as they go on the wire: float32 itself,
    else ``(n, row_bytes)`` uint8 (so ``shape[1]`` items a row either way).
    Codes are computed a few thousand values at a time, into the output."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n, dim = rows.shape
    if wire == "float32":
        return rows
    if wire == "bfloat16":
        # Round to nearest even: add 0x7FFF plus the lowest kept bit, keep
        # the upper half (uint32 arithmetic wraps as the rounding wants).
        u = rows.view(np.uint32)
        half = np.empty((n, dim), np.uint16)
        for rows_of in _passes(n, dim):
            x = u[rows_of]
            t = x >> np.uint32(16)
            t &= np.uint32(1)
            t += np.uint32(0x7FFF)
            t += x
            t >>= np.uint32(16)
            half[rows_of] = t
        return half.view(np.uint8).reshape(n, 2 * dim)
    if wire == "float16":
        half16 = np.empty(rows.shape, np.float16)
        np.clip(rows, -_F16_MAX, _F16_MAX, out=half16, casting="same_kind")
        return half16.view(np.uint8).reshape(n, 2 * dim)
    out = np.empty((n, dim + 8), np.uint8)
    if n == 0:
        return out
    lo = rows.min(axis=1)
    scale = (rows.max(axis=1) - lo) / np.float32(255.0)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    for rows_of in _passes(n, dim):
        codes = rows[rows_of] - lo[rows_of, None]
        codes /= safe[rows_of, None]
        np.rint(codes, out=codes)
        np.clip(codes, 0, 255, out=codes)
        out[rows_of, :dim] = codes
    out[:, dim : dim + 4] = lo.astype(np.float32).view(np.uint8).reshape(n, 4)
    out[:, dim + 4 :] = scale.astype(np.float32).view(np.uint8).reshape(n, 4)
    return out


def decode(buf: np.ndarray, wire: str, dim: int) -> npt.NDArray[np.float32]:
    """Rows ``(n, dim)`` float32 from what :func:`encode` sent."""
    if wire == "float32":
        return np.ascontiguousarray(buf, dtype=np.float32).reshape(-1, dim)
    buf = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1, row_bytes(wire, dim))
    n = buf.shape[0]
    if wire == "bfloat16":
        u = np.empty((n, dim), np.uint32)
        np.left_shift(buf.view(np.uint16).reshape(n, dim), 16, out=u, dtype=np.uint32)
        return u.view(np.float32)
    if wire == "float16":
        out: npt.NDArray[np.float32] = buf.view(np.float16).reshape(n, dim).astype(np.float32)
        return out
    lo = buf[:, dim : dim + 4].copy().view(np.float32)
    scale = buf[:, dim + 4 :].copy().view(np.float32)
    rows: npt.NDArray[np.float32] = buf[:, :dim].astype(np.float32)
    rows *= scale
    rows += lo
    return rows
