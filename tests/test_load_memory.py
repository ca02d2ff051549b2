"""Loading a checkpoint leaves no read buffer resident: the buffers a load
reads its files into (up to 256 MiB each, one per pool thread) are kept
from file to file while the load runs and freed when it ends. Measured in a
fresh process: resident memory after the load against the table's own
``stats()["bytes"]``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

import embstore

CHILD = """
import json, sys, numpy as np, embstore

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

before = rss()
t = embstore.Table.load(sys.argv[1])
after = rss()
print(json.dumps({"grown": after - before, "bytes": t.stats()["bytes"], "rows": len(t)}))
"""


def test_a_load_leaves_no_read_buffer_resident(tmp_path: Path) -> None:
    """A 1M-row dim-64 table (8 files of about 34 MB) loads in a fresh
    process whose resident memory then grows by the table's bytes and
    little more (the buffers kept on each pool thread for good held one
    file each, about 34 MB a thread, 20% of the table here)."""
    rows, dim = 1_000_000, 64
    t = embstore.Table(dim, seed=3)
    keys = np.arange(rows, dtype=np.int64) * 7
    t.assign(keys, np.ones((rows, dim), np.float32))
    t.save(tmp_path, with_optimizer=False)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(out.stdout)
    assert got["rows"] == rows
    extra = got["grown"] - got["bytes"]
    assert extra < 0.08 * got["bytes"], (
        f"resident memory grew {got['grown']:,} bytes for a table of {got['bytes']:,}"
    )
