"""The demo's CTR model (``python -m embstore demo``: a factorization
machine over 26 sparse fields and 13 dense ones) trained on N ranks over
one ShardedTable, once per wire dtype, to compare the held-out AUC of
compressed exchanges with float32's. Each rank takes its share of every
global batch; the dense gradients are summed across ranks, so every rank
takes the same dense step. Run under MPI::

    mpirun -n 2 python benches/demo_sharded.py [--samples 2000000] [--wire float32 bfloat16 int8]

Prints, on rank 0, one line per wire dtype: AUC, log loss, the bytes a
rank sent per step, and the training time.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from embstore import init, optim
from embstore.demo import DENSE, FIELDS, _batch, auc, logloss, make_data
from embstore.distributed import ShardedCollection, ShardedTable

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def train(wire: str, samples: int, test_samples: int, batch: int, k: int, seed: int) -> dict:
    train_data = make_data(samples, seed)
    test = make_data(test_samples, seed + 1)
    table = ShardedTable(
        1 + k,
        optimizer=optim.Adagrad(lr=0.05, initial_accumulator_value=1e-3),
        initializer=init.Normal(0.0, 0.01),
        seed=seed,
        wire_dtype=wire,
    )
    coll = ShardedCollection({f"C{f + 1}": table for f in range(FIELDS)})
    w, b = np.zeros(DENSE), 0.0
    m, v = np.zeros(DENSE + 1), np.zeros(DENSE + 1)
    lr = 0.01

    def forward(keys: np.ndarray, dense: np.ndarray, train: bool) -> tuple:
        emb = coll.lookup_pooled(_batch(keys), insert=train)
        e = emb.reshape(len(keys), FIELDS, 1 + k).astype(np.float64)
        first, fac = e[:, :, 0], e[:, :, 1:]
        s = fac.sum(axis=1)
        fm = 0.5 * (s * s - (fac * fac).sum(axis=1)).sum(axis=1)
        return b + dense @ w + first.sum(axis=1) + fm, e, s

    steps = (samples + batch - 1) // batch
    sent = 0
    t0 = time.perf_counter()
    for i in range(steps):
        lo, hi = i * batch, min((i + 1) * batch, samples)
        share = np.array_split(np.arange(lo, hi), SIZE)[RANK]
        keys, dense = train_data.keys[share], train_data.dense[share]
        label = train_data.label[share]
        logit, e, s = forward(keys, dense, True)
        sent += table.last_call["sent_bytes"]
        d = (1.0 / (1.0 + np.exp(-logit)) - label) / (hi - lo)  # the global mean loss
        grad = np.empty_like(e)
        grad[:, :, 0] = d[:, None]
        grad[:, :, 1:] = d[:, None, None] * (s[:, None, :] - e[:, :, 1:])
        coll.apply_pooled_gradients(_batch(keys), grad.reshape(len(keys), -1).astype(np.float32))
        sent += table.last_call["sent_bytes"]
        g = COMM.allreduce(np.concatenate([dense.T @ d, [d.sum()]]))
        t = i + 1
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        upd = lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
        w -= upd[:DENSE]
        b -= float(upd[DENSE])
    train_s = time.perf_counter() - t0
    shares = np.array_split(np.arange(test_samples), SIZE)
    share = shares[RANK]
    scores = np.concatenate(
        [  # every rank calls as often as the largest share needs (collective)
            forward(test.keys[share[j : j + 65536]], test.dense[share[j : j + 65536]], False)[0]
            for j in range(0, max(len(s) for s in shares), 65536)
        ]
    )
    every = COMM.gather((share, scores), root=0)
    out = {"wire": wire, "train_s": train_s, "sent_bytes_per_step": sent / steps}
    if RANK == 0:
        assert every is not None
        order = np.concatenate([s for s, _ in every])
        score = np.empty(test_samples)
        score[order] = np.concatenate([sc for _, sc in every])
        out["auc"] = auc(test.label, score)
        out["logloss"] = logloss(test.label, score)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--samples", type=int, default=2_000_000)
    p.add_argument("--test-samples", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wire", nargs="+", default=["float32", "bfloat16", "float16", "int8"])
    args = p.parse_args()
    base = None
    for wire in args.wire:
        r = train(wire, args.samples, args.test_samples, args.batch, args.k, args.seed)
        if RANK == 0:
            base = r["auc"] if base is None else base
            print(
                f"ranks {SIZE}, wire {wire:<8}: AUC {r['auc']:.6f} (vs {args.wire[0]}: "
                f"{r['auc'] - base:+.6f}), log loss {r['logloss']:.6f}, "
                f"{r['sent_bytes_per_step'] / 1e6:.2f} MB sent a rank a step, "
                f"training {r['train_s']:.1f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
