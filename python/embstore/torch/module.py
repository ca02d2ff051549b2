"""nn.Modules whose rows live in embstore tables."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from embstore.collection import Collection
from embstore.store import Table

__all__ = ["Embedding", "EmbeddingBag", "EmbeddingCollection"]


def _np(t: Any) -> Any:
    """A torch tensor as a NumPy array of its own (on the host); anything
    else unchanged. A copy, not a view: the backward must see the ids of the
    forward even if the caller reuses (modifies in place) its id tensor in
    between, as a loader refilling one buffer does."""
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().numpy().copy()
    if isinstance(t, np.ndarray):
        return t.copy()
    return t


def _grad_np(grad: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(grad.detach().to("cpu", torch.float32).numpy())


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, table: Table, ids: np.ndarray, insert: bool
    ) -> torch.Tensor:
        ctx.table, ctx.ids = table, ids
        return torch.from_numpy(table.lookup(ids, insert=insert))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        ctx.table.apply_gradients(ctx.ids, _grad_np(grad))
        return (None,) * 4


class _LookupPooled(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        table: Table,
        ids: np.ndarray,
        offsets: np.ndarray,
        weights: np.ndarray | None,
        combiner: str,
        insert: bool,
    ) -> torch.Tensor:
        ctx.args = (table, ids, offsets, weights, combiner)
        return torch.from_numpy(
            table.lookup_pooled(ids, offsets, combiner=combiner, weights=weights, insert=insert)
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        table, ids, offsets, weights, combiner = ctx.args
        table.apply_pooled_gradients(
            ids, offsets, _grad_np(grad), combiner=combiner, weights=weights
        )
        return (None,) * 7


class _CollectionPooled(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        collection: Collection,
        batch: dict[str, tuple[Any, ...]],
        insert: bool,
    ) -> torch.Tensor:
        ctx.collection, ctx.batch = collection, batch
        return torch.from_numpy(collection.lookup_pooled(batch, insert=insert))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        ctx.collection.apply_pooled_gradients(ctx.batch, _grad_np(grad))
        return (None,) * 4


def _anchor() -> torch.Tensor:
    # An empty leaf that requires grad, so that autograd records the lookup
    # and calls its backward; it never receives a gradient itself.
    return torch.empty(0, requires_grad=True)


class Embedding(nn.Module):
    """``forward(ids) -> (n, dim)`` rows of ``table``; backward steps the table's optimizer.

    In training mode a missing id gets a stored row; in eval mode
    (``module.eval()``) it gets the initializer's row and nothing is stored.

    Each backward pass is one optimizer step of the table. Use one module per
    table per forward pass (a Collection shares tables between features).
    """

    def __init__(self, table: Table) -> None:
        super().__init__()
        if not isinstance(table, Table):
            raise TypeError(f"table: expected an embstore.Table, got {type(table).__name__}")
        self.table = table

    def forward(self, ids: Any) -> torch.Tensor:
        device = ids.device if isinstance(ids, torch.Tensor) else torch.device("cpu")
        out: torch.Tensor = _Lookup.apply(_anchor(), self.table, _np(ids), self.training)
        return out.to(device)

    def extra_repr(self) -> str:
        return f"dim={self.table.dim}, rows={len(self.table)}"


class EmbeddingBag(nn.Module):
    """``forward(ids, offsets, per_sample_weights=None) -> (batch, dim)`` pooled rows.

    CSR input as ``torch.nn.EmbeddingBag(include_last_offset=True)``;
    ``combiner`` is "sum", "mean" or "sqrtn". ``per_sample_weights`` are
    constants (they receive no gradient).
    """

    def __init__(self, table: Table, combiner: str = "sum") -> None:
        super().__init__()
        if not isinstance(table, Table):
            raise TypeError(f"table: expected an embstore.Table, got {type(table).__name__}")
        from embstore._convert import check_combiner

        self.table = table
        self.combiner = check_combiner(combiner)

    def forward(self, ids: Any, offsets: Any, per_sample_weights: Any = None) -> torch.Tensor:
        device = ids.device if isinstance(ids, torch.Tensor) else torch.device("cpu")
        out: torch.Tensor = _LookupPooled.apply(
            _anchor(),
            self.table,
            _np(ids),
            _np(offsets),
            _np(per_sample_weights),
            self.combiner,
            self.training,
        )
        return out.to(device)

    def extra_repr(self) -> str:
        return f"dim={self.table.dim}, combiner={self.combiner!r}"


class EmbeddingCollection(nn.Module):
    """``forward(batch) -> (batch, sum of dims)``: every feature of a
    :class:`embstore.Collection` pooled in one native call; backward takes one
    optimizer step per distinct table."""

    def __init__(self, collection: Collection) -> None:
        super().__init__()
        if not isinstance(collection, Collection):
            raise TypeError(
                f"collection: expected an embstore.Collection, got {type(collection).__name__}"
            )
        self.collection = collection

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        host = {
            name: _np(entry) if not isinstance(entry, tuple) else tuple(_np(x) for x in entry)
            for name, entry in batch.items()
        }
        out: torch.Tensor = _CollectionPooled.apply(_anchor(), self.collection, host, self.training)
        return out

    def extra_repr(self) -> str:
        return ", ".join(
            f"{n}: {d}" for n, d in zip(self.collection.features, self.collection.dims, strict=True)
        )
