"""The main job: train a factorization-machine CTR model on synthetic
Criteo-like data, with its embeddings in embstore.

    python -m embstore demo            # NumPy model (about 80 s on 2 cores)
    python -m embstore demo --torch    # the same model as a torch nn.Module

Data: 26 categorical fields of Zipf-distributed ids from vocabularies of 10
to 2,000,000 ids, 13 dense features, and labels drawn from a planted logistic
model (a per-id effect in every field, a dense linear term and a pairwise
interaction between two fields). The model is an FM: a bias, a dense linear
term, a first-order weight and a k-dim factor per id, all 26 fields served by
one shared table through a Collection (one native call per step, one
optimizer step per batch). It prints the loss, held-out AUC, samples/s and
the table's stats.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

import embstore
from embstore import init, optim
from embstore._cli import Parser, phase, positive_int, require
from embstore._progress import Bar
from embstore.serving import Publisher

FIELDS = 26
DENSE = 13
_M = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finalizer on an array (a pure function: the planted model)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _normal(field: int, rank: npt.NDArray[np.int64], salt: int) -> npt.NDArray[np.float64]:
    """A standard normal per (field, rank, salt), by Box-Muller on two hashes."""
    base = rank.astype(np.uint64) + np.uint64((field + 1) * 1_000_003 + salt * 7_919_000_001)
    h1, h2 = _mix(base), _mix(base ^ np.uint64(0x9E3779B97F4A7C15))
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 1.0) / 2.0**53
    u2 = (h2 >> np.uint64(11)).astype(np.float64) / 2.0**53
    out: npt.NDArray[np.float64] = np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * np.pi * u2)
    return out


@dataclass
class Data:
    """A synthetic Criteo-like sample set."""

    keys: npt.NDArray[np.int64]  # (n, FIELDS) feature ids, unique across fields
    dense: npt.NDArray[np.float32]  # (n, DENSE)
    label: npt.NDArray[np.float32]  # (n,)
    logit: npt.NDArray[np.float64]  # (n,) the planted model's logit


def make_data(n: int, seed: int) -> Data:
    """``n`` samples of the planted model; the model itself does not depend on ``seed``."""
    rng = np.random.default_rng(seed)
    vocab = np.geomspace(10, 2_000_000, FIELDS).astype(np.int64)
    planted = np.random.default_rng(12345)
    sigma = planted.uniform(0.2, 0.6, FIELDS)
    dense_w = planted.normal(0.0, 0.3, DENSE)
    keys = np.empty((n, FIELDS), np.int64)
    logit = np.full(n, -1.2)
    factors = []
    for f in range(FIELDS):
        rank = (rng.zipf(1.15, n) - 1) % vocab[f]
        keys[:, f] = (np.int64(f) << 48) | rank
        logit += sigma[f] * _normal(f, rank, 0)
        if f in (0, 1):
            factors.append(np.stack([_normal(f, rank, 1 + j) for j in range(4)], axis=1))
    logit += 0.35 * (factors[0] * factors[1]).sum(axis=1)
    dense = rng.normal(size=(n, DENSE))
    logit += dense @ dense_w
    label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return Data(keys, dense.astype(np.float32), label, logit)


def auc(label: npt.NDArray[np.float32], score: npt.NDArray[np.float64]) -> float:
    """Area under the ROC curve (Mann-Whitney, ties averaged)."""
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    ranks = np.empty(len(s))
    ranks[order] = np.arange(1, len(s) + 1)
    # Average the ranks of tied scores.
    _, first, counts = np.unique(s, return_index=True, return_counts=True)
    tied = counts > 1
    for start, c in zip(first[tied], counts[tied], strict=True):
        ranks[order[start : start + c]] = start + (c + 1) / 2
    pos = label > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def logloss(label: npt.NDArray[np.float32], logit: npt.NDArray[np.float64]) -> float:
    return float(np.mean(np.logaddexp(0.0, logit) - label * logit))


def _batch(keys: npt.NDArray[np.int64]) -> dict[str, tuple[Any, Any]]:
    offsets = np.arange(keys.shape[0] + 1, dtype=np.int64)
    return {f"C{f + 1}": (np.ascontiguousarray(keys[:, f]), offsets) for f in range(FIELDS)}


class NumpyFM:
    """FM in NumPy: bias + dense linear + per-id weight + pairwise factors."""

    def __init__(self, collection: embstore.Collection, k: int, lr: float) -> None:
        self.coll, self.k, self.lr = collection, k, lr
        self.w = np.zeros(DENSE)
        self.b = 0.0
        self.m = np.zeros(DENSE + 1)
        self.v = np.zeros(DENSE + 1)
        self.t = 0

    def logits(
        self, keys: npt.NDArray[np.int64], dense: npt.NDArray[np.float32], train: bool
    ) -> tuple[npt.NDArray[np.float64], Any]:
        emb = self.coll.lookup_pooled(_batch(keys), insert=train)
        e = emb.reshape(len(keys), FIELDS, 1 + self.k).astype(np.float64)
        first, fac = e[:, :, 0], e[:, :, 1:]
        s = fac.sum(axis=1)
        fm = 0.5 * (s * s - (fac * fac).sum(axis=1)).sum(axis=1)
        return self.b + dense @ self.w + first.sum(axis=1) + fm, (e, s)

    def step(
        self,
        keys: npt.NDArray[np.int64],
        dense: npt.NDArray[np.float32],
        label: npt.NDArray[np.float32],
    ) -> float:
        logit, (e, s) = self.logits(keys, dense, train=True)
        n = len(keys)
        d = (1.0 / (1.0 + np.exp(-logit)) - label) / n  # dloss/dlogit (mean loss)
        grad = np.empty_like(e)
        grad[:, :, 0] = d[:, None]
        grad[:, :, 1:] = d[:, None, None] * (s[:, None, :] - e[:, :, 1:])
        self.coll.apply_pooled_gradients(_batch(keys), grad.reshape(n, -1).astype(np.float32))
        g = np.concatenate([dense.T @ d, [d.sum()]])
        self.t += 1
        self.m = 0.9 * self.m + 0.1 * g
        self.v = 0.999 * self.v + 0.001 * g * g
        upd = (
            self.lr * (self.m / (1 - 0.9**self.t)) / (np.sqrt(self.v / (1 - 0.999**self.t)) + 1e-8)
        )
        self.w -= upd[:DENSE]
        self.b -= float(upd[DENSE])
        return logloss(label, logit)


class TorchFM:
    """The same FM as a torch nn.Module over embstore.torch.EmbeddingBagCollection."""

    def __init__(self, collection: embstore.Collection, k: int, lr: float) -> None:
        import torch

        import embstore.torch as et

        self.torch, self.k = torch, k
        self.emb = et.EmbeddingBagCollection(collection)
        self.linear = torch.nn.Linear(DENSE, 1, dtype=torch.float64)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)
        self.opt = torch.optim.Adam(self.linear.parameters(), lr=lr)

    def _logits(self, keys: npt.NDArray[np.int64], dense: npt.NDArray[np.float32]) -> Any:
        torch = self.torch
        e = self.emb(_batch(keys)).double().view(len(keys), FIELDS, 1 + self.k)
        first, fac = e[:, :, 0], e[:, :, 1:]
        s = fac.sum(dim=1)
        fm = 0.5 * (s * s - (fac * fac).sum(dim=1)).sum(dim=1)
        lin = self.linear(torch.from_numpy(dense.astype(np.float64))).squeeze(1)
        return lin + first.sum(dim=1) + fm

    def logits(
        self, keys: npt.NDArray[np.int64], dense: npt.NDArray[np.float32], train: bool
    ) -> tuple[npt.NDArray[np.float64], None]:
        self.emb.train(train)
        with self.torch.no_grad():
            out = self._logits(keys, dense)
        self.emb.train(True)
        return out.numpy(), None

    def step(
        self,
        keys: npt.NDArray[np.int64],
        dense: npt.NDArray[np.float32],
        label: npt.NDArray[np.float32],
    ) -> float:
        torch = self.torch
        logit = self._logits(keys, dense)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logit, torch.from_numpy(label.astype(np.float64))
        )
        self.opt.zero_grad()
        loss.backward()  # also steps the embedding table (fused backward)
        self.opt.step()
        return float(loss.detach())


def run(
    samples: int,
    batch: int,
    k: int,
    use_torch: bool,
    seed: int,
    quiet: bool,
    test_samples: int,
    dtype: str = "float32",
    publish: str | None = None,
    checkpoint: str | None = None,
) -> dict[str, float]:

    def say(text: str) -> None:
        if not quiet:
            phase(text)

    say(f"generating {samples:,} training and {test_samples:,} held-out samples")
    t0 = time.perf_counter()
    train = make_data(samples, seed)
    test = make_data(test_samples, seed + 1)
    gen_s = time.perf_counter() - t0
    table = embstore.Table(
        1 + k,
        optimizer=optim.Adagrad(lr=0.05, initial_accumulator_value=1e-3),
        initializer=init.Normal(0.0, 0.01),
        seed=seed,
        dtype=dtype,
    )
    coll = embstore.Collection({f"C{f + 1}": table for f in range(FIELDS)})
    model: NumpyFM | TorchFM = (TorchFM if use_torch else NumpyFM)(coll, k, lr=0.01)
    steps = (samples + batch - 1) // batch
    say(f"training: {steps:,} steps of {batch:,} samples ({'torch' if use_torch else 'NumPy'})")
    bar = Bar(steps, "training", unit="step", show=False if quiet else None, delay=0.0)
    losses: list[float] = []
    publishers = []
    if publish is not None:
        say(f"publishing the rows to {publish} every second (Table.load(path, mmap=True))")
        publishers.append(Publisher(table, publish, 1.0))
    if checkpoint is not None:
        say(f"saving training checkpoints to {checkpoint} every 10 seconds")
        publishers.append(Publisher(table, checkpoint, 10.0, with_optimizer=True))
    t1 = time.perf_counter()
    for i in range(steps):
        sl = slice(i * batch, min((i + 1) * batch, samples))
        losses.append(model.step(train.keys[sl], train.dense[sl], train.label[sl]))
        if (i + 1) % 10 == 0 or i + 1 == steps:
            rate = sl.stop / max(time.perf_counter() - t1, 1e-9)
            bar.update_to(i + 1, f"loss {np.mean(losses[-10:]):.4f} {rate / 1e3:.1f}k samples/s")
    bar.close()
    train_s = time.perf_counter() - t1
    for pub in publishers:
        pub.stop()
    # The final state, at both paths.
    if publish is not None:
        table.save(publish, incremental=True, with_optimizer=False)
    if checkpoint is not None:
        table.save(checkpoint, incremental=True)
    say(f"evaluating on {test_samples:,} held-out samples")
    scores = np.concatenate(
        [
            model.logits(test.keys[j : j + 65536], test.dense[j : j + 65536], train=False)[0]
            for j in range(0, test_samples, 65536)
        ]
    )
    stats = table.stats()
    return {
        "train_loss": float(np.mean(losses[-max(1, steps // 10) :])),
        "test_logloss": logloss(test.label, scores),
        "test_auc": auc(test.label, scores),
        "planted_auc": auc(test.label, test.logit),
        "samples_per_s": samples / train_s,
        "train_s": train_s,
        "data_s": gen_s,
        "rows": stats["rows"],
        "bytes": stats["bytes"],
        "step": stats["step"],
        "ctr": float(train.label.mean()),
        "publishes": float(len(publishers[0].seconds)) if publishers else 0.0,
        "publish_s": float(np.median(publishers[0].seconds))
        if publishers and publishers[0].seconds
        else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = Parser("python -m embstore demo", __doc__)
    p.add_argument("--samples", type=positive_int, default=2_000_000, help="training samples")
    p.add_argument("--test-samples", type=positive_int, default=200_000, help="held-out samples")
    p.add_argument("--batch", type=positive_int, default=4096, help="samples per training step")
    p.add_argument("--k", type=positive_int, default=8, help="FM factor size (row dim is k + 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and of the table")
    p.add_argument(
        "--torch", action="store_true", help="train the torch nn.Module version (needs torch)"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16", "int8"],
        help="row storage dtype of the embedding table",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="print only the results (no phase lines, no progress bar); the bar is drawn "
        "only when stderr is a terminal",
    )
    p.add_argument(
        "--publish",
        metavar="DIR",
        default=None,
        help="publish the rows to checkpoint DIR every second while training (incremental, "
        "rows only), for serving processes that map it with Table.load(DIR, mmap=True, follow=1)",
    )
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        default=None,
        help="save training checkpoints (with optimizer state) to DIR every 10 seconds",
    )
    a = p.parse_args(argv)
    if a.torch:
        require(p, "torch", "torch", "--torch")
    for flag, where in (("--publish", a.publish), ("--checkpoint", a.checkpoint)):
        # Checked before training: a save makes the directory, not its parent.
        if where is not None:
            parent = os.path.dirname(os.path.abspath(where))
            if not os.path.isdir(parent):
                p.error(f"{flag}: the parent directory {parent!r} of {where!r} does not exist")
            if os.path.exists(where) and not os.path.isdir(where):
                p.error(f"{flag}: {where!r} exists and is not a directory")
            if not os.path.exists(where):
                # Made and removed now, so a directory no save could make
                # (/proc/x, a read-only mount) is refused before training.
                try:
                    os.mkdir(where)
                    os.rmdir(where)
                except OSError as e:
                    p.error(f"{flag}: cannot make the directory {where!r}: {e.strerror}")
    r = run(
        a.samples,
        a.batch,
        a.k,
        a.torch,
        a.seed,
        a.quiet,
        a.test_samples,
        a.dtype,
        a.publish,
        a.checkpoint,
    )
    print(
        f"model: FM (k={a.k}) in {'torch' if a.torch else 'NumPy'}; embeddings in embstore "
        f"(Adagrad, {FIELDS} fields sharing one {a.dtype} table)"
    )
    print(
        f"data: {a.samples:,} training / {a.test_samples:,} held-out samples, "
        f"CTR {r['ctr']:.3f} (generated in {r['data_s']:.1f} s)"
    )
    print(
        f"train loss {r['train_loss']:.4f}  held-out logloss {r['test_logloss']:.4f}  "
        f"held-out AUC {r['test_auc']:.4f} (the planted model's own: {r['planted_auc']:.4f})"
    )
    print(f"throughput {r['samples_per_s']:,.0f} samples/s ({r['train_s']:.1f} s training)")
    if a.publish is not None:
        print(
            f"published to {a.publish} {r['publishes']:.0f} times while training "
            f"(median {r['publish_s'] * 1e3:.0f} ms a publish)"
        )
    print(
        f"table: {r['rows']:,} rows, {r['bytes'] / 2**20:.1f} MiB, {r['step']} steps, "
        f"SIMD {table_simd()}"
    )
    return 0


def table_simd() -> str:
    return embstore.Table(1).simd
