"""Peer comparison: embstore against what a user would otherwise use, in one
process on one machine, reported as ratios.

    python -m embstore bench            # full sizes (about 2 minutes on 2 cores)
    python -m embstore bench --quick    # small sizes, a smoke run

Peers: ``torch.index_select`` on a dense tensor and a Python dict of NumPy
rows (lookup), ``torch.optim.SparseAdam`` (Adam step). Thread scaling and
memory are measured in child processes (a fresh pool size, a fresh RSS).
Small calls (1 to 16,384 keys: lookup, Adam step, pooled step; 1 and 4
serving threads) are measured against np.take and a dict of rows.
``--readers``: the p99 of serving lookups next to a writer of the same
table and of another one. ``--serving``: many readers of one mapped table
(processes and threads) and the freshness of followers under large deltas
(:mod:`embstore.bench.serving`).

``--json`` prints the figures; the comparison's validate against the JSON
Schema at ``embstore/bench/schema.json`` (:data:`SCHEMA`; ``--schema``
prints it), with the machine they were measured on under ``machine``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from embstore._cli import Parser, positive_int, require
from embstore.bench.bags import bag_lengths, report_bags
from embstore.bench.checkpoint import checkpoint_compare, report_checkpoint
from embstore.bench.collection import batch_sizes, report_batch_sizes
from embstore.bench.policy import POLICIES, policy_costs, report_policies
from embstore.bench.readers import reader_latency, report_readers
from embstore.bench.serving import report_serving, serving_bench
from embstore.bench.table import compare, core, memory, report

__all__ = ["POLICIES", "SCHEMA", "main"]

#: The JSON Schema (draft 2020-12) of ``python -m embstore bench --json``.
SCHEMA = pathlib.Path(__file__).with_name("schema.json")


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_fits(p: Parser, args: argparse.Namespace) -> None:
    """Refuses (one line, exit 2) sizes no table takes or whose arrays
    cannot fit in the memory available, before any work."""
    if args.dim > 1 << 20:
        p.error(f"--dim: expected at most {1 << 20} (the widest row a table takes), got {args.dim}")
    # The largest single array of a run (the table's rows, or a step's
    # ids' rows): a run needs several such, so one that alone exceeds the
    # memory available cannot run.
    need = 4 * args.dim * max(args.vocab, args.mem_rows, args.batch * args.fields)
    have = _available_bytes()
    if have is not None and need > have:
        p.error(
            f"--vocab {args.vocab}, --batch {args.batch}, --fields {args.fields}, --dim "
            f"{args.dim} need about {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB are available"
        )


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
    p.add_argument(
        "--json",
        action="store_true",
        help="print the raw figures as JSON (the comparison's: valid against --schema)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar (drawn only on a terminal, by tqdm where installed)",
    )
    p.add_argument(
        "--schema",
        action="store_true",
        help="print the JSON Schema of the comparison's --json output and exit",
    )
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
        "--readers",
        action="store_true",
        help="measure only the p99 of 128-key serving lookups next to a writer of the same "
        "table and of another one",
    )
    p.add_argument(
        "--serving",
        action="store_true",
        help="measure only the standalone cache at load: many readers of a mapped table, "
        "and followers' freshness under 1M-row deltas of a 10M-row table (needs ~6 GB of "
        "disk and ~8 GB of memory; --quick: small)",
    )
    p.add_argument(
        "--serving-readers",
        type=positive_int,
        default=16,
        help="reader processes (and threads) of the --serving measure",
    )
    p.add_argument(
        "--dir",
        default=None,
        help="where the checkpoint and serving benchmarks write (default: a temp dir)",
    )
    p.add_argument("--child", choices=["core", "memory"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.schema:
        print(SCHEMA.read_text(), end="")
        return 0
    if not (args.checkpoint or args.policy or args.readers or args.serving or args.child):
        require(p, "torch", "torch", "the peer comparison")
    if args.quick:
        args.vocab, args.batch, args.mem_rows, args.reps = 50_000, 2_048, 200_000, 2
    _check_fits(p, args)
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
    if args.serving:
        res = serving_bench(args)
        print(json.dumps(res) if args.json else report_serving(res))
        return 0
    if args.readers:
        res = reader_latency(args)
        print(json.dumps(res) if args.json else report_readers(res))
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
