"""The targets of the peer comparison, each judged met or not met on the
figures of one run, and only at the sizes it is for: a target set for a
2M-key table and 65,536-sample batches says nothing about a ``--quick`` run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The sizes every target below is for (the defaults of ``python -m embstore bench``).
FULL_SIZES = {"vocab": 2_000_000, "batch": 65_536, "fields": 26, "dim": 64, "mem_rows": 10_000_000}


def _insert_bound(r: dict[str, Any], fill: str = "numpy_fill_rows_per_s") -> float:
    """Rows/s an insert target asks for (see TARGETS): of NumPy's fill
    ``fill`` (of the same bytes as the rows inserted)."""
    return float(min(1e7, r[fill] / 1.5))


def _coll_best(c: dict[str, Any], what: str) -> float:
    return float(min(c[f"torch_per_feature_{what}_s"], c[f"torch_shared_{what}_s"]))


@dataclass(frozen=True)
class Target:
    """``value(res)`` compared with ``bound``: at least it (``low=True``) or at most."""

    name: str
    text: str
    value: Callable[[dict[str, Any]], float]
    bound: float
    low: bool = True

    def met(self, res: dict[str, Any]) -> bool:
        v = self.value(res)
        return v >= self.bound if self.low else v <= self.bound


TARGETS = [
    Target(
        "lookup_vs_index_select",
        "embstore <= 1.5x the peer's time (ratio >= 0.67)",
        lambda r: r["torch_index_select_s"] / r["lookup_s"],
        0.67,
    ),
    Target("lookup_vs_dict", ">= 50x", lambda r: r["dict_stack_s"] / r["lookup_s"], 50),
    Target(
        "adam_vs_sparse_adam",
        ">= 8x",
        lambda r: r["torch_sparse_adam_s"] / r["apply_adam_s"],
        8,
    ),
    # Fresh rows cost a page fault per page wherever they are written: the
    # bound is the lower of 10 M rows/s and 1/1.5 of NumPy filling the same
    # bytes into fresh memory in the same run (a machine whose page faults
    # are slow bounds both).
    Target(
        "insert_rows_per_s",
        ">= 10 M rows/s, or 1/1.5 of a NumPy fill where lower",
        lambda r: r["insert_new_rows_per_s"] / _insert_bound(r),
        1.0,
    ),
    Target(
        "insert_reserved_rows_per_s",
        ">= 10 M rows/s, or 1/1.5 of a NumPy fill where lower",
        lambda r: r["insert_reserved_rows_per_s"] / _insert_bound(r),
        1.0,
    ),
    Target(
        "reserve_vs_numpy_fill",
        "reserve no slower than a NumPy fill of the same bytes",
        lambda r: r["numpy_fill_s"] / r["reserve_s"],
        1.0,
    ),
    Target(
        "assign_rows_per_s",
        ">= 10 M rows/s, or 1/1.5 of a NumPy fill where lower",
        lambda r: r["assign_new_rows_per_s"] / _insert_bound(r, "numpy_fill_plain_rows_per_s"),
        1.0,
    ),
    Target(
        "lookup_2_threads",
        ">= 1.7x",
        lambda r: r["threads1"]["lookup_s"] / r["threads2"]["lookup_s"],
        1.7,
    ),
    Target(
        "adam_2_threads",
        ">= 1.7x",
        lambda r: r["threads1"]["apply_adam_s"] / r["threads2"]["apply_adam_s"],
        1.7,
    ),
    Target(
        "memory_stats_bytes",
        "<= payload + 32 B/key",
        lambda r: r["memory"]["stats_overhead_per_key"],
        32,
        low=False,
    ),
    Target(
        "memory_resident",
        "<= payload + 32 B/key",
        lambda r: r["memory"]["rss_overhead_per_key"],
        32,
        low=False,
    ),
    Target(
        "collection_step_vs_torch",
        ">= 8x",
        lambda r: _coll_best(r["collection"], "step") / r["collection"]["ours_step_s"],
        8,
    ),
    Target(
        "collection_forward_vs_torch",
        "embstore <= 2x torch (ratio >= 0.5)",
        lambda r: _coll_best(r["collection"], "forward") / r["collection"]["ours_forward_s"],
        0.5,
    ),
]

BY_NAME = {t.name: t for t in TARGETS}


def at_full_sizes(args: argparse.Namespace) -> bool:
    """Whether this run measured at the sizes the targets are for."""
    return all(getattr(args, k) == v for k, v in FULL_SIZES.items())


def judge(res: dict[str, Any], args: argparse.Namespace) -> dict[str, str]:
    """Each target's verdict: "met", "not met", or "not judged" when the run
    was at other sizes than :data:`FULL_SIZES`."""
    full = at_full_sizes(args)
    return {t.name: ("met" if t.met(res) else "not met") if full else "not judged" for t in TARGETS}


def cell(res: dict[str, Any], name: str) -> str:
    """A report's target cell: the target and its verdict in this run."""
    return f"{BY_NAME[name].text}: {res['verdicts'][name]}"


def sizes_note(args: argparse.Namespace) -> str:
    if at_full_sizes(args):
        return "Targets judged at the sizes they are for."
    sizes = ", ".join(f"{k} {v:,}" for k, v in FULL_SIZES.items())
    return f"Targets not judged: they are for {sizes} (the defaults); this run used other sizes."
