"""What a load may choose, as the core takes it: the settings of a
:class:`embstore.TableConfig` that are each copy's own (``num_shards``,
``disk``, ``memory_bytes``, ``dtype``), given as the constructor's config
or as loose keyword arguments, never both. Everything else (dim,
optimizer, initializer, seed, policies) is the checkpoint's; a config
given must agree with it."""

from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import Any

from embstore.config import TableConfig

__all__ = ["check_agrees", "load_settings"]

#: The settings each copy of a table chooses for itself.
COPY = ("num_shards", "disk", "memory_bytes", "dtype")
_FIELDS = {f.name: f for f in fields(TableConfig)}


def load_settings(config: TableConfig | None, **loose: Any) -> str:
    """The JSON of a load's own settings (the core's ``LoadConfig``): those
    of ``config``, or the ``loose`` keyword arguments (each checked as the
    config's field of that name; None: the checkpoint's)."""
    given = {k: v for k, v in loose.items() if v is not None}
    if config is not None:
        if not isinstance(config, TableConfig):
            got = type(config).__name__
            raise TypeError(f"config: expected an embstore.TableConfig, got {got}")
        if given:
            name = next(iter(given))
            raise ValueError(f"{name}: expected it in config= or on its own, not both")
        values = {k: getattr(config, k) for k in COPY}
    else:
        unknown = sorted(set(loose) - set(COPY))
        if unknown:
            raise TypeError(f"{unknown[0]}: not a setting of a load")
        values = {k: _FIELDS[k].metadata["check"](k, v) for k, v in given.items()}
    if values.get("disk") is not None:
        values["disk"] = os.fspath(values["disk"])
    return json.dumps({k: v for k, v in values.items() if v is not None})


def check_agrees(config: TableConfig | None, loaded: TableConfig, where: str) -> None:
    """Raises ValueError naming the first setting of ``config`` (the
    constructor's, given to a load) that the checkpoint at ``where``
    (``loaded``: the loaded table's) does not have; a seed of None matches
    any."""
    if config is None:
        return
    for name in _FIELDS:
        if name in COPY:
            continue
        want, got = getattr(config, name), getattr(loaded, name)
        if name == "seed" and want is None:
            continue
        if want != got:
            raise ValueError(
                f"config.{name}: the checkpoint at {where} has {got!r}, the config {want!r} "
                "(a load takes the checkpoint's table; only num_shards, disk, memory_bytes "
                "and dtype are the load's own)"
            )
