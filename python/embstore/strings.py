"""String features as int64 keys: :func:`hash_keys`."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import _core
from embstore._convert import check_int

__all__ = ["hash_keys"]


def hash_keys(values: Any, *, salt: int = 0) -> npt.NDArray[np.int64]:
    """The int64 key of each ``str`` or ``bytes`` value: XXH3-64 of its bytes
    (UTF-8 for ``str``), read as a signed int64; with ``salt`` s != 0 the
    hash h becomes ``mix64(h ^ mix64(s))`` (splitmix64's bijective
    finalizer), so keys under different salts are independent at every
    length (XXH3's own seed is not, for strings of 1-3 bytes; builds before
    2026-11-24 used it, so their salted keys differ).

    ``values`` may be a NumPy array of unicode (``U``), bytes (``S``),
    ``StringDType`` or object (``str``/``bytes``) values, which keeps its
    shape, or a list or tuple, which gives a 1-D array. Fixed-width NumPy
    values end at their last non-NUL character, as NumPy reads them; the
    same text gives the same key from every container.

    The hash is stable: the same value and salt give the same key on every
    platform and Python (XXH3 is a published algorithm; tests pin values).
    Different salts give independent keys (one salt per
    feature keeps "5" the user apart from "5" the item). For ``n`` distinct
    values, the chance that any two share a key is about ``n**2 / 2**65``
    (1e-6 for 6 million values). Hashing runs natively on all cores.
    """
    s = check_int("salt", salt, 0, 2**64 - 1)
    if isinstance(values, (str, bytes)):
        raise TypeError(
            f"values: expected an array or a list of str/bytes, got one {type(values).__name__}; "
            "wrap it in a list"
        )
    if isinstance(values, list):
        return _core.hash_objects(values, s)  # read in place: no copy of the list
    if not isinstance(values, np.ndarray):
        try:
            seq = list(values)
        except TypeError:
            raise TypeError(
                f"values: expected an array or a list of str/bytes, got {type(values).__name__}"
            ) from None
        return _core.hash_objects(seq, s)
    arr = values
    kind = arr.dtype.kind
    if kind == "U":
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        width = arr.dtype.itemsize // 4
        flat = np.ascontiguousarray(arr).reshape(-1)
        if width == 0:
            out = _core.hash_objects([b""] * flat.shape[0], s)
        else:
            out = _core.hash_ucs4(flat.view(np.uint32), width, s)
    elif kind == "S":
        width = arr.dtype.itemsize
        flat = np.ascontiguousarray(arr).reshape(-1)
        if width == 0:
            out = _core.hash_objects([b""] * flat.shape[0], s)
        else:
            out = _core.hash_fixed_bytes(flat.view(np.uint8), width, s)
    elif kind in ("O", "T"):
        out = _core.hash_objects(arr.reshape(-1).astype(object).tolist(), s)
    else:
        raise TypeError(
            f"values: expected str or bytes values (NumPy dtype U, S, T or object), "
            f"got dtype {arr.dtype}"
        )
    return out.reshape(arr.shape)
