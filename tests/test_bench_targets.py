"""The bench's verdicts: each target met or not met on a run's figures, and
judged only at the sizes it is for."""

from __future__ import annotations

import argparse
from typing import Any

from embstore.bench import targets


def _figures(scale: float) -> dict[str, Any]:
    """A run whose every ratio is ``scale`` times its target (scale > 1: all
    met; < 1: none)."""
    coll = {
        "torch_per_feature_step_s": 8.0 * scale,
        "torch_shared_step_s": 9.0 * scale,
        "ours_step_s": 1.0,
        "torch_per_feature_forward_s": 0.5 * scale,
        "torch_shared_forward_s": 0.6 * scale,
        "ours_forward_s": 1.0,
    }
    return {
        "torch_index_select_s": 0.67 * scale,
        "lookup_s": 1.0,
        "dict_stack_s": 50.0 * scale,
        "torch_sparse_adam_s": 8.0 * scale,
        "apply_adam_s": 1.0,
        "insert_new_rows_per_s": 1e7 * scale,
        "insert_reserved_rows_per_s": 1e7 * scale,
        "numpy_fill_rows_per_s": 1.5e7,
        "numpy_fill_s": 1.0 * scale,
        "reserve_s": 1.0,
        "assign_new_rows_per_s": 1e7 * scale,
        "numpy_fill_plain_rows_per_s": 4.5e7,
        "threads1": {"lookup_s": 1.7 * scale, "apply_adam_s": 1.7 * scale},
        "threads2": {"lookup_s": 1.0, "apply_adam_s": 1.0},
        "memory": {"stats_overhead_per_key": 32.0 / scale, "rss_overhead_per_key": 32.0 / scale},
        "collection": coll,
    }


def _args(**sizes: int) -> argparse.Namespace:
    return argparse.Namespace(**{**targets.FULL_SIZES, **sizes})


def test_every_target_is_met_above_its_bound_and_not_met_below() -> None:
    assert set(targets.judge(_figures(1.05), _args()).values()) == {"met"}
    assert set(targets.judge(_figures(0.95), _args()).values()) == {"not met"}


def test_a_run_at_other_sizes_judges_no_target() -> None:
    verdicts = targets.judge(_figures(2.0), _args(vocab=50_000))
    assert set(verdicts.values()) == {"not judged"}
    assert "not judged" in targets.sizes_note(_args(vocab=50_000))
    assert targets.sizes_note(_args()).startswith("Targets judged")


def test_a_cell_names_the_target_and_its_verdict() -> None:
    res = _figures(1.05)
    res["verdicts"] = targets.judge(res, _args())
    assert targets.cell(res, "adam_vs_sparse_adam") == ">= 8x: met"


def test_the_insert_bound_is_the_lower_of_10m_and_a_numpy_fill() -> None:
    """Where NumPy itself fills fresh memory slowly (page faults), the insert
    targets ask for 1/1.5 of its rate; elsewhere for 10 M rows/s."""
    slow_faults = {**_figures(1.05), "numpy_fill_rows_per_s": 3e6, "insert_new_rows_per_s": 2.1e6}
    assert targets.judge(slow_faults, _args())["insert_rows_per_s"] == "met"
    slow_faults["insert_new_rows_per_s"] = 1.9e6
    assert targets.judge(slow_faults, _args())["insert_rows_per_s"] == "not met"
    fast = {**_figures(1.05), "numpy_fill_rows_per_s": 1e9, "insert_new_rows_per_s": 9.9e6}
    assert targets.judge(fast, _args())["insert_rows_per_s"] == "not met"
    # An assign (rows without state) against NumPy's fill of its own bytes.
    plain = {**_figures(1.05), "numpy_fill_plain_rows_per_s": 6e6, "assign_new_rows_per_s": 4.1e6}
    assert targets.judge(plain, _args())["assign_rows_per_s"] == "met"
    plain["assign_new_rows_per_s"] = 3.9e6
    assert targets.judge(plain, _args())["assign_rows_per_s"] == "not met"
