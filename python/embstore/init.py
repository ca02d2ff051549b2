"""Initializers: a new row's values are a pure function of (seed, key, column).

The same key gets the same initial row whatever the number of shards or
ranks, the insertion order or the thread count.
"""

from __future__ import annotations

from dataclasses import dataclass

from embstore._convert import NativeConfig

__all__ = ["Constant", "Initializer", "Normal", "TruncatedNormal", "Uniform", "Zeros"]


@dataclass(frozen=True)
class Initializer(NativeConfig):
    """Base class: a named set of parameters, validated natively."""

    _kind = "initializer"


@dataclass(frozen=True)
class Uniform(Initializer):
    """Uniform in ``[low, high)``."""

    low: float = -0.05
    high: float = 0.05


@dataclass(frozen=True)
class Normal(Initializer):
    """Normal(mean, std)."""

    mean: float = 0.0
    std: float = 1.0


@dataclass(frozen=True)
class TruncatedNormal(Initializer):
    """Normal(mean, std) redrawn until within two standard deviations."""

    mean: float = 0.0
    std: float = 1.0


@dataclass(frozen=True)
class Zeros(Initializer):
    """Every value 0."""


@dataclass(frozen=True)
class Constant(Initializer):
    """Every value ``value``."""

    value: float = 0.0
