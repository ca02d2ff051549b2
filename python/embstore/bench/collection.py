"""The Collection step (26 pooled features) against torch's EmbeddingBags,
FBGEMM's CPU table-batched embedding and TorchRec when importable, and
against NumPy at every batch size."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

import embstore
from embstore import optim
from embstore.bench._timing import _best, _paired_us, _version, args_dim
from embstore.bench.targets import cell


def collection_compare(args: argparse.Namespace) -> dict[str, Any]:
    """A full training step of a 26-feature Collection against EmbeddingBag + SparseAdam.

    One id per feature per sample; 2M keys in all: embstore serves every
    feature from one shared table (one optimizer step per call); torch runs
    either one EmbeddingBag per feature (vocab / fields rows each) or one
    shared EmbeddingBag over all ids, whichever is faster.
    """

    vocab, dim, fields, batch, reps = args.vocab, args.dim, args.fields, args.batch, args.reps
    per = vocab // fields
    rng = np.random.default_rng(1)
    local = rng.integers(0, per, (fields, batch))
    keys = local + (np.arange(fields) * per)[:, None]  # feature f owns [f*per, (f+1)*per)
    offsets = np.arange(batch + 1, dtype=np.int64)
    upstream = rng.standard_normal((batch, fields * dim), dtype=np.float32)
    res: dict[str, Any] = {"fields": fields, "batch": batch, "keys": per * fields}

    res.update(_coll_ours(keys, offsets, upstream, per * fields, dim, reps))
    res.update(_coll_torch_per_feature(local, offsets, upstream, per, dim, reps))
    res.update(_coll_torch_shared(keys, upstream, per * fields, dim, reps))
    res["peers"] = _coll_peers(local, upstream, per, dim, reps)
    return res


def _coll_peers(
    local: np.ndarray, upstream: np.ndarray, per: int, dim: int, reps: int
) -> dict[str, Any]:
    """The Collection step with row-wise Adagrad (lr 0.01, eps 1e-8), the
    optimizer FBGEMM and TorchRec train sparse tables with by default, on
    the same ids: embstore (one table per feature), FBGEMM's CPU
    table-batched embedding (fbgemm-gpu-cpu) and TorchRec's
    FusedEmbeddingBagCollection (its optimizer runs inside the backward).
    FBGEMM and TorchRec pin their own torch, so they are measured where
    they are installed (scripts/torchrec_check.sh makes such a venv) and
    reported as skipped, with the reason, where they are not."""
    import torch

    fields, batch = local.shape
    res: dict[str, Any] = {}
    tables = [
        embstore.Table(dim, optimizer=optim.RowWiseAdagrad(lr=0.01, eps=1e-8), seed=f)
        for f in range(fields)
    ]
    for t in tables:
        t.lookup(np.arange(per))
    coll = embstore.Collection({f"f{f}": tables[f] for f in range(fields)})
    offsets = np.arange(batch + 1, dtype=np.int64)
    feed = {f"f{f}": (np.ascontiguousarray(local[f]), offsets) for f in range(fields)}

    def ours() -> None:
        coll.lookup_pooled(feed)
        coll.apply_pooled_gradients(feed, upstream)

    res["ours_rowwise_adagrad_step_s"] = _best(ours, reps)
    tup = torch.from_numpy(upstream)
    flat = torch.from_numpy(local.reshape(-1).astype(np.int64))  # feature-major
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(per, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * fields,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=0.01,
            eps=1e-8,
            pooling_mode=PoolingMode.SUM,
        )
        toffsets = torch.arange(fields * batch + 1, dtype=torch.int64)

        def fbgemm_step() -> None:
            tbe(flat, toffsets).backward(tup)

        res["fbgemm_rowwise_adagrad_step_s"] = _best(fbgemm_step, reps)
        res["fbgemm"] = _version("fbgemm-gpu-cpu")
    except Exception as e:  # ImportError, or its operators failing to load
        res["fbgemm_skipped"] = f"{type(e).__name__}: {e}"
    try:
        import torchrec
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        fused = FusedEmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t{f}", embedding_dim=dim, num_embeddings=per, feature_names=[f"f{f}"]
                )
                for f in range(fields)
            ],
            optimizer_type=torchrec.optim.RowWiseAdagrad,
            optimizer_kwargs={"lr": 0.01, "eps": 1e-8},
            device=torch.device("cpu"),
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{f}" for f in range(fields)],
            values=flat,
            lengths=torch.ones(fields * batch, dtype=torch.int64),
        )

        def torchrec_step() -> None:
            fused(kjt).values().backward(tup)

        res["torchrec_rowwise_adagrad_step_s"] = _best(torchrec_step, reps)
        res["torchrec"] = _version("torchrec")
    except Exception as e:  # ImportError, or fbgemm's operators failing to load
        res["torchrec_skipped"] = f"{type(e).__name__}: {e}"
    return res


def _coll_ours(
    keys: np.ndarray, offsets: np.ndarray, upstream: np.ndarray, vocab: int, dim: int, reps: int
) -> dict[str, float]:
    table = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3))
    table.lookup(np.arange(vocab))
    coll = embstore.Collection({f"f{f}": table for f in range(len(keys))})
    feed = {f"f{f}": (keys[f], offsets) for f in range(len(keys))}

    def step() -> None:
        coll.lookup_pooled(feed)
        coll.apply_pooled_gradients(feed, upstream)

    return {
        "ours_forward_s": _best(lambda: coll.lookup_pooled(feed), reps),
        "ours_step_s": _best(step, reps),
    }


def _coll_torch_per_feature(
    local: np.ndarray, offsets: np.ndarray, upstream: np.ndarray, per: int, dim: int, reps: int
) -> dict[str, float]:
    import torch

    fields = len(local)
    tup, toff = torch.from_numpy(upstream), torch.from_numpy(offsets)
    bags = [
        torch.nn.EmbeddingBag(per, dim, mode="sum", include_last_offset=True, sparse=True)
        for _ in range(fields)
    ]
    opt = torch.optim.SparseAdam([b.weight for b in bags], lr=1e-3)
    tlocal = [torch.from_numpy(local[f]) for f in range(fields)]

    def forward() -> torch.Tensor:
        return torch.cat([bags[f](tlocal[f], toff) for f in range(fields)], dim=1)

    def step() -> None:
        opt.zero_grad()
        (forward() * tup).sum().backward()
        opt.step()

    return {
        "torch_per_feature_forward_s": _best(lambda: forward().detach(), reps),
        "torch_per_feature_step_s": _best(step, reps),
    }


def _coll_torch_shared(
    keys: np.ndarray, upstream: np.ndarray, vocab: int, dim: int, reps: int
) -> dict[str, float]:
    import torch

    fields, batch = keys.shape
    tup = torch.from_numpy(upstream)
    shared = torch.nn.EmbeddingBag(vocab, dim, mode="sum", include_last_offset=True, sparse=True)
    opt = torch.optim.SparseAdam([shared.weight], lr=1e-3)
    # Sample-major order so the pooled (batch * fields, dim) output reshapes
    # to (batch, fields * dim) like the Collection's.
    tkeys = torch.from_numpy(np.ascontiguousarray(keys.T).ravel())
    toff = torch.arange(batch * fields + 1)

    def forward() -> torch.Tensor:
        return shared(tkeys, toff).view(batch, fields * dim)

    def step() -> None:
        opt.zero_grad()
        (forward() * tup).sum().backward()
        opt.step()

    return {
        "torch_shared_forward_s": _best(lambda: forward().detach(), reps),
        "torch_shared_step_s": _best(step, reps),
    }


def report_collection(c: dict[str, Any], res: dict[str, Any]) -> str:
    """The Collection table; ``res``: the whole run, for the verdicts."""
    best_step = min(c["torch_per_feature_step_s"], c["torch_shared_step_s"])
    best_fwd = min(c["torch_per_feature_forward_s"], c["torch_shared_forward_s"])
    return "\n".join(
        [
            f"Collection: {c['fields']} features x {c['batch']:,} samples, one id per feature, "
            f"dim {args_dim(c)}, {c['keys']:,} keys (one shared embstore table, Adam).",
            "",
            "| measure | embstore Collection | torch per-feature bags | torch one shared bag | "
            "ratio (best torch / embstore) | target |",
            "| --- | --- | --- | --- | --- | --- |",
            f"| full step: pooled forward + backward + Adam | {c['ours_step_s'] * 1e3:.0f} ms | "
            f"{c['torch_per_feature_step_s'] * 1e3:.0f} ms | {c['torch_shared_step_s'] * 1e3:.0f} ms | "
            f"{best_step / c['ours_step_s']:.1f}x | {cell(res, 'collection_step_vs_torch')} |",
            f"| forward only | {c['ours_forward_s'] * 1e3:.1f} ms | "
            f"{c['torch_per_feature_forward_s'] * 1e3:.1f} ms | {c['torch_shared_forward_s'] * 1e3:.1f} ms"
            f" | {best_fwd / c['ours_forward_s']:.2f}x | {cell(res, 'collection_forward_vs_torch')} |",
        ]
    )


def report_peers(p: dict[str, Any]) -> str:
    ours = p["ours_rowwise_adagrad_step_s"]
    lines = [
        "Row-wise Adagrad, the same ids: embstore Collection step "
        f"{ours * 1e3:.0f} ms (one table per feature).",
    ]
    for key, name in (
        ("fbgemm", "FBGEMM CPU table-batched embedding"),
        ("torchrec", "TorchRec FusedEmbeddingBagCollection"),
    ):
        if f"{key}_skipped" in p:
            lines.append(
                f"{name}: skipped, not importable here ({p[f'{key}_skipped']}); it pins its own "
                "torch: bash scripts/torchrec_check.sh makes a venv with it."
            )
        else:
            t = p[f"{key}_rowwise_adagrad_step_s"]
            lines.append(
                f"{name} {p[key]} (forward + backward with its fused optimizer): {t * 1e3:.0f} ms, "
                f"{t / ours:.1f}x embstore's time."
            )
    return "\n".join(lines)


def _numpy_adam_step(
    w: np.ndarray, m: np.ndarray, v: np.ndarray
) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The step of a Collection written in NumPy on dense arrays: forward
    ``np.take``, backward ``np.add.at`` into the touched rows, Adam (lr 1e-3,
    torch's defaults) on those rows only. Returns ``step(keys (fields,
    batch), upstream (batch, fields * dim)) -> forward output``."""
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    dim = w.shape[1]
    count = [0]

    def step(keys: np.ndarray, upstream: np.ndarray) -> np.ndarray:
        fields, batch = keys.shape
        out = np.take(w, keys, axis=0).transpose(1, 0, 2).reshape(batch, fields * dim)
        grads = upstream.reshape(batch, fields, dim).transpose(1, 0, 2).reshape(-1, dim)
        touched, inverse = np.unique(keys.reshape(-1), return_inverse=True)
        g = np.zeros((touched.size, dim), np.float32)
        np.add.at(g, inverse, grads)
        count[0] += 1
        k = count[0]
        m[touched] = b1 * m[touched] + (1 - b1) * g
        v[touched] = b2 * v[touched] + (1 - b2) * g * g
        step_size = lr / (1 - b1**k)
        w[touched] -= step_size * m[touched] / (np.sqrt(v[touched] / (1 - b2**k)) + eps)
        return out

    return step


def _filled_adam_table(vocab: int, dim: int) -> embstore.Table:
    """An Adam table (lr 1e-3) holding the keys ``0..vocab``."""
    table = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3), seed=0)
    table.reserve(vocab)
    table.lookup(np.arange(vocab))
    return table


def batch_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """A ``fields``-feature Collection training step (one id per feature
    per sample, one shared ``vocab``-row Adam table: pooled forward,
    backward, Adam) at batch sizes from 1 to ``batch``, against the same
    step in NumPy on dense arrays (:func:`_numpy_adam_step`); the two
    measured in turn, best of the rounds."""
    vocab, dim, fields = args.vocab, args.dim, args.fields
    sizes = [b for b in (1, 16, 128, 1_024, 16_384, 65_536) if b < args.batch] + [args.batch]
    table = _filled_adam_table(vocab, dim)
    w = table.lookup(np.arange(vocab), insert=False)
    m, v = np.zeros_like(w), np.zeros_like(w)
    numpy_step = _numpy_adam_step(w, m, v)
    coll = embstore.Collection({f"f{f}": table for f in range(fields)})
    per = vocab // fields
    rng = np.random.default_rng(2)
    rows: dict[str, dict[str, float]] = {}
    for batch in sizes:
        keys = rng.integers(0, per, (fields, batch)) + (np.arange(fields) * per)[:, None]
        offsets = np.arange(batch + 1, dtype=np.int64)
        feed = {f"f{f}": (keys[f], offsets) for f in range(fields)}
        upstream = rng.standard_normal((batch, fields * dim), dtype=np.float32)

        def ours(feed: dict[str, Any] = feed, upstream: np.ndarray = upstream) -> None:
            coll.lookup_pooled(feed)
            coll.apply_pooled_gradients(feed, upstream)

        calls = max(1, 20_000 // (batch * fields))
        best = _paired_us(
            {"ours": ours, "numpy": partial(numpy_step, keys, upstream)}, calls, args.reps + 2
        )
        rows[str(batch)] = {"ours_us": best["ours"], "numpy_us": best["numpy"]}
    return {"vocab": vocab, "dim": dim, "fields": fields, "per_batch": rows}


def report_batch_sizes(c: dict[str, Any]) -> str:
    lines = [
        f"A {c['fields']}-feature Collection training step (pooled forward, backward, Adam; one "
        f"shared {c['vocab']:,}-row table, dim {c['dim']}) against the same step in NumPy on dense "
        "arrays (np.take forward, np.add.at backward, Adam on the touched rows); microseconds per "
        "step, the two measured in turn.",
        "",
        "| batch | embstore Collection | NumPy dense | NumPy / embstore |",
        "| --- | --- | --- | --- |",
    ]
    for batch, r in c["per_batch"].items():
        lines.append(
            f"| {int(batch):,} | {r['ours_us']:,.0f} | {r['numpy_us']:,.0f} | "
            f"{r['numpy_us'] / r['ours_us']:.1f}x |"
        )
    return "\n".join(lines)
