"""``python -m embstore inspect PATH``: what a checkpoint holds and whether
every check a load makes holds (sizes, CRC-32C checksums, finite rows).

Exit code 0: the checkpoint is whole; 1: it is damaged (the report names
each damaged file); 2: PATH is not a checkpoint directory."""

from __future__ import annotations

import json
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
        text, files = _core.verify_checkpoint(a.path)
    except (CheckpointError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    m = json.loads(text)
    bad = [f for f in files if f[3] is not None]
    if a.json:
        out = {
            "manifest": m,
            "files": [
                {"name": n, "rows": r, "bytes": b, "ok": err is None, "error": err}
                for n, r, b, err in files
            ],
        }
        print(json.dumps(out, indent=2))
        return 1 if bad else 0
    opt = m["optimizer"]
    opt_text = (
        f"{opt['name']}({', '.join(f'{k}={v:g}' for k, v in opt['params'].items())})"
        if opt
        else "none"
    )
    print(f"format: {m['format']} version {m['version']} (id {m['id']})")
    print(f"dim: {m['dim']}  dtype: {m['dtype']}  rows: {m['rows']:,}  step: {m['step']}")
    print(
        f"optimizer: {opt_text}  state saved: {m['with_optimizer']} "
        f"({m['state_len']} floats/row: {', '.join(m['state_names']) or '-'})"
    )
    init = m["initializer"]
    print(
        f"initializer: {init['name']}({', '.join(f'{k}={v:g}' for k, v in init['params'].items())})"
        f"  seed: {m['seed']}  saved from {m['num_shards']} shards"
    )
    status = {n: err for n, _, _, err in files}
    for i, link in enumerate(m["chain"]):
        entries = [*link["files"], *([link["removed"]] if link["removed"] else [])]
        print(
            f"link {i} ({link['kind']}): {len(entries)} files, "
            f"{sum(e['bytes'] for e in entries):,} bytes"
        )
        for e in entries:
            err = status.get(e["name"])
            print(
                f"  {e['name']}  {e['rows']:>12,} rows  {e['bytes']:>14,} bytes  "
                f"crc32c {e['crc32c']:08x}  {'ok' if err is None else 'BAD: ' + err}"
            )
    print(f"checksums: {'all ok' if not bad else f'{len(bad)} of {len(files)} files damaged'}")
    return 1 if bad else 0
