"""A read-only table served from a checkpoint's files mapped into memory:
``Table.load(path, mmap=True)``.

Opening reads the manifest and each file's header, no rows: any number of
processes that open one checkpoint share one copy of its rows in the page
cache, and a checkpoint larger than memory is served page by page. Each
shard file carries its own hash index (written by ``save``), so no process
builds an index. A file's CRC-32C is checked once, by the first call that
reads from it; until it passes no row of it is served, and a damaged file
is refused (:class:`embstore.CheckpointError`) on every call.

Live updates: ``refresh()`` serves what a trainer published at the path
since (an incremental save maps its delta's files only; a new full save
becomes the new base), checking the new files' checksums first and then
swapping the new version in at once, so a lookup reads the old version or
the new, never a mix. ``follow=seconds`` refreshes in a background thread,
so that a publish is served within about that many seconds.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NoReturn, overload

import numpy as np
import numpy.typing as npt

from embstore import _core, ops
from embstore._convert import (
    _NDARRAY,
    Default,
    as_bags,
    as_keys,
    check_bool,
    check_default,
    check_real,
    like,
)
from embstore.exceptions import ReadOnlyError
from embstore.protocol import TableFigures

if TYPE_CHECKING:
    import torch


def _manifest_stamp(path: str) -> tuple[int, int, int] | None:
    """What changes when a save publishes at ``path``: the manifest's inode,
    mtime and size (a publish renames a new manifest over the old)."""
    try:
        st = os.stat(os.path.join(path, "manifest.json"))
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _follow(ref: weakref.ref[MappedTable], every: float, stop: threading.Event) -> None:
    """The background refresh of ``MappedTable(follow=every)``: looks at the
    manifest (one stat) four times every ``every`` seconds and refreshes
    when it changed, and at least once every ``every`` seconds, so a publish
    is served within about ``every`` seconds; runs until the table is closed
    or collected (it holds the table only while it refreshes). A refresh
    waits at most ``every`` seconds for the directory's readers' lock; one
    that cannot get it (another process holds it) is reported in
    ``follow_error`` and tried again."""
    table = ref()
    if table is None:
        return
    path = table.path
    del table
    seen = _manifest_stamp(path)
    since = 0.0
    while not stop.wait(every / 4):
        since += every / 4
        now = _manifest_stamp(path)
        if now == seen and since < every:
            continue
        table = ref()
        if table is None:
            return
        try:
            table._inner.refresh(every)
            table._follow_error = None
            seen = now
        except Exception as e:  # kept for the owner: the next round tries again
            table._follow_error = e
        since = 0.0
        del table


# Every table that follows, so that a forked child restarts their threads
# (a child has only the thread that forked: without this, a follower
# inherited through fork would serve the fork-time version forever).
_FOLLOWERS: weakref.WeakSet[MappedTable] = weakref.WeakSet()


def _restart_followers() -> None:
    """In a forked child: a new follow thread for every table that was
    following in the parent."""
    for table in list(_FOLLOWERS):
        if table._follow is not None and not table._stop.is_set():
            table._start_follow()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_restart_followers)


def _reopen(path: str, follow: float | None, warm: bool = False) -> MappedTable:
    """A MappedTable unpickled: the checkpoint at ``path`` mapped again."""
    return MappedTable(path, follow=follow, warm=warm)


def _refused(name: str) -> Callable[..., NoReturn]:
    """A method of MappedTable that changes rows: refused, naming itself."""

    def refuse(self: MappedTable, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse(name)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = "Refused: the table is read-only (:class:`embstore.ReadOnlyError`)."
    return refuse


class MappedTable:
    """A read-only table over the checkpoint at ``path`` (see the module
    docs). Reads as :class:`embstore.Table` reads (``lookup`` with
    ``insert=False``, ``return_found``, ``lookup_pooled``, ``contains``,
    ``export``); every call that would change a row raises
    :class:`embstore.ReadOnlyError` and changes nothing.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, follow: float | None = None, warm: bool = False
    ) -> None:
        warm = check_bool("warm", warm)
        every = None
        if follow is not None:
            every = check_real("follow", follow)
            if not (math.isfinite(every) and every > 0):
                raise ValueError(f"follow: expected a number of seconds > 0, got {follow!r}")
        self._inner = _core.MappedTable(os.fspath(path))
        # Resolved once, at open (absolute): a refresh, the follow thread
        # and a pickled copy read this directory, whatever the working
        # directory is later.
        self._path = os.fspath(self._inner.path)
        self._warm = warm
        if warm:
            # Refreshes warm their new files before serving them; the
            # version opened is warmed now.
            self._inner.set_warm(True)
            self._inner.warm()
        self._follow = every
        self._follow_error: Exception | None = None
        self._stop = threading.Event()
        if every is not None:
            self._start_follow()
            _FOLLOWERS.add(self)

    def _start_follow(self) -> None:
        """Starts the follow thread (at open, and in a forked child)."""
        assert self._follow is not None
        # A fresh event: in a forked child, the parent's may be mid-wait by
        # a thread that does not exist here.
        self._stop = threading.Event()
        threading.Thread(
            target=_follow,
            args=(weakref.ref(self), self._follow, self._stop),
            name=f"embstore-follow {self._path}",
            daemon=True,
        ).start()

    def refresh(self) -> bool:
        """Serve what was published at the path since this table was opened
        or last refreshed (see the module docs); returns whether anything
        was. A damaged publish raises :class:`embstore.CheckpointError` and
        the table goes on serving the version it served; so does a
        directory whose readers' lock another process holds for over 10 s.
        With nothing published (the manifest reads as before) it returns
        False at once and takes no lock."""
        return bool(self._inner.refresh())

    def warm(self) -> dict[str, Any]:
        """Read every file of the version served into memory now, in 2 MiB
        pages where the kernel can give them, so that lookups spread over a
        large table do not miss the TLB on every row. A file the page cache
        holds in 4 KiB pages (a checkpoint copied onto the host by ``cp``,
        ``shutil.copytree`` or a download tool is cached so) is dropped from
        the page cache, where no other process maps it, and read again:
        2,000-key lookups of a 10M-row dim-64 copy took about 1.5x as long
        before (benches/RESULTS.md). Files warmed before are skipped; with
        ``MappedTable(path, warm=True)`` the files are warmed at open and
        every refresh warms the files it maps before it serves them. It
        reads the whole table: for tables that fit in memory.

        Returns ``files`` and ``bytes`` read in now, ``recached_files`` and
        ``recached_bytes`` (those found in small pages and read again), and
        ``huge_page_bytes`` (of the files read in now, the bytes this
        process maps with 2 MiB pages; None where the kernel does not say).
        """
        return dict(self._inner.warm())

    @property
    def version(self) -> int:
        """Versions swapped in by refreshes (background ones included)
        since open: 0 at open, raised before a refresh that served a new
        publish returns. A cache of this table's rows (:class:`embstore.gpu.ServingCache`)
        reads it at the start of a call: unchanged, its rows are current."""
        return int(self._inner.version)

    def metrics(self) -> dict[str, TableFigures]:
        """This table's figures for :mod:`embstore.metrics`, read now: its
        lookups, rows, mapped and private bytes, the age of the version it
        serves, its last refresh and its lookup latency."""
        s = self.stats()
        figures = TableFigures(
            counters={"lookups": s["lookups"], "hits": s["hits"], "misses": s["misses"]},
            rows=int(s["rows"]),
            bytes={"mapped": int(s["mapped_bytes"]), "memory": int(s["bytes"])},
            snapshot_age_seconds=s["snapshot_age_seconds"],
            refresh_seconds=s["refresh_seconds"],
            latency=self._inner.lookup_latency(),
        )
        return {"": figures}

    def stats(self) -> dict[str, Any]:
        """The version served and the calls since open: ``rows``, ``dim``,
        ``dtype``, ``version``, ``lookups`` (keys looked up), ``hits`` (those
        that had a row), ``misses``, ``mapped_bytes`` (the files mapped,
        shared by every process that maps them), ``bytes`` (this process's
        own memory: the deltas' overlay, about 32 bytes a delta key),
        ``published`` (when the version served was published, seconds
        since the epoch: its manifest's modification time, or None),
        ``snapshot_age_seconds`` (now less ``published``: how stale what is
        served may be), ``refresh_seconds`` (what the last open or refresh
        that swapped a version in took) and ``follow``."""
        s = self._inner.stats()
        published = s["published"]
        return {
            "rows": s["rows"],
            "dim": self.dim,
            "dtype": self.dtype,
            "version": self.version,
            "lookups": s["lookups"],
            "hits": s["hits"],
            "misses": s["lookups"] - s["hits"],
            "mapped_bytes": s["mapped_bytes"],
            "bytes": s["overlay_bytes"],
            "published": published,
            "snapshot_age_seconds": None
            if published is None
            else max(time.time() - published, 0.0),
            "refresh_seconds": s["refresh_seconds"],
            "follow": self.follow,
        }

    @property
    def follow(self) -> float | None:
        """Seconds between background refreshes (None: not following)."""
        return None if self._stop.is_set() else self._follow

    @property
    def follow_error(self) -> Exception | None:
        """The error of the last background refresh, if it failed (the
        table serves the version it served before; the next refresh tries
        again)."""
        return self._follow_error

    def close(self) -> None:
        """Stop following (the table still serves the version it has)."""
        self._stop.set()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()

    @property
    def path(self) -> str:
        """The checkpoint directory."""
        return self._path

    @property
    def writable(self) -> bool:
        """Whether the table stores rows and takes steps: False, a mapped
        checkpoint is read-only (see :class:`embstore.protocol.ReadTier`)."""
        return False

    @property
    def dim(self) -> int:
        """Columns per row."""
        return int(self._inner.dim)

    @property
    def optimizer(self) -> None:
        """None: a mapped table takes no optimizer step."""
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (multiprocessing, copy.deepcopy) as its path: the copy
        # maps the same files, so processes share the rows.
        return (_reopen, (self._path, self.follow, self._warm))

    @property
    def dtype(self) -> str:
        """Row storage of the files ("float32", "float16", "bfloat16")."""
        return str(self._inner.dtype)

    @property
    def step(self) -> int:
        """Optimizer steps the saving table had taken."""
        return int(self._inner.step)

    def __len__(self) -> int:
        return len(self._inner)

    def __repr__(self) -> str:
        return f"MappedTable({self._path!r}, dim={self.dim}, rows={len(self)})"

    @overload
    def lookup(
        self,
        keys: Any,
        *,
        insert: bool = False,
        default: Default = "init",
        return_found: Literal[False] = ...,
    ) -> Any: ...
    @overload
    def lookup(
        self,
        keys: Any,
        *,
        insert: bool = False,
        default: Default = "init",
        return_found: Literal[True],
    ) -> tuple[Any, Any]: ...
    @overload
    def lookup(
        self,
        keys: Any,
        *,
        insert: bool = False,
        default: Default = "init",
        return_found: bool = ...,
    ) -> Any: ...
    def lookup(
        self,
        keys: Any,
        *,
        insert: bool = False,
        default: Default = "init",
        return_found: bool = False,
    ) -> Any:
        """Rows of ``keys (n,)`` as float32 ``(n, dim)`` (a tensor for CPU
        tensor keys); a key without a row reads as ``default`` ("init": the
        row the saving table's initializer gives it, "zeros", or a row).
        ``return_found=True`` returns ``(rows, found)``. ``insert=True``
        raises :class:`embstore.ReadOnlyError`."""
        if check_bool("insert", insert):
            self._refuse("lookup(insert=True)")
        with_found = check_bool("return_found", return_found)
        if type(default) is str:
            rows, found = self._inner.lookup(keys, default, None, with_found)
        else:
            rows, found = self._inner.lookup(keys, *check_default(default, self.dim), with_found)
        if type(keys) is not _NDARRAY:
            rows = like(keys, rows)
            found = None if found is None else like(keys, found)
        return (rows, found) if with_found else rows

    def lookup_pooled(
        self,
        ids: Any,
        offsets: Any,
        *,
        combiner: str = "sum",
        weights: Any = None,
        insert: bool = False,
        default: Default = "init",
    ) -> Any:
        """Pooled rows of bags, as :meth:`embstore.Table.lookup_pooled`
        (CSR ``ids`` and ``offsets``, ``combiner``, ``weights``): each
        distinct id's row read once, then pooled. ``insert=True`` raises
        :class:`embstore.ReadOnlyError`."""
        if check_bool("insert", insert):
            self._refuse("lookup_pooled(insert=True)")
        i, o, w, c = as_bags(ids, offsets, weights, combiner)
        uniq, inverse = ops.unique_inverse(i)
        rows = self.lookup(uniq, default=default)
        out = ops.pool_rows(rows, inverse, o, w, c)
        return out if type(ids) is _NDARRAY else like(ids, out)

    def export(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """Every row, keys ascending: ``(keys (n,), rows (n, dim))`` (reads,
        and checks, every file)."""
        keys, rows = self._inner.export()
        return keys, rows

    @overload
    def contains(self, keys: torch.Tensor) -> torch.Tensor: ...
    @overload
    def contains(self, keys: Any) -> npt.NDArray[np.bool_]: ...
    def contains(self, keys: Any) -> Any:
        """Whether each of ``keys (n,)`` has a row: bool ``(n,)``."""
        return like(keys, self._inner.contains(as_keys(keys)))

    # -- writes: refused ----------------------------------------------------------

    def _refuse(self, call: str) -> NoReturn:
        raise ReadOnlyError(
            f"{call}: this table is read-only (opened with mmap=True from {self._path!r}); "
            "load it with Table.load(path) to change rows"
        )

    assign = _refused("assign")
    apply_gradients = _refused("apply_gradients")
    apply_pooled_gradients = _refused("apply_pooled_gradients")
    remove = _refused("remove")
    reserve = _refused("reserve")
    evict = _refused("evict")
    load_state_dict = _refused("load_state_dict")
