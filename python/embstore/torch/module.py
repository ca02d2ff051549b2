"""nn.Modules whose rows live in embstore tables.

They follow torch.nn.Embedding / EmbeddingBag's conventions (ids of any
shape, ``include_last_offset`` either way, 2-D fixed-length bags,
``per_sample_weights``, ``mode``) and take part in ``state_dict()`` /
``load_state_dict()``: the tables' keys, rows, optimizer state, step and seed
travel with the model (see :meth:`embstore.Table.state_dict` for the memory
cost, and use the tables' own checkpoints for tables that do not fit twice
in memory).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from embstore._convert import Default, check_combiner, check_default, host_array
from embstore.collection import Collection
from embstore.store import Table

__all__ = [
    "Embedding",
    "EmbeddingBag",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "KeyedTensor",
]

_STATE_FIELDS = ("keys", "rows", "state", "meta", "clock", "step", "seed")


def _np(t: Any, arg: str) -> Any:
    """A torch tensor as a NumPy array of its own (on the host); anything
    else unchanged. A copy, not a view: the backward must see the ids of the
    forward even if the caller reuses (modifies in place) its id tensor in
    between, as a loader refilling one buffer does. Ids on a GPU are copied
    to the host (the output goes back to their device); a tensor that
    requires grad is refused with the argument's name."""
    if isinstance(t, torch.Tensor):
        # host_array refuses a tensor that requires grad, naming the argument.
        return host_array(t.cpu(), arg).copy()
    if isinstance(t, np.ndarray):
        return t.copy()
    return t


def _grad_np(grad: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(grad.detach().to("cpu", torch.float32).numpy())


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, table: Table, ids: np.ndarray, insert: bool, default: Any
    ) -> torch.Tensor:
        ctx.table, ctx.ids = table, ids
        return torch.from_numpy(table.lookup(ids, insert=insert, default=default))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        ctx.table.apply_gradients(ctx.ids, _grad_np(grad))
        return (None,) * 5


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
        default: Any,
    ) -> torch.Tensor:
        ctx.args = (table, ids, offsets, weights, combiner)
        return torch.from_numpy(
            table.lookup_pooled(
                ids, offsets, combiner=combiner, weights=weights, insert=insert, default=default
            )
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        table, ids, offsets, weights, combiner = ctx.args
        table.apply_pooled_gradients(
            ids, offsets, _grad_np(grad), combiner=combiner, weights=weights
        )
        return (None,) * 8


class _CollectionPooled(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        collection: Collection,
        batch: dict[str, Any],
        insert: bool,
        default: str,
    ) -> torch.Tensor:
        ctx.collection, ctx.batch = collection, batch
        return torch.from_numpy(collection.lookup_pooled(batch, insert=insert, default=default))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        ctx.collection.apply_pooled_gradients(ctx.batch, _grad_np(grad))
        return (None,) * 5


def _anchor() -> torch.Tensor:
    # An empty leaf that requires grad, so that autograd records the lookup
    # and calls its backward; it never receives a gradient itself.
    return torch.empty(0, requires_grad=True)


def _device(x: Any) -> torch.device:
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


def _stores(module: nn.Module) -> bool:
    """Whether a forward stores rows for unseen ids: in training mode with
    gradients enabled (a ``torch.no_grad()`` validation pass in train mode
    stores nothing, as eval mode)."""
    return bool(module.training and torch.is_grad_enabled())


def _refuse_unsupported(
    max_norm: Any, norm_type: Any, scale_grad_by_freq: Any, sparse: Any
) -> None:
    """torch.nn.Embedding(Bag)'s arguments that embstore does not implement
    are refused by name where given a value other than torch's default;
    ``sparse`` is accepted (the tables always step only the rows a batch
    touches, as torch's sparse gradients with a sparse optimizer do)."""
    if max_norm is not None:
        raise ValueError(
            "max_norm: not supported (embstore does not renormalize rows on lookup); "
            "use weight_decay in the optimizer or clip the looked-up rows instead"
        )
    if norm_type != 2.0:
        raise ValueError("norm_type: not supported (it only applies with max_norm)")
    if scale_grad_by_freq is not False:
        raise ValueError(
            "scale_grad_by_freq: not supported (an id's gradients are summed, as torch's default)"
        )
    if not isinstance(sparse, bool):
        raise TypeError(f"sparse: expected a bool, got {type(sparse).__name__}")


def _check_padding_idx(padding_idx: Any) -> int | None:
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, (int, np.integer)):
        raise TypeError(
            f"padding_idx: expected an int id or None, got {type(padding_idx).__name__}"
        )
    return int(padding_idx)


class _TableState(nn.Module):
    """State-dict support for modules over embstore tables: each table's
    :meth:`Table.state_dict` as tensors under ``{prefix}{name}.{field}``."""

    #: Whether state_dict() includes the tables' optimizer state.
    state_dict_optimizer: bool = True

    def _tables(self) -> dict[str, Table]:
        raise NotImplementedError

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, table in self._tables().items():
            for field, value in table.state_dict(with_optimizer=self.state_dict_optimizer).items():
                destination[f"{prefix}{name}.{field}"] = torch.from_numpy(np.asarray(value))

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        ours = {f"{prefix}{name}.{f}" for name in self._tables() for f in _STATE_FIELDS}
        unexpected_keys[:] = [k for k in unexpected_keys if k not in ours]
        for name, table in self._tables().items():
            entries = {
                f: state_dict[f"{prefix}{name}.{f}"]
                for f in _STATE_FIELDS
                if f"{prefix}{name}.{f}" in state_dict
            }
            required = [f for f in ("keys", "rows", "step", "seed") if f not in entries]
            if required:
                missing_keys.extend(f"{prefix}{name}.{f}" for f in required)
                continue
            try:
                table.load_state_dict({f: v.detach().cpu().numpy() for f, v in entries.items()})
            except (TypeError, ValueError) as e:
                error_msgs.append(f"{prefix}{name}: {e}")


class _OneTable(_TableState):
    """A module over one table: the arguments torch.nn.Embedding and
    EmbeddingBag share (``padding_idx``, refused ``max_norm``, ``norm_type``
    and ``scale_grad_by_freq``, accepted ``sparse``), ``embedding_dim`` and
    ``num_embeddings``."""

    def __init__(
        self,
        table: Table,
        default: Default,
        padding_idx: int | None,
        max_norm: float | None,
        norm_type: float,
        scale_grad_by_freq: bool,
        sparse: bool,
    ) -> None:
        super().__init__()
        if not isinstance(table, Table):
            raise TypeError(f"table: expected an embstore.Table, got {type(table).__name__}")
        check_default(default, table.dim)
        _refuse_unsupported(max_norm, norm_type, scale_grad_by_freq, sparse)
        self.table = table
        self.default = default
        self.padding_idx = _check_padding_idx(padding_idx)
        self.sparse = sparse

    @property
    def embedding_dim(self) -> int:
        """Columns per row (the table's dim)."""
        return self.table.dim

    @property
    def num_embeddings(self) -> int:
        """Rows the table holds now."""
        return len(self.table)

    def _tables(self) -> dict[str, Table]:
        return {"table": self.table}


class Embedding(_OneTable):
    """``forward(ids) -> (*ids.shape, dim)`` rows of ``table``, as
    torch.nn.Embedding (ids of any shape); backward steps the table's optimizer.

    In training mode (with gradients enabled) a missing id gets a stored row;
    under ``torch.no_grad()`` or in eval mode
    (``module.eval()``) nothing is stored and a missing id reads as
    ``default``: "init" (the row it would get), "zeros" or a given row.

    Each backward pass is one optimizer step of the table. Use one module per
    table per forward pass (a Collection shares tables between features).

    ``padding_idx``: ids equal to it read as zeros, are not stored and get
    no gradient (torch.nn.Embedding's padding, without a stored row).
    ``max_norm``, ``norm_type`` and ``scale_grad_by_freq`` are refused by
    name; ``sparse`` is accepted (updates are always row-wise).
    ``embedding_dim`` is the table's dim, ``num_embeddings`` the rows it
    holds now (it grows as ids arrive).
    """

    def __init__(
        self,
        table: Table,
        *,
        default: Default = "init",
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> None:
        super().__init__(
            table, default, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse
        )

    def forward(self, ids: Any) -> torch.Tensor:
        host = _np(ids, "ids")
        shape = np.shape(host)
        flat = np.reshape(host, -1)
        store = _stores(self)
        default = "init" if store else self.default
        if self.padding_idx is None:
            out: torch.Tensor = _Lookup.apply(_anchor(), self.table, flat, store, default)
            return out.view(*shape, self.table.dim).to(_device(ids))
        keep = np.flatnonzero(np.asarray(flat) != self.padding_idx)
        kept: torch.Tensor = _Lookup.apply(
            _anchor(), self.table, np.asarray(flat)[keep], store, default
        )
        full = kept.new_zeros((len(flat), self.table.dim))
        full = full.index_copy(0, torch.from_numpy(keep), kept)  # padding rows: zeros
        return full.view(*shape, self.table.dim).to(_device(ids))

    def extra_repr(self) -> str:
        return f"dim={self.table.dim}, rows={len(self.table)}"


class EmbeddingBag(_OneTable):
    """``forward(input, offsets=None, per_sample_weights=None) -> (batch, dim)``
    pooled rows, with torch.nn.EmbeddingBag's conventions:

    - ``input`` 2-D ``(batch, L)`` with ``offsets=None``: fixed-length bags;
    - ``input`` 1-D with ``offsets``: bag ``b`` starts at ``offsets[b]``;
      with ``include_last_offset=False`` (torch's default) ``offsets`` has
      one entry per bag, with ``True`` a last entry ``len(input)`` too;
    - ``mode`` "sum", "mean" (torch's default) or "sqrtn" ("max" is not
      supported); ``combiner`` is another name for it;
    - ``per_sample_weights``, the shape of ``input``, are constants (they
      receive no gradient).

    In eval mode nothing is stored and a missing id pools as ``default``.

    ``padding_idx``: ids equal to it pool as nothing (not counted by "mean"
    or "sqrtn"), are not stored and get no gradient, as in
    torch.nn.EmbeddingBag. ``max_norm``, ``norm_type`` and
    ``scale_grad_by_freq`` are refused by name; ``sparse`` is accepted.
    ``embedding_dim`` and ``num_embeddings`` as :class:`Embedding`'s.
    """

    def __init__(
        self,
        table: Table,
        mode: str | None = None,
        *,
        combiner: str | None = None,
        include_last_offset: bool = False,
        default: Default = "init",
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> None:
        if mode is not None and combiner is not None and mode != combiner:
            raise ValueError(f"mode: {mode!r} and combiner {combiner!r} disagree; give one")
        name = mode if mode is not None else combiner if combiner is not None else "mean"
        if name == "max":
            raise ValueError(
                'mode: embstore pools with "sum", "mean" or "sqrtn"; "max" is not supported'
            )
        if not isinstance(include_last_offset, bool):
            raise TypeError("include_last_offset: expected a bool")
        super().__init__(
            table, default, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse
        )
        self.combiner = check_combiner(name)
        self.include_last_offset = include_last_offset

    @property
    def mode(self) -> str:
        return self.combiner

    def _csr(self, ids: np.ndarray, offsets: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, offsets)`` in the table's CSR form (a last offset)."""
        if offsets is None:
            if ids.ndim != 2:
                raise ValueError(
                    f"input: expected a 2-D (batch, bag length) array when offsets is None, "
                    f"got shape {ids.shape}"
                )
            b, length = ids.shape
            return ids.reshape(-1), np.arange(b + 1, dtype=np.int64) * length
        if ids.ndim != 1:
            raise ValueError(
                f"offsets: given with {ids.ndim}-D input; 2-D input (fixed-length bags) "
                "takes offsets=None"
            )
        off = np.asarray(offsets)
        if off.ndim != 1 or off.dtype.kind not in "iu":
            raise ValueError(f"offsets: expected a 1-D integer array, got {off.dtype} {off.shape}")
        off = off.astype(np.int64)
        if not self.include_last_offset:
            return ids, np.concatenate([off, [ids.shape[0]]])
        if off.size == 0 or int(off[-1]) != ids.shape[0]:
            raise ValueError(
                "offsets: with include_last_offset=True the last offset is len(input) "
                f"({ids.shape[0]}), got {int(off[-1]) if off.size else 'none'}; offsets "
                "without a last entry take include_last_offset=False (torch's default)"
            )
        return ids, off

    def forward(
        self, input: Any, offsets: Any = None, per_sample_weights: Any = None
    ) -> torch.Tensor:
        given = np.asarray(_np(input, "input"))
        ids, off = self._csr(given, _np(offsets, "offsets"))
        w = _np(per_sample_weights, "per_sample_weights")
        if w is not None:
            w = np.asarray(w)
            if w.shape != given.shape:
                raise ValueError(
                    f"per_sample_weights: expected the shape of input {given.shape}, got {w.shape}"
                )
            w = w.reshape(-1)
        if self.padding_idx is not None:
            # Padding ids leave their bags (and the counts of mean and sqrtn).
            keep = ids != self.padding_idx
            ends = np.concatenate([[0], np.cumsum(keep)])
            ids, off = ids[keep], ends[off]
            w = None if w is None else w[keep]
        out: torch.Tensor = _LookupPooled.apply(
            _anchor(),
            self.table,
            ids,
            off,
            w,
            self.combiner,
            _stores(self),
            "init" if _stores(self) else self.default,
        )
        return out.to(_device(input))

    def extra_repr(self) -> str:
        return (
            f"dim={self.table.dim}, mode={self.combiner!r}, "
            f"include_last_offset={self.include_last_offset}"
        )


class EmbeddingCollection(_TableState):
    """``forward(batch) -> (batch, sum of dims)``: every feature of a
    :class:`embstore.Collection` pooled in one native call; backward takes one
    optimizer step per distinct table. A feature is ``ids`` (one per
    sample), ``(ids, offsets)`` or ``(ids, offsets, weights)`` as in
    :meth:`embstore.Collection.lookup_pooled`. In eval mode nothing is stored
    and a missing id pools as ``default`` ("init" or "zeros")."""

    def __init__(self, collection: Collection, *, default: str = "init") -> None:
        super().__init__()
        if not isinstance(collection, Collection):
            raise TypeError(
                f"collection: expected an embstore.Collection, got {type(collection).__name__}"
            )
        check_default(default, None)
        self.collection = collection
        self.default = default

    def _tables(self) -> dict[str, Table]:
        # One entry per distinct table, named by its first feature.
        out: dict[str, Table] = {}
        seen: set[int] = set()
        for name, table in self.collection.tables.items():
            if id(table) not in seen:
                seen.add(id(table))
                out[name] = table
        return out

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        host = {
            name: _np(entry, f"batch[{name!r}]")
            if not isinstance(entry, tuple)
            else tuple(_np(x, f"batch[{name!r}]") for x in entry)
            for name, entry in batch.items()
        }
        out: torch.Tensor = _CollectionPooled.apply(
            _anchor(),
            self.collection,
            host,
            _stores(self),
            "init" if _stores(self) else self.default,
        )
        return out

    def extra_repr(self) -> str:
        return ", ".join(
            f"{n}: {d}" for n, d in zip(self.collection.features, self.collection.dims, strict=True)
        )


class KeyedTensor:
    """What :class:`EmbeddingBagCollection` returns when torchrec is not
    installed: TorchRec's ``KeyedTensor`` accessors over one ``(batch, sum of
    dims)`` tensor (``keys()``, ``values()``, ``length_per_key()``,
    ``offset_per_key()``, ``to_dict()``, ``__getitem__``)."""

    def __init__(self, keys: list[str], length_per_key: list[int], values: torch.Tensor) -> None:
        self._keys, self._lengths, self._values = list(keys), list(length_per_key), values

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return list(self._lengths)

    def offset_per_key(self) -> list[int]:
        return [0, *np.cumsum(self._lengths).tolist()]

    def to_dict(self) -> dict[str, torch.Tensor]:
        cuts = self.offset_per_key()
        return {k: self._values[:, cuts[i] : cuts[i + 1]] for i, k in enumerate(self._keys)}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.to_dict()[key]


def _keyed_tensor(keys: list[str], lengths: list[int], values: torch.Tensor) -> Any:
    try:
        from torchrec.sparse.jagged_tensor import (  # type: ignore[import-not-found, unused-ignore]
            KeyedTensor as TorchRecKeyedTensor,
        )
    except ImportError:
        return KeyedTensor(keys, lengths, values)
    return TorchRecKeyedTensor(keys=keys, length_per_key=lengths, values=values)


class EmbeddingBagCollection(EmbeddingCollection):
    """TorchRec's ``EmbeddingBagCollection`` interface over an
    :class:`embstore.Collection`: ``forward(features)`` takes a
    ``KeyedJaggedTensor`` (or any object with its accessors ``keys()``,
    ``values()``, ``lengths()``, ``weights_or_none()``, ``stride()``) and
    returns a torchrec ``KeyedTensor`` (this module's :class:`KeyedTensor`
    without torchrec) of the pooled features in the collection's order.
    Features of the input that the collection does not serve are ignored;
    a feature it serves must be present. Backward steps each distinct
    table's optimizer once (a fused backward, as TorchRec's FBGEMM tables)."""

    def forward(self, features: Any) -> Any:
        try:
            names = list(features.keys())
            values, lengths = features.values(), features.lengths()
            weights = features.weights_or_none()
            batch = int(features.stride())
        except AttributeError as e:
            raise TypeError(
                "features: expected a torchrec KeyedJaggedTensor (keys(), values(), lengths(), "
                f"weights_or_none(), stride()), got {type(features).__name__}"
            ) from e
        vals = _np(values, "features.values()")
        lens = np.asarray(_np(lengths, "features.lengths()"), dtype=np.int64)
        w = None if weights is None else _np(weights, "features.weights()")
        if lens.shape != (len(names) * batch,):
            raise ValueError(
                f"features: expected {len(names)} keys x stride {batch} lengths, got "
                f"{lens.shape[0]} (variable-stride inputs are not supported)"
            )
        if (lens < 0).any():
            j = int(np.flatnonzero(lens < 0)[0]) // max(batch, 1)
            raise ValueError(f"features: feature {names[j]!r} has a negative length")
        starts = np.concatenate([[0], np.cumsum(lens)])
        if int(starts[-1]) != vals.shape[0]:
            # Ids the lengths do not cover would be dropped silently, and
            # ids they claim but that are missing read past the end.
            raise ValueError(
                f"features: the lengths sum to {int(starts[-1])} ids but values() holds "
                f"{vals.shape[0]} (through feature {names[-1]!r}); nothing looked up"
            )
        if w is not None and w.shape[0] != vals.shape[0]:
            raise ValueError(
                f"features: weights() holds {w.shape[0]} values for {vals.shape[0]} ids"
            )
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ValueError(
                    f"features: feature {name!r} appears twice among the keys (each key "
                    "names one feature of the batch)"
                )
            seen.add(name)
        bags: dict[str, Any] = {}
        for j, name in enumerate(names):
            if name not in self.collection.tables:
                continue
            lo, hi = int(starts[j * batch]), int(starts[(j + 1) * batch])
            offsets = starts[j * batch : (j + 1) * batch + 1] - lo
            ids = vals[lo:hi]
            bags[name] = (ids, offsets) if w is None else (ids, offsets, w[lo:hi])
        missing = [f for f in self.collection.features if f not in bags]
        if missing:
            raise ValueError(f"features: missing keys {missing} (the collection serves them)")
        out = super().forward(bags)
        return _keyed_tensor(self.collection.features, self.collection.dims, out)
