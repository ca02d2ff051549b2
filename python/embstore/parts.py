"""Checkpoints written by many tables at once (the ranks of a
:class:`embstore.distributed.ShardedTable`): each writes its part's files,
one publishes them together; each rank loads the keys it owns. Methods of
every :class:`embstore.Table` (:class:`CheckpointParts`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self

from embstore import _core
from embstore._convert import check_bool, check_int
from embstore.config import TableConfig
from embstore.loading import check_agrees, load_settings

__all__ = ["CheckpointParts"]

_I64_MAX = 2**63 - 1


class CheckpointParts:
    """The checkpoint-by-part methods of a :class:`embstore.Table` (a
    mixin: ``_inner`` is the table's native table, ``_adopt`` makes a
    Table of a native one)."""

    _inner: _core.Table

    if TYPE_CHECKING:

        def _adopt(self, inner: _core.Table) -> None: ...

    def save_part(
        self, path: str | os.PathLike[str], part: str, *, with_optimizer: bool = True
    ) -> str:
        """Write this table's rows to files of the checkpoint directory
        ``path`` named after ``part`` (``"<checkpoint id>-<name>"``), without
        publishing them; returns what :meth:`publish_parts` takes. For a
        checkpoint written by many tables at once (the ranks of a
        ShardedTable)."""
        return self._inner.write_files(
            os.fspath(path), part, check_bool("with_optimizer", with_optimizer)
        )

    def publish_parts(
        self,
        path: str | os.PathLike[str],
        checkpoint_id: str,
        parts: list[str],
        rows: int,
        *,
        with_optimizer: bool = True,
        partition: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Publish one checkpoint at ``path`` made of the ``parts`` that
        :meth:`save_part` wrote (``rows`` rows in all), described by this
        table's configuration and step, and with ``partition`` (a
        :class:`embstore.distributed.Partition`'s ``to_record()``) by how
        the parts' tables spread their keys; returns its manifest."""
        text = self._inner.publish_parts(
            os.fspath(path),
            checkpoint_id,
            list(parts),
            check_int("rows", rows, 0, _I64_MAX),
            check_bool("with_optimizer", with_optimizer),
            None if partition is None else json.dumps(dict(partition)),
        )
        manifest: dict[str, Any] = json.loads(text)
        return manifest

    def new_checkpoint_id(self) -> str:
        """A fresh checkpoint id, for the parts of one checkpoint that
        :meth:`save_part` writes (``"<checkpoint id>-<name>"``)."""
        return _core.new_checkpoint_id()

    def remove_part(self, path: str | os.PathLike[str], part: str) -> None:
        """Delete the files that :meth:`save_part` wrote for ``part`` at
        ``path`` and no published manifest names (a checkpoint that was not
        published); files a manifest names stay."""
        _core.remove_unpublished(os.fspath(path), part)

    @staticmethod
    def hold_checkpoint(path: str | os.PathLike[str]) -> _core.DirectoryHold:
        """Hold the readers' lock of the checkpoint directory ``path`` until
        ``release()``: while any process holds it, a save publishing there
        deletes none of the files of the checkpoint read before, so several
        processes can load one checkpoint (from
        :meth:`checkpoint_manifest` read once) while another saves."""
        return _core.hold_directory(os.fspath(path))

    @staticmethod
    def checkpoint_manifest(path: str | os.PathLike[str]) -> str:
        """The manifest text of the checkpoint at ``path``, checked (format,
        version, its own checksum), for :meth:`load_owned` in several
        processes that must load the same checkpoint."""
        return _core.checkpoint_manifest_text(os.fspath(path))

    @classmethod
    def load_owned(
        cls,
        path: str | os.PathLike[str],
        *,
        ranks: int,
        rank: int,
        partition: str = "hash",
        key_space: int | None = None,
        num_shards: int | None = None,
        manifest: str | None = None,
        disk: str | os.PathLike[str] | None = None,
        memory_bytes: int | None = None,
        buckets: list[int] | None = None,
        config: TableConfig | None = None,
        dtype: str | None = None,
    ) -> Self:
        """Load the rows of the checkpoint at ``path`` whose keys rank
        ``rank`` of ``ranks`` owns under ``partition`` (see
        :func:`embstore.ops.partition_owners`; "bucket" with ``buckets``,
        each bucket's rank) into a new Table, as
        :meth:`load` loads them all; ``manifest``: the text of
        :meth:`checkpoint_manifest` to load (else read now); ``disk`` and
        ``memory_bytes``: as a disk table, ``dtype``, ``config``: as
        :meth:`load` takes them."""
        inner = _core.load_table_owned(
            os.fspath(path),
            check_int("ranks", ranks, 1, 1 << 30),
            check_int("rank", rank, 0, ranks - 1),
            load_settings(
                config, num_shards=num_shards, disk=disk, memory_bytes=memory_bytes, dtype=dtype
            ),
            partition,
            key_space,
            buckets,
            manifest,
        )
        table = cls.__new__(cls)
        table._adopt(inner)
        check_agrees(config, TableConfig._from_core(inner.config_json()), os.fspath(path))
        return table
