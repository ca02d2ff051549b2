"""Peer comparison: embstore against what a user would otherwise use, in one
process on one machine, reported as ratios.

    python -m embstore bench            # full sizes (about 2 minutes on 2 cores)
    python -m embstore bench --quick    # small sizes, a smoke run

Peers: ``torch.index_select`` on a dense tensor and a Python dict of NumPy
rows (lookup), ``torch.optim.SparseAdam`` (Adam step). Thread scaling and
memory are measured in child processes (a fresh pool size, a fresh RSS).
Small calls (1 to 16,384 keys: lookup, Adam step, pooled step; 1 and 4
serving threads) are measured against np.take and a dict of rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

import embstore
from embstore import optim
from embstore._cli import Parser, positive_int, require


def _best(fn: Callable[[], object], reps: int) -> float:
    """Best wall time of ``reps`` runs after one warm-up (the peers get the same)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def core(vocab: int, batch: int, fields: int, dim: int, reps: int) -> dict[str, float]:
    """embstore's own timings: lookup and Adam apply on a full table."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, batch * fields)
    grads = rng.standard_normal((ids.size, dim), dtype=np.float32)
    table = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3))
    table.lookup(np.arange(vocab))
    return {
        "lookup_s": _best(lambda: table.lookup(ids), reps),
        "apply_adam_s": _best(lambda: table.apply_gradients(ids, grads), reps),
    }


POLICIES: dict[str, dict[str, Any]] = {
    "none": {},
    "capacity-lfu": {"capacity": 1 << 40, "eviction": "lfu"},
    "ttl": {"ttl_steps": 1 << 30},
    "count-filter": {"admission": embstore.policy.CountFilter(1)},
    "float16": {"dtype": "float16"},
}


def policy_costs(vocab: int, batch: int, fields: int, dim: int, reps: int) -> dict[str, Any]:
    """Lookup and Adam apply on a full table under each policy (policies set
    so that nothing is evicted or refused: the bookkeeping alone), as ratios
    to the table without policies, measured in this process."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, batch * fields)
    grads = rng.standard_normal((ids.size, dim), dtype=np.float32)
    out: dict[str, Any] = {}
    for name, kwargs in POLICIES.items():
        table = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3), **kwargs)
        keys = np.arange(vocab)
        table.apply_gradients(keys, np.zeros((vocab, dim), np.float32))

        def lookup(t: embstore.Table = table) -> object:
            return t.lookup(ids)

        def apply(t: embstore.Table = table) -> None:
            t.apply_gradients(ids, grads)

        out[name] = {
            "lookup_s": _best(lookup, reps),
            "apply_adam_s": _best(apply, reps),
            "bytes_per_row": table.stats()["bytes"] / len(table),
        }
        del table
    base = out["none"]
    for v in out.values():
        v["lookup_ratio"] = v["lookup_s"] / base["lookup_s"]
        v["apply_ratio"] = v["apply_adam_s"] / base["apply_adam_s"]
    return out


def report_policies(res: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"policy bookkeeping: {args.vocab:,}-row dim-{args.dim} Adam table, "
        f"batch {args.batch:,} x {args.fields}; ratio to the table without policies",
        f"{'policy':<14}{'lookup s':>10}{'ratio':>8}{'apply s':>10}{'ratio':>8}{'B/row':>8}",
    ]
    for name, v in res.items():
        lines.append(
            f"{name:<14}{v['lookup_s']:>10.4f}{v['lookup_ratio']:>8.2f}"
            f"{v['apply_adam_s']:>10.4f}{v['apply_ratio']:>8.2f}{v['bytes_per_row']:>8.1f}"
        )
    return "\n".join(lines)


def memory(rows: int, dim: int) -> dict[str, float]:
    """Resident-memory growth of a table of ``rows`` keys with no optimizer."""
    chunk = 1_000_000
    values = np.zeros((chunk, dim), np.float32)
    before = _rss()
    table = embstore.Table(dim)
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        table.assign(np.arange(start, start + n) * 7919, values[:n])
    rss = _rss() - before
    payload = rows * dim * 4
    stats_bytes = table.stats()["bytes"]
    return {
        "rows": rows,
        "payload_bytes": payload,
        "stats_bytes": stats_bytes,
        "rss_growth_bytes": rss,
        "stats_overhead_per_key": (stats_bytes - payload) / rows,
        "rss_overhead_per_key": (rss - payload) / rows,
    }


def _child(mode: str, args: argparse.Namespace, threads: int | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    if threads is not None:
        env["RAYON_NUM_THREADS"] = str(threads)
    cmd = [
        sys.executable,
        "-m",
        "embstore",
        "bench",
        "--child",
        mode,
        "--vocab",
        str(args.vocab),
        "--batch",
        str(args.batch),
        "--fields",
        str(args.fields),
        "--dim",
        str(args.dim),
        "--reps",
        str(args.reps),
        "--mem-rows",
        str(args.mem_rows),
    ]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=1800)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def compare(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    vocab, dim, reps = args.vocab, args.dim, args.reps
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, args.batch * args.fields)
    distinct = int(np.unique(ids).size)
    grads = rng.standard_normal((ids.size, dim), dtype=np.float32)
    res: dict[str, Any] = {"ids": int(ids.size), "distinct": distinct, "vocab": vocab, "dim": dim}

    table = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3))
    all_keys = np.arange(vocab)
    t0 = time.perf_counter()
    table.lookup(all_keys)
    res["fill_rows_per_s"] = vocab / (time.perf_counter() - t0)
    ours_lookup = _best(lambda: table.lookup(ids), reps)

    weight = torch.from_numpy(table.lookup(all_keys, insert=False))
    tids = torch.from_numpy(ids)
    torch_lookup = _best(lambda: torch.index_select(weight, 0, tids), reps)
    correct = bool(np.array_equal(table.lookup(ids), torch.index_select(weight, 0, tids).numpy()))

    rows_dict = {int(k): row for k, row in zip(all_keys, weight.numpy(), strict=True)}
    id_list = ids.tolist()
    dict_lookup = _best(lambda: np.stack([rows_dict[k] for k in id_list]), 1)

    res.update(
        lookup_s=ours_lookup,
        torch_index_select_s=torch_lookup,
        dict_stack_s=dict_lookup,
        lookup_correct=correct,
    )

    ours_apply = _best(lambda: table.apply_gradients(ids, grads), reps)
    param = torch.nn.Parameter(weight.clone())
    sparse_adam = torch.optim.SparseAdam([param], lr=1e-3)
    tgrads = torch.from_numpy(grads)

    def torch_step() -> None:
        param.grad = torch.sparse_coo_tensor(
            tids[None, :], tgrads, param.shape, check_invariants=False
        )
        sparse_adam.step()

    torch_apply = _best(torch_step, reps)
    res.update(apply_adam_s=ours_apply, torch_sparse_adam_s=torch_apply)

    new_keys = np.arange(vocab, vocab + distinct) * 31 + 7
    t0 = time.perf_counter()
    table.lookup(new_keys)
    res["insert_new_rows_per_s"] = distinct / (time.perf_counter() - t0)
    # The same insert into a table that reserved the room first (the
    # reservation maps the rows' memory; the insert then maps none).
    del table
    table = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3))
    table.lookup(all_keys)
    t0 = time.perf_counter()
    table.reserve(distinct)
    res["reserve_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    table.lookup(new_keys)
    res["insert_reserved_rows_per_s"] = distinct / (time.perf_counter() - t0)
    plain = embstore.Table(dim)
    values = np.zeros((distinct, dim), np.float32)
    t0 = time.perf_counter()
    plain.assign(new_keys, values)
    res["assign_new_rows_per_s"] = distinct / (time.perf_counter() - t0)

    one = _child("core", args, threads=1)
    two = _child("core", args, threads=2)
    res.update(threads1=one, threads2=two)
    res["memory"] = _child("memory", args)
    res["collection"] = collection_compare(args)
    res["collection"]["dim"] = dim
    res["small_calls"] = small_calls(dim, args.quick)
    return res


def checkpoint_compare(rows: int, dim: int, reps: int, where: str | None) -> dict[str, Any]:
    """Save and load of a ``rows`` x ``dim`` Adam table against ``cp`` of the
    same bytes on the same disk (bare, and followed by ``sync`` so that the
    copy is as durable as the save, which fsyncs every file)."""
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="embstore-bench-", dir=where)
    try:
        table = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3))
        for start in range(0, rows, 1_000_000):
            table.lookup(np.arange(start, min(rows, start + 1_000_000)))
        ck = os.path.join(base, "ck")
        # One untimed save first: on a VM, the first touch of guest memory
        # (here: page cache for the new files) costs far more than later ones,
        # and cp below runs on memory that earlier steps already touched.
        # Each timed save then writes a fresh directory, as cp does.
        save_s = []
        for _ in range(reps + 1):
            shutil.rmtree(ck, ignore_errors=True)
            t0 = time.perf_counter()
            m = table.save(ck, progress=False)
            save_s.append(time.perf_counter() - t0)
        save_s = save_s[1:]
        size = sum(f["bytes"] for f in m["chain"][0]["files"])
        expect = table.export()[0][:1000]
        del table
        cp_s, cp_sync_s = [], []
        for i in range(reps):
            dst = os.path.join(base, f"cp{i}")
            t0 = time.perf_counter()
            subprocess.run(["cp", "-r", ck, dst], check=True)
            t1 = time.perf_counter()
            subprocess.run(["sync"], check=True)
            cp_s.append(t1 - t0)
            cp_sync_s.append(time.perf_counter() - t0)
            shutil.rmtree(dst)
        load_s = []
        for _ in range(reps):
            t0 = time.perf_counter()
            loaded = embstore.Table.load(ck, progress=False)
            load_s.append(time.perf_counter() - t0)
            ok = bool(np.array_equal(loaded.export()[0][:1000], expect))
            del loaded
        return {
            "rows": rows,
            "dim": dim,
            "bytes": size,
            "save_s": min(save_s),
            "load_s": min(load_s),
            "cp_s": min(cp_s),
            "cp_sync_s": min(cp_sync_s),
            "load_correct": ok,
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)


def report_checkpoint(c: dict[str, Any]) -> str:
    mib = c["bytes"] / 2**20
    rate = lambda s: f"{mib / s:,.0f} MiB/s"  # noqa: E731
    return "\n".join(
        [
            f"Checkpoint: {c['rows']:,} x {c['dim']} Adam table, {mib / 1024:.2f} GiB of shard files; "
            f"best of the runs after an untimed warm-up save; same disk.",
            "",
            "| measure | time | throughput | vs cp + sync | vs bare cp | target |",
            "| --- | --- | --- | --- | --- | --- |",
            f"| save (fsynced, atomic publish) | {c['save_s']:.2f} s | {rate(c['save_s'])} | "
            f"{c['cp_sync_s'] / c['save_s']:.0%} | {c['cp_s'] / c['save_s']:.0%} | >= 70% of cp |",
            f"| load (checks every checksum, then inserts) | {c['load_s']:.2f} s | {rate(c['load_s'])} | "
            f"{c['cp_sync_s'] / c['load_s']:.0%} | {c['cp_s'] / c['load_s']:.0%} | >= 70% of cp |",
            f"| cp -r of the checkpoint | {c['cp_s']:.2f} s | {rate(c['cp_s'])} | | | |",
            f"| cp -r, then sync | {c['cp_sync_s']:.2f} s | {rate(c['cp_sync_s'])} | | | |",
            "",
            f"loaded keys equal the saved table's: {c['load_correct']}",
        ]
    )


def collection_compare(args: argparse.Namespace) -> dict[str, Any]:
    """A full training step of a 26-feature Collection against EmbeddingBag + SparseAdam.

    One id per feature per sample; 2M keys in all: embstore serves every
    feature from one shared table (one optimizer step per call); torch runs
    either one EmbeddingBag per feature (vocab / fields rows each) or one
    shared EmbeddingBag over all ids, whichever is faster.
    """

    vocab, dim, fields, batch, reps = args.vocab, args.dim, args.fields, args.batch, args.reps
    per = vocab // fields
    rng = np.random.default_rng(1)
    local = rng.integers(0, per, (fields, batch))
    keys = local + (np.arange(fields) * per)[:, None]  # feature f owns [f*per, (f+1)*per)
    offsets = np.arange(batch + 1, dtype=np.int64)
    upstream = rng.standard_normal((batch, fields * dim), dtype=np.float32)
    res: dict[str, Any] = {"fields": fields, "batch": batch, "keys": per * fields}

    res.update(_coll_ours(keys, offsets, upstream, per * fields, dim, reps))
    res.update(_coll_torch_per_feature(local, offsets, upstream, per, dim, reps))
    res.update(_coll_torch_shared(keys, upstream, per * fields, dim, reps))
    res["peers"] = _coll_peers(local, upstream, per, dim, reps)
    return res


def _coll_peers(
    local: np.ndarray, upstream: np.ndarray, per: int, dim: int, reps: int
) -> dict[str, Any]:
    """The Collection step with row-wise Adagrad (lr 0.01, eps 1e-8), the
    optimizer FBGEMM and TorchRec train sparse tables with by default, on
    the same ids: embstore (one table per feature), FBGEMM's CPU
    table-batched embedding (fbgemm-gpu-cpu) and TorchRec's
    FusedEmbeddingBagCollection (its optimizer runs inside the backward).
    FBGEMM and TorchRec pin their own torch, so they are measured where
    they are installed (scripts/torchrec_check.sh makes such a venv) and
    reported as skipped, with the reason, where they are not."""
    import torch

    fields, batch = local.shape
    res: dict[str, Any] = {}
    tables = [
        embstore.Table(dim, optimizer=optim.RowWiseAdagrad(lr=0.01, eps=1e-8), seed=f)
        for f in range(fields)
    ]
    for t in tables:
        t.lookup(np.arange(per))
    coll = embstore.Collection({f"f{f}": tables[f] for f in range(fields)})
    offsets = np.arange(batch + 1, dtype=np.int64)
    feed = {f"f{f}": (np.ascontiguousarray(local[f]), offsets) for f in range(fields)}

    def ours() -> None:
        coll.lookup_pooled(feed)
        coll.apply_pooled_gradients(feed, upstream)

    res["ours_rowwise_adagrad_step_s"] = _best(ours, reps)
    tup = torch.from_numpy(upstream)
    flat = torch.from_numpy(local.reshape(-1).astype(np.int64))  # feature-major
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(per, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * fields,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=0.01,
            eps=1e-8,
            pooling_mode=PoolingMode.SUM,
        )
        toffsets = torch.arange(fields * batch + 1, dtype=torch.int64)

        def fbgemm_step() -> None:
            tbe(flat, toffsets).backward(tup)

        res["fbgemm_rowwise_adagrad_step_s"] = _best(fbgemm_step, reps)
        res["fbgemm"] = _version("fbgemm-gpu-cpu")
    except Exception as e:  # ImportError, or its operators failing to load
        res["fbgemm_skipped"] = f"{type(e).__name__}: {e}"
    try:
        import torchrec
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        fused = FusedEmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t{f}", embedding_dim=dim, num_embeddings=per, feature_names=[f"f{f}"]
                )
                for f in range(fields)
            ],
            optimizer_type=torchrec.optim.RowWiseAdagrad,
            optimizer_kwargs={"lr": 0.01, "eps": 1e-8},
            device=torch.device("cpu"),
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{f}" for f in range(fields)],
            values=flat,
            lengths=torch.ones(fields * batch, dtype=torch.int64),
        )

        def torchrec_step() -> None:
            fused(kjt).values().backward(tup)

        res["torchrec_rowwise_adagrad_step_s"] = _best(torchrec_step, reps)
        res["torchrec"] = _version("torchrec")
    except Exception as e:  # ImportError, or fbgemm's operators failing to load
        res["torchrec_skipped"] = f"{type(e).__name__}: {e}"
    return res


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def _coll_ours(
    keys: np.ndarray, offsets: np.ndarray, upstream: np.ndarray, vocab: int, dim: int, reps: int
) -> dict[str, float]:
    table = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3))
    table.lookup(np.arange(vocab))
    coll = embstore.Collection({f"f{f}": table for f in range(len(keys))})
    feed = {f"f{f}": (keys[f], offsets) for f in range(len(keys))}

    def step() -> None:
        coll.lookup_pooled(feed)
        coll.apply_pooled_gradients(feed, upstream)

    return {
        "ours_forward_s": _best(lambda: coll.lookup_pooled(feed), reps),
        "ours_step_s": _best(step, reps),
    }


def _coll_torch_per_feature(
    local: np.ndarray, offsets: np.ndarray, upstream: np.ndarray, per: int, dim: int, reps: int
) -> dict[str, float]:
    import torch

    fields = len(local)
    tup, toff = torch.from_numpy(upstream), torch.from_numpy(offsets)
    bags = [
        torch.nn.EmbeddingBag(per, dim, mode="sum", include_last_offset=True, sparse=True)
        for _ in range(fields)
    ]
    opt = torch.optim.SparseAdam([b.weight for b in bags], lr=1e-3)
    tlocal = [torch.from_numpy(local[f]) for f in range(fields)]

    def forward() -> torch.Tensor:
        return torch.cat([bags[f](tlocal[f], toff) for f in range(fields)], dim=1)

    def step() -> None:
        opt.zero_grad()
        (forward() * tup).sum().backward()
        opt.step()

    return {
        "torch_per_feature_forward_s": _best(lambda: forward().detach(), reps),
        "torch_per_feature_step_s": _best(step, reps),
    }


def _coll_torch_shared(
    keys: np.ndarray, upstream: np.ndarray, vocab: int, dim: int, reps: int
) -> dict[str, float]:
    import torch

    fields, batch = keys.shape
    tup = torch.from_numpy(upstream)
    shared = torch.nn.EmbeddingBag(vocab, dim, mode="sum", include_last_offset=True, sparse=True)
    opt = torch.optim.SparseAdam([shared.weight], lr=1e-3)
    # Sample-major order so the pooled (batch * fields, dim) output reshapes
    # to (batch, fields * dim) like the Collection's.
    tkeys = torch.from_numpy(np.ascontiguousarray(keys.T).ravel())
    toff = torch.arange(batch * fields + 1)

    def forward() -> torch.Tensor:
        return shared(tkeys, toff).view(batch, fields * dim)

    def step() -> None:
        opt.zero_grad()
        (forward() * tup).sum().backward()
        opt.step()

    return {
        "torch_shared_forward_s": _best(lambda: forward().detach(), reps),
        "torch_shared_step_s": _best(step, reps),
    }


SMALL_KEYS = (1, 16, 128, 1024, 16384)


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Best of 5 runs of ``calls`` calls, in microseconds per call."""
    return _paired_us({"fn": fn}, calls, rounds=5)["fn"]


def _paired_us(
    fns: dict[str, Callable[[], object]], calls: int, rounds: int = 7
) -> dict[str, float]:
    """:func:`_per_call_us` of several functions measured in turn, round
    after round (best of ``rounds``): on a machine whose speed drifts, a
    ratio of two of them compares the same moments."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return {name: b * 1e6 for name, b in best.items()}


def _stack_rows(rows: dict[int, np.ndarray], keys: list[int]) -> np.ndarray:
    return np.stack([rows[k] for k in keys])


def serving_calls_per_s(table: embstore.Table, keys: np.ndarray, threads: int, calls: int) -> float:
    """Serving lookups (``insert=False``) of ``keys`` per second, from
    ``threads`` Python threads making ``calls`` calls each (best of 3)."""
    return _calls_per_s(partial(table.lookup, keys, insert=False), threads, calls)


def _calls_per_s(fn: Callable[[], object], threads: int, calls: int) -> float:
    """Calls of ``fn`` per second from ``threads`` Python threads making
    ``calls`` calls each (best of 3)."""
    import threading

    def serve() -> None:
        for _ in range(calls):
            fn()

    best = float("inf")
    for _ in range(3):
        ts = [threading.Thread(target=serve) for _ in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return threads * calls / best


def gil_ceiling(threads: int, calls: int) -> dict[str, float]:
    """What CPython's own C code reaches: ``hashlib.sha256`` of 2,100 bytes
    (it releases the GIL inside for data of 2,048 bytes or more; a call
    takes a few microseconds, like a 128-key lookup) from 1 and ``threads``
    Python threads. The handing over of the GIL at each call's entry and
    exit bounds the scaling of every extension's small calls; this is that
    bound on the machine at hand."""
    import hashlib

    data = b"x" * 2_100

    def digest() -> bytes:
        return hashlib.sha256(data).digest()

    def held() -> int:
        return sum(range(150))

    t0 = time.perf_counter()
    for _ in range(calls):
        digest()
    one_call = (time.perf_counter() - t0) / calls
    return {
        "call_us": one_call * 1e6,
        "1": _calls_per_s(digest, 1, calls),
        str(threads): _calls_per_s(digest, threads, calls),
        # Code that holds the GIL throughout (a pure-Python call of about
        # the same length): what threads reach with no hand-over per call.
        "held_1": _calls_per_s(held, 1, calls),
        f"held_{threads}": _calls_per_s(held, threads, calls),
    }


def small_calls(dim: int, quick: bool) -> dict[str, Any]:
    """Per-call cost at 1 to 16,384 keys on a 100,000-row Adam table (default
    shards), against np.take on a dense array and a dict of rows (same run):
    training and serving lookups, Adam step, and a pooled step (lookup_pooled
    + backward, 4 ids a bag); and calls/s of 128-key serving lookups from 1
    and 4 Python threads."""

    rows = 100_000
    table = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3), seed=0)
    table.lookup(np.arange(rows))
    dense = table.lookup(np.arange(rows), insert=False)
    as_dict = {int(k): dense[k] for k in range(rows)}
    rng = np.random.default_rng(0)
    budget = 2_000 if quick else 20_000  # ids per measured run
    per_keys: dict[str, dict[str, float]] = {}
    for n in SMALL_KEYS:
        keys = rng.integers(0, rows, n)
        key_list = keys.tolist()
        grads = np.ones((n, dim), np.float32)
        offsets = np.arange(0, n + 1, 4, dtype=np.int64)
        if offsets[-1] != n:
            offsets = np.append(offsets, n)
        bag_grads = np.ones((offsets.size - 1, dim), np.float32)
        calls = max(3, budget // n)

        def pooled_step(
            k: np.ndarray = keys, o: np.ndarray = offsets, g: np.ndarray = bag_grads
        ) -> None:
            table.lookup_pooled(k, o)
            table.apply_pooled_gradients(k, o, g)

        per_keys[str(n)] = _paired_us(
            {
                "lookup_us": partial(table.lookup, keys),
                "serve_us": partial(table.lookup, keys, insert=False),
                "np_take_us": partial(np.take, dense, keys, axis=0),
                "dict_stack_us": partial(_stack_rows, as_dict, key_list),
                "adam_step_us": partial(table.apply_gradients, keys, grads),
                "pooled_step_us": pooled_step,
            },
            calls,
        )
    keys = rng.integers(0, rows, 128)
    calls = 500 if quick else 4_000
    serving: dict[str, float] = {}
    ceiling: dict[str, list[float]] = {"1": [], "4": [], "held_1": [], "held_4": [], "call_us": []}
    for _ in range(2):  # in turn: the machine's speed drifts
        for n in (1, 4):
            serving[str(n)] = max(
                serving.get(str(n), 0.0), serving_calls_per_s(table, keys, n, calls)
            )
        for k, v in gil_ceiling(4, calls).items():
            ceiling[k].append(v)
    return {
        "rows": rows,
        "per_keys": per_keys,
        "serving_calls_per_s": serving,
        "gil_ceiling": {
            "1": max(ceiling["1"]),
            "4": max(ceiling["4"]),
            "held_1": max(ceiling["held_1"]),
            "held_4": max(ceiling["held_4"]),
            "call_us": min(ceiling["call_us"]),
        },
    }


def _numpy_adam_step(
    w: np.ndarray, m: np.ndarray, v: np.ndarray
) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The step of a Collection written in NumPy on dense arrays: forward
    ``np.take``, backward ``np.add.at`` into the touched rows, Adam (lr 1e-3,
    torch's defaults) on those rows only. Returns ``step(keys (fields,
    batch), upstream (batch, fields * dim)) -> forward output``."""
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    dim = w.shape[1]
    count = [0]

    def step(keys: np.ndarray, upstream: np.ndarray) -> np.ndarray:
        fields, batch = keys.shape
        out = np.take(w, keys, axis=0).transpose(1, 0, 2).reshape(batch, fields * dim)
        grads = upstream.reshape(batch, fields, dim).transpose(1, 0, 2).reshape(-1, dim)
        touched, inverse = np.unique(keys.reshape(-1), return_inverse=True)
        g = np.zeros((touched.size, dim), np.float32)
        np.add.at(g, inverse, grads)
        count[0] += 1
        k = count[0]
        m[touched] = b1 * m[touched] + (1 - b1) * g
        v[touched] = b2 * v[touched] + (1 - b2) * g * g
        step_size = lr / (1 - b1**k)
        w[touched] -= step_size * m[touched] / (np.sqrt(v[touched] / (1 - b2**k)) + eps)
        return out

    return step


def _filled_adam_table(vocab: int, dim: int) -> embstore.Table:
    """An Adam table (lr 1e-3) holding the keys ``0..vocab``."""
    table = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3), seed=0)
    table.reserve(vocab)
    table.lookup(np.arange(vocab))
    return table


def batch_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """A ``fields``-feature Collection training step (one id per feature
    per sample, one shared ``vocab``-row Adam table: pooled forward,
    backward, Adam) at batch sizes from 1 to ``batch``, against the same
    step in NumPy on dense arrays (:func:`_numpy_adam_step`); the two
    measured in turn, best of the rounds."""
    vocab, dim, fields = args.vocab, args.dim, args.fields
    sizes = [b for b in (1, 16, 128, 1_024, 16_384, 65_536) if b < args.batch] + [args.batch]
    table = _filled_adam_table(vocab, dim)
    w = table.lookup(np.arange(vocab), insert=False)
    m, v = np.zeros_like(w), np.zeros_like(w)
    numpy_step = _numpy_adam_step(w, m, v)
    coll = embstore.Collection({f"f{f}": table for f in range(fields)})
    per = vocab // fields
    rng = np.random.default_rng(2)
    rows: dict[str, dict[str, float]] = {}
    for batch in sizes:
        keys = rng.integers(0, per, (fields, batch)) + (np.arange(fields) * per)[:, None]
        offsets = np.arange(batch + 1, dtype=np.int64)
        feed = {f"f{f}": (keys[f], offsets) for f in range(fields)}
        upstream = rng.standard_normal((batch, fields * dim), dtype=np.float32)

        def ours(feed: dict[str, Any] = feed, upstream: np.ndarray = upstream) -> None:
            coll.lookup_pooled(feed)
            coll.apply_pooled_gradients(feed, upstream)

        calls = max(1, 20_000 // (batch * fields))
        best = _paired_us(
            {"ours": ours, "numpy": partial(numpy_step, keys, upstream)}, calls, args.reps + 2
        )
        rows[str(batch)] = {"ours_us": best["ours"], "numpy_us": best["numpy"]}
    return {"vocab": vocab, "dim": dim, "fields": fields, "per_batch": rows}


def report_batch_sizes(c: dict[str, Any]) -> str:
    lines = [
        f"A {c['fields']}-feature Collection training step (pooled forward, backward, Adam; one "
        f"shared {c['vocab']:,}-row table, dim {c['dim']}) against the same step in NumPy on dense "
        "arrays (np.take forward, np.add.at backward, Adam on the touched rows); microseconds per "
        "step, the two measured in turn.",
        "",
        "| batch | embstore Collection | NumPy dense | NumPy / embstore |",
        "| --- | --- | --- | --- |",
    ]
    for batch, r in c["per_batch"].items():
        lines.append(
            f"| {int(batch):,} | {r['ours_us']:,.0f} | {r['numpy_us']:,.0f} | "
            f"{r['numpy_us'] / r['ours_us']:.1f}x |"
        )
    return "\n".join(lines)


BAG_LENGTHS = (1, 4, 26, 100)


def _even_bags(ids: np.ndarray, per: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole bags of ``per`` ids that ``ids`` makes: (ids, offsets)."""
    bags = ids.size // per
    return ids[: bags * per], (np.arange(bags + 1) * per).astype(np.int64)


def bag_lengths(args: argparse.Namespace) -> dict[str, Any]:
    """Pooled lookups of ``batch * fields`` ids (1.7M by default) from a
    ``vocab``-row Adam table, in bags of 1, 4, 26 and 100 ids: lookup_pooled
    against the unpooled lookup of the same ids and torch EmbeddingBag's
    forward (sum, include_last_offset=True, a dense weight of the same
    size); and the full step at 26 ids a bag (pooled forward, backward,
    Adam) against EmbeddingBag(sparse=True) + SparseAdam. Calls measured in
    turn, best of ``reps``."""
    import torch

    vocab, dim = args.vocab, args.dim
    n = args.batch * args.fields
    table = _filled_adam_table(vocab, dim)
    ids = np.random.default_rng(0).integers(0, vocab, n).astype(np.int64)
    emb = torch.nn.EmbeddingBag(vocab, dim, mode="sum", include_last_offset=True)
    rows: dict[str, dict[str, float]] = {}
    for per in BAG_LENGTHS:
        ii, offsets = _even_bags(ids, per)
        bags = offsets.size - 1
        ti, to = torch.from_numpy(ii), torch.from_numpy(offsets)

        def torch_forward(ti: torch.Tensor = ti, to: torch.Tensor = to) -> None:
            with torch.no_grad():
                emb(ti, to)

        best = _paired_us(
            {
                "pooled": partial(table.lookup_pooled, ii, offsets),
                "unpooled": partial(table.lookup, ii),
                "torch": torch_forward,
            },
            1,
            args.reps,
        )
        rows[str(per)] = {f"{k}_s": v / 1e6 for k, v in best.items()} | {"bags": bags}
    ii, offsets = _even_bags(ids, 26)
    grads = np.ones((offsets.size - 1, dim), np.float32)
    sparse = torch.nn.EmbeddingBag(vocab, dim, mode="sum", include_last_offset=True, sparse=True)
    topt = torch.optim.SparseAdam(list(sparse.parameters()), lr=1e-3)
    ti, to, tg = torch.from_numpy(ii), torch.from_numpy(offsets), torch.from_numpy(grads)

    def ours_step() -> None:
        table.lookup_pooled(ii, offsets)
        table.apply_pooled_gradients(ii, offsets, grads)

    def torch_step() -> None:
        topt.zero_grad()
        (sparse(ti, to) * tg).sum().backward()
        topt.step()

    step = _paired_us({"ours": ours_step, "torch": torch_step}, 1, args.reps)
    return {
        "vocab": vocab,
        "dim": dim,
        "ids": n,
        "per_bag_length": rows,
        "step26_ours_s": step["ours"] / 1e6,
        "step26_torch_s": step["torch"] / 1e6,
    }


def report_bags(c: dict[str, Any]) -> str:
    lines = [
        f"Bags of several ids: {c['ids']:,} ids a call from a {c['vocab']:,}-row Adam table, "
        f"dim {c['dim']}; best of the runs, the three calls measured in turn.",
        "",
        "| ids per bag | bags | lookup_pooled | unpooled lookup of the same ids | "
        "torch EmbeddingBag forward | pooled / unpooled | pooled / torch |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for per, r in c["per_bag_length"].items():
        lines.append(
            f"| {per} | {r['bags']:,} | {r['pooled_s'] * 1e3:.1f} ms | {r['unpooled_s'] * 1e3:.1f} ms"
            f" | {r['torch_s'] * 1e3:.1f} ms | {r['pooled_s'] / r['unpooled_s']:.2f}x | "
            f"{r['pooled_s'] / r['torch_s']:.2f}x |"
        )
    lines += [
        "",
        f"Full step at 26 ids a bag (pooled forward, backward, Adam): embstore "
        f"{c['step26_ours_s'] * 1e3:.0f} ms, torch EmbeddingBag + SparseAdam "
        f"{c['step26_torch_s'] * 1e3:.0f} ms ({c['step26_torch_s'] / c['step26_ours_s']:.1f}x).",
    ]
    return "\n".join(lines)


def report_small(c: dict[str, Any]) -> str:
    lines = [
        f"Small calls: {c['rows']:,}-row Adam table, default shards; microseconds per call "
        "(best of 7 rounds, the six calls measured in turn); peers in the same run: np.take on "
        "a dense array of the same rows, a dict of rows + np.stack. lookup is the training "
        "lookup (insert=True, the default), serving is insert=False.",
        "",
        "| keys | lookup | serving | np.take | lookup / np.take | serving / np.take | "
        "dict + np.stack | Adam step | pooled step (4 ids a bag) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, r in c["per_keys"].items():
        take = r["np_take_us"]
        lines.append(
            f"| {int(n):,} | {r['lookup_us']:.1f} | {r['serve_us']:.1f} | {take:.1f} | "
            f"{r['lookup_us'] / take:.1f}x | {r['serve_us'] / take:.1f}x | "
            f"{r['dict_stack_us']:.1f} | {r['adam_step_us']:.1f} | {r['pooled_step_us']:.1f} |"
        )
    one, four = c["serving_calls_per_s"]["1"], c["serving_calls_per_s"]["4"]
    lines += [
        "",
        f"Serving, 128-key lookups (insert=False): 1 thread {one:,.0f} calls/s, "
        f"4 threads {four:,.0f} calls/s ({four / one:.2f}x).",
    ]
    g = c["gil_ceiling"]
    lines.append(
        f"The GIL's bound on this machine, same run: hashlib.sha256 of 2,100 bytes "
        f"({g['call_us']:.1f} us a call, GIL released inside) from 4 threads reaches "
        f"{g['4'] / g['1']:.2f}x the calls/s of one; pure-Python calls (the GIL held "
        f"throughout, as by a small serving lookup) reach {g['held_4'] / g['held_1']:.2f}x."
    )
    return "\n".join(lines)


def report_collection(c: dict[str, Any]) -> str:
    best_step = min(c["torch_per_feature_step_s"], c["torch_shared_step_s"])
    best_fwd = min(c["torch_per_feature_forward_s"], c["torch_shared_forward_s"])
    return "\n".join(
        [
            f"Collection: {c['fields']} features x {c['batch']:,} samples, one id per feature, "
            f"dim {args_dim(c)}, {c['keys']:,} keys (one shared embstore table, Adam).",
            "",
            "| measure | embstore Collection | torch per-feature bags | torch one shared bag | "
            "ratio (best torch / embstore) | target |",
            "| --- | --- | --- | --- | --- | --- |",
            f"| full step: pooled forward + backward + Adam | {c['ours_step_s'] * 1e3:.0f} ms | "
            f"{c['torch_per_feature_step_s'] * 1e3:.0f} ms | {c['torch_shared_step_s'] * 1e3:.0f} ms | "
            f"{best_step / c['ours_step_s']:.1f}x | >= 8x |",
            f"| forward only | {c['ours_forward_s'] * 1e3:.1f} ms | "
            f"{c['torch_per_feature_forward_s'] * 1e3:.1f} ms | {c['torch_shared_forward_s'] * 1e3:.1f} ms"
            f" | {best_fwd / c['ours_forward_s']:.2f}x | embstore <= 2x torch (ratio >= 0.5) |",
        ]
    )


def report_peers(p: dict[str, Any]) -> str:
    ours = p["ours_rowwise_adagrad_step_s"]
    lines = [
        "Row-wise Adagrad, the same ids: embstore Collection step "
        f"{ours * 1e3:.0f} ms (one table per feature).",
    ]
    for key, name in (
        ("fbgemm", "FBGEMM CPU table-batched embedding"),
        ("torchrec", "TorchRec FusedEmbeddingBagCollection"),
    ):
        if f"{key}_skipped" in p:
            lines.append(
                f"{name}: skipped, not importable here ({p[f'{key}_skipped']}); it pins its own "
                "torch: bash scripts/torchrec_check.sh makes a venv with it."
            )
        else:
            t = p[f"{key}_rowwise_adagrad_step_s"]
            lines.append(
                f"{name} {p[key]} (forward + backward with its fused optimizer): {t * 1e3:.0f} ms, "
                f"{t / ours:.1f}x embstore's time."
            )
    return "\n".join(lines)


def args_dim(c: dict[str, Any]) -> int:
    return int(c.get("dim", 64))


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    t1, t2, mem = res["threads1"], res["threads2"], res["memory"]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = [
        f"Machine: {cpu}, {os.cpu_count()} cores, SIMD backend {embstore.Table(1).simd}; "
        f"embstore {embstore.__version__}, numpy {np.__version__}, torch {_torch_version()}.",
        f"Workload: {res['vocab']:,}-key table, dim {res['dim']}, batch of {res['ids']:,} ids "
        f"({res['distinct']:,} distinct); best of {args.reps} runs after a warm-up.",
        "",
        "| measure | embstore | peer | ratio (peer / embstore) | target |",
        "| --- | --- | --- | --- | --- |",
        f"| lookup of existing keys vs torch.index_select | {res['lookup_s'] * 1e3:.1f} ms | "
        f"{res['torch_index_select_s'] * 1e3:.1f} ms | {res['torch_index_select_s'] / res['lookup_s']:.2f}x"
        f" | embstore <= 1.5x the peer's time (ratio >= 0.67) |",
        f"| lookup vs dict of NumPy rows + np.stack | {res['lookup_s'] * 1e3:.1f} ms | "
        f"{res['dict_stack_s'] * 1e3:.0f} ms | {res['dict_stack_s'] / res['lookup_s']:.0f}x | >= 50x |",
        f"| Adam step vs torch.optim.SparseAdam | {res['apply_adam_s'] * 1e3:.1f} ms | "
        f"{res['torch_sparse_adam_s'] * 1e3:.0f} ms | "
        f"{res['torch_sparse_adam_s'] / res['apply_adam_s']:.1f}x | >= 8x |",
        f"| insert {res['distinct']:,} new keys, lookup(insert=True), Adam table | "
        f"{res['insert_new_rows_per_s'] / 1e6:.2f} M rows/s | | | >= 10 M rows/s |",
        f"| insert {res['distinct']:,} new keys, lookup(insert=True), Adam table after "
        f"table.reserve({res['distinct']:,}) ({res['reserve_s'] * 1e3:.0f} ms) | "
        f"{res['insert_reserved_rows_per_s'] / 1e6:.2f} M rows/s | | | >= 10 M rows/s |",
        f"| insert {res['distinct']:,} new keys, assign, no-optimizer table | "
        f"{res['assign_new_rows_per_s'] / 1e6:.2f} M rows/s | | | >= 10 M rows/s |",
        f"| 2 threads vs 1 thread, lookup | {t2['lookup_s'] * 1e3:.1f} ms | {t1['lookup_s'] * 1e3:.1f} ms "
        f"(1 thread) | {t1['lookup_s'] / t2['lookup_s']:.2f}x | >= 1.7x |",
        f"| 2 threads vs 1 thread, Adam apply | {t2['apply_adam_s'] * 1e3:.1f} ms | "
        f"{t1['apply_adam_s'] * 1e3:.1f} ms (1 thread) | {t1['apply_adam_s'] / t2['apply_adam_s']:.2f}x"
        f" | >= 1.7x |",
        f"| memory at {mem['rows']:,} keys (dim {res['dim']}, no optimizer): stats bytes | "
        f"{mem['stats_bytes'] / 2**20:.0f} MiB | payload {mem['payload_bytes'] / 2**20:.0f} MiB | "
        f"+{mem['stats_overhead_per_key']:.1f} B/key | <= payload + 32 B/key |",
        f"| memory at {mem['rows']:,} keys: resident growth | {mem['rss_growth_bytes'] / 2**20:.0f} MiB"
        f" | payload {mem['payload_bytes'] / 2**20:.0f} MiB | +{mem['rss_overhead_per_key']:.1f} B/key"
        f" | <= payload + 32 B/key |",
        "",
        f"lookup result equal to torch.index_select: {res['lookup_correct']}; "
        f"filling the table by lookup: {res['fill_rows_per_s'] / 1e6:.2f} M rows/s.",
        "",
        report_collection(res["collection"]),
        "",
        report_peers(res["collection"]["peers"]),
        "",
        report_small(res["small_calls"]),
    ]
    return "\n".join(lines)


def _torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:
        return "absent"


def main(argv: list[str] | None = None) -> int:
    p = Parser("python -m embstore bench", __doc__)
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (vocab 50,000, batch 2,048, 200,000 memory rows, 2 reps): a smoke run",
    )
    p.add_argument("--vocab", type=positive_int, default=2_000_000, help="distinct ids per table")
    p.add_argument("--batch", type=positive_int, default=65_536, help="samples per step")
    p.add_argument(
        "--fields", type=positive_int, default=26, help="features of the Collection step"
    )
    p.add_argument("--dim", type=positive_int, default=64, help="row width")
    p.add_argument(
        "--reps", type=positive_int, default=3, help="repetitions of each measure (best taken)"
    )
    p.add_argument(
        "--mem-rows", type=positive_int, default=10_000_000, help="rows of the memory measure"
    )
    p.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    p.add_argument(
        "--checkpoint",
        action="store_true",
        help="measure only checkpoint save/load against cp (needs ~3x the table's "
        "size in free disk)",
    )
    p.add_argument(
        "--checkpoint-rows",
        type=positive_int,
        default=10_000_000,
        help="rows of the --checkpoint measure",
    )
    p.add_argument(
        "--policy",
        action="store_true",
        help="measure only the cost of the memory policies' bookkeeping",
    )
    p.add_argument(
        "--batch-sizes",
        action="store_true",
        help="measure only the Collection step at batch sizes 1 to --batch against NumPy",
    )
    p.add_argument(
        "--bags",
        action="store_true",
        help="measure only pooled lookups of bags of 1, 4, 26 and 100 ids against torch",
    )
    p.add_argument(
        "--dir", default=None, help="where the checkpoint benchmark writes (default: a temp dir)"
    )
    p.add_argument("--child", choices=["core", "memory"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not (args.checkpoint or args.policy or args.child):
        require(p, "torch", "torch", "the peer comparison")
    if args.quick:
        args.vocab, args.batch, args.mem_rows, args.reps = 50_000, 2_048, 200_000, 2
    if args.checkpoint:
        rows = 200_000 if args.quick else args.checkpoint_rows
        res = checkpoint_compare(rows, args.dim, max(2, args.reps - 1), args.dir)
        print(json.dumps(res) if args.json else report_checkpoint(res))
        return 0
    if args.batch_sizes:
        res = batch_sizes(args)
        print(json.dumps(res) if args.json else report_batch_sizes(res))
        return 0
    if args.bags:
        res = bag_lengths(args)
        print(json.dumps(res) if args.json else report_bags(res))
        return 0
    if args.policy:
        res = policy_costs(args.vocab, args.batch, args.fields, args.dim, args.reps)
        print(json.dumps(res) if args.json else report_policies(res, args))
        return 0
    if args.child == "core":
        print(json.dumps(core(args.vocab, args.batch, args.fields, args.dim, args.reps)))
        return 0
    if args.child == "memory":
        print(json.dumps(memory(args.mem_rows, args.dim)))
        return 0
    res = compare(args)
    print(json.dumps(res) if args.json else report(res, args))
    return 0
