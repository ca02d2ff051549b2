"""The host tier: :class:`Table`, every row this process owns."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import numpy as np
import numpy.typing as npt

from embstore import _core, table_state
from embstore._convert import (
    _NDARRAY,
    VOCABULARY,
    Default,
    as_bags,
    as_keys,
    as_rows,
    check_bool,
    check_default,
    check_int,
    check_name,
    like,
)
from embstore._progress import run_with_progress
from embstore.config import TableConfig
from embstore.init import Initializer
from embstore.loading import check_agrees, load_settings
from embstore.optim import Optimizer
from embstore.parts import CheckpointParts
from embstore.policy import Admission
from embstore.protocol import TableFigures, table_figures
from embstore.seeds import manual_seed, next_seed
from embstore.serving import remote
from embstore.serving.mapped import MappedTable

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

    from embstore.config import TableSettings

__all__ = ["Table", "manual_seed", "next_seed"]


_U64_MAX = 2**64 - 1
_I64_MAX = 2**63 - 1
#: The combiners' names, for the pooled calls' inline check.
_COMBINERS = frozenset(VOCABULARY["combiners"])


def _restore_table(config: TableConfig | dict[str, Any], state: Mapping[str, Any]) -> Table:
    """A table built from ``config`` holding ``state`` (the inverse of
    :meth:`Table.__reduce__`; a dict of constructor arguments is what
    pickles made before 0.1.0's TableConfig hold)."""
    if isinstance(config, dict):
        config = TableConfig(**config)
    table = Table.from_config(config)
    table.load_state_dict(state)
    return table


class Table(CheckpointParts):
    """A growable table from int64 keys to float32 rows and optimizer state.

    Rows live in native sharded hash tables. Every method takes a whole batch,
    releases the GIL and runs on all cores; any number of Python threads may
    call any method at once.

    Parameters
    ----------
    dim:
        Columns per row (>= 1).
    **settings:
        The rest of its :class:`embstore.TableConfig` (every field is
        described there): ``optimizer``, ``initializer``, ``seed``,
        ``num_shards``, ``dtype``, ``admission``, ``ttl_steps``,
        ``ttl_seconds``, ``capacity``, ``capacity_bytes``, ``eviction``.
        ``Table.from_config(config)`` builds one from a TableConfig, and
        :attr:`table_config` gives a table's own.
    """

    def __init__(self, dim: int, **settings: Unpack[TableSettings]) -> None:
        self._build(TableConfig(dim, **cast("dict[str, Any]", settings)))

    @classmethod
    def from_config(cls, config: TableConfig) -> Table:
        """An empty table built from ``config``."""
        if not isinstance(config, TableConfig):
            raise TypeError(
                f"config: expected an embstore.TableConfig, got {type(config).__name__}"
            )
        table = cls.__new__(cls)
        table._build(config)
        return table

    def _build(self, config: TableConfig) -> None:
        # The seed is drawn last: a refused config uses no seed of the
        # sequence.
        if config.seed is None:
            config = replace(config, seed=next_seed())
        self._inner = _core.Table(config._to_core())
        self._config = replace(config, num_shards=int(self._inner.num_shards))

    def _native_table(self, seed: int) -> _core.Table:
        """An empty native table of this table's configuration with ``seed``."""
        return _core.Table(replace(self._config, seed=seed)._to_core())

    # -- properties ---------------------------------------------------------

    @property
    def writable(self) -> bool:
        """Whether the table stores rows and takes steps: True (see
        :class:`embstore.protocol.ReadTier`)."""
        return True

    @property
    def dim(self) -> int:
        """Columns per row."""
        return int(self._inner.dim)

    @property
    def seed(self) -> int:
        """Seed of the initializer."""
        return int(self._inner.seed)

    @property
    def step(self) -> int:
        """Optimizer steps taken (one per apply call)."""
        return int(self._inner.step)

    @property
    def table_config(self) -> TableConfig:
        """The :class:`embstore.TableConfig` this table was built from (or
        loaded with), its seed and shard count as they are."""
        return self._config

    @property
    def optimizer(self) -> Optimizer | None:
        """The optimizer configuration."""
        return self._config.optimizer

    @property
    def initializer(self) -> Initializer:
        """The initializer configuration."""
        return self._config.initializer

    @property
    def dtype(self) -> str:
        """Row storage dtype."""
        return self._config.dtype

    @property
    def admission(self) -> Admission | None:
        """The admission filter, if any."""
        return self._config.admission

    @property
    def ttl_steps(self) -> int | None:
        """Steps a row lives untouched before :meth:`evict` removes it."""
        return self._config.ttl_steps

    @property
    def ttl_seconds(self) -> int | None:
        """Seconds a row lives untouched before :meth:`evict` removes it."""
        return self._config.ttl_seconds

    @property
    def capacity(self) -> int | None:
        """Most rows the table keeps."""
        return self._config.capacity

    @property
    def capacity_bytes(self) -> int | None:
        """Most bytes of rows the table keeps (``stats()["row_cost"]`` a row)."""
        return self._config.capacity_bytes

    @property
    def eviction(self) -> str:
        """Capacity eviction order: "lfu" or "lru"."""
        return self._config.eviction

    @property
    def state_len(self) -> int:
        """Floats of optimizer state per row."""
        return int(self._inner.state_len)

    @property
    def state_names(self) -> list[str]:
        """Names of the state blocks, in order within a row's state."""
        return list(self._inner.state_names)

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return int(self._inner.num_shards)

    @property
    def simd(self) -> str:
        """The SIMD backend of the optimizer kernels."""
        return str(self._inner.simd)

    def __len__(self) -> int:
        return int(self._inner.__len__())

    def __repr__(self) -> str:
        return (
            f"Table(dim={self.dim}, rows={len(self)}, optimizer={self._config.optimizer!r}, "
            f"step={self.step}, num_shards={self.num_shards}, dtype={self.dtype!r})"
        )

    def config(self) -> dict[str, Any]:
        """The configuration every copy of this table must share (the ranks
        of a ShardedTable check theirs agree): dim, seed, and the native
        table's dtype, optimizer, initializer, admission and eviction
        policies (named configurations as ``(name, {param: value})``)."""
        return TableConfig._plain(self._inner.config_json())

    # -- batch protocol ------------------------------------------------------

    @overload
    def lookup(
        self,
        keys: torch.Tensor,
        *,
        insert: bool = True,
        default: Default = "init",
        return_found: Literal[False] = ...,
    ) -> torch.Tensor: ...
    @overload
    def lookup(
        self,
        keys: Any,
        *,
        insert: bool = True,
        default: Default = "init",
        return_found: Literal[False] = ...,
    ) -> npt.NDArray[np.float32]: ...
    @overload
    def lookup(
        self,
        keys: Any,
        *,
        insert: bool = True,
        default: Default = "init",
        return_found: Literal[True],
    ) -> tuple[Any, Any]: ...
    @overload
    def lookup(
        self, keys: Any, *, insert: bool = True, default: Default = "init", return_found: bool = ...
    ) -> Any: ...
    def lookup(
        self,
        keys: Any,
        *,
        insert: bool = True,
        default: Default = "init",
        return_found: bool = False,
    ) -> Any:
        """Rows of ``keys (n,)`` as float32 ``(n, dim)``: a NumPy array, or a
        torch tensor (sharing its memory) when ``keys`` is a CPU tensor.

        With ``insert=True`` a missing key gets a row from the initializer
        (unless the table has an admission filter: then only gradient calls
        admit keys); with ``insert=False`` (serving) nothing is stored.

        ``default`` is what a key that has no row (and gets none) reads as:
        ``"init"`` the row the initializer would give it (the default),
        ``"zeros"``, or a given row (``dim`` finite floats), e.g. the mean
        row for unseen ids at evaluation.

        ``return_found=True`` (with ``insert=False``) returns ``(rows,
        found)``, ``found`` bool ``(n,)`` telling which keys had a row: each
        row and its flag come from one probe, so a key evicted or removed by
        another thread meanwhile is either read and found or read as
        ``default`` and not found (HierarchicalKV's find with its founds).
        """
        # (A plain lookup pays one identity test for return_found.)
        if return_found is not False and check_bool("return_found", return_found):
            return self._lookup_found(keys, insert, default)
        # One path: keys go to the native call as given, which takes a 1-D
        # int64 array as it is and has anything else converted and checked
        # by as_keys (a small call pays for every check made here).
        if insert is not True and insert is not False:
            insert = check_bool("insert", insert)
        if type(default) is str:  # a name: the native call checks it
            out = self._inner.lookup(keys, insert, default, None)
        else:
            out = self._inner.lookup(keys, insert, *check_default(default, self.dim))
        return out if type(keys) is _NDARRAY else like(keys, out)

    def _lookup_found(self, keys: Any, insert: Any, default: Default) -> tuple[Any, Any]:
        if check_bool("insert", insert):
            raise ValueError(
                "return_found: needs insert=False (a lookup that inserts finds every key; "
                "call contains() first to know which were new)"
            )
        k = as_keys(keys)
        if type(default) is str:
            rows, found = self._inner.lookup_found(k, default, None)
        else:
            rows, found = self._inner.lookup_found(k, *check_default(default, self.dim))
        if type(keys) is _NDARRAY:
            return rows, found
        return like(keys, rows), like(keys, found)

    @overload
    def contains(self, keys: torch.Tensor) -> torch.Tensor: ...
    @overload
    def contains(self, keys: Any) -> npt.NDArray[np.bool_]: ...
    def contains(self, keys: Any) -> Any:
        """Whether each of ``keys (n,)`` has a row: bool ``(n,)`` (a tensor
        for tensor keys)."""
        return like(keys, self._inner.contains(as_keys(keys)))

    def assign(self, keys: Any, values: Any) -> None:
        """Insert or overwrite rows: ``keys (n,)``, ``values (n, dim)``.

        Optimizer state of the assigned rows is reset; for a repeated key the
        last value wins.
        """
        # As in lookup: the native call takes int64 (n,) keys and float32
        # (n, dim) values as given and has anything else converted.
        self._inner.assign(keys, values)

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` more rows now: index space, and row memory
        allocated and touched, so that inserting that many new keys later
        maps no fresh memory (on first write, fresh memory costs a page
        fault and a page clear per page: most of an insert's time for rows
        with optimizer state). Like the initial capacity of a
        HierarchicalKV or TFRA table. The memory counts in
        ``stats()["bytes"]`` from now on; rows and keys do not change.

        Raises TypeError if ``rows`` is not an integer, ValueError if it is
        negative or needs more memory than is available.
        """
        self._inner.reserve(check_int("rows", rows, 0, _I64_MAX))

    def remove(self, keys: Any) -> int:
        """Remove the rows of ``keys (n,)``; returns how many were present."""
        return int(self._inner.remove(as_keys(keys)))

    def apply_gradients(self, keys: Any, grads: Any, *, step: int | None = None) -> None:
        """One optimizer step: ``keys (n,)``, ``grads (n, dim)``.

        Gradients of repeated keys are summed first (one update per distinct
        key), missing keys are created from the initializer, only touched
        rows change, and :attr:`step` goes up by one. Non-finite gradients,
        or a table without an optimizer, raise ValueError (the core's) and
        change nothing.

        ``step``: for a tier above the table (a device cache) that applies
        part of one step itself: the step number from :meth:`take_step`, at
        which these rows are updated; :attr:`step` does not move.
        """
        # As in lookup: the native call takes keys and grads as given and has
        # anything but int64 (n,) and float32 (n, dim) arrays converted.
        if step is None:
            self._inner.apply_gradients(keys, grads)
        else:
            self._inner.apply_gradients_at(keys, grads, check_int("step", step, 1, _I64_MAX))

    def take_step(self) -> int:
        """Count one optimizer step and return its number (:attr:`step`
        after it), without updating any row: a tier above the table that
        trains some rows itself takes the step here, then applies the
        table's part with ``apply_gradients(..., step=n)``. Atomic: threads
        that take steps at once get distinct numbers."""
        return int(self._inner.advance_step())

    def lookup_with_state(
        self,
        keys: Any,
        *,
        insert: bool = True,
        out: npt.NDArray[np.float32] | None = None,
        stored: bool = False,
    ) -> tuple[npt.NDArray[Any], npt.NDArray[np.float32]]:
        """Rows and optimizer state of ``keys (n,)``: ``(n, dim)`` and
        ``(n, state_len)`` float32 (a missing key reads its initial row and
        fresh state; with ``insert`` it gets them), for a tier that trains
        rows away from the table and writes them back with
        :meth:`write_back`. With ``out`` (a writeable C-contiguous float32
        array of at least ``n * (dim + state_len)`` values, such as a pinned
        transfer buffer) both are written there, rows first, and returned as
        views of it. ``stored=True``: each row as the table stores it, its
        bytes (uint8 ``(n, row_bytes)``; an int8 row's codes, then its
        float32 scale and offset), or in ``out`` its ``row_bytes / 4``
        float32 words; :meth:`write_back` with ``stored=True`` takes them
        back bit for bit."""
        k = as_keys(keys)
        insert = check_bool("insert", insert)
        stored = check_bool("stored", stored)
        width = self._inner.weight_words() if stored else self.dim
        if out is None:
            pair = self._inner.lookup_with_state(k, insert, None, stored)
            assert pair is not None
            return (pair[0].view(np.uint8), pair[1]) if stored else pair
        if not isinstance(out, np.ndarray) or out.dtype != np.float32:
            raise TypeError("out: expected a float32 NumPy array")
        if not out.flags.c_contiguous:
            raise ValueError("out: expected a C-contiguous array")
        flat = out.reshape(-1)
        self._inner.lookup_with_state(k, insert, flat, stored)
        n, sl = k.shape[0], self.state_len
        return (
            flat[: n * width].reshape(n, width),
            flat[n * width : n * (width + sl)].reshape(n, sl),
        )

    def write_back(self, keys: Any, rows: Any, state: Any, *, stored: bool = False) -> None:
        """Insert or overwrite rows together with their optimizer state
        (``keys (n,)``, ``rows (n, dim)``, ``state (n, state_len)``): what a
        tier that trained them elsewhere returns to the table.
        ``stored=True``: ``rows`` as :meth:`lookup_with_state` with
        ``stored=True`` gives them (uint8 ``(n, row_bytes)``, or float32
        words ``(n, row_bytes / 4)``), kept exactly; checked as rows are
        (the weights they decode to, an int8 row's scale and offset)."""
        k = as_keys(keys)
        st = as_rows(state, k.shape[0], self.state_len, "state")
        if check_bool("stored", stored):
            words = self._inner.weight_words()
            r = np.asarray(rows)
            if r.dtype == np.uint8 and r.ndim == 2 and r.shape[1] == 4 * words:
                r = np.ascontiguousarray(r).view(np.float32)
            elif r.dtype != np.float32 or r.shape[1:] != (words,):
                raise ValueError(
                    f"rows: expected stored rows, uint8 ({k.shape[0]}, {4 * words}) or float32 "
                    f"({k.shape[0]}, {words}), got {r.dtype} {r.shape}"
                )
            if r.shape[0] != k.shape[0]:
                raise ValueError(f"rows: expected {k.shape[0]} rows, got {r.shape[0]}")
            self._inner.assign_stored(k, np.ascontiguousarray(r), st)
            return
        r = as_rows(rows, k.shape[0], self.dim, "rows")
        self._inner.assign(k, r, st)

    @overload
    def lookup_pooled(
        self,
        ids: torch.Tensor,
        offsets: Any,
        *,
        combiner: str = "sum",
        weights: Any = None,
        insert: bool = True,
        default: Default = "init",
    ) -> torch.Tensor: ...
    @overload
    def lookup_pooled(
        self,
        ids: Any,
        offsets: Any,
        *,
        combiner: str = "sum",
        weights: Any = None,
        insert: bool = True,
        default: Default = "init",
    ) -> npt.NDArray[np.float32]: ...
    def lookup_pooled(
        self,
        ids: Any,
        offsets: Any,
        *,
        combiner: str = "sum",
        weights: Any = None,
        insert: bool = True,
        default: Default = "init",
    ) -> Any:
        """Pooled rows of bags: float32 ``(batch, dim)`` (a tensor sharing
        its memory when ``ids`` is a CPU tensor).

        CSR input as ``torch.nn.EmbeddingBag(include_last_offset=True)``: bag
        ``b`` holds ``ids[offsets[b]:offsets[b+1]]``; ``offsets (batch+1,)``
        starts at 0, never decreases and ends at ``len(ids)``. ``combiner`` is
        "sum" (sum of w*x), "mean" (sum of w*x over sum of w) or "sqrtn" (sum
        of w*x over sqrt of sum of w**2); ``weights (nnz,)`` are optional
        per-id weights (1 without). An empty bag pools to zeros. ``default``
        is what an id without a row pools as (see :meth:`lookup`).
        """
        if weights is None and type(combiner) is str and combiner in _COMBINERS:
            # As given (see lookup): the native call converts ids and offsets
            # when needed and checks the offsets.
            i, o, w, c = ids, offsets, None, combiner
        else:
            i, o, w, c = as_bags(ids, offsets, weights, combiner)
        if insert is not True and insert is not False:
            insert = check_bool("insert", insert)
        if type(default) is str:  # a name: the native call checks it
            out = self._inner.lookup_pooled(i, o, w, c, insert, default, None)
        else:
            out = self._inner.lookup_pooled(i, o, w, c, insert, *check_default(default, self.dim))
        return out if type(ids) is _NDARRAY else like(ids, out)

    def apply_pooled_gradients(
        self,
        ids: Any,
        offsets: Any,
        grads: Any,
        *,
        combiner: str = "sum",
        weights: Any = None,
    ) -> None:
        """Backward of :meth:`lookup_pooled` and one optimizer step.

        ``grads (batch, dim)`` is spread back to the ids as EmbeddingBag's
        backward spreads it (id i of bag b gets ``w_i / denominator_b *
        grads[b]``), then the step proceeds as :meth:`apply_gradients`.
        """
        if weights is None and type(combiner) is str and combiner in _COMBINERS:
            # As given (see lookup_pooled).
            self._inner.apply_pooled_gradients(ids, offsets, grads, None, combiner)
        else:
            i, o, w, c = as_bags(ids, offsets, weights, combiner)
            self._inner.apply_pooled_gradients(i, o, grads, w, c)

    @overload
    def evict(self, *, with_rows: Literal[False] = ...) -> npt.NDArray[np.int64]: ...
    @overload
    def evict(
        self, *, with_rows: Literal[True]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]: ...
    @overload
    def evict(
        self, *, with_rows: bool
    ) -> npt.NDArray[np.int64] | tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]: ...
    def evict(
        self, *, with_rows: bool = False
    ) -> npt.NDArray[np.int64] | tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """Run the eviction policy now and return the evicted keys, ascending.

        Removes the rows not touched for ``ttl_steps`` optimizer steps, then,
        above ``capacity``, the lowest-scoring rows. ``with_rows=True``
        returns ``(keys, rows (n, dim))`` so the caller can archive them.
        """
        keys, rows = self._inner.evict(check_bool("with_rows", with_rows))
        if with_rows:
            assert rows is not None
            return keys, rows
        return keys

    def admission_counts(self, keys: Any) -> npt.NDArray[np.uint32]:
        """The admission sketch's count estimate of each key (0 without a CountFilter)."""
        return self._inner.admission_counts(as_keys(keys))

    @overload
    def export(
        self, *, with_state: Literal[False] = ..., consistent: bool = ...
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]: ...
    @overload
    def export(
        self, *, with_state: Literal[True], consistent: bool = ...
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.float32]]: ...
    @overload
    def export(
        self, *, with_state: bool, consistent: bool = ...
    ) -> (
        tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]
        | tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.float32]]
    ): ...
    def export(
        self, *, with_state: bool = False, consistent: bool = True, progress: bool | None = None
    ) -> (
        tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]
        | tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], npt.NDArray[np.float32]]
    ):
        """Every row, keys ascending: ``(keys (n,), rows (n, dim))``, and with
        ``with_state=True`` also the optimizer state ``(n, state_len)``.

        By default one consistent snapshot, even while other threads call the
        table: it waits for the writer calls in flight, and writers wait for
        it. With ``consistent=False`` it waits for no writer (a serving
        snapshot next to training): each row, with its state, is one
        version of it, whole, but rows are of different moments, and a key
        inserted or removed during the call may or may not be in it.

        ``progress``: a bar of the bytes copied, for an export still running
        after a second (None: when stderr is a terminal; see
        ``embstore._progress``).
        """
        with_state = check_bool("with_state", with_state)
        consistent = check_bool("consistent", consistent)
        width = 4 * (self.dim + (self.state_len if with_state else 0))
        keys, rows, state, _, _ = run_with_progress(
            lambda p: self._inner.export(with_state, False, consistent, p),
            len(self) * width,
            "export",
            progress,
        )
        if with_state:
            return keys, rows, state
        return keys, rows

    # -- checkpoints -------------------------------------------------------------

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        incremental: bool = False,
        with_optimizer: bool = True,
        progress: bool | None = None,
        dtype: str | None = None,
    ) -> dict[str, Any]:
        """Save a consistent snapshot to the checkpoint directory ``path``
        (created if missing; its parent must exist, else CheckpointError).

        The directory holds ``manifest.json`` and safetensors shard files
        (keys, rows and optimizer state) that NumPy/torch can read without
        embstore. The save is crash-safe: until it returns, the previous
        checkpoint at ``path`` stays whole and loadable. ``incremental=True``
        writes only the rows changed and the keys removed since this table's
        last save (or load) at ``path``, chained to it; each path keeps its
        own record (up to eight paths), so serving publishes to one path and
        training checkpoints to another are both incremental. Chains stay
        bounded: past eight deltas a save writes one delta of every change
        since the full save in their place, and once the deltas hold half
        the full save's rows it writes a full save (the manifest's last
        link says which). ``with_optimizer=False``
        writes rows only (a serving export). Calls that change rows wait while
        the snapshot is taken. ``progress``: draw a progress bar on stderr
        for a save that takes more than a moment (None: when stderr is a
        terminal). Returns the new manifest.

        ``dtype`` ("float32", "float16", "bfloat16", "int8") writes rows of
        that storage whatever the table's: a trainer in float32 publishes
        8-bit rows with ``save(path, with_optimizer=False, dtype="int8")``
        (rows rounded to nearest). Such a save is a full one, made from a
        copy of the table in that dtype (in memory while it saves). A URL
        ``path`` (``s3://...``) saves through fsspec: :mod:`embstore.serving.remote`.
        """
        if remote.is_url(path):
            return remote.save_to_url(self, path, incremental, with_optimizer, progress, dtype)
        if dtype is not None and dtype != self.dtype:
            check_name("dtype", "dtypes", dtype)
            if check_bool("incremental", incremental):
                raise ValueError(
                    f"dtype: an incremental save writes the table's own {self.dtype} rows; "
                    f"save in full to change them to {dtype}"
                )
            copy = Table.from_config(replace(self._config, dtype=dtype))
            copy.load_state_dict(self.state_dict(with_optimizer=with_optimizer))
            return copy.save(path, with_optimizer=with_optimizer, progress=progress)
        width = {"float32": 4, "int8": 1}.get(self.dtype, 2)
        row_bytes = 8 + width * self.dim + 4 * (self.state_len if with_optimizer else 0)
        text, _ = run_with_progress(
            lambda p: self._inner.save(
                os.fspath(path),
                check_bool("incremental", incremental),
                check_bool("with_optimizer", with_optimizer),
                p,
            ),
            len(self) * row_bytes,
            "save",
            progress,
        )
        manifest: dict[str, Any] = json.loads(text)
        return manifest

    @overload
    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        config: TableConfig | None = None,
        num_shards: int | None = None,
        progress: bool | None = None,
        mmap: Literal[False] = ...,
        disk: str | os.PathLike[str] | None = None,
        memory_bytes: int | None = None,
        dtype: str | None = None,
    ) -> Table: ...
    @overload
    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        num_shards: int | None = None,
        progress: bool | None = None,
        mmap: Literal[True],
        follow: float | None = None,
        warm: bool = False,
    ) -> MappedTable: ...
    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        config: TableConfig | None = None,
        num_shards: int | None = None,
        progress: bool | None = None,
        mmap: bool = False,
        follow: float | None = None,
        warm: bool = False,
        disk: str | os.PathLike[str] | None = None,
        memory_bytes: int | None = None,
        dtype: str | None = None,
    ) -> Table | MappedTable:
        """Load the checkpoint at ``path`` into a new Table.

        With ``mmap=True``, returns a read-only :class:`embstore.MappedTable`
        instead: the files are mapped into memory and no row is read until a
        lookup needs it, so processes that open one checkpoint share one
        copy of the rows (``num_shards`` and ``progress`` do not apply).
        Its ``refresh()`` serves what a trainer published at ``path`` since;
        ``follow=seconds`` refreshes in the background every so often;
        ``warm=True`` reads its files into memory at open, in 2 MiB pages
        where the kernel can give them (:meth:`embstore.MappedTable.warm`).

        The table gets the saved dim, dtype, optimizer and its configuration,
        initializer, seed and step; ``num_shards`` may differ from the saving
        table's. Each file is read once; its size and checksum and every
        tensor's shape are checked before its rows are loaded, and the table
        is returned only when every file holds: a damaged, unknown or newer
        checkpoint raises :class:`embstore.CheckpointError`. Nothing is
        unpickled or executed.

        With ``disk`` and ``memory_bytes``, the table is a disk table (see
        :class:`embstore.TableConfig`), at the checkpoint's shard count
        unless ``num_shards`` is given. Each file is read once and checked
        whole, then taken as one of the table's files on disk as it is (a
        hard link under ``disk``, or a copy on another file system; every
        row read from it is checked against the CRC-32C its load took), so
        a checkpoint larger than memory opens at about the disk's
        sequential read rate and writes nothing; at another shard count
        the rows are written to the table's own files instead.

        ``dtype`` ("float32", "float16", "bfloat16", "int8") gives the
        table rows of that storage, whatever the checkpoint's: an int8
        checkpoint loads as float32 rows equal to its dequantized rows (and
        a float32 one as int8 rows rounded to nearest), each file's rows
        converted as it loads (a disk table's too), never two copies of the
        table in memory.

        ``config``: the :class:`embstore.TableConfig` the table was made
        with, instead of the loose ``num_shards``, ``disk``,
        ``memory_bytes`` and ``dtype`` (its values of those are the load's);
        every other setting must be the checkpoint's (ValueError naming the
        first that is not; a seed of None matches any).
        """
        if check_bool("mmap", mmap):
            if config is not None:
                raise ValueError("config: a table loaded with mmap=True serves its files as saved")
            if disk is not None or memory_bytes is not None:
                raise ValueError("disk: a table loaded with mmap=True is read from its files")
            if dtype is not None:
                raise ValueError("dtype: a table loaded with mmap=True serves its files' rows")
            return MappedTable(path, follow=follow, warm=warm)
        if follow is not None:
            raise ValueError("follow: only a table loaded with mmap=True follows its path")
        if check_bool("warm", warm):
            raise ValueError("warm: only a table loaded with mmap=True maps its files")
        settings = load_settings(
            config, num_shards=num_shards, disk=disk, memory_bytes=memory_bytes, dtype=dtype
        )
        try:
            # Read natively, with the loader's checks and size limit; the load
            # reads every file once (each file checked, then loaded).
            total = _core.checkpoint_size(os.fspath(path))[0]
        except Exception:  # the load itself reports what is wrong
            total = 0
        inner = run_with_progress(
            lambda p: _core.load_table(os.fspath(path), settings, p), total, "load", progress
        )
        table = cls.__new__(cls)
        table._adopt(inner)
        check_agrees(config, table._config, os.fspath(path))
        return table

    def _adopt(self, inner: _core.Table) -> None:
        """Become the wrapper of a native table (loaded from a checkpoint):
        the configuration is read back from the table's own."""
        self._config = TableConfig._from_core(inner.config_json())
        self._inner = inner

    # -- copies -------------------------------------------------------------------

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled by value: the configuration and :meth:`state_dict` (rows,
        optimizer state, step, seed, the policies' touch metadata), so
        ``pickle``, ``copy.deepcopy`` and ``torch.save(model)`` give an
        independent table that trains on as this one would. Memory: as
        :meth:`state_dict` (a full copy); large tables are saved with
        :meth:`save` instead."""
        return (_restore_table, (self._config, self.state_dict()))

    def __deepcopy__(self, memo: dict[int, Any]) -> Table:
        import copy

        out = _restore_table(copy.deepcopy(self._config, memo), self.state_dict())
        memo[id(self)] = out
        return out

    # -- torch-style state dict ------------------------------------------------

    def state_dict(self, *, with_optimizer: bool = True) -> dict[str, npt.NDArray[Any]]:
        """The table as arrays, for ``torch.save(model.state_dict())`` (the
        embstore.torch modules put it in theirs): ``keys`` int64 ``(n,)``
        (ascending), ``rows`` float32 ``(n, dim)``, ``state`` float32 ``(n,
        state_len)`` (with ``with_optimizer`` and an optimizer), ``step`` and
        ``seed`` (int64 scalars; the seed's 64 bits). :meth:`load_state_dict`
        restores exactly this table: training on from it equals training on.

        Memory: a full copy, ``8 + 4 * (dim + state_len)`` bytes per row
        (for dim 64 and Adam, 520 bytes: 5 GB for 10M rows), held until the
        caller drops it, plus what torch.save writes. Tables that should not
        be copied whole into memory, or should be saved incrementally, use
        :meth:`save` / :meth:`load` (streamed, checksummed, crash-safe).
        A table with ``ttl_steps`` or ``capacity`` also gives each row's
        touch metadata, ``meta`` int64 ``(n, 3)`` (last touch's call tick,
        last touch's step, touch count), and the call ``clock`` (int64
        scalar), so LFU/LRU/TTL decisions after a load equal the original's.
        The admission sketch is not included (counts of unadmitted keys
        restart), as in checkpoints.
        """
        return table_state.state_dict(
            self._inner, self._config.optimizer is not None, with_optimizer
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the table's rows, optimizer state, step and seed with
        those of :meth:`state_dict` (without ``state``, rows get fresh
        optimizer state). The configuration (dim, optimizer, initializer,
        dtype, policies) stays this table's. Checked whole before anything
        changes; threads calling the table meanwhile see it before or after.
        """
        self._inner = table_state.load_state_dict(
            state,
            self.dim,
            self.state_len if self._config.optimizer is not None else None,
            self._native_table,
        )
        self._config = replace(self._config, seed=int(self._inner.seed))

    def prefetch(self, keys: Any) -> None:
        """Start reading the rows of ``keys`` that a disk table holds on
        disk into memory, in the background, and return at once (nothing
        for a table in memory): call it with the next batch's keys before
        the current step, so that the disk reads overlap the step. The
        rows stay in memory until the step after next has used them."""
        self._inner.prefetch(keys)

    def metrics(self) -> dict[str, TableFigures]:
        """This table's figures for :mod:`embstore.metrics`, read now."""
        return {"": table_figures(self.stats(), self._inner.lookup_latency())}

    def stats(self) -> dict[str, Any]:
        """Figures of the table.

        ``rows``; ``bytes`` (exact: index, keys, rows, state, per-row
        metadata, sketch, memory reserved by :meth:`reserve`, and the rows
        the last lookup found, kept for the gradient call on the same keys:
        16 bytes per id, for lookups of up to 2**22 ids); ``shard_rows``;
        ``step``; and counters since the table was built or loaded:
        ``lookups`` (ids looked up), ``hits``
        and ``misses`` (whether the id's key had a row before the call),
        ``inserts`` (rows created by any call), ``admitted`` (keys given a row
        by a gradient call), ``rejected`` (keys whose gradients the admission
        filter dropped, once per call), ``evicted`` (rows removed by TTL or
        capacity); ``sketch_bytes``; of ``bytes``, ``index_bytes`` (the key
        indexes), ``weights_bytes`` (the rows' weights as stored: for 8-bit
        rows their codes, scale and offset) and ``state_bytes`` (optimizer
        state), the rest each row's 8-byte tag, per-row metadata, the sketch
        and the kept rows; ``capacity``; ``capacity_bytes``;
        ``capacity_rows`` (the most rows kept under both, None: no bound);
        ``row_cost`` (the bytes a row counts for under ``capacity_bytes``);
        ``dtype``. A disk table adds ``memory_rows``, ``disk_rows``,
        ``disk_bytes`` (its files, dead records included),
        ``disk_index_bytes`` (memory of the index of the rows on disk),
        ``overall_hit_rate`` (ids whose rows were in memory over all ids its
        calls asked for), ``disk_rows_read``, ``disk_rows_written``,
        ``disk_rows_compacted`` (rows the background compaction moved),
        ``disk_spill_rounds`` (rounds of moving rows out of memory, run on
        the disk tier's thread after the call that went over the bound),
        ``disk_spill_rounds_on_calls`` (of those, the rounds the next call
        ran itself before it started, the tier's thread not having begun
        them) and ``disk_error`` (the last failure to move rows to disk or
        compact, which left them where they were; None). A disk table's
        figures are settled: a round still running is waited for.
        """
        return dict(self._inner.stats())
