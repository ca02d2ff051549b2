"""Biased matrix factorisation at batch 128: the small-batch training loop of
a MovieLens user (the model Surprise's SVD trains), on synthetic ratings of
MovieLens-100k's shape (943 users, 1,682 items, 100,000 ratings, 1 to 5
stars).

    python benches/mf_small_batch.py [--epochs 3] [--factors 100] [--json] [--floor]

Four tables, all trained with SGD (Surprise's defaults: lr 0.005, reg 0.02,
factors drawn from N(0, 0.1), biases from 0): user factors, item factors,
user biases and item biases. One step looks up the batch's rows in the four
tables, computes ``mu + b_u + b_i + p_u . q_i`` and the regularised
gradients in NumPy, and applies them to the four tables. Prints epochs/s
and microseconds per step, best of the epochs after the first.

``--floor`` also times the same loop with each table replaced by a stand-in
whose lookup returns rows it holds ready and whose gradient call does
nothing: the step's NumPy and Python share, which no store can remove (the
least time a step can take).

The script uses only the API every embstore version has had (Table,
lookup, apply_gradients, optim.SGD, init.Normal, init.Zeros), so it runs
unchanged against an older build: benches/RESULTS.md compares this build
with 0763d05, the build issue 14 measured.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

import embstore
from embstore import init, optim

USERS, ITEMS, RATINGS = 943, 1_682, 100_000


def ratings(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Synthetic ratings of MovieLens-100k's shape: Zipf-like item
    popularity, per-user activity, stars 1 to 5 from a low-rank model."""
    rng = np.random.default_rng(seed)
    item_p = 1.0 / np.arange(1, ITEMS + 1) ** 0.8
    user_p = rng.gamma(0.6, size=USERS)
    users = rng.choice(USERS, RATINGS, p=user_p / user_p.sum())
    items = rng.choice(ITEMS, RATINGS, p=item_p / item_p.sum())
    pu, qi = rng.normal(0, 0.6, (USERS, 8)), rng.normal(0, 0.6, (ITEMS, 8))
    stars = np.clip(np.rint(3.5 + (pu[users] * qi[items]).sum(1)), 1, 5)
    return users.astype(np.int64), items.astype(np.int64), stars.astype(np.float32)


class FreeTable:
    """A stand-in for a table that costs nothing: ``lookup`` returns rows
    it holds ready (N(0, 0.1) factors, or zeros), ``apply_gradients`` does
    nothing. The loop run with it times what is left of a step without any
    store."""

    def __init__(self, dim: int, batch: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.rows = rng.normal(0.0, 0.1, (batch, dim)).astype(np.float32)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        return self.rows[: len(keys)]

    def apply_gradients(self, keys: np.ndarray, grads: np.ndarray) -> None:
        pass


def train(epochs: int, factors: int, batch: int = 128, free: bool = False) -> dict[str, float]:
    users, items, stars = ratings()
    lr, reg = 0.005, 0.02
    mu = float(stars.mean())
    normal = init.Normal(mean=0.0, std=0.1)
    p: Any
    q: Any
    bu: Any
    bi: Any
    if free:
        p, q = FreeTable(factors, batch, 1), FreeTable(factors, batch, 2)
        bu, bi = FreeTable(1, batch, 3), FreeTable(1, batch, 4)
    else:
        p = embstore.Table(factors, optimizer=optim.SGD(lr=lr), initializer=normal, seed=1)
        q = embstore.Table(factors, optimizer=optim.SGD(lr=lr), initializer=normal, seed=2)
        bu = embstore.Table(1, optimizer=optim.SGD(lr=lr), initializer=init.Zeros(), seed=3)
        bi = embstore.Table(1, optimizer=optim.SGD(lr=lr), initializer=init.Zeros(), seed=4)
    rng = np.random.default_rng(1)
    epoch_s = []
    rmse = float("nan")
    for _ in range(epochs):
        order = rng.permutation(RATINGS)
        sq = 0.0
        t0 = time.perf_counter()
        for s in range(0, RATINGS, batch):
            idx = order[s : s + batch]
            u, i, r = users[idx], items[idx], stars[idx]
            pu, qi = p.lookup(u), q.lookup(i)
            b_u, b_i = bu.lookup(u), bi.lookup(i)
            err = r - (mu + b_u[:, 0] + b_i[:, 0] + (pu * qi).sum(1))
            sq += float((err * err).sum())
            e = err[:, None]
            p.apply_gradients(u, reg * pu - e * qi)
            q.apply_gradients(i, reg * qi - e * pu)
            bu.apply_gradients(u, reg * b_u - e)
            bi.apply_gradients(i, reg * b_i - e)
        epoch_s.append(time.perf_counter() - t0)
        rmse = (sq / RATINGS) ** 0.5
    steps = -(-RATINGS // batch)
    best = min(epoch_s[1:] or epoch_s)
    return {
        "epochs_per_s": 1.0 / best,
        "us_per_step": best / steps * 1e6,
        "train_rmse_last_epoch": rmse,
        "epochs": epochs,
        "factors": factors,
        "batch": batch,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--factors", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also time the loop with stand-in tables that cost nothing",
    )
    a = ap.parse_args()
    res: dict[str, Any] = dict(train(a.epochs, a.factors))
    res["embstore"] = getattr(embstore, "__version__", "?")
    if a.floor:
        floor = train(a.epochs, a.factors, free=True)
        res["floor_us_per_step"] = floor["us_per_step"]
    if a.json:
        print(json.dumps(res))
    else:
        print(
            f"biased MF, batch {res['batch']}, {res['factors']} factors: "
            f"{res['epochs_per_s']:.2f} epochs/s, {res['us_per_step']:.0f} us/step, "
            f"train RMSE {res['train_rmse_last_epoch']:.3f} after {res['epochs']} epochs"
        )
        if a.floor:
            print(
                f"the same loop with tables that cost nothing (its NumPy and Python): "
                f"{res['floor_us_per_step']:.0f} us/step"
            )


if __name__ == "__main__":
    main()
