"""The core owns every name, parameter and default (embstore_core::vocab);
the Python declarations must say the same. Changing a default, adding a
parameter or renaming a choice in Rust alone fails these tests."""

from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import embstore
from embstore import _convert, init, optim, policy
from embstore._convert import VOCABULARY


def declared(
    module: ModuleType, base: type, name_of: Any
) -> dict[str, list[tuple[str, Any, bool]]]:
    """Each config class of ``module`` as the core exports it: name ->
    [(field, default or None, integer)]."""
    out = {}
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if issubclass(cls, base) and cls is not base and cls.__module__ == module.__name__:
            out[name_of(cls)] = [
                (
                    f.name,
                    None if f.default is dataclasses.MISSING else float(f.default),
                    f.type in ("int", int),
                )
                for f in dataclasses.fields(cls)
            ]
    return out


@pytest.mark.parametrize(
    ("kind", "module", "base", "name_of"),
    [
        ("optimizers", optim, optim.Optimizer, lambda c: c.__name__),
        ("initializers", init, init.Initializer, lambda c: c.__name__),
        ("admissions", policy, policy.Admission, lambda c: c._name),
    ],
)
def test_configuration_classes_declare_what_the_core_exports(
    kind: str, module: ModuleType, base: type, name_of: Any
) -> None:
    core = {name: [tuple(p) for p in params] for name, params in VOCABULARY[kind].items()}
    assert declared(module, base, name_of) == core


def test_every_exported_optimizer_has_a_python_class() -> None:
    for name in VOCABULARY["optimizers"]:
        assert hasattr(optim, name), name
        assert name in optim.__all__


@pytest.mark.parametrize(
    ("kind", "accepts"),
    [
        ("dtypes", lambda v: embstore.Table(2, dtype=v)),
        ("evictions", lambda v: embstore.Table(2, eviction=v)),
        ("combiners", lambda v: embstore.Table(2).lookup_pooled([1], [0, 1], combiner=v)),
    ],
)
def test_every_exported_name_is_accepted_and_others_refused(kind: str, accepts: Any) -> None:
    for v in VOCABULARY[kind]:
        accepts(v)
    with pytest.raises(
        ValueError, match=str(tuple(VOCABULARY[kind])).replace("(", r"\(").replace(")", r"\)")
    ):
        accepts("not-a-" + kind)


def test_partitions_are_the_cores() -> None:
    keys = np.arange(10, dtype=np.int64)
    for p in VOCABULARY["partitions"]:
        embstore._core.partition_owners(keys, 2, p, 10)
    assert _convert.check_name("partition", "partitions", "hash") == "hash"
    with pytest.raises(ValueError, match="partition"):
        _convert.check_name("partition", "partitions", "range")
