"""The disk tier against the table in memory: ``python benches/disk_tier.py``.

One run, three parts, each in a process of its own:

1. ``memory``: the table in memory (no limit): every key's row made, then
   ``--steps`` Adam steps of Zipf(``--zipf``) batches of ``--batch`` ids
   (a lookup, then its gradient, as a training loop does); step times and
   a digest of every row and state at the end.
2. ``disk``: the same table as a disk table with ``memory_bytes`` of
   ``--memory-fraction`` of its rows, under a cgroup v1 memory limit of
   ``memory_bytes`` + the disk index + ``--extra-mb`` (it counts the page
   cache, so that the segment files are read from the device, not from
   memory); the same steps, optionally with ``prefetch`` of the next batch;
   step times, resident memory, the cgroup's peak, the hit rate against
   the static optimum for that memory (the share of the stream's ids whose
   key is among the most frequent that fit), and the digest.
3. ``device``: the device's random 4 KiB read rate with O_DIRECT at queue
   depth 32 (threads), the physical limit the disk step is measured
   against.

Prints one JSON object; ``--quick`` runs a small size in a few seconds
(no cgroup) to check the script.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

CGROUP = Path("/sys/fs/cgroup/memory/embstore-disk-bench")


class Stream:
    """Batches of ids drawn by Zipf(``zipf``) over ``keys`` keys, ranks
    scattered over the key space by a fixed permutation; batch ``s`` is a
    function of (``seed``, ``s``), made when asked for (a whole stream of
    200 batches of 65,536 ids would take a run's memory)."""

    def __init__(self, keys: int, zipf: float, batch: int, seed: int) -> None:
        cdf = np.cumsum(np.arange(1, keys + 1, dtype=np.float64) ** -zipf)
        cdf /= cdf[-1]
        self.cdf = cdf
        self.perm = np.random.default_rng(seed).permutation(keys).astype(np.int64)
        self.keys, self.batch, self.seed = keys, batch, seed

    def __call__(self, step: int) -> np.ndarray:
        u = np.random.default_rng((self.seed, step)).random(self.batch)
        ranks = np.minimum(np.searchsorted(self.cdf, u), self.keys - 1)
        return self.perm[ranks]


def static_optimum(stream: Stream, steps: int, rows: int) -> float:
    """The hit rate of the best fixed set of ``rows`` keys for the stream."""
    counts = np.zeros(stream.keys, dtype=np.int64)
    for s in range(steps):
        counts += np.bincount(stream(s), minlength=stream.keys)
    counts = np.sort(counts)[::-1]
    return float(counts[:rows].sum() / counts.sum())


def digest(table: Any, keys: int) -> str:
    """A hash of every row and its state, read in chunks of keys (a disk
    table's rows pass through its memory a chunk at a time)."""
    import embstore

    h = hashlib.sha256()
    chunk = 1 << 14
    for start in range(0, keys, chunk):
        rows, state = table.lookup_with_state(
            np.arange(start, min(keys, start + chunk), dtype=np.int64), insert=False
        )
        h.update(rows.tobytes())
        h.update(state.tobytes())
    embstore.free_output_buffers()
    return h.hexdigest()


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_table(args: argparse.Namespace, disk: str | None) -> dict[str, Any]:
    import embstore
    from embstore import optim

    settings: dict[str, Any] = {"optimizer": optim.Adam(lr=1e-3), "seed": 1}
    probe = embstore.Table(args.dim, **settings)
    row_cost = probe.stats()["row_cost"]
    del probe
    memory_bytes = int(args.keys * args.memory_fraction) * row_cost
    if disk is not None:
        settings.update(disk=disk, memory_bytes=memory_bytes)
    table = embstore.Table(args.dim, **settings)
    t0 = time.perf_counter()
    chunk = 1 << 16
    for start in range(0, args.keys, chunk):
        table.lookup(np.arange(start, min(args.keys, start + chunk), dtype=np.int64))
    made = time.perf_counter() - t0
    ids = Stream(args.keys, args.zipf, args.batch, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    grads = rng.standard_normal((args.batch, args.dim)).astype(np.float32) * 0.01
    times = []
    before = table.stats()
    for s in range(args.steps):
        if args.prefetch and disk is not None and s + 1 < args.steps:
            table.prefetch(ids(s + 1))
        batch = ids(s)
        t = time.perf_counter()
        table.lookup(batch)
        if args.compute_ms:
            time.sleep(args.compute_ms / 1000)
        table.apply_gradients(batch, grads)
        times.append(time.perf_counter() - t)
    st = table.stats()
    rss = rss_mb()
    out: dict[str, Any] = {
        "made_s": made,
        "step_ms_median": 1000 * float(np.median(times[args.steps // 10 :])),
        "step_ms_mean": 1000 * float(np.mean(times[args.steps // 10 :])),
        "rss_mb": rss,
        "table_bytes": st["bytes"],
        "digest": digest(table, args.keys),
        "rows": st["rows"],
        "row_cost": row_cost,
        "memory_bytes": memory_bytes,
    }
    if disk is not None:
        distinct_cold = st["disk_rows_read"] - before["disk_rows_read"]
        out.update(
            memory_rows=st["memory_rows"],
            disk_rows=st["disk_rows"],
            disk_bytes=st["disk_bytes"],
            disk_index_bytes=st["disk_index_bytes"],
            overall_hit_rate=st["overall_hit_rate"],
            static_optimum=static_optimum(ids, args.steps, int(args.keys * args.memory_fraction)),
            rows_read_per_step=distinct_cold / args.steps,
            disk_error=st["disk_error"],
            disk_rows_compacted=st["disk_rows_compacted"],
            disk_spill_rounds=st.get("disk_spill_rounds"),
            disk_spill_rounds_on_calls=st.get("disk_spill_rounds_on_calls"),
        )
        peak = CGROUP / "memory.max_usage_in_bytes"
        if args.cgroup_bytes and peak.exists():
            out["cgroup_peak_mb"] = int(peak.read_text()) / 2**20
    return out


def adam(w: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, t: int) -> None:
    """torch.optim.Adam's update of rows ``w`` in place (lr 1e-3)."""
    b1, b2, lr, eps = 0.9, 0.999, 1e-3, 1e-8
    m *= b1
    m += (1 - b1) * g
    v *= b2
    v += (1 - b2) * g * g
    w -= lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)


def summed(batch: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The batch's distinct keys and each one's summed gradient."""
    uniq, inv = np.unique(batch, return_inverse=True)
    g = np.zeros((len(uniq), grads.shape[1]), np.float32)
    np.add.at(g, inv, grads)
    return uniq, g


def run_peer(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """What a user would do instead, under the same memory limit: a dense
    ``numpy.memmap`` table (weights, Adam's m and v) paged by the OS, or
    RocksDB (``rocksdict``) behind an LRU cache of ``memory_bytes`` of
    rows in a dict. Each step looks the batch up and takes an Adam step."""
    d = args.dim
    rows_in_memory = int(args.keys * args.memory_fraction)
    ids = Stream(args.keys, args.zipf, args.batch, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    grads = rng.standard_normal((args.batch, d)).astype(np.float32) * 0.01
    init = np.random.default_rng(7)
    t0 = time.perf_counter()
    times = []
    if kind == "memmap":
        mm = np.lib.format.open_memmap(
            Path(args.dir) / "dense.npy", "w+", np.float32, (args.keys, 3 * d)
        )
        for start in range(0, args.keys, 1 << 16):
            stop = min(args.keys, start + (1 << 16))
            block = np.zeros((stop - start, 3 * d), np.float32)
            block[:, :d] = init.uniform(-0.05, 0.05, (stop - start, d))
            mm[start:stop] = block
        mm.flush()
        made = time.perf_counter() - t0
        for s in range(args.steps):
            batch = ids(s)
            t = time.perf_counter()
            uniq, g = summed(batch, grads)
            rows = mm[uniq]
            _ = rows[:, :d][np.searchsorted(uniq, batch)]  # the lookup's output
            w, m, v = rows[:, :d], rows[:, d : 2 * d], rows[:, 2 * d :]
            adam(w, m, v, g, s + 1)
            mm[uniq] = rows
            times.append(time.perf_counter() - t)
    else:
        import collections

        import rocksdict

        opts = rocksdict.Options()
        opts.create_if_missing(True)
        # Small memtables: the cgroup's memory is the cache's.
        opts.set_write_buffer_size(32 << 20)
        opts.set_max_write_buffer_number(2)
        db = rocksdict.Rdict(str(Path(args.dir) / "rocks"), opts)
        for start in range(0, args.keys, 1 << 16):
            stop = min(args.keys, start + (1 << 16))
            block = np.zeros((stop - start, 3 * d), np.float32)
            block[:, :d] = init.uniform(-0.05, 0.05, (stop - start, d))
            wb = rocksdict.WriteBatch()
            for k, row in zip(range(start, stop), block, strict=True):
                wb.put(k, row.tobytes())
            db.write(wb)
        made = time.perf_counter() - t0
        # The hot rows: a slab of memory_bytes' rows, an LRU of key -> slot.
        slab = np.zeros((rows_in_memory + args.batch, 3 * d), np.float32)
        free = list(range(len(slab)))
        lru: collections.OrderedDict[int, int] = collections.OrderedDict()
        for s in range(args.steps):
            batch = ids(s)
            t = time.perf_counter()
            uniq, g = summed(batch, grads)
            keys = uniq.tolist()
            missing = [k for k in keys if k not in lru]
            if missing:
                fetched: list[Any] = db.get(missing) or []
                for k, raw in zip(missing, fetched, strict=True):
                    slot = free.pop()
                    slab[slot] = np.frombuffer(raw, np.float32)
                    lru[k] = slot
            slots = np.fromiter((lru[k] for k in keys), np.int64, len(keys))
            rows = slab[slots]
            _ = rows[:, :d][np.searchsorted(uniq, batch)]
            adam(rows[:, :d], rows[:, d : 2 * d], rows[:, 2 * d :], g, s + 1)
            slab[slots] = rows
            for k in keys:
                lru.move_to_end(k)
            if len(lru) > rows_in_memory:
                wb = rocksdict.WriteBatch()
                while len(lru) > rows_in_memory:
                    k, slot = lru.popitem(last=False)
                    wb.put(k, slab[slot].tobytes())
                    free.append(slot)
                db.write(wb)
            times.append(time.perf_counter() - t)
        db.close()
    out: dict[str, Any] = {
        "made_s": made,
        "step_ms_median": 1000 * float(np.median(times[len(times) // 10 :])),
        "steps": args.steps,
        "rss_mb": rss_mb(),
    }
    peak = CGROUP / "memory.max_usage_in_bytes"
    if args.cgroup_bytes and peak.exists():
        out["cgroup_peak_mb"] = int(peak.read_text()) / 2**20
    return out


def device_rate(path: Path, seconds: float, depth: int = 32, size: int = 2 << 30) -> float:
    """Random 4 KiB reads a second with O_DIRECT at queue depth ``depth``."""
    with open(path, "wb") as f:
        block = os.urandom(1 << 20)
        for _ in range(size >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    pages = size // 4096
    done = [0] * depth
    stop = time.perf_counter() + seconds

    def reader(i: int) -> None:
        buf = mmap.mmap(-1, 4096)
        rng = np.random.default_rng(i)
        offsets = rng.integers(0, pages, 1 << 16) * 4096
        n = 0
        while time.perf_counter() < stop:
            os.preadv(fd, [buf], int(offsets[n & 0xFFFF]))
            n += 1
        done[i] = n

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(depth)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t
    os.close(fd)
    path.unlink()
    return sum(done) / elapsed


def child(args: argparse.Namespace) -> None:
    if args.part != "memory" and args.cgroup_bytes:
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    if args.part in ("memmap", "rocksdb"):
        print(json.dumps(run_peer(args, args.part)))
        return
    disk = args.dir if args.part == "disk" else None
    print(json.dumps(run_table(args, disk)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=65_536)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--memory-fraction", type=float, default=0.1)
    p.add_argument("--extra-mb", type=int, default=300)
    p.add_argument("--prefetch", action="store_true")
    p.add_argument("--compute-ms", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None)
    p.add_argument("--no-cgroup", action="store_true")
    p.add_argument("--device-seconds", type=float, default=5.0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--part", choices=["memory", "disk", "memmap", "rocksdb"], default=None)
    p.add_argument("--peers", action="store_true", help="also time the memmap and RocksDB peers")
    p.add_argument("--peer-steps", type=int, default=30)
    p.add_argument("--cgroup-bytes", type=int, default=0)
    args = p.parse_args()
    if args.part == "disk" and not args.dir:
        # Without a directory the table would be one in memory.
        p.error("--part disk needs --dir (the directory of the table's files)")
    if args.quick:
        args.keys, args.batch, args.steps, args.no_cgroup = 20_000, 2048, 20, True
        args.device_seconds = 0.5
    if args.part:
        child(args)
        return
    work = Path(args.dir or tempfile.mkdtemp(prefix="embstore-disk-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, __file__, *sys.argv[1:]]
    mem = json.loads(
        subprocess.run(
            [*base, "--part", "memory"], check=True, capture_output=True, text=True
        ).stdout
    )
    limit = 0
    if not args.no_cgroup:
        # Rows, and the index of the rows on disk (about 40 bytes a key).
        limit = mem["memory_bytes"] + 48 * args.keys + args.extra_mb * 2**20
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.limit_in_bytes").write_text(str(limit))
        (CGROUP / "memory.max_usage_in_bytes").write_text("0")
    disk = json.loads(
        subprocess.run(
            [*base, "--part", "disk", "--dir", str(work), "--cgroup-bytes", str(limit)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    peers = {}
    if args.peers:
        for kind in ("memmap", "rocksdb"):
            if not args.no_cgroup:
                (CGROUP / "memory.max_usage_in_bytes").write_text("0")
            run = subprocess.run(
                [
                    *base,
                    "--part",
                    kind,
                    "--dir",
                    str(work),
                    "--cgroup-bytes",
                    str(limit),
                    "--steps",
                    str(args.peer_steps),
                ],
                capture_output=True,
                text=True,
            )
            peers[kind] = (
                json.loads(run.stdout)
                if run.returncode == 0
                else {"failed": run.returncode, "stderr": run.stderr[-500:]}
            )
    rate = device_rate(work / "device.bin", args.device_seconds)
    cold_ms = 1000 * disk["rows_read_per_step"] / rate
    out = {
        "args": {k: v for k, v in vars(args).items() if k not in ("part", "cgroup_bytes")},
        "cgroup_limit_mb": limit / 2**20,
        "memory": mem,
        "disk": disk,
        "device_reads_per_s": rate,
        "bit_identical": mem["digest"] == disk["digest"],
        "hit_rate_over_optimum": disk["overall_hit_rate"] / disk["static_optimum"],
        "extra_step_ms": disk["step_ms_median"] - mem["step_ms_median"],
        "device_ms_for_cold_rows": cold_ms,
        "extra_over_device": (disk["step_ms_median"] - mem["step_ms_median"]) / max(cold_ms, 1e-9),
        "step_ratio": disk["step_ms_median"] / mem["step_ms_median"],
        "peers": peers,
        "peer_over_disk": {
            k: v["step_ms_median"] / disk["step_ms_median"]
            for k, v in peers.items()
            if "step_ms_median" in v
        },
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
