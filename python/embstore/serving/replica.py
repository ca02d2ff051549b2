"""Serving hosts other than the trainer's: :class:`Replica` keeps a local
copy of a checkpoint directory that a trainer publishes to (a path, or a
URL through fsspec: ``http(s)://``, ``s3://``, ``gs://``, ``abfs://``,
``hdfs://`` with the matching fsspec package), and publishes each new
version locally with the same protocol as a save, so that
``MappedTable(LOCAL, follow=...)`` readers on that host serve whole
versions only. ``python -m embstore replicate SOURCE LOCAL`` runs one.

Each poll reads the source's manifest and checks it as a load does (its
checksum, its file names). A file the local copy lacks is fetched once,
streamed to ``LOCAL/.embstore-replica/NAME.part`` (several at a time),
its size and CRC-32C checked against the manifest before it takes its
name; a file that fails the check is fetched again, a fetch cut off
resumes where it stopped. When every file is there, the manifest is
published locally (``_core.publish_copied``: under the directory's
writers' lock, files synced, the manifest renamed over the old one), and
the files no manifest names any longer are deleted once no local reader
holds the directory. A replica that was cut off fetches only the newest
version (the ones it skipped are never served); a replicator killed
mid-fetch starts again where it was. A replica's directory is a
checkpoint directory like any other, so it can be the source of more
replicas (a tree of hosts).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from embstore import _core
from embstore._deps import require
from embstore.exceptions import CheckpointError
from embstore.protocol import TableFigures

__all__ = ["Replica", "ReplicaError", "open_source"]

#: Bytes a fetch reads and writes at a time.
PIECE = 4 << 20
#: The manifest is read bounded (the core refuses a larger one anyway).
MAX_MANIFEST = 64 << 20
#: Where a replica keeps its partial files and its lock, inside LOCAL.
STATE_DIR = ".embstore-replica"


class ReplicaError(CheckpointError):
    """A replica could not bring a version over (the source unreadable, a
    file that kept failing its check); the version served stays the one
    before."""


class _Gone(Exception):
    """A file the source's manifest named is no longer there: the source
    published again meanwhile; the next poll takes its newest manifest."""


def _open(path: str, write: bool = False) -> IO[bytes]:
    """A file of a directory another process hands us (a source, or the
    local copy someone else may write into), opened as the core opens a
    checkpoint's files: no link followed, never blocking (a FIFO), a
    regular file or an OSError; ``write``: created if missing, appended."""
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    flags |= os.O_WRONLY | os.O_CREAT | os.O_APPEND if write else os.O_RDONLY
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "ab" if write else "rb")
    except BaseException:
        os.close(fd)
        raise


class _Closed(Exception):
    """The replica was closed during a fetch (what arrived stays for the
    next replica of the directory to resume)."""


class _Source:
    """A checkpoint directory that a replica reads: a local path."""

    def __init__(self, root: str) -> None:
        self.root = root

    def __str__(self) -> str:
        return self.root

    def manifest(self) -> tuple[bytes, float | None]:
        """The manifest's bytes and, where known, when it was published
        (the source's modification time)."""
        with _open(os.path.join(self.root, "manifest.json")) as f:
            mtime = os.fstat(f.fileno()).st_mtime
            return f.read(MAX_MANIFEST + 1), mtime

    @contextlib.contextmanager
    def open(self, name: str, offset: int) -> Iterator[IO[bytes]]:
        """The file ``name`` (a plain name the core checked), read from
        ``offset``."""
        try:
            f = _open(os.path.join(self.root, name))
        except FileNotFoundError as e:
            raise _Gone(name) from e
        with f:
            f.seek(offset)
            yield f


class _FsspecSource(_Source):
    """A checkpoint directory behind a URL, read through fsspec."""

    def __init__(self, url: str, options: dict[str, Any], timeout: float) -> None:
        fsspec = require("fsspec", "replicate")
        protocol = url.split("://", 1)[0]
        if protocol in ("http", "https") and "client_kwargs" not in options:
            # A link that goes quiet must not hold a fetch for TCP's
            # minutes: each read waits at most ``timeout`` seconds.
            aiohttp = require("aiohttp", "replicate")
            options = {
                **options,
                "client_kwargs": {
                    "timeout": aiohttp.ClientTimeout(
                        total=None, sock_connect=timeout, sock_read=timeout
                    )
                },
            }
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        super().__init__(root.rstrip("/"))
        self.url = url
        self.http = protocol in ("http", "https")

    def __str__(self) -> str:
        return self.url

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def manifest(self) -> tuple[bytes, float | None]:
        with self.fs.open(self._path("manifest.json"), "rb", block_size=0) as f:
            data = f.read(MAX_MANIFEST + 1)
        mtime = None
        if not self.http:
            with contextlib.suppress(Exception):
                m = self.fs.modified(self._path("manifest.json"))
                mtime = m.timestamp()
        return data, mtime

    @contextlib.contextmanager
    def open(self, name: str, offset: int) -> Iterator[IO[bytes]]:
        try:
            if offset == 0:
                # Streamed in one request (an HTTP server need not serve ranges).
                f = self.fs.open(self._path(name), "rb", block_size=0)
            else:
                f = self.fs.open(self._path(name), "rb", block_size=PIECE)
        except FileNotFoundError as e:
            raise _Gone(name) from e
        with f:
            if offset:
                f.seek(offset)
            yield f


def open_source(
    source: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    timeout: float = 10.0,
) -> _Source:
    """The source a replica reads: a local directory (a path or
    ``file://``) or any fsspec URL."""
    text = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text:
        raise TypeError(f"source: expected a path or URL, got {source!r}")
    if "://" not in text:
        return _Source(text)
    if text.startswith("file://") and not storage_options:
        return _Source(text[len("file://") :])
    return _FsspecSource(text, dict(storage_options or {}), timeout)


class Replica:
    """A local copy of the checkpoint directory ``source`` at ``local``,
    brought up to date every ``period`` seconds by a background thread
    (``start=False``: only when :meth:`poll` is called); see the module's
    docstring. ``workers`` files are fetched at a time, each tried up to
    ``retries`` times in a poll; ``storage_options`` go to fsspec;
    ``timeout`` bounds each read of an HTTP source. One replica per
    ``local`` directory (a second one is refused). ``close()`` stops it;
    the directory and what it serves stay."""

    def __init__(
        self,
        source: str | os.PathLike[str],
        local: str | os.PathLike[str],
        *,
        period: float = 1.0,
        workers: int = 4,
        retries: int = 5,
        timeout: float = 10.0,
        storage_options: dict[str, Any] | None = None,
        start: bool = True,
    ) -> None:
        for name, v, low in (("period", period, 0.0), ("timeout", timeout, 0.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > low:
                raise ValueError(f"{name}: expected a number of seconds > 0, got {v!r}")
        for name, n in (("workers", workers), ("retries", retries)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {n!r}")
        self.source = open_source(source, storage_options, timeout)
        self.local = os.fspath(local)
        self.period, self.workers, self.retries = float(period), workers, retries
        self._state = os.path.join(self.local, STATE_DIR)
        os.makedirs(self._state, exist_ok=True)
        self._lock_file = _open(os.path.join(self._state, "lock"), write=True)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise ValueError(f"local: another replica keeps {self.local} up to date") from None
        self._mutex = threading.Lock()  # one poll at a time
        self._figures_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._seen: bytes | None = None  # the source manifest last published here
        self._verified: set[str] = set()  # local files known to match the source's
        self._stats: dict[str, Any] = {
            "version": None,
            "publishes": 0,
            "files_fetched": 0,
            "bytes_fetched": 0,
            "retries": 0,
            "errors": 0,
            "error": None,
            "lag_seconds": None,
            "lag_seconds_max": None,
            "last_publish": None,
            "fetch_seconds": None,
            "polls": 0,
        }
        self._adopt_local()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(
                target=self._run, name=f"replica {self.local}", daemon=True
            )
            self._thread.start()

    # -- the loop ---------------------------------------------------------

    def _adopt_local(self) -> None:
        """Takes what ``local`` already serves (a restart): its files were
        checked before its manifest named them."""
        try:
            with _open(os.path.join(self.local, "manifest.json")) as f:
                text = f.read(MAX_MANIFEST + 1)
            files = _core.manifest_files(self.local, text)
        except (OSError, CheckpointError):
            return
        self._verified = {name for name, _, _ in files}
        self._stats["version"] = _version(text)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # reported in stats()["error"]
                self.poll()
            self._wake.wait(self.period)
            self._wake.clear()

    def notify(self) -> None:
        """Polls now (a publisher that tells the replica of a publish)."""
        self._wake.set()

    def poll(self) -> bool:
        """Reads the source's manifest and, if it names a version not
        served here, brings that version over and publishes it locally.
        Returns whether it published. Raises :class:`ReplicaError` when the
        version could not be brought over (also kept in
        ``stats()["error"]``; the version served stays the one before)."""
        with self._mutex:
            self._count("polls")
            try:
                published = self._poll()
            except ReplicaError as e:
                with self._figures_lock:
                    self._stats["errors"] += 1
                    self._stats["error"] = str(e)
                raise
            with self._figures_lock:
                self._stats["error"] = None
            return published

    def _poll(self) -> bool:
        seen = time.time()
        try:
            text, mtime = self.source.manifest()
        except Exception as e:
            raise ReplicaError(f"cannot read the manifest of {self.source}: {e}") from e
        if text == self._seen:
            return False
        try:
            files = _core.manifest_files(str(self.source), text)
        except CheckpointError as e:
            raise ReplicaError(f"the manifest of {self.source} does not hold: {e}") from e
        if _version(text) == self._stats["version"] and all(
            name in self._verified for name, _, _ in files
        ):
            self._seen = text
            return False
        wanted = {name for name, _, _ in files}
        self._drop_partials(wanted)
        missing = [f for f in files if not self._have(*f)]
        if missing:
            with ThreadPoolExecutor(min(self.workers, len(missing))) as pool:
                results = list(pool.map(lambda f: self._fetch_quietly(*f), missing))
            failed = [r for r in results if r is not None]
            if failed:
                gone = [r for r in failed if isinstance(r, _Gone)]
                if gone and len(gone) == len(failed):
                    # Published over meanwhile: the next poll takes the newest.
                    self._wake.set()
                    return False
                raise ReplicaError(
                    f"{len(failed)} of {len(missing)} files of {self.source} could not be "
                    f"fetched: {failed[0]}"
                )
        try:
            _core.publish_copied(self.local, text)
        except CheckpointError as e:
            raise ReplicaError(f"cannot publish at {self.local}: {e}") from e
        now = time.time()
        self._seen = text
        with self._figures_lock:
            s = self._stats
            s["version"] = _version(text)
            s["publishes"] += 1
            s["last_publish"] = now
            s["fetch_seconds"] = now - seen
            if mtime is not None:
                lag = max(0.0, now - mtime)
                s["lag_seconds"] = lag
                s["lag_seconds_max"] = max(lag, s["lag_seconds_max"] or 0.0)
        self._verified &= wanted
        return True

    def _have(self, name: str, size: int, crc: int) -> bool:
        """Whether ``local`` holds the file ``name`` as the manifest
        records it (checked once: a file left by a replica killed after
        it was fetched, or by the trainer itself on a shared disk)."""
        if name in self._verified:
            return True
        path = os.path.join(self.local, name)
        try:
            if os.lstat(path).st_size != size or _file_crc(path, size) != crc:
                return False
        except OSError:
            return False
        self._verified.add(name)
        return True

    def _drop_partials(self, wanted: set[str]) -> None:
        """Deletes partial files of files the source no longer names."""
        with contextlib.suppress(OSError):
            for entry in os.scandir(self._state):
                if entry.name.endswith(".part") and entry.name[:-5] not in wanted:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)

    def _fetch_quietly(self, name: str, size: int, crc: int) -> Exception | None:
        try:
            self._fetch(name, size, crc)
        except Exception as e:
            return e
        return None

    def _fetch(self, name: str, size: int, crc: int) -> None:
        """Brings ``name`` over into ``local``: streamed into its partial
        file (resumed from what an earlier try left), checked, renamed."""
        part = os.path.join(self._state, name + ".part")
        error: Exception | None = None
        for attempt in range(self.retries):
            if self._stop.is_set():
                raise ReplicaError("the replica was closed")
            if attempt:
                self._count("retries")
                time.sleep(min(2.0, 0.05 * 2**attempt))
            try:
                st = os.lstat(part)
                have = st.st_size
                if not stat.S_ISREG(st.st_mode):  # not ours: never written through
                    os.unlink(part)
                    have = 0
            except OSError:
                have = 0
            value = 0
            if have > size:
                os.unlink(part)
                have = 0
            elif have:
                value = _file_crc(part, have)
            start = have
            try:
                with _open(part, write=True) as out, self.source.open(name, have) as src:
                    while have < size:
                        if self._stop.is_set():
                            raise _Closed(name)
                        piece = src.read(min(PIECE, size - have))
                        if not piece:
                            break
                        out.write(piece)
                        value = _core.crc32c(piece, value)
                        have += len(piece)
                        self._count("bytes_fetched", len(piece))
                    extra = src.read(1) if have == size else b""
                    if have == size and not extra and value == crc:
                        # Synced now, beside the other fetches, so that the
                        # publish's own sync finds nothing left to write.
                        out.flush()
                        os.fsync(out.fileno())
            except _Gone:
                with contextlib.suppress(OSError):
                    os.unlink(part)
                raise
            except _Closed:
                raise ReplicaError("the replica was closed") from None
            except Exception as e:  # a cut: resume from what arrived
                error = e
                if have == start and start:
                    # A resume that got nothing: perhaps the source serves
                    # no byte ranges; the next try starts from the start.
                    with contextlib.suppress(OSError):
                        os.unlink(part)
                continue
            if have != size or extra or value != crc:
                error = ReplicaError(
                    f"{name}: fetched {have + len(extra)} bytes with CRC-32C {value:08x}, "
                    f"the manifest says {size} bytes, {crc:08x}"
                )
                os.unlink(part)
                continue
            os.replace(part, os.path.join(self.local, name))
            self._verified.add(name)
            self._count("files_fetched")
            return
        raise ReplicaError(f"{name}: {self.retries} tries failed, the last: {error}")

    def _count(self, key: str, n: int = 1) -> None:
        with self._figures_lock:
            self._stats[key] += n

    # -- the rest ---------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What the replica has done: ``version`` (the checksum of the
        manifest served here), ``publishes``, ``files_fetched``,
        ``bytes_fetched``, ``retries`` (tries after a failed or damaged
        fetch), ``errors`` (polls that failed), ``error`` (the last poll's
        error, None once one succeeds), ``lag_seconds`` (the last
        publish's: from the source's manifest being written to its
        publish here, where the source tells when: a path or an object
        store, not HTTP) and ``lag_seconds_max``, ``fetch_seconds`` (the
        last publish's: from the poll that found its manifest to its
        publish here), ``last_publish`` (a time.time()), ``polls``."""
        with self._figures_lock:
            return dict(self._stats)

    def metrics(self) -> dict[str, TableFigures]:
        """The replica's figures for :mod:`embstore.metrics`."""
        s = self.stats()
        return {
            "": TableFigures(
                counters={
                    "replica_fetched_bytes": s["bytes_fetched"],
                    "replica_fetched_files": s["files_fetched"],
                    "replica_retries": s["retries"],
                    "replica_errors": s["errors"],
                    "replica_publishes": s["publishes"],
                },
                lag_seconds=s["lag_seconds"],
            )
        }

    def close(self) -> None:
        """Stops the replica (after the poll under way)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        with self._mutex:
            if not self._lock_file.closed:
                self._lock_file.close()

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Replica({str(self.source)!r}, {self.local!r}, period={self.period})"


def _version(text: bytes) -> int | None:
    """The checksum a manifest records: what names its version."""
    import json

    try:
        value = json.loads(text).get("checksum")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def _file_crc(path: str, size: int) -> int:
    """The CRC-32C of the first ``size`` bytes of the local file ``path``."""
    value, left = 0, size
    with _open(path) as f:
        while left:
            piece = f.read(min(PIECE, left))
            if not piece:
                break
            value = _core.crc32c(piece, value)
            left -= len(piece)
    return value
