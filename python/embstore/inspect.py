"""``python -m embstore inspect PATH``: what a checkpoint holds and whether
every check a load makes holds (sizes, CRC-32C checksums, finite rows).

Exit code 0: the checkpoint is whole; 1: it is damaged (the report names
each damaged file); 2: PATH is not a checkpoint directory."""

from __future__ import annotations

import os
import sys

from embstore import _core
from embstore._cli import Parser
from embstore.exceptions import CheckpointError


def main(argv: list[str] | None = None) -> int:
    p = Parser("python -m embstore inspect", __doc__)
    p.add_argument("path", help="checkpoint directory (as given to Table.save)")
    p.add_argument("--json", action="store_true", help="print the manifest and results as JSON")
    a = p.parse_args(argv)
    if not os.path.isdir(a.path):
        p.error(f"path: {a.path!r} is not a directory; expected a checkpoint directory")
    if not os.path.exists(os.path.join(a.path, "manifest.json")):
        p.error(f"path: {a.path!r} has no manifest.json; it is not an embstore checkpoint")
    try:
        text, as_json, whole = _core.checkpoint_report(a.path)
    except (CheckpointError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(as_json if a.json else text, end="" if not a.json else "\n")
    return 0 if whole else 1
