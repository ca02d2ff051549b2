"""The old home of :class:`MappedTable` (now :mod:`embstore.serving`, with
the :class:`~embstore.serving.Publisher`); ``embstore.MappedTable`` is the
name to use. Importing it from here still works for a release, with a
DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    if name != "MappedTable":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        "embstore.mapped.MappedTable is now embstore.serving.MappedTable "
        "(embstore.MappedTable); the old path goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    from embstore.serving.mapped import MappedTable

    return MappedTable
