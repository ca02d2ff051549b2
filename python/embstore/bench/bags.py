"""Pooled lookups of bags of 1, 4, 26 and 100 ids against torch's
EmbeddingBag forward and against the unpooled lookup of the same ids."""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

import numpy as np

from embstore.bench._timing import _paired_us
from embstore.bench.collection import _filled_adam_table

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
