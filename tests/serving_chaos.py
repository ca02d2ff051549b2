"""The serving chaos run: a trainer publishing to one checkpoint directory
(incremental publishes with removals, the compactions they make, a full
save now and then), SIGKILLed at random and restarted from what it
published; reader processes following the directory, one of them forked
while it follows; every reader checks each lookup against a whole-version
invariant, and the directory's files are counted against the bound.

The invariant: version ``V`` of the table holds, for key ``k`` of
``0..KEYS``, the row of ``V``'s schedule (changed at the versions with
``(v + 7k) % 10 == 0``, removed at those with ``(v + 3k + 5) % 10 == 0``,
change first), every column the version of its last change; key ``-1``
holds ``V``. One lookup of every key must read one version whole: the
marker's ``V``, every key's presence and value as the schedule says at
``V``. A lookup that mixes two publishes, serves a removed key or misses a
present one counts as mixed.

``python -m tests.serving_chaos --seconds 600`` runs it by hand (the
figures in benches/RESULTS.md); tests/test_serving_chaos.py runs it
briefly in the slow suite.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import pathlib
import random
import signal
import sys
import time
from typing import Any

import numpy as np

KEYS = 2_000
DIM = 8
SHARDS = 4
MARKER = -1


def expected(v: int) -> tuple[np.ndarray, np.ndarray]:
    """Presence and value of keys ``0..KEYS`` at version ``v``."""
    k = np.arange(KEYS, dtype=np.int64)
    changed = v - (v + 7 * k) % 10
    removed = v - (v + 3 * k + 5) % 10
    present = (removed < 1) | (changed > removed)
    return present, np.where(changed >= 1, changed, 0).astype(np.float32)


def _trainer(path: str, full_every: int) -> None:
    """Publishes versions until killed; resumes from what was published."""
    import embstore
    from embstore import optim

    keys = np.arange(KEYS, dtype=np.int64)
    if os.path.exists(os.path.join(path, "manifest.json")):
        t = embstore.Table.load(path)
        v = int(t.lookup(np.array([MARKER]), insert=False)[0, 0])
    else:
        t = embstore.Table(DIM, optimizer=optim.SGD(lr=0.1), num_shards=SHARDS, seed=5)
        t.assign(keys, np.zeros((KEYS, DIM), np.float32))
        t.assign(np.array([MARKER]), np.zeros((1, DIM), np.float32))
        t.save(path, with_optimizer=False)
        v = 0
    while True:
        v += 1
        ch = keys[(v + 7 * keys) % 10 == 0]
        t.assign(ch, np.full((ch.size, DIM), v, np.float32))
        t.remove(keys[(v + 3 * keys + 5) % 10 == 0])
        t.assign(np.array([MARKER]), np.full((1, DIM), v, np.float32))
        t.save(path, incremental=v % full_every != 0, with_optimizer=False)


def _check(rows: np.ndarray, found: np.ndarray) -> tuple[int, bool]:
    """The version a lookup read, and whether it read it whole."""
    if not found[0]:
        return -1, False
    v = int(rows[0, 0])
    present, value = expected(v)
    ok = bool(
        (rows[0] == v).all()
        and np.array_equal(found[1:], present)
        and (rows[1:][present] == value[present, None]).all()
    )
    return v, ok


def _reader(path: str, seconds: float, out: str, fork_at: float | None) -> None:
    """Follows ``path`` for ``seconds`` and checks every lookup; with
    ``fork_at``, forks a child then that follows on (inherited follower)."""
    import embstore

    keys = np.concatenate([[MARKER], np.arange(KEYS)]).astype(np.int64)
    m = embstore.Table.load(path, mmap=True, follow=0.05)
    start = time.monotonic()
    calls = mixed = 0
    versions: list[int] = []
    child = None
    forked = False
    while time.monotonic() - start < seconds:
        if fork_at is not None and not forked and time.monotonic() - start > fork_at:
            forked = True
            child = os.fork()
            if child == 0:
                out, versions, calls, mixed = out + ".child", [], 0, 0
                seconds = min(seconds - (time.monotonic() - start), 5.0)
                start, fork_at = time.monotonic(), None
                continue
        rows, found = m.lookup(keys, return_found=True)
        v, ok = _check(np.asarray(rows), np.asarray(found))
        calls += 1
        mixed += not ok
        versions.append(v)
    err = m.follow_error
    result = {
        "calls": calls,
        "mixed": mixed,
        "first": versions[0] if versions else None,
        "last": versions[-1] if versions else None,
        "backwards": sum(b < a for a, b in itertools.pairwise(versions)),
        "follow_error": None if err is None else str(err),
    }
    pathlib.Path(out).write_text(json.dumps(result))
    if child == 0:
        os._exit(0)
    if child:
        os.waitpid(child, 0)


def _files(path: str) -> tuple[int, int, dict[str, int]]:
    """Checkpoint files in ``path``, how many the manifest names, and what
    the rest are (listed for deletion as kept for a reader, or neither:
    a publish in flight or a killed one's leftovers)."""
    try:
        names = os.listdir(path)
        m = json.loads(pathlib.Path(path, "manifest.json").read_text())
    except (OSError, ValueError):
        return 0, 0, {}
    try:
        retired = set(pathlib.Path(path, ".embstore-retired").read_text().split())
    except OSError:
        retired = set()
    named_set = {f["name"] for link in m["chain"] for f in link["files"]} | {
        link["removed"]["name"] for link in m["chain"] if link["removed"] is not None
    }
    held = [n for n in names if n.endswith(".safetensors")]
    parts = {
        "named": sum(n in named_set for n in held),
        "retired": sum(n in retired and n not in named_set for n in held),
        "other": sum(n not in named_set and n not in retired for n in held),
    }
    return len(held), len(named_set), parts


def run(seconds: float, root: pathlib.Path, seed: int, readers: int = 3) -> dict[str, Any]:
    """The chaos run (see the module docs); returns its figures."""
    rng = random.Random(seed)
    path = str(root / "ckpt")
    ctx = mp.get_context("spawn")
    trainer = ctx.Process(target=_trainer, args=(path, 25), daemon=True)
    trainer.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(path, "manifest.json")):
        assert time.monotonic() < deadline, "the trainer never published"
        time.sleep(0.05)
    outs = [str(root / f"reader{i}.json") for i in range(readers)]
    procs = [
        ctx.Process(target=_reader, args=(path, seconds, outs[i], seconds / 2 if i == 0 else None))
        for i in range(readers)
    ]
    for p in procs:
        p.start()
    kills = worst_held = samples = longest = 0
    worst_parts: dict[str, int] = {}
    end = time.monotonic() + seconds
    next_kill = time.monotonic() + rng.uniform(1, 4)
    while time.monotonic() < end:
        time.sleep(0.1)
        held, named, parts = _files(path)
        if named:
            # The bound, judged at the end: the chain, the chain it
            # replaced (kept for a reader that held the directory through
            # a publish's clean-up wait), a publish in flight and a killed
            # publish's leftovers (one link each: a file per shard and the
            # removals' file).
            samples += 1
            longest = max(longest, named)
            if held > worst_held:
                worst_held, worst_parts = held, parts
        if time.monotonic() > next_kill:
            os.kill(trainer.pid, signal.SIGKILL)  # type: ignore[arg-type]
            trainer.join(30)
            kills += 1
            trainer = ctx.Process(target=_trainer, args=(path, 25), daemon=True)
            trainer.start()
            next_kill = time.monotonic() + rng.uniform(1, 4)
    os.kill(trainer.pid, signal.SIGKILL)  # type: ignore[arg-type]
    trainer.join(30)
    hangs = 0
    for p in procs:
        p.join(seconds + 60)
        if p.is_alive():
            hangs += 1
            p.kill()
    results = []
    for o in [*outs, outs[0] + ".child"]:
        try:
            results.append(json.loads(pathlib.Path(o).read_text()))
        except (OSError, ValueError):
            hangs += 1
    import embstore

    final = embstore.Table.load(path)
    v = int(final.lookup(np.array([MARKER]), insert=False)[0, 0])
    return {
        "seed": seed,
        "seconds": seconds,
        "trainer_kills": kills,
        "versions_published": v,
        "readers": results,
        "mixed": sum(r["mixed"] for r in results),
        "calls": sum(r["calls"] for r in results),
        "hangs": hangs,
        "worst_files": worst_held,
        "worst_files_were": worst_parts,
        "longest_chain_files": longest,
        "bound": 2 * longest + 2 * (SHARDS + 1),
        "worst_beyond_bound": max(0, worst_held - 2 * longest - 2 * (SHARDS + 1)),
        "file_samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--seconds", type=float, default=60)
    a.add_argument("--seed", type=int, default=None)
    a.add_argument("--root", default=None)
    args = a.parse_args(argv)
    import tempfile

    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(31)
    with tempfile.TemporaryDirectory(dir=args.root) as d:
        r = run(args.seconds, pathlib.Path(d), seed)
    print(json.dumps(r, indent=1))
    ok = r["mixed"] == 0 and r["hangs"] == 0 and r["worst_beyond_bound"] <= 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
