"""The device tier: :class:`DeviceCache`, hot rows and their optimizer state
in device arrays (CuPy on a GPU; NumPy, array-api-strict or torch elsewhere),
written against the Python array API; and :func:`cache_curve`, the hit rate
a cache would reach at each size on a recorded key stream."""

from __future__ import annotations

from embstore._convert import to_numpy
from embstore.gpu.cache import DeviceCache
from embstore.gpu.curve import CacheCurve, cache_curve

__all__ = ["CacheCurve", "DeviceCache", "cache_curve", "to_numpy"]
