"""Sparse optimizers for :class:`embstore.Table`.

Each is a frozen configuration; the table runs the update natively, on the
rows a batch touches only ("lazy"), after summing the gradients of repeated
keys (one update per distinct key per step). Formulas are those of each
class's docstring and of the named reference implementation.

``weight_decay`` (SGD, Adagrad, RowWiseAdagrad, Adam, Ftrl) is coupled L2
regularisation as torch's ``weight_decay`` (or a Keras embedding
regularizer ``l2(weight_decay / 2)``): a touched row's summed gradient
becomes ``g + weight_decay * w`` before the update; rows a batch does not
touch do not decay. AdamW's ``weight_decay`` is decoupled, as in
torch.optim.AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass

from embstore._convert import NativeConfig

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "Ftrl", "Optimizer", "RowWiseAdagrad"]


@dataclass(frozen=True)
class Optimizer(NativeConfig):
    """Base class: a named set of parameters, validated natively."""

    _kind = "optimizer"


@dataclass(frozen=True)
class SGD(Optimizer):
    """``w -= lr * (g + weight_decay * w)``. No state."""

    lr: float
    weight_decay: float = 0.0


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """torch.optim.Adagrad: ``h += g**2; w -= lr * g / (sqrt(h) + eps)``. State ``h[dim]``."""

    lr: float
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    weight_decay: float = 0.0


@dataclass(frozen=True)
class RowWiseAdagrad(Optimizer):
    """FBGEMM row-wise Adagrad: ``h += mean(g**2); w -= lr * g / (sqrt(h) + eps)``.

    State: one float per row.
    """

    lr: float
    eps: float = 1e-10
    weight_decay: float = 0.0


@dataclass(frozen=True)
class Adam(Optimizer):
    """torch.optim.SparseAdam (with ``weight_decay``: torch.optim.Adam's coupled
    L2 on the touched rows). State ``exp_avg[dim], exp_avg_sq[dim]``."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass(frozen=True)
class AdamW(Optimizer):
    """torch.optim.AdamW on touched rows: ``w *= 1 - lr*wd``, then Adam's step
    with eps added after bias correction. State as Adam."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass(frozen=True)
class Ftrl(Optimizer):
    """FTRL-Proximal as tf.keras.optimizers.Ftrl (learning_rate_power=-0.5).

    State ``linear[dim], accumulator[dim]``.
    """

    lr: float
    l1: float = 0.0
    l2: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1
    weight_decay: float = 0.0
