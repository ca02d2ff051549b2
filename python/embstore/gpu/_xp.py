"""Array-API helpers of the device cache: the namespace, host transfers,
scatter without duplicate indices, and segment sums.

Everything here uses array-API operations only (through array-api-compat and
array-api-extra), so it runs on CuPy, NumPy, array-api-strict and torch.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import array_api_compat
import array_api_extra as xpx
import numpy as np

from embstore._convert import to_host

Array = Any


def gpu_usable() -> tuple[bool, str]:
    """Whether CuPy can use a GPU here, and if not, why."""
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return False, "CuPy is not installed"
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # any CUDA error means no usable GPU
        return False, f"CuPy finds no usable GPU ({type(e).__name__}: {e})"
    return (n > 0), ("" if n > 0 else "CuPy finds no GPU")


def namespace(xp: ModuleType | None) -> ModuleType:
    """The array-API namespace for ``xp`` (a module such as cupy, numpy or
    array_api_strict); None: CuPy when a GPU is usable, else NumPy."""
    if xp is None:
        ok, _ = gpu_usable()
        if ok:
            import cupy  # type: ignore[import-not-found, unused-ignore]

            xp = cupy
        else:
            xp = np
    if not isinstance(xp, ModuleType) or not hasattr(xp, "asarray"):
        raise TypeError(f"xp: expected an array namespace module, got {type(xp).__name__}")
    if xp.__name__.split(".")[0] == "cupy":
        ok, why = gpu_usable()
        if not ok:
            raise RuntimeError(
                f"xp: cupy was asked for, but {why}; pass xp=numpy to run on the host"
            )
    ns: ModuleType = array_api_compat.array_namespace(xp.asarray(0))
    return ns


def is_numpy(xp: ModuleType) -> bool:
    return bool(array_api_compat.is_numpy_namespace(xp))


def to_device(xp: ModuleType, a: np.ndarray) -> Array:
    """``a`` (NumPy; pinned for a fast copy, see :func:`host_buffer`) on the
    device of ``xp``."""
    if array_api_compat.is_cupy_namespace(xp):
        import cupy  # type: ignore[import-not-found, unused-ignore]

        out = cupy.empty(a.shape, dtype=a.dtype)
        out.set(np.ascontiguousarray(a))
        return out
    return xp.asarray(a)


def supports_fancy_setitem(xp: ModuleType) -> bool:
    """Whether ``xpx.at(x, int_index).set(...)`` works in this namespace
    (array-api-strict refuses integer-array setitem)."""
    try:
        xpx.at(xp.zeros(2), xp.asarray([0])).set(1.0)
    except (IndexError, TypeError, NotImplementedError):
        return False
    return True


def scatter_rows(xp: ModuleType, fancy: bool, x: Array, idx: Array, v: Array) -> Array:
    """``x`` with rows ``idx`` (distinct) replaced by ``v``.

    With integer-array setitem this is array-api-extra's ``at().set``;
    otherwise a gather: each row of the result is taken from ``x`` or ``v``.
    """
    n = int(idx.shape[0])
    if n == 0:
        return x
    if fancy:
        return xpx.at(x, idx).set(v)
    m = int(x.shape[0])
    order = xp.argsort(idx)
    s = xp.take(idx, order)
    rows = xp.arange(m, dtype=idx.dtype)
    pos = xp.minimum(xp.searchsorted(s, rows), n - 1)
    hit = xp.take(s, pos) == rows
    src = xp.where(hit, m + xp.take(order, pos), rows)
    return xp.take(xp.concat([x, v], axis=0), src, axis=0)


def scatter_values(xp: ModuleType, fancy: bool, x: Array, idx: Array, v: Array | int) -> Array:
    """1-D ``x`` with entries ``idx`` (distinct) set to ``v`` (an array of
    ``idx``'s length, or one value for all)."""
    n = int(idx.shape[0])
    if n == 0:
        return x
    vals = xp.full((n,), v, dtype=x.dtype) if isinstance(v, (int, bool)) else v
    col = scatter_rows(xp, fancy, xp.reshape(x, (-1, 1)), idx, xp.reshape(vals, (-1, 1)))
    return col[:, 0]


def segment_sum(xp: ModuleType, idx: Array, v: Array, n_out: int) -> Array:
    """Rows of ``v`` (n, c) summed by ``idx`` (n,) into (n_out, c), float32.

    Duplicate indices are what this is for, and array-api-extra's
    ``at().add`` does not accumulate them; so: a stable sort by index, a
    float64 running sum, and differences at the segment bounds.
    """
    c = int(v.shape[1])
    if int(idx.shape[0]) == 0:
        return xp.zeros((n_out, c), dtype=xp.float32)
    order = xp.argsort(idx, stable=True)
    s = xp.take(idx, order)
    sv = xp.astype(xp.take(v, order, axis=0), xp.float64)
    cs = xp.cumulative_sum(sv, axis=0, include_initial=True)
    bins = xp.arange(n_out, dtype=idx.dtype)
    lo = xp.searchsorted(s, bins, side="left")
    hi = xp.searchsorted(s, bins, side="right")
    return xp.astype(xp.take(cs, hi, axis=0) - xp.take(cs, lo, axis=0), xp.float32)


def segment_sum_in_order(xp: ModuleType, idx: Array, v: Array, n_out: int) -> Array:
    """Rows of ``v`` (n, c) summed by ``idx`` (n,) into (n_out, c) as the
    table's step sums a key's gradients: in float32, in batch order, one
    addition at a time (``0 + g_1 + g_2 + ...``; a key given once takes its
    row as it is), so that the sums are the table's bit for bit.

    Segments are summed side by side: pass ``k`` adds every segment's k-th
    row, so there are as many passes as the most rows one index has."""
    c = int(v.shape[1])
    n = int(idx.shape[0])
    if n == 0:
        return xp.zeros((n_out, c), dtype=xp.float32)
    order = xp.argsort(idx, stable=True)
    s = xp.take(idx, order)
    sv = xp.take(v, order, axis=0)
    bins = xp.arange(n_out, dtype=idx.dtype)
    lo = xp.searchsorted(s, bins, side="left")
    hi = xp.searchsorted(s, bins, side="right")
    count = hi - lo
    present = count > 0
    first = xp.take(sv, xp.minimum(lo, n - 1), axis=0)
    zero = xp.zeros((1, c), dtype=xp.float32)
    # Two or more rows: the table starts its sum at zero (-0.0 becomes 0.0).
    acc = xp.where(xp.reshape(count > 1, (-1, 1)), zero + first, first)
    acc = xp.where(xp.reshape(present, (-1, 1)), acc, zero)
    # The k-th row of each segment: positions grouped by their rank k.
    rank = xp.arange(n, dtype=idx.dtype) - xp.take(lo, s)
    by_rank = xp.argsort(rank, stable=True)
    ranks = xp.take(rank, by_rank)
    most = int(xp.max(count))
    starts = xp.searchsorted(ranks, xp.arange(most + 1, dtype=idx.dtype), side="left")
    bounds = [int(b) for b in starts]
    fancy = supports_fancy_setitem(xp)
    for k in range(1, most):
        pos = by_rank[bounds[k] : bounds[k + 1]]
        segs = xp.take(s, pos)
        rows = xp.take(acc, segs, axis=0) + xp.take(sv, pos, axis=0)
        acc = scatter_rows(xp, fancy, acc, segs, rows)
    return acc


#: The largest finite value of each 16-bit row format, as the core clamps.
_FORMAT_MAX = {
    "bfloat16": 3.3895313892515355e38,
    "float16": 65504.0,
    "int8": 1.7014117331926443e38,  # half of float32's range (an 8-bit row's span stays finite)
}


def round_to_format(xp: ModuleType, w: Array, dtype: str) -> Array:
    """Rows ``w`` (float32) as a table of ``dtype`` stores them after a
    step: clamped to the format's largest finite value and rounded to
    nearest-even 16-bit values (bfloat16, float16), then widened back."""
    if dtype == "float32":
        return w
    top = xp.asarray(_FORMAT_MAX[dtype], dtype=xp.float32)
    if array_api_compat.is_cupy_namespace(xp):
        import cupy  # type: ignore[import-not-found, unused-ignore]

        w = cupy.clip(w, -top, top)  # one kernel (the namespace's clip takes several)
    else:
        w = xp.clip(w, -top, top)
    if dtype == "int8":
        return w  # encoded by the caller (gpu/_int8.py)
    if array_api_compat.is_numpy_namespace(xp):
        return xp.asarray(_round16(np, np.asarray(w), dtype))
    if array_api_compat.is_cupy_namespace(xp):
        import cupy  # type: ignore[import-not-found, unused-ignore]

        return _round16(cupy, w, dtype)
    # Namespaces without bit views (array-api-strict): on the host.
    host = _round16(np, np.ascontiguousarray(to_host(xp, w), dtype=np.float32), dtype)
    return xp.asarray(host)


def _round16(xp: Any, w: Any, dtype: str) -> Any:
    if dtype == "float16":
        return w.astype(xp.float16).astype(xp.float32)
    bits = xp.ascontiguousarray(w).view(xp.uint32)
    # Round to nearest, ties to even, on the top 16 bits (NaN stays NaN:
    # the step refuses non-finite rows before this).
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> xp.uint32(16)) & xp.uint32(1))) & xp.uint32(
        0xFFFF0000
    )
    return rounded.view(xp.float32)


def _is_cupy(xp: ModuleType) -> bool:
    return bool(array_api_compat.is_cupy_namespace(xp))


def host_buffer(xp: ModuleType, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An empty host array for transfers: pinned (page-locked) memory on
    CuPy, so copies run at the bus's speed and asynchronously."""
    if _is_cupy(xp):
        import cupyx  # type: ignore[import-not-found, unused-ignore]

        out: np.ndarray = cupyx.empty_pinned(shape, dtype=dtype)
        return out
    return np.empty(shape, dtype=dtype)


def pack_to_host(
    xp: ModuleType, ints: Array, floats: list[Array], staging: Any = None
) -> tuple[np.ndarray, list[np.ndarray]]:
    """1-D int64 ``ints`` and float32 blocks on the host, in one copy: on
    CuPy packed into one device buffer of bytes and copied into pinned
    memory at once (``staging(nbytes)`` gives a host buffer of bytes to
    reuse; the results are views of it); elsewhere each is read as it is."""
    if not _is_cupy(xp):
        return (
            np.ascontiguousarray(to_host(xp, ints), dtype=np.int64),
            [np.ascontiguousarray(to_host(xp, f), dtype=np.float32) for f in floats],
        )
    import cupy  # type: ignore[import-not-found, unused-ignore]

    parts = [cupy.ascontiguousarray(ints, dtype=cupy.int64).view(cupy.uint8)]
    parts += [
        cupy.ascontiguousarray(f, dtype=cupy.float32).reshape(-1).view(cupy.uint8) for f in floats
    ]
    buf = cupy.concatenate(parts)
    nbytes = int(buf.shape[0])
    host = host_buffer(xp, (nbytes,), np.uint8) if staging is None else staging(nbytes)[:nbytes]
    buf.get(out=host)
    n_int = int(ints.shape[0]) * 8
    keys = host[:n_int].view(np.int64)
    blocks, at = [], n_int
    for f in floats:
        size = int(np.prod(f.shape)) * 4
        blocks.append(host[at : at + size].view(np.float32).reshape(tuple(f.shape)))
        at += size
    return keys, blocks


def synchronize(xp: ModuleType) -> None:
    """Waits for the device's queued work (CuPy); elsewhere nothing."""
    if _is_cupy(xp):
        import cupy  # type: ignore[import-not-found, unused-ignore]

        cupy.cuda.get_current_stream().synchronize()


class side_stream:  # a context manager used as a statement, hence the name
    """On CuPy, runs the block on a stream of its own (ordered with the
    default stream, so nothing on it races the caller's work), waited for at
    the end; elsewhere nothing."""

    def __init__(self, xp: ModuleType) -> None:
        self._stream: Any = None
        if _is_cupy(xp):
            import cupy  # type: ignore[import-not-found, unused-ignore]

            self._stream = cupy.cuda.Stream()

    def __enter__(self) -> None:
        if self._stream is not None:
            self._stream.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._stream is not None:
            self._stream.synchronize()
            self._stream.__exit__(*exc)


def segment_sum_fast(xp: ModuleType, idx: Array, v: Array, n_out: int) -> Array:
    """:func:`segment_sum_in_order` (bit for bit the table's sums) except on
    CuPy, where a key repeated thousands of times in a batch would take as
    many passes: there :func:`segment_sum`, one sorted pass in float64
    (equal to the table's sums to float32 rounding)."""
    if _is_cupy(xp):
        return segment_sum(xp, idx, v, n_out)
    return segment_sum_in_order(xp, idx, v, n_out)


def unique_counts(xp: ModuleType, keys: Array) -> tuple[Array, Array, Array]:
    """Distinct keys (ascending), each key's position among them, and how
    often each occurs: one ``unique_all`` where the namespace has it (CuPy,
    NumPy), else counts from the sorted keys."""
    if _is_cupy(xp) or is_numpy(xp):
        u = xp.unique_all(keys)
        return u.values, xp.reshape(u.inverse_indices, (-1,)), u.counts
    u = xp.unique_inverse(keys)
    ks = xp.sort(keys)
    counts = xp.searchsorted(ks, u.values, side="right") - xp.searchsorted(
        ks, u.values, side="left"
    )
    return u.values, xp.reshape(u.inverse_indices, (-1,)), counts
