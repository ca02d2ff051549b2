"""Serving live updates: a trainer publishes, mapped readers refresh.

    python benches/serving.py [--rows 1000000] [--publishes 10000] [--seconds 15]

1. Refresh: a reader process maps a ``--rows`` x 64 checkpoint and reads
   every row; the trainer changes 1,000 rows (and removes 10) and publishes
   them (``save(incremental=True, with_optimizer=False)``); the reader's
   ``refresh()`` time and the growth of its private memory (smaps_rollup,
   after reading the changed rows) over 8 publishes.
2. Follow: a reader process with ``follow=1`` polls one key while the
   trainer publishes new values at random moments: seconds from the save's
   return to the reader serving the value.
3. The main job's speed: the CTR demo (``python -m embstore demo``, 2M
   samples) without and with ``--publish DIR --checkpoint DIR2`` (a serving
   publish every second, a training checkpoint every 10 seconds, from
   threads beside the training loop), alternated ``--demo-runs`` times:
   samples a second, and the ratio of the medians.
4. Training speed under stress: Adam steps (lookup + apply of 16,384 ids, Zipf-like
   over the ``--rows`` table) for ``--seconds``, without publishing and
   with two threads beside them: one publishes for serving every second,
   the other saves an incremental training checkpoint (with optimizer
   state) to a second path every 10 seconds; alternated twice; the ratio
   of steps a second.
5. Chains: ``--publishes`` incremental publishes of 100 changed rows (and 5
   removals) on a 200,000-row table: the most files the directory held,
   the links of the final chain, and the final chain's load and mapped
   open + first full read against a fresh full checkpoint of the same
   table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

import numpy as np

import embstore
from benches.mapped import private_bytes
from embstore import optim
from embstore.serving import Publisher

DIM = 64


def zipf_ids(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Ids with a heavy head, as CTR features have."""
    return (rng.zipf(1.2, n) - 1) % rows


def refresh_reader(path: str, rows: int, conn: Any) -> None:
    table = embstore.Table.load(path, mmap=True)
    for lo in range(0, rows, 65_536):
        table.lookup(np.arange(lo, min(rows, lo + 65_536)))
    embstore.free_output_buffers()
    conn.send("ready")
    while True:
        keys = conn.recv()
        if keys is None:
            return
        before = private_bytes()
        t0 = time.perf_counter()
        changed = table.refresh()
        seconds = time.perf_counter() - t0
        table.lookup(keys)
        embstore.free_output_buffers()
        conn.send((changed, seconds, private_bytes() - before))


def refresh_figures(d: str, rows: int) -> dict[str, Any]:
    path = os.path.join(d, "serve")
    t = embstore.Table(DIM, optimizer=optim.Adam(lr=0.01), seed=0)
    for lo in range(0, rows, 1 << 20):
        t.lookup(np.arange(lo, min(rows, lo + (1 << 20))))
    t.save(path, with_optimizer=False)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=refresh_reader, args=(path, rows, child))
    p.start()
    assert parent.recv() == "ready"
    rng = np.random.default_rng(0)
    ms, grew, publish_ms = [], [], []
    for _ in range(8):
        keys = rng.choice(rows, 1_000, replace=False)
        t.apply_gradients(keys, rng.standard_normal((keys.size, DIM)).astype(np.float32))
        t.remove(rng.choice(rows, 10, replace=False))
        t0 = time.perf_counter()
        t.save(path, incremental=True, with_optimizer=False)
        publish_ms.append((time.perf_counter() - t0) * 1e3)
        parent.send(keys)
        changed, seconds, private = parent.recv()
        assert changed
        ms.append(round(seconds * 1e3, 2))
        grew.append(private)
    parent.send(None)
    p.join(timeout=120)
    return {
        "refresh_ms": ms,
        "publish_ms": [round(x, 1) for x in publish_ms],
        "private_growth_bytes": grew,
        "delta_row_bytes": 1_000 * DIM * 4,
        "base_row_bytes": rows * DIM * 4,
    }


def follow_reader(path: str, conn: Any) -> None:
    table = embstore.Table.load(path, mmap=True, follow=1.0)
    conn.send("ready")
    want = 1.0
    while want <= 8:
        if table.lookup([0])[0, 0] == want:
            conn.send(time.time())
            want += 1
        time.sleep(0.001)


def follow_latency(d: str) -> list[float]:
    path = os.path.join(d, "follow")
    t = embstore.Table(4, seed=0)
    t.assign(np.arange(1_000), np.zeros((1_000, 4), np.float32))
    t.save(path, with_optimizer=False)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=follow_reader, args=(path, child))
    p.start()
    assert parent.recv() == "ready"
    rng = np.random.default_rng(1)
    late = []
    for v in range(1, 9):
        time.sleep(rng.uniform(0.2, 1.3))
        t.assign([0], np.full((1, 4), v, np.float32))
        t.save(path, incremental=True, with_optimizer=False)
        published = time.time()
        late.append(round(parent.recv() - published, 3))
    p.join(timeout=60)
    return late


def train_for(
    t: embstore.Table, seconds: float, rng: np.random.Generator, rows: int, paths: Any
) -> tuple[float, list[float]]:
    """Steps a second over ``seconds``; with ``paths`` (serving, training)
    the demo's publishers run beside the steps: a serving publish every
    second, a training checkpoint every 10 (each starts with an untimed
    full save, so what changed while nothing published is not timed)."""
    grads = np.random.default_rng(9).standard_normal((16_384, DIM)).astype(np.float32) * 0.01
    steps = 0
    pubs = []
    if paths is not None:
        pubs = [Publisher(t, paths[0], 1.0), Publisher(t, paths[1], 10.0, with_optimizer=True)]
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        ids = zipf_ids(rng, rows, 16_384)
        t.lookup(ids)
        t.apply_gradients(ids, grads)
        steps += 1
    rate = steps / (time.perf_counter() - start)
    for pub in pubs:
        pub.stop()
    return rate, pubs[0].seconds if pubs else []


def training_speed(d: str, rows: int, seconds: float) -> dict[str, Any]:
    t = embstore.Table(DIM, optimizer=optim.Adam(lr=0.01), seed=0)
    for lo in range(0, rows, 1 << 20):
        t.lookup(np.arange(lo, min(rows, lo + (1 << 20))))
    paths = (os.path.join(d, "pub"), os.path.join(d, "ckpt"))
    rng = np.random.default_rng(2)
    res: dict[str, list[float]] = {"alone": [], "publishing": []}
    saves: list[float] = []
    for _ in range(2):
        res["alone"].append(round(train_for(t, seconds, rng, rows, None)[0], 2))
        rate, took = train_for(t, seconds, rng, rows, paths)
        res["publishing"].append(round(rate, 2))
        saves += took
    m = embstore.Table.load(paths[0])
    with open(os.path.join(paths[0], "manifest.json")) as f:
        chain = json.load(f)["chain"]
    out: dict[str, Any] = dict(res)
    out["ratio"] = round(sum(res["publishing"]) / sum(res["alone"]), 3)
    out["publishes"] = len(saves)
    out["publish_s_median"] = round(float(np.median(saves)), 3)
    out["final_chain_links"] = len(chain)
    out["published_rows"] = len(m)
    return out


def demo_speed(d: str, samples: int, runs: int) -> dict[str, Any]:
    """The main job (the CTR demo's trainer) without and with publishing,
    alternated: samples a second."""
    from embstore import demo

    res: dict[str, Any] = {"alone": [], "publishing": [], "publishes": [], "publish_ms": []}
    for i in range(runs):
        for publishing in (False, True):
            paths = (os.path.join(d, f"demo-pub{i}"), os.path.join(d, f"demo-ckpt{i}"))
            r = demo.run(
                samples,
                4096,
                8,
                False,
                0,
                True,
                10_000,
                publish=paths[0] if publishing else None,
                checkpoint=paths[1] if publishing else None,
            )
            res["publishing" if publishing else "alone"].append(round(r["samples_per_s"]))
            if publishing:
                res["publishes"].append(int(r["publishes"]))
                res["publish_ms"].append(round(r["publish_s"] * 1e3, 1))
                res["rows"] = int(r["rows"])
    res["ratio_of_medians"] = round(
        float(np.median(res["publishing"]) / np.median(res["alone"])), 3
    )
    return res


def chains(d: str, publishes: int) -> dict[str, Any]:
    path, fresh = os.path.join(d, "chain"), os.path.join(d, "fresh")
    rows = 200_000
    t = embstore.Table(DIM, seed=0)
    t.lookup(np.arange(rows))
    t.save(path, with_optimizer=False)
    rng = np.random.default_rng(3)
    most_files, kinds = 0, {"full": 0, "delta": 0}
    t0 = time.perf_counter()
    for i in range(publishes):
        keys = rng.integers(0, rows + i, 100)
        t.assign(keys, np.full((keys.size, DIM), i % 7, np.float32))
        t.remove(rng.integers(0, rows, 5))
        m = t.save(path, incremental=True, with_optimizer=False)
        kinds[m["chain"][-1]["kind"]] += 1
        if i % 10 == 0:
            most_files = max(most_files, len(os.listdir(path)))
    publish_s = time.perf_counter() - t0
    t.save(fresh, with_optimizer=False)
    with open(os.path.join(path, "manifest.json")) as f:
        links = len(json.load(f)["chain"])

    def load_s(p: str) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            embstore.Table.load(p)
            best = min(best, time.perf_counter() - t0)
        return best

    def map_s(p: str) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            m = embstore.Table.load(p, mmap=True)
            m.lookup(np.arange(rows))
            best = min(best, time.perf_counter() - t0)
        return best

    loads = {"chain": load_s(path), "fresh": load_s(fresh)}
    maps = {"chain": map_s(path), "fresh": map_s(fresh)}
    return {
        "publishes": publishes,
        "mean_publish_ms": round(publish_s / publishes * 1e3, 2),
        "links_written": kinds,
        "most_files": most_files,
        "final_links": links,
        "load_s": {k: round(v, 4) for k, v in loads.items()},
        "load_ratio": round(loads["chain"] / loads["fresh"], 2),
        "map_and_read_s": {k: round(v, 4) for k, v in maps.items()},
        "map_ratio": round(maps["chain"] / maps["fresh"], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--publishes", type=int, default=10_000)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--demo-runs", type=int, default=3)
    p.add_argument(
        "--only", choices=["refresh", "follow", "demo", "training", "chains"], default=None
    )
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    res: dict[str, Any] = {"rows": args.rows, "dim": DIM}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        if args.only in (None, "refresh"):
            res["refresh"] = refresh_figures(d, args.rows)
            print(json.dumps(res["refresh"]), flush=True)
        if args.only in (None, "follow"):
            res["follow_seconds"] = follow_latency(d)
            print(json.dumps(res["follow_seconds"]), flush=True)
        if args.only in (None, "demo"):
            res["demo"] = demo_speed(d, 2_000_000, args.demo_runs)
            print(json.dumps(res["demo"]), flush=True)
        if args.only in (None, "training"):
            res["training"] = training_speed(d, args.rows, args.seconds)
            print(json.dumps(res["training"]), flush=True)
        if args.only in (None, "chains"):
            res["chains"] = chains(d, args.publishes)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
