"""8-bit rows in a :class:`~embstore.gpu.DeviceCache`, held on the device
as the table stores them: each row's codes (one byte a weight, in whole
float32 words), then its float32 scale and offset, ``words(dim)`` float32
words a row (18 at dim 64, against 64 for float32 rows). A call that reads
rows decodes them (``offset + scale * code``); a step decodes, updates in
float32 and encodes again by the table's own formula (the core's
``format/codec.rs`` and ``simd/kernels.rs``; ``tests/test_int8.py`` holds its
NumPy reference): the row's range, codes ``floor((w - lo) * (1 / scale) +
u)`` with ``u`` drawn from the stream of (seed, key, step), or 0.5 where the
process rounds to nearest. A row trained in the cache is the row the table
would hold; rows move between the two as stored (``stored=True``), bit for
bit."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import array_api_compat
import numpy as np

from embstore import _core
from embstore._convert import to_host
from embstore.gpu import _xp as X

Array = Any

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
#: The largest weight an 8-bit row holds: half of float32's range (its span
#: stays finite).
MOST = np.float32(np.finfo(np.float32).max / 2)


def words(dim: int) -> int:
    """Float32 words of an 8-bit row of ``dim`` weights: codes, scale, offset."""
    return -(-dim // 4) + 2


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64, wrapping (the core's ``hash::mix64``)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        out: np.ndarray = z ^ (z >> _U64(31))
    return out


def _stream_mixes(seed: int, step: int) -> tuple[np.uint64, np.uint64]:
    """The seed's mix and the step's term of the core's ``rounding_stream``."""
    with np.errstate(over="ignore"):
        s = _mix64(np.array([(seed ^ 0xB7E151628AED2A6B) ^ 0x6A09E667F3BCC909], dtype=_U64))
        return s[0], _U64(step) * _GOLDEN


def rounding_bases(seed: int, keys: np.ndarray, step: int) -> np.ndarray:
    """Per key, the 32-bit base of its rounding draws at ``step``: the
    core's ``rounding_stream(seed, key, step)``, its two halves xored."""
    s, t = _stream_mixes(seed, step)
    with np.errstate(over="ignore"):
        row = _mix64(s ^ keys.astype(np.int64).view(_U64))
        stream = _mix64(row ^ t)
    return ((stream >> _U64(32)) ^ (stream & _U64(0xFFFFFFFF))).astype(np.uint32)


def _draws(mod: Any, bases: Any, dim: int) -> Any:
    """``u`` of each (row, column) in [0, 1): 24 bits of lowbias32 of
    ``base + c * 0x9E3779B9`` (the core's ``rounding_draw``), in module
    ``mod`` (NumPy or CuPy: uint32 arithmetic, wrapping)."""
    c = mod.arange(dim, dtype=mod.uint32) * mod.uint32(0x9E3779B9)
    x = bases.reshape(-1, 1) + c.reshape(1, -1)
    x = x ^ (x >> mod.uint32(16))
    x = x * mod.uint32(0x7FEB352D)
    x = x ^ (x >> mod.uint32(15))
    x = x * mod.uint32(0x846CA68B)
    x = x ^ (x >> mod.uint32(16))
    return (x >> mod.uint32(8)).astype(mod.float32) * mod.float32(2.0**-24)


def _native(xp: ModuleType) -> Any:
    """The array module whose arrays ``xp`` holds and that views bytes and
    wraps uint32 (NumPy, CuPy, torch), or None: then on the host."""
    if array_api_compat.is_numpy_namespace(xp):
        return np
    if array_api_compat.is_cupy_namespace(xp):
        import cupy  # type: ignore[import-not-found, unused-ignore]

        return cupy
    return None


def _as_bytes(xp: ModuleType, w: Array) -> Any:
    """Float32 words ``(n, k)`` as their bytes ``(n, 4k)``: on the device
    where the namespace views bytes, else a NumPy array on the host."""
    mod = _native(xp)
    if mod is not None:
        return mod.ascontiguousarray(w).view(mod.uint8)
    if array_api_compat.is_torch_namespace(xp):
        import torch

        return w.contiguous().view(torch.uint8)
    return np.ascontiguousarray(to_host(xp, w)).view(np.uint8)


class Int8Rows:
    """Decoding and encoding of a cache's 8-bit rows (see the module)."""

    @classmethod
    def of(cls, xp: ModuleType, table: Any) -> Int8Rows | None:
        """The codec of ``table``'s rows where they are 8-bit (an
        :class:`embstore.Table`'s: it moves rows as stored), else None."""
        if str(table.dtype) != "int8":
            return None
        from embstore.store import Table

        if not isinstance(table, Table):
            raise ValueError(
                f"table: expected an embstore.Table for int8 rows, got {type(table).__name__}"
            )
        return cls(xp, table.dim, table.seed)

    def __init__(self, xp: ModuleType, dim: int, seed: int, kernels: bool = True) -> None:
        self.xp, self.dim, self.seed = xp, int(dim), int(seed)
        self.cw = -(-self.dim // 4)
        self.width = self.cw + 2
        self.stochastic = bool(_core.int8_stochastic_steps())
        #: On CuPy the CUDA kernels of _cuda_int8 (equal to the array code
        #: below bit for bit), else None.
        self.kernels = None
        if kernels and array_api_compat.is_cupy_namespace(xp):
            from embstore.gpu._cuda_int8 import Int8Kernels

            self.kernels = Int8Kernels()

    def decode_at(self, rows: Array, slots: Array) -> Array:
        """The stored rows at ``slots`` of ``rows`` as float32 weights."""
        if self.kernels is not None:
            return self.kernels.decode(rows, slots, self.dim)
        return self.decode(self.xp.take(rows, slots, axis=0))

    def decode(self, w: Array) -> Array:
        """Stored rows ``(n, width)`` as float32 weights ``(n, dim)``."""
        xp, dim, cw = self.xp, self.dim, self.cw
        if self.kernels is not None:
            return self.kernels.decode(w, None, dim)
        codes = _as_bytes(xp, w)[:, :dim]
        if _native(xp) is None and not _is_torch(xp):
            codes = xp.asarray(np.ascontiguousarray(codes))
        q = xp.astype(codes, xp.float32)
        return w[:, cw + 1 : cw + 2] + w[:, cw : cw + 1] * q

    def encode_step(
        self, w: Array, keys: Array, step: int, host: Callable[[Array], np.ndarray] | None = None
    ) -> Array:
        """Updated weights ``w`` (float32 ``(n, dim)``, finite, within
        :data:`MOST`) of ``keys`` (the cache's namespace, or NumPy) at
        optimizer step ``step`` as stored rows ``(n, width)``; ``host``
        brings the keys to the host where the draws are made there."""
        xp, dim, cw = self.xp, self.dim, self.cw
        if self.kernels is not None:
            seedmix, stepmix = _stream_mixes(self.seed, step)
            return self.kernels.encode(
                w, xp.asarray(keys), self.width, int(seedmix), int(stepmix), self.stochastic
            )
        if not isinstance(keys, np.ndarray):
            keys = host(keys) if host is not None else np.asarray(to_host(xp, keys))
        n = int(w.shape[0])
        lo = xp.min(w, axis=1, keepdims=True)
        hi = xp.max(w, axis=1, keepdims=True)
        scale = (hi - lo) / xp.asarray(255.0, dtype=xp.float32)
        flat = scale == 0
        inv = xp.asarray(1.0, dtype=xp.float32) / xp.where(flat, xp.ones_like(scale), scale)
        if self.stochastic:
            bases = rounding_bases(self.seed, keys, step)
            mod = _native(xp)
            if mod is None:
                u = xp.asarray(_draws(np, bases, dim))
            else:
                u = _draws(mod, X.to_device(xp, bases), dim)
        else:
            u = xp.asarray(0.5, dtype=xp.float32)
        f = xp.floor((w - lo) * inv + u)
        # The core's selects: below 0 (or NaN, where 1 / scale overflowed)
        # is 0, above 255 is 255, a constant row all 0.
        zero = xp.zeros_like(f)
        f = xp.where(f >= 0.0, f, zero)
        f = xp.where(f > 255.0, xp.full_like(f, 255.0), f)
        f = xp.where(flat, zero, f)
        codes = xp.astype(f, xp.uint8)
        pad = 4 * cw - dim
        if pad:
            codes = xp.concat([codes, xp.zeros((n, pad), dtype=xp.uint8)], axis=1)
        packed = self._as_words(codes)
        return xp.concat([packed, scale, lo], axis=1)

    def _as_words(self, codes: Array) -> Array:
        """Bytes ``(n, 4k)`` as float32 words ``(n, k)``, on the device."""
        xp = self.xp
        mod = _native(xp)
        if mod is not None:
            return mod.ascontiguousarray(codes).view(mod.float32)
        if _is_torch(xp):
            import torch

            return codes.contiguous().view(torch.float32)
        host = np.ascontiguousarray(to_host(xp, codes)).view(np.float32)
        return xp.asarray(host)


def decoded(codec: Int8Rows | None, rows: Array) -> Array:
    """A cache's stored rows as float32 weights (decoded where 8-bit)."""
    return rows if codec is None else codec.decode(rows)


def rows_at(codec: Int8Rows | None, xp: ModuleType, rows: Array, slots: Array) -> Array:
    """A cache's rows at ``slots`` as float32 weights (decoded where 8-bit)."""
    return xp.take(rows, slots, axis=0) if codec is None else codec.decode_at(rows, slots)


def _is_torch(xp: ModuleType) -> bool:
    return bool(array_api_compat.is_torch_namespace(xp))
