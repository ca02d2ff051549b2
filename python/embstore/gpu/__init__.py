"""The device tier: :class:`DeviceCache`, hot rows and their optimizer state
in device arrays (CuPy on a GPU; NumPy, array-api-strict or torch elsewhere),
written against the Python array API; :class:`ServingCache`, a read-only
table's hot rows on the device for serving, fresh after every publish; and
:func:`cache_curve`, the hit rate a cache would reach at each size on a
recorded key stream."""

from __future__ import annotations

from embstore._convert import to_numpy
from embstore.gpu.cache import DeviceCache
from embstore.gpu.curve import CacheCurve, cache_curve
from embstore.gpu.serving import ServingCache

__all__ = ["CacheCurve", "DeviceCache", "ServingCache", "cache_curve", "to_numpy"]
