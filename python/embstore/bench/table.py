"""The table against its peers at full size: lookup against
``torch.index_select`` and a dict of rows, the Adam step against
``torch.optim.SparseAdam``, inserts, thread scaling and memory (in child
processes: a fresh pool size, a fresh RSS)."""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

import embstore
from embstore import optim
from embstore._progress import Bar
from embstore.bench._timing import _best, _rss, _torch_version, machine_facts
from embstore.bench.collection import collection_compare, report_collection, report_peers
from embstore.bench.small import report_small, small_calls
from embstore.bench.targets import cell, judge, sizes_note


def _numpy_fill_s(nbytes: int) -> float:
    """Seconds NumPy takes to write ``nbytes`` into fresh memory, page
    faults included, as NumPy's own large arrays get it: a private
    anonymous mapping of its own (never memory an allocator kept from an
    earlier free) that asks for huge pages. (Until 2026-11-27 the mapping
    was ``mmap.mmap(-1, n)``'s default, shared: shmem, which a kernel in THP
    mode ``madvise`` backs with 4 KiB pages whatever it is asked; NumPy's
    own arrays filled the same bytes 4-7x faster on machine E.)"""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    fresh = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        fresh.madvise(mmap.MADV_HUGEPAGE)
    t0 = time.perf_counter()
    np.frombuffer(fresh, np.float32).fill(1.0)
    took = time.perf_counter() - t0
    fresh.close()
    return took


def _warm_bytes(want: int) -> int:
    """``want``, or half the memory the kernel says is available where that
    is less (``MemAvailable``; ``want`` where it cannot tell)."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return want
    return min(want, kib * 1024 // 2)


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
    bar = Bar(8, "bench", unit="measure", show=False if args.quiet else None)
    bar.update_to(0, "lookups")

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

    bar.update_to(1, "Adam steps")
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

    bar.update_to(2, "inserts")
    # On a VM, the first touch of memory the guest has never used costs the
    # host's fault too (machine E: NumPy's fill below ran at 0.6M or 12.6M
    # rows/s by whether the memory was new to the guest): touched and
    # freed first, the memory these inserts and their peers map (about 6x
    # the new Adam rows' bytes: two tables' growth, a reserve, two fills)
    # costs the same to each, whichever comes first.
    _numpy_fill_s(_warm_bytes(8 * distinct * (dim + table.state_len) * 4))
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
    # The peer of both: NumPy writing the same bytes (rows and Adam state)
    # into fresh memory (_numpy_fill_s).
    res["numpy_fill_s"] = _numpy_fill_s(distinct * (dim + table.state_len) * 4)
    res["numpy_fill_rows_per_s"] = distinct / res["numpy_fill_s"]
    plain = embstore.Table(dim)
    values = np.zeros((distinct, dim), np.float32)
    t0 = time.perf_counter()
    plain.assign(new_keys, values)
    res["assign_new_rows_per_s"] = distinct / (time.perf_counter() - t0)
    # The assign's peer: NumPy writing its rows' bytes (no state) into fresh
    # memory, as above.
    res["numpy_fill_plain_rows_per_s"] = distinct / _numpy_fill_s(distinct * dim * 4)

    bar.update_to(3, "threads")
    one = _child("core", args, threads=1)
    two = _child("core", args, threads=2)
    res.update(threads1=one, threads2=two)
    bar.update_to(5, "memory")
    res["memory"] = _child("memory", args)
    bar.update_to(6, "Collection step")
    res["collection"] = collection_compare(args)
    res["collection"]["dim"] = dim
    bar.update_to(7, "small calls")
    res["small_calls"] = small_calls(dim, args.quick)
    bar.update_to(8)
    bar.close()
    res["verdicts"] = judge(res, args)
    res["machine"] = machine_facts()
    return res


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    t1, t2, mem = res["threads1"], res["threads2"], res["memory"]
    m = res["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, SIMD backend {m['simd']}, transparent "
        f"huge pages {m['thp']}; embstore {m['embstore']}, numpy {m['numpy']}, "
        f"torch {_torch_version()}.",
        f"Workload: {res['vocab']:,}-key table, dim {res['dim']}, batch of {res['ids']:,} ids "
        f"({res['distinct']:,} distinct); best of {args.reps} runs after a warm-up.",
        "",
        "| measure | embstore | peer | ratio (peer / embstore) | target |",
        "| --- | --- | --- | --- | --- |",
        f"| lookup of existing keys vs torch.index_select | {res['lookup_s'] * 1e3:.1f} ms | "
        f"{res['torch_index_select_s'] * 1e3:.1f} ms | {res['torch_index_select_s'] / res['lookup_s']:.2f}x"
        f" | {cell(res, 'lookup_vs_index_select')} |",
        f"| lookup vs dict of NumPy rows + np.stack | {res['lookup_s'] * 1e3:.1f} ms | "
        f"{res['dict_stack_s'] * 1e3:.0f} ms | {res['dict_stack_s'] / res['lookup_s']:.0f}x | {cell(res, 'lookup_vs_dict')} |",
        f"| Adam step vs torch.optim.SparseAdam | {res['apply_adam_s'] * 1e3:.1f} ms | "
        f"{res['torch_sparse_adam_s'] * 1e3:.0f} ms | "
        f"{res['torch_sparse_adam_s'] / res['apply_adam_s']:.1f}x | {cell(res, 'adam_vs_sparse_adam')} |",
        f"| insert {res['distinct']:,} new keys, lookup(insert=True), Adam table vs NumPy "
        f"filling the same bytes into fresh memory | {res['insert_new_rows_per_s'] / 1e6:.2f} M "
        f"rows/s | {res['numpy_fill_rows_per_s'] / 1e6:.2f} M rows/s | "
        f"{res['insert_new_rows_per_s'] / res['numpy_fill_rows_per_s']:.2f}x | "
        f"{cell(res, 'insert_rows_per_s')} |",
        f"| insert {res['distinct']:,} new keys, lookup(insert=True), Adam table after "
        f"table.reserve({res['distinct']:,}) | "
        f"{res['insert_reserved_rows_per_s'] / 1e6:.2f} M rows/s | "
        f"{res['numpy_fill_rows_per_s'] / 1e6:.2f} M rows/s | "
        f"{res['insert_reserved_rows_per_s'] / res['numpy_fill_rows_per_s']:.2f}x | "
        f"{cell(res, 'insert_reserved_rows_per_s')} |",
        f"| table.reserve({res['distinct']:,}) vs the NumPy fill | "
        f"{res['reserve_s'] * 1e3:.0f} ms | {res['numpy_fill_s'] * 1e3:.0f} ms | "
        f"{res['numpy_fill_s'] / res['reserve_s']:.2f}x | {cell(res, 'reserve_vs_numpy_fill')} |",
        f"| insert {res['distinct']:,} new keys, assign, no-optimizer table vs NumPy filling its rows' bytes into fresh memory | "
        f"{res['assign_new_rows_per_s'] / 1e6:.2f} M rows/s | "
        f"{res['numpy_fill_plain_rows_per_s'] / 1e6:.2f} M rows/s | "
        f"{res['assign_new_rows_per_s'] / res['numpy_fill_plain_rows_per_s']:.2f}x | "
        f"{cell(res, 'assign_rows_per_s')} |",
        f"| 2 threads vs 1 thread, lookup | {t2['lookup_s'] * 1e3:.1f} ms | {t1['lookup_s'] * 1e3:.1f} ms "
        f"(1 thread) | {t1['lookup_s'] / t2['lookup_s']:.2f}x | {cell(res, 'lookup_2_threads')} |",
        f"| 2 threads vs 1 thread, Adam apply | {t2['apply_adam_s'] * 1e3:.1f} ms | "
        f"{t1['apply_adam_s'] * 1e3:.1f} ms (1 thread) | {t1['apply_adam_s'] / t2['apply_adam_s']:.2f}x"
        f" | {cell(res, 'adam_2_threads')} |",
        f"| memory at {mem['rows']:,} keys (dim {res['dim']}, no optimizer): stats bytes | "
        f"{mem['stats_bytes'] / 2**20:.0f} MiB | payload {mem['payload_bytes'] / 2**20:.0f} MiB | "
        f"+{mem['stats_overhead_per_key']:.1f} B/key | {cell(res, 'memory_stats_bytes')} |",
        f"| memory at {mem['rows']:,} keys: resident growth | {mem['rss_growth_bytes'] / 2**20:.0f} MiB"
        f" | payload {mem['payload_bytes'] / 2**20:.0f} MiB | +{mem['rss_overhead_per_key']:.1f} B/key"
        f" | {cell(res, 'memory_resident')} |",
        "",
        f"lookup result equal to torch.index_select: {res['lookup_correct']}; "
        f"filling the table by lookup: {res['fill_rows_per_s'] / 1e6:.2f} M rows/s.",
        "",
        report_collection(res["collection"], res),
        "",
        sizes_note(args),
        "",
        report_peers(res["collection"]["peers"]),
        "",
        report_small(res["small_calls"]),
    ]
    return "\n".join(lines)
