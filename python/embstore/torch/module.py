"""nn.Modules whose rows live in embstore tables.

They follow torch.nn.Embedding / EmbeddingBag's conventions (ids of any
shape, ``include_last_offset`` either way, 2-D fixed-length bags,
``per_sample_weights``, ``mode``) and take part in ``state_dict()`` /
``load_state_dict()``: the tables' keys, rows, optimizer state, step and seed
travel with the model (see :meth:`embstore.Table.state_dict` for the memory
cost, and use the tables' own checkpoints for tables that do not fit twice
in memory).

Each module's forward and backward run as the registered custom ops of
:mod:`embstore.torch._ops`, so ``torch.compile`` compiles models that use
them. The modules here check what they can from shapes and dtypes before
the op (so a compiled graph meets the same errors at trace time), and the
op does the rest on the host.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from embstore import _core
from embstore._convert import Default, as_bags, check_combiner, check_default, to_numpy
from embstore.ops import pool_rows, spread_pooled, unique_inverse
from embstore.protocol import BatchTier, ReadTier, StateTier, takes_default
from embstore.store import Table
from embstore.torch._ops import call, register

__all__ = ["Embedding", "EmbeddingBag"]

_STATE_FIELDS = ("keys", "rows", "state", "meta", "clock", "step", "seed")

#: One backward's gradients: (table, distinct keys, their gradient rows).
Parts = list[tuple[ReadTier, np.ndarray, np.ndarray]]


def as_input(x: Any, arg: str) -> torch.Tensor:
    """An argument of a forward as a tensor of its own: a copy, not a view,
    because the backward reads the ids of the forward even if the caller
    reuses (modifies in place) its id tensor in between, as a loader
    refilling one buffer does. NumPy arrays and lists become tensors; a
    tensor that requires grad, or is not dense, is refused with the
    argument's name."""
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            raise TypeError(
                f"{arg}: a tensor that requires grad; embstore gives it no gradient: pass "
                f"{arg}.detach()"
            )
        if x.layout != torch.strided:
            raise TypeError(f"{arg}: expected a dense tensor, got layout {x.layout}")
        return x.clone()
    a = np.array(x)
    if a.dtype.kind not in "biuf":
        raise TypeError(f"{arg}: expected an array of numbers, got dtype {a.dtype}")
    return torch.from_numpy(a)


def host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a NumPy array on the host (16-bit floats as
    float32)."""
    t = t.detach().cpu()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return t.numpy()


def grad_rows(grad: torch.Tensor, n: int, dim: int) -> np.ndarray:
    """A backward's gradient as float32 ``(n, dim)`` on the host."""
    g = grad.detach().to("cpu", torch.float32).reshape(n, dim)
    return np.ascontiguousarray(g.numpy())


def spread(
    table: ReadTier,
    ids: Any,
    offsets: Any,
    weights: Any,
    combiner: str,
    grads: np.ndarray,
    prefix: str = "",
) -> tuple[ReadTier, np.ndarray, np.ndarray]:
    """A pooled backward as gradients of distinct keys: ``(table, keys,
    rows)``, what one ``apply_gradients`` call would take."""
    i, o, w, c = as_bags(ids, offsets, weights, combiner, prefix=prefix)
    keys, inverse = unique_inverse(i)
    return table, keys, spread_pooled(grads, inverse, o, keys.shape[0], w, c)


def check_parts(parts: Parts) -> None:
    """Refuses a backward's gradients before any table steps or holds them:
    every table has an optimizer, every gradient is finite."""
    for table, _, grads in parts:
        if table.optimizer is None:
            raise ValueError(
                "optimizer: a table of this module has no optimizer (a table built "
                "without one is only read and assigned)"
            )
        if not np.isfinite(grads).all():
            raise ValueError("grads: non-finite gradient (no table stepped, nothing held)")


def _stores(module: nn.Module) -> bool:
    """Whether a forward stores rows for unseen ids: in training mode with
    gradients enabled (a ``torch.no_grad()`` validation pass in train mode
    stores nothing, as eval mode)."""
    return bool(module.training and torch.is_grad_enabled())


def _refuse_unsupported(
    max_norm: Any, norm_type: Any, scale_grad_by_freq: Any, sparse: Any
) -> tuple[float | None, float]:
    """Checks torch.nn.Embedding(Bag)'s arguments: ``max_norm`` (a float
    > 0 or None) and ``norm_type`` (a float > 0, ``inf`` too) are returned;
    ``scale_grad_by_freq`` is refused where given True; ``sparse`` is
    accepted (the tables always step only the rows a batch touches, as
    torch's sparse gradients with a sparse optimizer do)."""
    if max_norm is not None:
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float, np.number)):
            raise TypeError(
                f"max_norm: expected a float > 0 or None, got {type(max_norm).__name__}"
            )
        if not max_norm > 0:
            raise ValueError(f"max_norm: expected a float > 0 or None, got {max_norm}")
        max_norm = float(max_norm)
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float, np.number)):
        raise TypeError(f"norm_type: expected a float > 0, got {type(norm_type).__name__}")
    if not norm_type > 0:
        raise ValueError(f"norm_type: expected a float > 0, got {norm_type}")
    if scale_grad_by_freq is not False:
        raise ValueError(
            "scale_grad_by_freq: not supported (an id's gradients are summed, as torch's default)"
        )
    if not isinstance(sparse, bool):
        raise TypeError(f"sparse: expected a bool, got {type(sparse).__name__}")
    return max_norm, float(norm_type)


def _renormed(rows: np.ndarray, max_norm: float, norm_type: float) -> np.ndarray:
    """Which rows exceed ``max_norm`` in the ``norm_type`` norm, and those
    rows scaled by ``max_norm / (norm + 1e-7)``, as torch's
    ``embedding_renorm_`` scales its weight's rows (norm in float32, the
    scale in float64 applied in float32): ``rows`` changed in place, the
    mask returned."""
    norms = torch.linalg.vector_norm(torch.from_numpy(rows), ord=norm_type, dim=1).double()
    big = norms > max_norm
    if bool(big.any()):
        scale = (max_norm / (norms[big] + 1e-7)).float().numpy()
        mask: np.ndarray = big.numpy()
        rows[mask] *= scale[:, None]
        return mask
    none: np.ndarray = big.numpy()
    return none


def _check_padding_idx(padding_idx: Any) -> int | None:
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, (int, np.integer)):
        raise TypeError(
            f"padding_idx: expected an int id or None, got {type(padding_idx).__name__}"
        )
    return int(padding_idx)


def _check_accumulate(accumulate: Any) -> int:
    if isinstance(accumulate, bool) or not isinstance(accumulate, (int, np.integer)):
        raise TypeError(f"accumulate: expected an int >= 1, got {type(accumulate).__name__}")
    if accumulate < 1:
        raise ValueError(
            f"accumulate: expected an int >= 1 (backward calls a step), got {accumulate}"
        )
    return int(accumulate)


def _step_together(steps: list[tuple[ReadTier, np.ndarray, np.ndarray]]) -> None:
    """One optimizer step of several tables in one native call, which
    applies whole or not at all (the grouped pooled backward, each table's
    keys a feature of one-id bags, padded with empty bags to one batch)."""
    batch = max(keys.size for _, keys, _ in steps)
    width = sum(table.dim for table, _, _ in steps)
    grads = np.zeros((batch, width), dtype=np.float32)
    ids, offsets, inners, col = [], [], [], 0
    for table, keys, g in steps:
        # Pending gradients are checked to be of tables that step.
        assert isinstance(table, Table)
        inners.append(table._inner)
        n = keys.size
        grads[:n, col : col + table.dim] = g
        ids.append(np.ascontiguousarray(keys, dtype=np.int64))
        offsets.append(np.minimum(np.arange(batch + 1, dtype=np.int64), n))
        col += table.dim
    _core.collection_apply_pooled_gradients(
        inners,
        ids,
        offsets,
        [None] * len(steps),
        ["sum"] * len(steps),
        grads,
    )


def _as_torch(rows: Any) -> torch.Tensor:
    """A tier's output as a tensor, without a copy where one can be shared:
    NumPy (a Table's, a ShardedTable's), a tensor (a DeviceCache's over
    torch), or a CuPy array (through ``__cuda_array_interface__``)."""
    if isinstance(rows, torch.Tensor):
        return rows
    if isinstance(rows, np.ndarray):
        return torch.from_numpy(rows)
    return torch.as_tensor(rows)


class _TableState(nn.Module):
    """What every module over embstore tables shares: state-dict support
    (each table's :meth:`Table.state_dict` as tensors under
    ``{prefix}{name}.{field}``), its handle in the custom ops' registry, and
    gradient accumulation.

    ``accumulate=k``: the tables step once every ``k`` backward calls, with
    the gradients of those calls summed (as torch's ``.grad`` accumulates
    over backwards until ``optimizer.step()``); 1 (the default) steps them
    at every backward, as TorchRec's fused tables do. Gradients held between
    steps are not in ``state_dict()``: :meth:`flush_gradients` applies them
    now as one step, :meth:`discard_gradients` drops them.

    ``gradient_reduction``: how the ranks' gradients of a sharded table
    (a ShardedTable or ShardedCollection over N ranks) make its one step.
    ``"mean"`` divides each rank's by N: with DDP averaging the dense
    gradients, N ranks of batch b then train as one process of batch N*b
    (TorchRec's behaviour: its ``comm_ops.GRADIENT_DIVISION``, on by
    default). ``"sum"`` adds them as they are (a loss summed, not averaged,
    over the global batch). Not given: ``"sum"``, with a DeprecationWarning
    at the first backward over more than one rank; the default becomes
    ``"mean"`` in the next release. Over one process both are the same.
    """

    #: Whether state_dict() includes the tables' optimizer state.
    state_dict_optimizer: bool = True

    def __init__(self, accumulate: int = 1, gradient_reduction: str | None = None) -> None:
        super().__init__()
        self.accumulate = _check_accumulate(accumulate)
        if gradient_reduction not in (None, "mean", "sum"):
            raise ValueError(
                f'gradient_reduction: expected "mean" or "sum", got {gradient_reduction!r}'
            )
        self.gradient_reduction = gradient_reduction
        self._warned_reduction = False
        self._pending: list[Parts] = []
        self._handle = register(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A deep copy or an unpickled module is a module of its own: it
        # registers under a new handle (the original keeps its own).
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._handle = register(self)

    def _tables(self) -> dict[str, ReadTier]:
        raise NotImplementedError

    # The custom ops' side (embstore.torch._ops): every module implements these.
    def _run(self, inputs: list[torch.Tensor | None], store: bool, spec: str) -> torch.Tensor:
        raise NotImplementedError

    def _empty(self, inputs: list[torch.Tensor | None], spec: str) -> torch.Tensor:
        raise NotImplementedError

    def _backward(self, inputs: list[torch.Tensor | None], grad: torch.Tensor, spec: str) -> None:
        raise NotImplementedError

    def _world_size(self) -> int:
        """Ranks the module's sharded tables span (1 without one)."""
        from embstore.distributed.table import ShardedTable

        sizes = [t.size for t in self._tables().values() if isinstance(t, ShardedTable)]
        return max(sizes, default=1)

    def _reduce(self, grads: np.ndarray) -> np.ndarray:
        """A backward's gradients as its tables take them (see
        ``gradient_reduction``)."""
        n = self._world_size()
        if n == 1:
            return grads
        if self.gradient_reduction is None:
            if not self._warned_reduction:
                self._warned_reduction = True
                warnings.warn(
                    f"gradient_reduction: not given, so the {n} ranks' gradients of the "
                    'sharded tables are summed ("sum", this release\'s default) while DDP '
                    'averages the dense ones; pass gradient_reduction="mean" (TorchRec\'s '
                    'behaviour) to train as one process of the global batch, or "sum" to '
                    'keep this; the default becomes "mean" in the next release',
                    DeprecationWarning,
                    stacklevel=2,
                )
            return grads
        if self.gradient_reduction == "mean":
            return np.ascontiguousarray(grads / np.float32(n), dtype=np.float32)
        return grads

    @property
    def pending_backwards(self) -> int:
        """Backward calls whose gradients wait for the next step (always 0
        with ``accumulate=1``)."""
        return len(self._pending)

    def _finish(self, step: Callable[[], None], parts: Callable[[], Parts]) -> None:
        """The end of a backward: ``step()`` (one native call) without
        accumulation; else this backward's gradients join the pending ones,
        checked now (finite, a table with an optimizer) so that a bad
        backward is refused whole and the step that applies them cannot fail
        on them."""
        if self.accumulate == 1:
            step()
            return
        mine = parts()
        check_parts(mine)
        self._pending.append(mine)
        if len(self._pending) >= self.accumulate:
            self.flush_gradients()

    def flush_gradients(self) -> bool:
        """Applies the pending backwards' gradients now, summed, as one step
        of each table they touch; returns whether there were any. The step
        applies whole or not at all: refused (a step its bounds refuse, out
        of memory), no table moves and the gradients stay pending."""
        if not self._pending:
            return False
        merged: dict[int, tuple[ReadTier, list[np.ndarray], list[np.ndarray]]] = {}
        for parts in self._pending:
            for table, keys, grads in parts:
                entry = merged.setdefault(id(table), (table, [], []))
                entry[1].append(keys)
                entry[2].append(grads)
        steps = [(t, np.concatenate(k), np.concatenate(g)) for t, k, g in merged.values()]
        if len(steps) == 1:
            table, keys, grads = steps[0]
            cast(BatchTier, table).apply_gradients(keys, grads)
        else:
            _step_together(steps)
        self._pending = []
        return True

    def discard_gradients(self) -> None:
        """Drops the pending backwards' gradients (the tables do not move)."""
        self._pending = []

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, table in self._tables().items():
            if not table.writable:
                continue  # read-only: its rows are the checkpoint at its path
            export = getattr(table, "state_dict", None)
            if export is None:
                raise TypeError(
                    f"state_dict: the table of {prefix}{name} is a {type(table).__name__}, "
                    "which has no state_dict; save it with its save(path), or build the "
                    "module on an embstore.Table"
                )
            for field, value in export(with_optimizer=self.state_dict_optimizer).items():
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
            if not table.writable:
                if entries:
                    error_msgs.append(f"{prefix}{name}: a {type(table).__name__} is read-only")
                continue
            restore = getattr(table, "load_state_dict", None)
            if restore is None:
                if entries:
                    error_msgs.append(
                        f"{prefix}{name}: a {type(table).__name__} has no load_state_dict"
                    )
                continue
            required = [f for f in ("keys", "rows", "step", "seed") if f not in entries]
            if required:
                missing_keys.extend(f"{prefix}{name}.{f}" for f in required)
                continue
            meta = [f for f, v in entries.items() if v.device.type == "meta"]
            if meta:
                error_msgs.append(
                    f"{prefix}{name}.{meta[0]}: a meta tensor holds no values to load "
                    "(materialize the state dict first)"
                )
                continue
            try:
                restore({f: v.detach().cpu().numpy() for f, v in entries.items()})
            except (TypeError, ValueError) as e:
                error_msgs.append(f"{prefix}{name}: {e}")


class _OneTable(_TableState):
    """A module over one table: the arguments torch.nn.Embedding and
    EmbeddingBag share (``padding_idx``, ``max_norm``, ``norm_type``,
    refused ``scale_grad_by_freq``, accepted ``sparse``), ``embedding_dim`` and
    ``num_embeddings``."""

    def __init__(
        self,
        table: ReadTier,
        default: Default,
        padding_idx: int | None,
        max_norm: float | None,
        norm_type: float,
        scale_grad_by_freq: bool,
        sparse: bool,
        accumulate: int,
        gradient_reduction: str | None = None,
    ) -> None:
        if not isinstance(table, ReadTier):
            raise TypeError(
                "table: expected an embstore tier (a Table, MappedTable, DeviceCache or "
                f"ShardedTable: embstore.protocol.ReadTier), got {type(table).__name__}"
            )
        check_default(default, table.dim)
        #: Whether the tier's lookups take ``default=`` (a Table's and a
        #: MappedTable's do); over one whose do not, a missing id reads as
        #: the tier's initializer row, so only ``default="init"`` is taken.
        self._takes_default = takes_default(table)
        if not self._takes_default and not (isinstance(default, str) and default == "init"):
            raise ValueError(
                f"default: a {type(table).__name__} reads a missing id as its initializer's "
                'row; expected default="init" over it'
            )
        max_norm, norm_type = _refuse_unsupported(max_norm, norm_type, scale_grad_by_freq, sparse)
        if max_norm is not None and table.writable and not isinstance(table, StateTier):
            raise ValueError(
                f"max_norm: renormalizes the stored rows in place, with their optimizer "
                f"state kept, which a {type(table).__name__} does not offer "
                "(lookup_with_state and write_back); use an embstore.Table"
            )
        padding = _check_padding_idx(padding_idx)
        super().__init__(accumulate, gradient_reduction)
        self.table = table
        self.default = default
        self.padding_idx = padding
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.sparse = sparse
        #: A frozen module reads its table only: no row stored, no step
        #: (always, over a tier that is not writable: a MappedTable).
        self.frozen = not table.writable

    @property
    def embedding_dim(self) -> int:
        """Columns per row (the table's dim)."""
        return self.table.dim

    @property
    def num_embeddings(self) -> int:
        """Rows the table holds now."""
        return len(self.table)

    def _store(self) -> bool:
        return _stores(self) and not self.frozen

    @classmethod
    def from_pretrained(
        cls,
        embeddings: Any,
        *,
        freeze: bool = True,
        optimizer: Any = None,
        padding_idx: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """A module over a new table holding ``embeddings`` (``(n, dim)``)
        as the rows of ids ``0 .. n-1``, as torch.nn.Embedding's and
        EmbeddingBag's ``from_pretrained``; ``kwargs`` go to the module.
        ``freeze=True`` (torch's default) gives a table without an optimizer
        and a module that never stores or steps it (:attr:`frozen`);
        ``freeze=False`` needs an ``optimizer``."""
        rows = host(embeddings.detach()) if isinstance(embeddings, torch.Tensor) else embeddings
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.dtype.kind not in "iuf":
            raise ValueError(
                "embeddings: expected a 2-D (n, dim) array of numbers, got "
                f"{rows.dtype} {rows.shape}"
            )
        if not isinstance(freeze, bool):
            raise TypeError("freeze: expected a bool")
        if freeze and optimizer is not None:
            raise ValueError("optimizer: a frozen (freeze=True) table takes no optimizer")
        if not freeze and optimizer is None:
            raise ValueError("optimizer: freeze=False trains the rows, so give an optimizer")
        table = Table(rows.shape[1], optimizer=optimizer)
        table.assign(np.arange(rows.shape[0], dtype=np.int64), rows.astype(np.float32))
        module = cls(table, padding_idx=padding_idx, **kwargs)
        module.frozen = freeze
        return module

    def _renorm(self, keys: np.ndarray, rows: np.ndarray, store: bool) -> np.ndarray:
        """``rows`` (of ``keys``, repeats allowed) with ``max_norm`` applied
        as torch applies it; in a pass that stores, the table's rows of
        those keys are renormalized in place too (optimizer state kept), as
        torch's forward renormalizes its weight. Rows that only a pass that
        stores nothing reads (eval mode, a frozen module) are renormalized
        in the output alone: what a later forward reads is the same."""
        if self.max_norm is None or rows.shape[0] == 0:
            return rows
        big = _renormed(rows, self.max_norm, self.norm_type)
        if store and big.any():
            tier = cast(StateTier, self.table)
            held = np.unique(keys[big])
            held = held[to_numpy(tier.contains(held)).astype(bool)]
            if held.size:
                r, st = tier.lookup_with_state(held, insert=False)
                r = np.array(r, np.float32)
                _renormed(r, self.max_norm, self.norm_type)
                tier.write_back(held, r, st)
        return rows

    def _tables(self) -> dict[str, ReadTier]:
        return {"table": self.table}


class Embedding(_OneTable):
    """``forward(ids) -> (*ids.shape, dim)`` rows of ``table``, as
    torch.nn.Embedding (ids of any shape); backward steps the table's optimizer.

    In training mode (with gradients enabled) a missing id gets a stored row;
    under ``torch.no_grad()`` or in eval mode
    (``module.eval()``) nothing is stored and a missing id reads as
    ``default``: "init" (the row it would get), "zeros" or a given row.

    Each backward pass is one optimizer step of the table, or one in
    ``accumulate`` (see :class:`_TableState`). Use one module per table per
    forward pass (a Collection shares tables between features).

    ``padding_idx``: ids equal to it are not stored and get no gradient;
    they read the row the table holds for the id (a pretrained one, as
    torch reads its weight's row), else zeros. ``max_norm`` and
    ``norm_type``: rows read are scaled to norm ``max_norm`` where above
    it, as torch's, and in a training forward the table's rows too (their
    optimizer state kept). ``scale_grad_by_freq`` is refused by name;
    ``sparse`` is accepted (updates are always row-wise).
    ``embedding_dim`` is the table's dim, ``num_embeddings`` the rows it
    holds now (it grows as ids arrive).
    """

    def __init__(
        self,
        table: ReadTier,
        *,
        default: Default = "init",
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        accumulate: int = 1,
        gradient_reduction: str | None = None,
    ) -> None:
        super().__init__(
            table,
            default,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            accumulate,
            gradient_reduction,
        )

    def forward(self, ids: Any) -> torch.Tensor:
        return call(self, [as_input(ids, "ids")], self._store())

    def _kept(self, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
        """The flat ids and, with a ``padding_idx``, the positions of the
        others."""
        flat = host(ids).reshape(-1)
        if self.padding_idx is None:
            return flat, None
        return flat, np.flatnonzero(flat != self.padding_idx)

    def _run(self, inputs: list[torch.Tensor | None], store: bool, spec: str) -> torch.Tensor:
        ids = inputs[0]
        assert ids is not None
        flat, keep = self._kept(ids)
        kw: dict[str, Any] = (
            {"default": "init" if store else self.default} if self._takes_default else {}
        )
        if keep is None and self.max_norm is None:
            rows = _as_torch(self.table.lookup(flat, insert=store, **kw))
            return rows.view(*ids.shape, self.table.dim).to(ids.device)
        if keep is None:
            out = np.array(to_numpy(self.table.lookup(flat, insert=store, **kw)), np.float32)
        else:
            out = np.empty((flat.shape[0], self.table.dim), np.float32)
            out[keep] = to_numpy(self.table.lookup(flat[keep], insert=store, **kw))
            # Padding reads the row the table holds (a pretrained one), as
            # torch reads its weight's row, or zeros (never stored).
            out[flat == self.padding_idx] = self._padding_row()
        out = self._renorm(flat, out, store)
        return torch.from_numpy(out).view(*ids.shape, self.table.dim).to(ids.device)

    def _padding_row(self) -> np.ndarray:
        """The padding id's row: the table's, where it holds one (asked
        every call, so that every rank of a sharded table asks alike), else
        zeros."""
        key = np.array([self.padding_idx], np.int64)
        if bool(to_numpy(self.table.contains(key))[0]):
            rows = np.asarray(to_numpy(self.table.lookup(key, insert=False)), np.float32)
            row: np.ndarray = rows[0]
            return row
        return np.zeros(self.table.dim, np.float32)

    def _empty(self, inputs: list[torch.Tensor | None], spec: str) -> torch.Tensor:
        ids = inputs[0]
        assert ids is not None
        return ids.new_empty((*ids.shape, self.table.dim), dtype=torch.float32)

    def _backward(self, inputs: list[torch.Tensor | None], grad: torch.Tensor, spec: str) -> None:
        ids = inputs[0]
        assert ids is not None
        if self.frozen:
            return
        flat, keep = self._kept(ids)
        g = self._reduce(grad_rows(grad, flat.shape[0], self.table.dim))
        if keep is not None:
            flat, g = flat[keep], g[keep]

        def parts() -> Parts:
            keys, inverse = unique_inverse(np.ascontiguousarray(flat, dtype=np.int64))
            summed = np.zeros((keys.shape[0], self.table.dim), np.float32)
            np.add.at(summed, inverse, g)
            return [(self.table, keys, summed)]

        self._finish(lambda: cast(BatchTier, self.table).apply_gradients(flat, g), parts)

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
      receive no gradient) and apply in every mode.

    In eval mode nothing is stored and a missing id pools as ``default``.

    ``padding_idx``: ids equal to it pool as nothing (not counted by "mean"
    or "sqrtn"), are not stored and get no gradient, as in
    torch.nn.EmbeddingBag. ``max_norm`` and ``norm_type`` as
    :class:`Embedding`'s (rows renormalized before pooling);
    ``per_sample_weights`` must be float32, as torch requires;
    ``scale_grad_by_freq`` is refused by name; ``sparse`` is accepted.
    ``embedding_dim`` and ``num_embeddings`` as :class:`Embedding`'s;
    ``accumulate`` as :class:`_TableState`'s.
    """

    def __init__(
        self,
        table: ReadTier,
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
        accumulate: int = 1,
        gradient_reduction: str | None = None,
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
        combiner_name = check_combiner(name)
        super().__init__(
            table,
            default,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            accumulate,
            gradient_reduction,
        )
        self.combiner = combiner_name
        self.include_last_offset = include_last_offset

    @property
    def mode(self) -> str:
        return self.combiner

    def forward(
        self, input: Any, offsets: Any = None, per_sample_weights: Any = None
    ) -> torch.Tensor:
        ids = as_input(input, "input")
        off = None if offsets is None else as_input(offsets, "offsets")
        w = (
            None
            if per_sample_weights is None
            else as_input(per_sample_weights, "per_sample_weights")
        )
        if off is None:
            if ids.dim() != 2:
                raise ValueError(
                    f"input: expected a 2-D (batch, bag length) array when offsets is None, "
                    f"got shape {tuple(ids.shape)}"
                )
        else:
            if ids.dim() != 1:
                raise ValueError(
                    f"offsets: given with {ids.dim()}-D input; 2-D input (fixed-length bags) "
                    "takes offsets=None"
                )
            if off.dim() != 1 or off.dtype.is_floating_point or off.dtype == torch.bool:
                raise ValueError(
                    f"offsets: expected a 1-D integer array, got {off.dtype} {tuple(off.shape)}"
                )
            if self.include_last_offset and off.shape[0] == 0:
                raise ValueError(
                    f"offsets: with include_last_offset=True the last offset is len(input) "
                    f"({ids.shape[0]}), got none; offsets without a last entry take "
                    "include_last_offset=False (torch's default)"
                )
        if w is not None and w.dtype != torch.float32:
            raise TypeError(
                f"per_sample_weights: expected float32, the dtype of the rows (torch "
                f"requires the weights' type), got {w.dtype}"
            )
        if w is not None and w.shape != ids.shape:
            raise ValueError(
                f"per_sample_weights: expected the shape of input {tuple(ids.shape)}, "
                f"got {tuple(w.shape)}"
            )
        return call(self, [ids, off, w], self._store())

    def _bags(
        self, inputs: list[torch.Tensor | None]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The call's bags in the table's CSR form (a last offset), padding
        ids taken out."""
        given, offsets, weights = inputs
        assert given is not None
        ids = host(given)
        if offsets is None:
            b, length = ids.shape
            ids, off = ids.reshape(-1), np.arange(b + 1, dtype=np.int64) * length
        else:
            off = host(offsets).astype(np.int64)
            if not self.include_last_offset:
                off = np.concatenate([off, [ids.shape[0]]])
            elif int(off[-1]) != ids.shape[0]:
                raise ValueError(
                    "offsets: with include_last_offset=True the last offset is len(input) "
                    f"({ids.shape[0]}), got {int(off[-1])}; offsets without a last entry "
                    "take include_last_offset=False (torch's default)"
                )
        w = None if weights is None else host(weights).reshape(-1)
        if self.padding_idx is not None:
            # Padding ids leave their bags (and the counts of mean and sqrtn).
            keep = ids != self.padding_idx
            ends = np.concatenate([[0], np.cumsum(keep)])
            if off.size and (off.min() < 0 or off.max() > keep.shape[0]):
                raise ValueError(
                    f"offsets: expected offsets within 0..{keep.shape[0]} (the ids given)"
                )
            ids, off = ids[keep], ends[off]
            w = None if w is None else w[keep]
        return ids, off, w

    def _run(self, inputs: list[torch.Tensor | None], store: bool, spec: str) -> torch.Tensor:
        ids, off, w = self._bags(inputs)
        kw: dict[str, Any] = (
            {"default": "init" if store else self.default} if self._takes_default else {}
        )
        if self.max_norm is None:
            out = self.table.lookup_pooled(
                ids, off, combiner=self.combiner, weights=w, insert=store, **kw
            )
        else:
            # Rows renormalized before pooling, as torch's embedding_bag.
            keys, inverse = unique_inverse(np.ascontiguousarray(ids, dtype=np.int64))
            rows = np.array(to_numpy(self.table.lookup(keys, insert=store, **kw)), np.float32)
            rows = self._renorm(keys, rows, store)
            out = pool_rows(rows, inverse, off, w, self.combiner)
        given = inputs[0]
        assert given is not None
        return _as_torch(out).to(given.device)

    def _empty(self, inputs: list[torch.Tensor | None], spec: str) -> torch.Tensor:
        ids, offsets, _ = inputs
        assert ids is not None
        b = ids.shape[0] if offsets is None else offsets.shape[0] - int(self.include_last_offset)
        return ids.new_empty((b, self.table.dim), dtype=torch.float32)

    def _backward(self, inputs: list[torch.Tensor | None], grad: torch.Tensor, spec: str) -> None:
        if self.frozen:
            return
        ids, off, w = self._bags(inputs)
        g = self._reduce(grad_rows(grad, off.shape[0] - 1, self.table.dim))
        self._finish(
            lambda: cast(BatchTier, self.table).apply_pooled_gradients(
                ids, off, g, combiner=self.combiner, weights=w
            ),
            lambda: [spread(self.table, ids, off, w, self.combiner, g)],
        )

    def extra_repr(self) -> str:
        return (
            f"dim={self.table.dim}, mode={self.combiner!r}, "
            f"include_last_offset={self.include_last_offset}"
        )
