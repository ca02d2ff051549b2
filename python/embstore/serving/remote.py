"""Publishing to a URL: ``table.save(url, incremental=True)`` (and a
:class:`~embstore.serving.Publisher` given a URL) saves to a local staging
directory with the usual protocol, then copies to the URL through fsspec
in a save's order: the new files first (several at a time), the manifest
last (one write: an object store replaces it whole), then the files no
manifest names any longer are deleted. A replica polling the URL sees the
old version or the new, never a manifest naming a file not yet there.

The staging directory is ``$EMBSTORE_STAGING`` (else the system's
temporary directory) / ``embstore-publish-HASH``, one per URL: it keeps
the chain that makes the next save incremental, and it is a checkpoint
directory a replica or a reader can use too."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeGuard

from embstore import _core
from embstore._deps import require

__all__ = ["is_url", "staging_dir", "upload"]

#: The files a save writes (an id, then its shard and part numbers, or
#: ``removed``); only those are ever deleted at a URL.
_OURS = re.compile(r"[0-9a-f]{16}-[0-9a-z-]+\.safetensors")


def is_url(path: object) -> TypeGuard[str]:
    """Whether ``path`` names a location through fsspec (``s3://...``)
    rather than a local path (``file://`` is a local path)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def staging_dir(url: str) -> str:
    """The local directory a save to ``url`` is staged in."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    root = os.environ.get("EMBSTORE_STAGING") or tempfile.gettempdir()
    return os.path.join(root, f"embstore-publish-{digest}")


def upload(local: str, url: str, storage_options: dict[str, Any] | None = None) -> int:
    """Copies the checkpoint at ``local`` to ``url`` in a save's order (see
    the module); returns the bytes written."""
    fsspec = require("fsspec", "replicate")
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    root = root.rstrip("/")
    if getattr(fs, "protocol", None) in ("http", "https") or fs.protocol == ("http", "https"):
        raise ValueError(f"path: cannot write to {url!r}: HTTP is read-only in fsspec")
    with open(os.path.join(local, "manifest.json"), "rb") as f:
        text = f.read()
    files = _core.manifest_files(local, text)
    fs.makedirs(root, exist_ok=True)
    try:
        there = {os.path.basename(d["name"]): d.get("size") for d in fs.ls(root, detail=True)}
    except FileNotFoundError:
        there = {}
    todo = [(name, size) for name, size, _ in files if there.get(name) != size]

    def put(item: tuple[str, int]) -> int:
        fs.put_file(os.path.join(local, item[0]), f"{root}/{item[0]}")
        return item[1]

    with ThreadPoolExecutor(4) as pool:
        sent = sum(pool.map(put, todo))
    fs.pipe_file(f"{root}/manifest.json", text)
    named = {name for name, _, _ in files}
    stale = [f"{root}/{n}" for n in there if _OURS.fullmatch(n) and n not in named]
    if stale:
        fs.rm(stale)
    return sent + len(text)


def save_to_url(
    table: Any,
    url: str,
    incremental: bool,
    with_optimizer: bool,
    progress: bool | None,
    dtype: str | None,
) -> dict[str, Any]:
    """``table.save(url, ...)``: saved to the URL's staging directory, then
    uploaded. Returns the manifest."""
    local = staging_dir(url)
    os.makedirs(os.path.dirname(local), exist_ok=True)
    manifest: dict[str, Any] = table.save(
        local,
        incremental=incremental,
        with_optimizer=with_optimizer,
        progress=progress,
        dtype=dtype,
    )
    upload(local, url)
    return manifest
