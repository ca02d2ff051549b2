"""Crafting checkpoints for the tests that feed the loader damaged or hostile
directories: the format's CRC-32C written from its definition, a manifest
rewritten with a valid checksum, a small saved table, and a load in a child
process that must refuse."""

from __future__ import annotations

import json
import pathlib

import numpy as np

import embstore
from embstore import optim

from . import _child


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as the checkpoint format uses: written here from
    its definition, so crafted files carry valid checksums."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def rewrite_manifest(path: pathlib.Path, edit: object) -> None:
    """Applies ``edit(manifest)`` and writes the manifest back with a valid
    checksum (the canonical JSON: sorted keys, compact, checksum null)."""
    m = json.loads((path / "manifest.json").read_text())
    edit(m)  # type: ignore[operator]
    m["checksum"] = None
    canon = json.dumps(m, sort_keys=True, separators=(",", ":"))
    m["checksum"] = crc32c(canon.encode())
    (path / "manifest.json").write_text(json.dumps(m))


def saved_sgd_table(path: pathlib.Path, n: int = 200) -> embstore.Table:
    # SGD(lr=0.5) and Uniform(-0.05, 0.05): parameters whose JSON spelling is
    # the same in Python and in the native writer (so crafted checksums match).
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.5), num_shards=2)
    t.lookup(np.arange(n))
    t.save(path)
    return t


def load_refusal(path: pathlib.Path, memory: int | None) -> str:
    """Loads ``path`` in a child (with at most ``memory`` more bytes of
    address space); returns the CheckpointError's message, which it must raise."""
    limit = "" if memory is None else f"limit_memory({memory})"
    out = _child.ok(
        f"""
        {limit}
        try:
            embstore.Table.load({str(path)!r})
        except embstore.CheckpointError as e:
            print("refused:", e)
        """,
        timeout=60,
    )
    assert "refused:" in out, out
    return out
