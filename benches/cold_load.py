"""A cold ``Table.load`` against ``cat`` of the same files.

    python benches/cold_load.py [--rows 8000000] [--dir DIR] [--rounds 2]
        [--baseline DIR] [--no-prime]

An Adam table of ``--rows`` rows of dim 64 (8M rows: about 6 GiB with its
state) is saved under ``--dir`` (kept there, and reused by a later run);
then, ``--rounds`` times in turn, the page cache is dropped (``sync``, then
``/proc/sys/vm/drop_caches``: run as root) and the files are read with
``cat`` to /dev/null, and the page cache is dropped again and the
checkpoint loaded with ``Table.load`` in a fresh process (and, with
``--baseline DIR``, by the embstore installed at DIR, its directory put on
``PYTHONPATH``, in the same turn). Before each load a process touches and
frees memory of the checkpoint's size: on a VM the first touch of memory
the guest has never used (or gave back) costs the host's fault as well,
which a load pays for every page of its table and ``cat`` for none (on
machine E an 8M-row load took 7.1-8.7 s on such memory and 3.9 s after a
touch); ``--no-prime`` leaves it out. Prints JSON: every time, their rates,
and the ratio of the best load to the best ``cat``, and each load's user and
system CPU seconds.
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


def touch_and_free(nbytes: int) -> None:
    """A process that writes ``nbytes`` of fresh memory and exits."""
    code = f"import numpy as np; np.ones({nbytes} // 8, dtype=np.float64)"
    subprocess.run([sys.executable, "-c", code], check=True)


def load_in_child(ck: str, site: str | None) -> tuple[float, int, float, float]:
    """Seconds a fresh process takes to ``Table.load`` the checkpoint, its
    rows, and the load's user and system CPU seconds (all threads);
    ``site``: another embstore's directory, first on the path."""
    code = (
        "import resource, time, embstore\n"
        "r0 = resource.getrusage(resource.RUSAGE_SELF)\n"
        "t0 = time.perf_counter()\n"
        f"t = embstore.Table.load({ck!r}, progress=False)\n"
        "dt = time.perf_counter() - t0\n"
        "r1 = resource.getrusage(resource.RUSAGE_SELF)\n"
        "print(dt, len(t), r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime)\n"
    )
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    )
    seconds, rows, user, system = out.stdout.split()
    return float(seconds), int(rows), float(user), float(system)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8_000_000)
    p.add_argument("--dir", default="/tmp/embstore-cold-load")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--baseline", help="another embstore install's directory, loaded in turn")
    p.add_argument(
        "--no-prime",
        dest="prime",
        action="store_false",
        help="load onto memory the guest may never have used (see the module docs)",
    )
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
    res: dict = {"bytes": size, "files": len(files), "primed": args.prime}
    res.update(cat_s=[], load_s=[])
    if args.baseline:
        res["baseline_load_s"] = []
    for _ in range(args.rounds):
        drop_page_cache()
        t0 = time.perf_counter()
        with open(os.devnull, "wb") as null:
            subprocess.run(["cat", *files], stdout=null, check=True)
        res["cat_s"].append(time.perf_counter() - t0)
        builds: list[tuple[str, str | None]] = [("load_s", None)]
        if args.baseline:
            builds.append(("baseline_load_s", args.baseline))
        for key, site in builds:
            drop_page_cache()
            if args.prime:
                touch_and_free(size)
            seconds, rows, user, system = load_in_child(ck, site)
            res[key].append(seconds)
            res.setdefault(key.replace("_s", "_cpu_user_s"), []).append(user)
            res.setdefault(key.replace("_s", "_cpu_sys_s"), []).append(system)
            res["rows"] = rows
    res["cat_MBps"] = [size / s / 1e6 for s in res["cat_s"]]
    res["load_MBps"] = [size / s / 1e6 for s in res["load_s"]]
    res["ratio_load_to_cat"] = min(res["load_s"]) / min(res["cat_s"])
    if args.baseline:
        res["baseline_ratio_load_to_cat"] = min(res["baseline_load_s"]) / min(res["cat_s"])
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
