"""The cost of the memory policies' bookkeeping (admission, TTL, capacity,
16-bit rows) against a plain table."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import embstore
from embstore import optim
from embstore.bench._timing import _best

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
