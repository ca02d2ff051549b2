"""Serving across hosts: a trainer publishes, replicas on other hosts serve.

Hosts are network namespaces joined by rate-limited links
(``scripts/netlab.py``; root only): each replica host's at ``--rate``, the
trainer host's at ``--source-rate`` (it sends each publish to every host
at once; a slower one is what a tree of replicas is for: a replica's
directory can be the source of others). Host 0 is the trainer's: it publishes
a ``rows x dim`` float32 table (rows only, as for serving) to a directory
served over HTTP by a plain server with byte ranges (port 8000) and by a
mirror that, while armed, flips a byte in each new file's first response
(port 8001). Each of ``--hosts`` replica hosts runs ``python -m embstore
replicate http://trainer:PORT LOCAL`` (host 1 through the mirror) and a
reader, ``MappedTable(LOCAL, follow=...)``, that looks up 64 probe keys
every few milliseconds: each publish sets every probe row to the publish's
number, so a lookup that returns two numbers would have served two
versions at once, and the first lookup that returns publish v is when v
was served there.

Six publishes: a full save; two deltas with the last host's link cut
across both (restored after the second); a delta through the armed
mirror; a chain rewrite (a full save) with host 2's replicator killed
mid-fetch and restarted at once; a delta. ``--tree``: hosts 2.. replicate
from host 1's copy (served over HTTP there), so the trainer's link carries
each publish once. Each publish's lag on each host
(save returned -> first served) is printed against its bound: its new
bytes at the link's rate + 1 s (the cut host: the bytes it missed, from
the link's return; the killed one: + 3 s). Then the bytes each link
carried against the bytes published, each replica directory's peak
against the trainer's, and whether every host's final rows equal the
trainer's.

    python benches/replicate.py [--rows 1000000] [--dim 64] [--hosts 3] [--rate 1gbit]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import netlab  # noqa: E402

import embstore  # noqa: E402

PROBES = np.arange(0, 64 * 9973, 9973, dtype=np.int64)

READER = r"""
import os, sys, time
import numpy as np
import embstore
local, stop = sys.argv[1], sys.argv[2]
probes = np.arange(0, 64 * 9973, 9973, dtype=np.int64)
while not os.path.exists(os.path.join(local, "manifest.json")):
    time.sleep(0.005)
m = embstore.Table.load(local, mmap=True, follow=0.02)
seen = None
while not os.path.exists(stop):
    rows = m.lookup(probes)
    values = np.unique(rows)
    if len(values) != 1:
        print("MIXED", values.tolist(), flush=True)
    elif values[0] != seen:
        seen = values[0]
        print("SERVED", int(seen), time.time(), flush=True)
    time.sleep(0.002)
"""


def _named(path: str) -> dict[str, int]:
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        return {n: b for n, b, _ in embstore._core.manifest_files(path, f.read())}


def _dir_bytes(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(base, f)).st_size
    return total


class _Reader:
    """Follows one reader process's lines: when each publish was served."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.served: dict[int, float] = {}
        self.mixed: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            if parts and parts[0] == "SERVED":
                self.served.setdefault(int(parts[1]), float(parts[2]))
            elif parts and parts[0] == "MIXED":
                self.mixed.append(line.strip())


def run(
    rows: int,
    dim: int,
    hosts: int,
    rate: str,
    source_rate: str,
    workdir: str,
    tree: bool = False,
) -> dict[str, Any]:
    rate_b = netlab.rate_bytes(rate)
    src = os.path.join(workdir, "trainer")
    stop = os.path.join(workdir, "stop")
    armed = os.path.join(workdir, "armed")
    locals_ = [os.path.join(workdir, f"host{i}") for i in range(1, hosts + 1)]
    rng = np.random.default_rng(0)
    t = embstore.Table(dim, seed=1)
    keys = np.arange(rows, dtype=np.int64)
    for lo in range(0, rows, 1 << 17):
        k = keys[lo : lo + (1 << 17)]
        t.assign(k, rng.standard_normal((len(k), dim), dtype=np.float32))
    out: dict[str, Any] = {
        "rows": rows,
        "dim": dim,
        "hosts": hosts,
        "rate": rate,
        "source_rate": source_rate,
        "tree": tree,
        "publishes": [],
    }
    with netlab.Hosts(hosts + 1, rate, {0: source_rate}) as net:
        py = sys.executable
        serve = [py, os.path.join(ROOT, "tests", "_http_source.py"), src]
        os.makedirs(src)
        net.run(0, [*serve, "8000"], stdout=subprocess.DEVNULL)
        net.run(0, [*serve, "8001", "--corrupt-first", "--corrupt-when", armed])
        replicators: list[subprocess.Popen[str]] = []

        if tree:  # host 1 serves its copy to the others
            net.run(1, [*serve[:-1], locals_[0], "8000"], stdout=subprocess.DEVNULL)

        def replicator(i: int) -> subprocess.Popen[str]:
            port = 8001 if i == 1 else 8000
            url = f"http://{net.addr(1 if tree and i > 1 else 0)}:{port}"
            cmd = [py, "-m", "embstore", "replicate", url, locals_[i - 1], "--period", "0.05"]
            return net.run(i, [*cmd, "--timeout", "2"], stdout=subprocess.PIPE, text=True)

        replicators = [replicator(i) for i in range(1, hosts + 1)]
        outputs: list[tuple[int, str]] = []  # (host, a replicator's output)
        versions: dict[int, int] = {}  # a manifest's checksum -> publish number
        readers = []
        for i in range(1, hosts + 1):
            argv = [py, "-c", READER, locals_[i - 1], stop]
            readers.append(_Reader(net.run(i, argv, stdout=subprocess.PIPE, text=True)))
        time.sleep(1.0)  # the servers listening
        peak = {"trainer": 0, **{f"host{i}": 0 for i in range(1, hosts + 1)}}
        ratio_now = [0.0] * hosts
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                trainer = _dir_bytes(src)
                peak["trainer"] = max(peak["trainer"], trainer)
                for i, d in enumerate(locals_):
                    b = _dir_bytes(d)
                    peak[f"host{i + 1}"] = max(peak[f"host{i + 1}"], b)
                    if trainer:
                        ratio_now[i] = max(ratio_now[i], b / trainer)
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        published: dict[str, int] = {}
        cut_host = hosts  # the last host
        killed_host = 2 if hosts >= 2 else None
        rx0 = [net.rx_bytes(i) for i in range(hosts + 1)]
        bytes_published = 0
        missed: dict[str, int] = {}
        restored_at = None
        for v in range(1, 7):
            what = {1: "full", 2: "delta", 3: "delta", 4: "delta (corrupting mirror)",
                    5: "chain rewrite", 6: "delta"}[v]  # fmt: skip
            if v == 2:
                net.cut(cut_host)
            if v == 4:
                open(armed, "w").close()
            if v > 1:
                changed = rng.choice(rows, rows // 50, replace=False).astype(np.int64)
                t.assign(changed, rng.standard_normal((len(changed), dim), dtype=np.float32))
            t.assign(PROBES, np.full((len(PROBES), dim), float(v), np.float32))
            t0 = time.time()
            t.save(src, incremental=v != 5 and v != 1, with_optimizer=False)
            saved = time.time()
            names = _named(src)
            with open(os.path.join(src, "manifest.json"), "rb") as f:
                versions[json.loads(f.read())["checksum"]] = v
            new = {n: b for n, b in names.items() if n not in published}
            new_bytes = sum(new.values()) + os.path.getsize(os.path.join(src, "manifest.json"))
            bytes_published += new_bytes
            if v in (2, 3):
                missed.update(new)
            published.update(new)
            if v == 5 and killed_host is not None:
                time.sleep(min(1.0, 0.4 * new_bytes / rate_b))
                replicators[killed_host - 1].send_signal(signal.SIGKILL)
                outputs.append((killed_host, replicators[killed_host - 1].communicate()[0]))
                killed_at = time.time()
                replicators[killed_host - 1] = replicator(killed_host)
            if v == 3:
                time.sleep(0.5)
                net.restore(cut_host)
                restored_at = time.time()
            waiting = [h for h in range(hosts) if not (v == 2 and h == cut_host - 1)]
            deadline = time.time() + 60 + 3 * new_bytes / rate_b
            while time.time() < deadline and not all(v in readers[h].served for h in waiting):
                time.sleep(0.01)
            if v == 4:
                os.unlink(armed)
            row: dict[str, Any] = {
                "v": v,
                "what": what,
                "save_s": round(saved - t0, 3),
                "saved_at": saved,
                "new_bytes": new_bytes,
                "link_s": round(new_bytes / rate_b, 3),
                "hosts": {},
            }
            for h in range(hosts):
                name = f"host{h + 1}"
                at = readers[h].served.get(v)
                if v in (2, 3) and h == cut_host - 1:
                    if v == 2:
                        row["hosts"][name] = {"lag_s": None, "note": "link cut"}
                        continue
                    assert restored_at is not None
                    missed_bytes = sum(missed.values())
                    start, bound = restored_at, missed_bytes / rate_b + 1.0
                    note = f"from the link's return, {missed_bytes} bytes missed"
                elif v == 5 and h == (killed_host or 0) - 1:
                    start, bound = saved, new_bytes / rate_b + 1.0 + 3.0
                    note = f"replicator killed {killed_at - saved:.2f} s after the save, restarted"
                else:
                    start, bound, note = saved, new_bytes / rate_b + 1.0, ""
                lag = None if at is None else round(at - start, 3)
                row["hosts"][name] = {
                    "lag_s": lag,
                    "bound_s": round(bound, 3),
                    "within": lag is not None and lag <= bound,
                    **({"note": note} if note else {}),
                }
            out["publishes"].append(row)
            print(json.dumps(row), flush=True)
            time.sleep(0.3)
        sampling.set()
        sampler.join()
        rx = [net.rx_bytes(i) - rx0[i] for i in range(hosts + 1)]
        open(stop, "w").close()
        fetched = {}
        for h, p in enumerate(replicators):
            p.send_signal(signal.SIGTERM)
            try:
                text, _ = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                text, _ = p.communicate()
            outputs.append((h + 1, text or ""))
            lines = [ln for ln in (text or "").splitlines() if "bytes fetched" in ln]
            fetched[f"host{h + 1}"] = lines[-1] if lines else ""
        # Where each lag went: the replica's publish, then the reader's swap.
        for host, text in outputs:
            for line in text.splitlines():
                words = line.split()
                if line.startswith("published version") and len(words) > 4:
                    v = versions.get(int(words[2], 16))
                    row = out["publishes"][v - 1]["hosts"].get(f"host{host}") if v else None
                    if row and row.get("lag_s") is not None:
                        saved_at = out["publishes"][v - 1]["saved_at"]
                        row["replica_published_s"] = round(float(words[4]) - saved_at, 3)
        want_keys, want_rows = t.export()
        order = np.argsort(want_keys)
        equal = {}
        for h, d in enumerate(locals_):
            k, r = embstore.Table.load(d).export()
            o = np.argsort(k)
            equal[f"host{h + 1}"] = bool(
                np.array_equal(k[o], want_keys[order]) and np.array_equal(r[o], want_rows[order])
            )
        out["links"] = {
            f"host{h + 1}": {
                "rx_bytes": rx[h + 1],
                "over_published": round(rx[h + 1] / bytes_published, 3),
            }
            for h in range(hosts)
        }
        out["bytes_published"] = bytes_published
        out["dir_peak_bytes"] = peak
        out["dir_peak_over_trainer_peak"] = {
            f"host{h + 1}": round(peak[f"host{h + 1}"] / peak["trainer"], 3) for h in range(hosts)
        }
        out["dir_over_trainer_same_moment_max"] = [round(x, 3) for x in ratio_now]
        out["mixed"] = [m for r in readers for m in r.mixed]
        out["final_rows_equal"] = equal
        out["replicator_last_line"] = fetched
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--rate", default="1gbit", help="each replica host's link")
    p.add_argument(
        "--source-rate",
        default="10gbit",
        help="the trainer host's link (it sends every publish to every host at once)",
    )
    p.add_argument("--tree", action="store_true", help="hosts 2.. replicate from host 1")
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    why = netlab.available()
    if why:
        sys.exit(f"benches/replicate.py: the harness {why}")
    workdir = tempfile.mkdtemp(prefix="embstore-replicate-")
    try:
        out = run(args.rows, args.dim, args.hosts, args.rate, args.source_rate, workdir, args.tree)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({k: v for k, v in out.items() if k != "publishes"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
