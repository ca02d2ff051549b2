"""Conversion and checking of array arguments, shared by every tier.

Each helper returns a C-contiguous array of the native dtype, or raises a
TypeError/ValueError that names the argument and what was expected. They run
before any native call, so a refused call changes nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from types import ModuleType
from typing import Any, ClassVar, Literal, TypeAlias, TypeGuard

import array_api_compat
import numpy as np
import numpy.typing as npt

from embstore import _core

#: Every name, parameter and default the core accepts: ``_core.vocabulary()``
#: (``embstore_core::vocab``). The lists below and the configuration classes
#: of optim, init and policy are checked against it (tests/test_vocabulary.py).
VOCABULARY: dict[str, Any] = _core.vocabulary()

_I64_MAX = np.iinfo(np.int64).max
# The native dtypes: NumPy's descriptors for builtin types are singletons, so
# the fast paths below compare them by identity.
_I64 = np.dtype(np.int64)
_F32 = np.dtype(np.float32)
_NDARRAY = np.ndarray


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "requires_grad")


def host_array(x: Any, arg: str) -> Any:
    """``x`` as something NumPy reads without copying where it can: a torch
    tensor on the CPU becomes its NumPy view; one on another device, or one
    that requires grad, is refused with the argument's name. Anything else
    is returned as it is."""
    if not is_tensor(x):
        return x
    if x.requires_grad:
        raise TypeError(
            f"{arg}: a tensor that requires grad; embstore gives it no gradient: pass "
            f"{arg}.detach()"
        )
    if x.device.type != "cpu":
        raise TypeError(
            f"{arg}: a {x.device.type} tensor; embstore tables live in host memory: pass "
            f"{arg}.cpu() (or put an embstore.gpu.DeviceCache in front of the table)"
        )
    if str(x.layout) != "torch.strided":
        raise TypeError(f"{arg}: expected a dense tensor, got layout {x.layout}")
    if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
        return x.float().numpy()
    return x.numpy()


def like(given: Any, out: npt.NDArray[Any]) -> Any:
    """``out`` as a torch tensor sharing its memory when the caller gave a
    tensor (``given``), else as it is."""
    if type(given) is _NDARRAY or not is_tensor(given):
        return out
    import torch

    return torch.from_numpy(out)


def ready_i64(a: Any) -> TypeGuard[npt.NDArray[np.int64]]:
    """Whether ``a`` is already what :func:`as_keys` returns: a 1-D
    C-contiguous int64 NumPy array (then taken as it is)."""
    return type(a) is _NDARRAY and a.dtype is _I64 and a.ndim == 1 and a.flags.c_contiguous


def as_keys(keys: Any, arg: str = "keys") -> npt.NDArray[np.int64]:
    """Return ``keys`` as a 1-D C-contiguous int64 array.

    Integer arrays of other dtypes are widened. Floats, bools, strings and
    objects raise TypeError; uint64 values above 2**63-1 and arrays that are
    not 1-D raise ValueError. A CPU torch tensor is read without a copy.
    """
    if ready_i64(keys):
        return keys  # the common case, as it is (small calls pay for every check)
    arr = np.asarray(host_array(keys, arg))
    if arr.dtype == np.int64 and arr.ndim == 1:
        return np.ascontiguousarray(arr)
    if (
        arr.size == 0
        and arr.dtype.kind == "f"
        and arr.ndim == 1
        and not isinstance(keys, np.ndarray)
    ):
        # An empty Python list comes out as float64: it holds no float key.
        return np.empty(0, dtype=np.int64)
    kind = arr.dtype.kind
    if kind == "b":
        raise TypeError(f"{arg}: expected an integer array, got bool")
    if kind not in "iu":
        raise TypeError(f"{arg}: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{arg}: expected a 1-D array, got shape {arr.shape}")
    if kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) > _I64_MAX:
        raise ValueError(f"{arg}: expected keys <= 2**63-1, got uint64 value {int(arr.max())}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def ready_rows(a: Any, n: int, dim: int) -> TypeGuard[npt.NDArray[np.float32]]:
    """Whether ``a`` is already what :func:`as_rows` returns for ``(n, dim)``
    (then taken as it is)."""
    return type(a) is _NDARRAY and a.dtype is _F32 and a.shape == (n, dim) and a.flags.c_contiguous


def as_rows(values: Any, n: int, dim: int, arg: str) -> npt.NDArray[np.float32]:
    """Return ``values`` as a C-contiguous float32 array of shape (n, dim)."""
    if ready_rows(values, n, dim):
        return values
    arr = np.asarray(host_array(values, arg))
    if arr.dtype.kind not in "fiu" or arr.dtype.kind == "b":
        raise TypeError(f"{arg}: expected a float array, got dtype {arr.dtype}")
    if arr.shape != (n, dim):
        raise ValueError(f"{arg}: expected shape ({n}, {dim}), got {arr.shape}")
    if arr.dtype == np.float32:
        return np.ascontiguousarray(arr)
    # Values beyond float32's range become inf here, which the native
    # finiteness check then refuses with the argument's name.
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(arr, dtype=np.float32)


def as_weights(weights: Any, n: int) -> npt.NDArray[np.float32] | None:
    """Return per-id weights as a C-contiguous float32 array of shape (n,), or None."""
    if weights is None:
        return None
    arr = np.asarray(host_array(weights, "weights"))
    if arr.dtype.kind not in "fiu" or arr.dtype.kind == "b":
        raise TypeError(f"weights: expected a float array, got dtype {arr.dtype}")
    if arr.shape != (n,):
        raise ValueError(f"weights: expected shape ({n},) (one per id), got {arr.shape}")
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(arr, dtype=np.float32)


def check_name(arg: str, kind: str, value: Any) -> str:
    """``value`` if it is one of the core's ``kind`` names
    (``VOCABULARY[kind]``: "dtypes", "evictions", "combiners",
    "partitions"); ValueError naming ``arg`` otherwise."""
    names = tuple(VOCABULARY[kind])
    if not isinstance(value, str) or value not in names:
        raise ValueError(f"{arg}: expected one of {names}, got {value!r}")
    return value


def check_combiner(combiner: Any) -> str:
    """Return ``combiner`` if it names a combiner; ValueError otherwise."""
    return check_name("combiner", "combiners", combiner)


def as_bags(
    ids: Any, offsets: Any, weights: Any, combiner: Any, prefix: str = ""
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.float32] | None, str]:
    """Return CSR bags (ids, offsets, optional weights, combiner) converted
    and checked as far as Python can; the native call checks the offsets'
    order and range. ``prefix`` names where they came from (a feature)."""
    i = as_keys(ids, f"{prefix}ids")
    o = as_keys(offsets, f"{prefix}offsets")
    if o.shape[0] == 0:
        raise ValueError(
            f"{prefix}offsets: expected batch + 1 >= 1 offsets (include_last_offset=True), "
            "got an empty array"
        )
    return i, o, as_weights(weights, i.shape[0]), check_combiner(combiner)


def check_bool(arg: str, value: Any) -> bool:
    """Return a flag as bool; TypeError unless it is a bool (``insert="no"``
    is no flag: any non-empty string would read as True)."""
    if value is True or value is False:
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{arg}: expected True or False, got {type(value).__name__}")
    return bool(value)


def check_int(arg: str, value: Any, low: int, high: int) -> int:
    """Return an integer argument as int; TypeError unless an integer,
    ValueError naming ``arg`` unless ``low <= value <= high`` (so that a huge
    int never reaches the native module as an OverflowError)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{arg}: expected an integer, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{arg}: expected {arg} >= {low}, got {value}")
    if value > high:
        raise ValueError(f"{arg}: expected {arg} <= {high}, got {value}")
    return int(value)


def check_real(arg: str, value: Any) -> float:
    """Return a hyper-parameter as float; TypeError unless a real number."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{arg}: expected a real number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{arg}: expected a number finite as float32, got {value}") from None


@dataclass(frozen=True)
class NativeConfig:
    """A frozen set of named real parameters that the native module checks.

    Subclasses set ``_kind`` ("optimizer" or "initializer"); the class name
    and the fields are what the native side receives.
    """

    _kind: ClassVar[str]

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            object.__setattr__(self, name, check_real(name, value))
        getattr(_core, f"check_{self._kind}")(*self._native())
        # Integer fields (checked integral natively) keep their int type.
        for f in fields(self):
            if f.type in ("int", int):
                object.__setattr__(self, f.name, int(getattr(self, f.name)))

    def _native(self) -> tuple[str, dict[str, float]]:
        return type(self).__name__, {k: float(v) for k, v in asdict(self).items()}


#: A lookup's value for keys without a row: "init", "zeros" or a row.
Default: TypeAlias = 'Literal["init", "zeros"] | npt.ArrayLike'


def check_default(default: Any, dim: int | None) -> tuple[str, npt.NDArray[np.float32] | None]:
    """``(mode, row)`` of a lookup's ``default``: "init", "zeros", or a row of
    ``dim`` finite floats (``dim=None``: only the two names)."""
    if isinstance(default, str):
        if default in ("init", "zeros"):
            return default, None
        raise ValueError(f'default: expected "init", "zeros" or a row of floats, got {default!r}')
    if dim is None:
        raise TypeError(f'default: expected "init" or "zeros" here, got {type(default).__name__}')
    if type(default).__module__.startswith("torch") and hasattr(default, "detach"):
        if getattr(default, "requires_grad", False):
            raise ValueError(
                "default: expected a row that takes no gradient (the default row is a "
                "constant, not trained); pass default.detach()"
            )
        default = default.detach().cpu().numpy()
    row = np.asarray(default)
    if row.dtype.kind not in "iuf" or row.shape != (dim,):
        raise ValueError(
            f'default: expected "init", "zeros" or a row of {dim} floats, got '
            f"{'shape ' + str(row.shape) if row.dtype.kind in 'iuf' else 'dtype ' + str(row.dtype)}"
        )
    with np.errstate(over="ignore"):
        r = np.ascontiguousarray(row, dtype=np.float32)
    if not np.isfinite(r).all():
        raise ValueError("default: expected finite values (as float32)")
    return "row", r


def to_host(xp: ModuleType, x: Any) -> np.ndarray:
    """A NumPy copy (or view) of device array ``x``."""
    if array_api_compat.is_numpy_namespace(xp):
        return np.asarray(x)
    if array_api_compat.is_cupy_namespace(xp):
        return np.asarray(x.get())
    if array_api_compat.is_torch_namespace(xp):
        return np.asarray(x.detach().cpu().numpy())
    return np.from_dlpack(x)


def to_numpy(x: Any) -> np.ndarray:
    """Any tier's output (NumPy, CuPy, torch, array-api-strict...) as a
    C-contiguous NumPy array, copied to the host when it lives elsewhere."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    return np.ascontiguousarray(to_host(array_api_compat.array_namespace(x), x))
