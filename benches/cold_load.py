"""A cold ``Table.load`` against ``cat`` of the same files.

    python benches/cold_load.py [--rows 8000000] [--dir DIR] [--rounds 2]

An Adam table of ``--rows`` rows of dim 64 (8M rows: about 6 GiB with its
state) is saved under ``--dir`` (kept there, and reused by a later run);
then, ``--rounds`` times in turn, the page cache is dropped (``sync``, then
``/proc/sys/vm/drop_caches``: run as root) and the files are read with
``cat`` to /dev/null, and the page cache is dropped again and the
checkpoint loaded with ``Table.load``. Prints JSON: both times each round,
their rates, and the ratio of the best load to the best ``cat``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

import numpy as np

import embstore
from embstore import optim


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8_000_000)
    p.add_argument("--dir", default="/tmp/embstore-cold-load")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        print("cold_load.py: /proc/sys/vm/drop_caches is not writable (run as root)")
        return 2
    os.makedirs(args.dir, exist_ok=True)
    ck = os.path.join(args.dir, "ck")
    if not glob.glob(os.path.join(ck, "*")):
        t = embstore.Table(64, optimizer=optim.Adam(lr=1e-3), seed=1)
        for lo in range(0, args.rows, 1_000_000):
            k = np.arange(lo, min(args.rows, lo + 1_000_000))
            t.lookup(k)
            t.apply_gradients(k, np.full((k.size, 64), 1e-3, np.float32))
        t.save(ck, progress=False)
        del t
    files = sorted(f for f in glob.glob(ck + "/**", recursive=True) if os.path.isfile(f))
    size = sum(os.path.getsize(f) for f in files)
    res: dict = {"bytes": size, "files": len(files), "cat_s": [], "load_s": []}
    for _ in range(args.rounds):
        drop_page_cache()
        t0 = time.perf_counter()
        with open(os.devnull, "wb") as null:
            subprocess.run(["cat", *files], stdout=null, check=True)
        res["cat_s"].append(time.perf_counter() - t0)
        drop_page_cache()
        t0 = time.perf_counter()
        t = embstore.Table.load(ck, progress=False)
        res["load_s"].append(time.perf_counter() - t0)
        res["rows"] = len(t)
        del t
    res["cat_MBps"] = [size / s / 1e6 for s in res["cat_s"]]
    res["load_MBps"] = [size / s / 1e6 for s in res["load_s"]]
    res["ratio_load_to_cat"] = min(res["load_s"]) / min(res["cat_s"])
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
