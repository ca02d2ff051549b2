"""The sharded tier under torchrun with torch.distributed (gloo), no MPI:
run by tests/test_torchrun.py as

    torchrun --standalone --nproc_per_node N tests/torchrun/gloo_suite.py [hang]

Checks, on every rank: training through ShardedTable(comm="torch") equals
one Table fed every rank's batch; a ShardedCollection step on its lookup's
batch moves only gradients and the bytes equal the cost model; a checkpoint
saved by N ranks loads into one Table and back onto the ranks; ranks that
enter different calls, or one that refuses its input, raise on every rank.
With ``hang``: rank 1 stops calling and rank 0's watchdog must end the job.
With ``exit``: one step, then the group destroyed and a plain exit.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time

import numpy as np
import pytest
import torch.distributed as dist

import embstore
from embstore import ops, optim
from embstore.distributed import ShardedCollection, ShardedTable

dist.init_process_group("gloo")
R, N = dist.get_rank(), dist.get_world_size()
DIM = 6


def every(obj: object) -> list:
    out: list = [None] * N
    dist.all_gather_object(out, obj)
    return out


def close(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


if sys.argv[1:] == ["exit"]:
    # A job that builds a ShardedTable, trains one step, destroys the group
    # and leaves as any script does: its exit must be clean.
    t = ShardedTable(DIM, comm="torch", optimizer=optim.Adam(lr=0.05), seed=1)
    keys = np.arange(200) + R
    t.lookup(keys)
    t.apply_gradients(keys, np.ones((len(keys), DIM), np.float32))
    print(f"rank {R}: exit job trained", flush=True)
    dist.destroy_process_group()
    sys.exit(0)

if sys.argv[1:] == ["hang"]:
    t = ShardedTable(DIM, comm="torch", timeout=3)
    if R == 1:
        time.sleep(60)  # stops calling: rank 0's watchdog ends the job
    t.lookup(np.arange(10))
    sys.exit(0)

# 1. Training equals one Table over the union.
t = ShardedTable(DIM, comm="torch", optimizer=optim.Adam(lr=0.05), seed=9)
ref = embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=9)
for step in range(8):
    rng = np.random.default_rng(100 * step + R)
    keys = rng.integers(0, 400, 40)
    g = rng.normal(size=(40, DIM)).astype(np.float32)
    close(t.lookup(keys), ref.lookup(keys, insert=False))
    t.apply_gradients(keys, g)
    parts = every((keys, g))
    ref.apply_gradients(
        np.concatenate([k for k, _ in parts]), np.concatenate([x for _, x in parts])
    )
k_ref, rows_ref = ref.export()
close(t.lookup(k_ref, insert=False), rows_ref)
assert len(t) == len(ref)

# 1a. The transport's allgather: one collective where every rank's pickle
# fits its slot, the two of all_gather_object where one does not.
from embstore.distributed.transport import transport_of  # noqa: E402

tt = transport_of("torch")
assert tt.allgather({"rank": R}) == [{"rank": r} for r in range(N)]
big = [("r", r, "x" * (5000 if r == 1 else 1)) for r in range(N)]
assert tt.allgather(big[R]) == big
assert tt.allgather(None) == [None] * N

# 1b. On a group whose ranks are not the job's (the last N-1 ranks: the
# exchange's point-to-point calls name each peer by its rank in the job),
# training equals one Table over the group's batches.
last = dist.new_group(list(range(1, N)))
if R >= 1:
    members = list(range(1, N))
    tl = ShardedTable(DIM, comm=last, optimizer=optim.Adam(lr=0.05), seed=19)
    refl = embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=19)
    for step in range(4):
        batches = []
        for r in members:
            rng = np.random.default_rng(300 * step + r)
            g = rng.normal(size=(30, DIM)).astype(np.float32)
            batches.append((rng.integers(0, 300, 30), g))
        keys, g = batches[R - 1]
        close(tl.lookup(keys), refl.lookup(keys, insert=False))
        tl.apply_gradients(keys, g)
        refl.apply_gradients(
            np.concatenate([k for k, _ in batches]), np.concatenate([x for _, x in batches])
        )
    kl, rl = refl.export()
    close(tl.lookup(kl, insert=False), rl)
dist.barrier()

# 2. A collection step on its lookup's batch: only gradients move.
coll = ShardedCollection({"a": t, "b": t})
rng = np.random.default_rng(7 + R)
off = np.arange(13, dtype=np.int64)
b = {"a": (rng.integers(0, 300, 12), off), "b": (rng.integers(200, 500, 12), off)}
coll.lookup_pooled(b)
uniq, _, counts = ops.plan_exchange(np.concatenate([b["a"][0], b["b"][0]]), N)
remote = int(counts.sum() - counts[R])
gg = rng.normal(size=(12, 2 * DIM)).astype(np.float32)
coll.apply_pooled_gradients(b, gg)
assert t.last_call["sent_bytes"] == 4 * DIM * remote, (t.last_call, remote)
parts = every((b, gg))
ids = np.concatenate([np.concatenate([p[0][f][0] for p in parts]) for f in ("a", "b")])
grads = np.concatenate([np.concatenate([p[1][:, c : c + DIM] for p in parts]) for c in (0, DIM)])
ref.apply_gradients(ids, grads)
k_ref, rows_ref = ref.export()
close(t.lookup(k_ref, insert=False), rows_ref)

# 3. Saved by N ranks: one Table loads it, and so do the ranks again.
path = every(tempfile.mkdtemp() if R == 0 else None)[0]
t.save(path)
one = embstore.Table.load(path)
close(one.lookup(k_ref, insert=False), rows_ref)
back = ShardedTable.load(path, comm="torch")
close(back.lookup(k_ref, insert=False), rows_ref)
assert back.step == t.step == one.step

# 4. Different calls, or a refused input on one rank, raise on every rank.
other_call = (lambda: t.lookup(np.arange(5))) if R == 0 else (lambda: len(t))
with pytest.raises(RuntimeError, match="different collective calls"):
    other_call()
with pytest.raises((TypeError, ValueError)) as refused:
    t.lookup(np.arange(3) if R else np.array([1.5]))
assert R == 0 or "refused its input" in str(refused.value), refused.value
close(t.lookup(k_ref, insert=False), rows_ref)  # nothing changed, calls go on

# 5. A torch EmbeddingBag over a ShardedTable trains: each rank's backward
# is one collective step, equal to one Table stepped on every rank's bags.
import torch  # noqa: E402

import embstore.torch as et  # noqa: E402

st = ShardedTable(DIM, comm="torch", optimizer=optim.SGD(lr=0.2), seed=13)
one = embstore.Table(DIM, optimizer=optim.SGD(lr=0.2), seed=13)
bag = et.EmbeddingBag(st, mode="mean", include_last_offset=True)
for step in range(4):
    rng = np.random.default_rng(1000 + 10 * step + R)
    lens = rng.integers(0, 4, 6)
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ids = rng.integers(0, 300, int(offs[-1])).astype(np.int64)
    up = rng.normal(size=(6, DIM)).astype(np.float32)
    out = bag(torch.from_numpy(ids), torch.from_numpy(offs))
    close(out.detach().numpy(), one.lookup_pooled(ids, offs, combiner="mean", insert=False))
    (out * torch.from_numpy(up)).sum().backward()
    parts = every((ids, offs, up))
    all_ids = np.concatenate([p[0] for p in parts])
    starts = np.cumsum([0] + [p[0].shape[0] for p in parts[:-1]])
    all_offs = np.concatenate(
        [p[1][:-1] + s for p, s in zip(parts, starts, strict=True)] + [[all_ids.shape[0]]]
    ).astype(np.int64)
    one.apply_pooled_gradients(
        all_ids, all_offs, np.concatenate([p[2] for p in parts]), combiner="mean"
    )
k_one, rows_one = one.export()
close(st.lookup(k_one, insert=False), rows_one)
assert st.step == one.step == 4

# 6. A checkpoint records its partition; a load without one keeps it (over
# this job's ranks), a load naming one uses that one.
from embstore.distributed import Partition  # noqa: E402

dv = ShardedTable(DIM, comm="torch", partition="div", key_space=500, seed=3)
dv.lookup(np.arange(500)[R::N])
path = every(tempfile.mkdtemp() if R == 0 else None)[0]
m = dv.save(path)
assert m["version"] == 2
assert Partition.from_record(m["partition"]) == Partition("div", N, key_space=500)
kept = ShardedTable.load(path, comm="torch")
assert kept.partitioning == dv.partitioning
close(kept.lookup(np.arange(500), insert=False), dv.lookup(np.arange(500), insert=False))
hashed = ShardedTable.load(path, comm="torch", partition="hash")
assert hashed.partitioning == Partition("hash", N)
assert len(hashed) == len(dv) == 500
close(hashed.lookup(np.arange(500), insert=False), dv.lookup(np.arange(500), insert=False))

# 7. DDP on the dense part, the torch modules over sharded tables with
# gradient_reduction="mean": N ranks of batch b train as one process of batch
# N*b (the dense parameters and every row equal); without the argument the
# ranks' gradients are summed, with a DeprecationWarning.
import warnings  # noqa: E402

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


class Dlrm(nn.Module):
    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.top = emb, nn.Sequential(nn.Linear(2 * DIM, 4), nn.ReLU(), nn.Linear(4, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.top(self.emb({"user": users, "item": items})).squeeze(1)


def adagrad_tables(cls: type, **kw: object) -> dict:
    """An Adagrad table and an SGD one (SGD's step is linear in the
    gradient: a reduction off by N shows in every row)."""
    return {
        "user": cls(DIM, optimizer=optim.Adagrad(lr=0.1), seed=21, **kw),
        "item": cls(DIM, optimizer=optim.SGD(lr=0.5), seed=22, **kw),
    }


def dlrm_batch(step: int, rank: int, b: int = 16) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(500 + 10 * step + rank)
    y = rng.integers(0, 2, b).astype(np.float32)
    return rng.integers(0, 200, b), rng.integers(0, 200, b), y


sharded = adagrad_tables(ShardedTable, comm="torch")
ours = DistributedDataParallel(
    Dlrm(et.EmbeddingBagCollection(ShardedCollection(sharded), gradient_reduction="mean"))
)
single = adagrad_tables(embstore.Table)
ref = Dlrm(et.EmbeddingBagCollection(embstore.Collection(single)))
opt_ours = torch.optim.SGD(ours.parameters(), lr=0.5)
opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
for step in range(5):
    u, i, y = (torch.from_numpy(a) for a in dlrm_batch(step, R))
    opt_ours.zero_grad()
    F.binary_cross_entropy_with_logits(ours(u, i), y).backward()  # the mean over b
    opt_ours.step()
    u, i, y = (
        torch.from_numpy(np.concatenate(a))
        for a in zip(*(dlrm_batch(step, r) for r in range(N)), strict=True)
    )
    opt_ref.zero_grad()
    F.binary_cross_entropy_with_logits(ref(u, i), y).backward()  # the mean over N*b
    opt_ref.step()
for a, b in zip(ours.module.top.parameters(), ref.top.parameters(), strict=True):
    close(a.detach().numpy(), b.detach().numpy())
for name, table in single.items():
    k_ref, rows_ref = table.export()
    assert sharded[name].step == table.step == 5
    close(sharded[name].lookup(k_ref, insert=False), rows_ref)

# The unpooled collection and a single bag over a sharded table take it too.
ec = et.EmbeddingCollection(
    ShardedCollection(adagrad_tables(ShardedTable, comm="torch")), gradient_reduction="sum"
)
assert ec.gradient_reduction == "sum"
bag = et.EmbeddingBag(ShardedTable(DIM, comm="torch", optimizer=optim.SGD(lr=0.1)), mode="sum")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    bag(torch.arange(6).reshape(3, 2)).sum().backward()
assert any(
    issubclass(w.category, DeprecationWarning) and "gradient_reduction" in str(w.message)
    for w in caught
), [str(w.message) for w in caught]


# 9. An online reshard over gloo: a "bucket" table on the first N-1 ranks
# (one rank when N is 2) moved to all N ranks and back,
# training between, equals the offline path (saved, loaded) bit for bit.
from embstore.distributed import reshard  # noqa: E402


def reshard_batch(step: int, size: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(900 + step)
    keys = rng.integers(0, 3000, 90) * 7919
    return keys[rank::size], rng.normal(size=(90, DIM)).astype(np.float32)[rank::size]


def reshard_train(t: ShardedTable | None, steps: range) -> None:
    for step in steps if t is not None else ():
        k, g = reshard_batch(step, t.size, t.rank)
        t.lookup(k)
        t.apply_gradients(k, g)


few = dist.new_group(list(range(N - 1)))
mine_few = few if R < N - 1 else None


def reshard_table(comm: object) -> ShardedTable:
    return ShardedTable(DIM, comm=comm, partition="bucket", optimizer=optim.Adam(lr=0.05), seed=31)


online = reshard_table(mine_few) if R < N - 1 else None
offline = reshard_table(mine_few) if R < N - 1 else None
reshard_train(online, range(3))
reshard_train(offline, range(3))
online = reshard(online, "torch", via="torch")
where = every(tempfile.mkdtemp() if R == 0 else None)[0]
if offline is not None:
    offline.save(os.path.join(where, "few"))
dist.barrier()
offline = ShardedTable.load(os.path.join(where, "few"), comm="torch")
assert online is not None
assert online.partitioning == offline.partitioning
assert online.stats()["reshard"]["seconds"] > 0
reshard_train(online, range(3, 6))
reshard_train(offline, range(3, 6))
online = reshard(online, mine_few, via="torch")
offline.save(os.path.join(where, "all"))
offline = ShardedTable.load(os.path.join(where, "all"), comm=mine_few) if R < N - 1 else None
reshard_train(online, range(6, 9))
reshard_train(offline, range(6, 9))
if online is not None:
    assert offline is not None
    a, b = online.state_dict(), offline.state_dict()
    assert all(np.array_equal(a[f], b[f]) for f in ("keys", "rows", "state", "step"))
else:
    assert offline is None
dist.barrier()


# 8. Save and resume a torchrun + DDP job: each rank saves the model's
# state_dict (the dense parameters, and its shard of each sharded table) and
# the dense optimizer's; a fresh job of as many ranks loads them and trains
# on bit for bit as the job that went on.
def dlrm_job() -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    tables = adagrad_tables(ShardedTable, comm="torch")
    model = DistributedDataParallel(
        Dlrm(et.EmbeddingBagCollection(ShardedCollection(tables), gradient_reduction="mean"))
    )
    return model, torch.optim.Adam(model.parameters(), lr=0.01), tables


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        u, i, y = (torch.from_numpy(a) for a in dlrm_batch(step, R))
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(u, i), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


first, opt_first, first_tables = dlrm_job()
train(first, opt_first, range(3))
where = every(tempfile.mkdtemp() if R == 0 else None)[0]
torch.save(
    {"model": first.module.state_dict(), "optimizer": opt_first.state_dict()},
    os.path.join(where, f"rank{R}.pt"),
)
went_on = train(first, opt_first, range(3, 6))
resumed, opt_resumed, resumed_tables = dlrm_job()
saved = torch.load(os.path.join(where, f"rank{R}.pt"), weights_only=True)
resumed.module.load_state_dict(saved["model"])
opt_resumed.load_state_dict(saved["optimizer"])
assert train(resumed, opt_resumed, range(3, 6)) == went_on
for a, b in zip(resumed.module.parameters(), first.module.parameters(), strict=True):
    assert torch.equal(a, b)
for name in ("user", "item"):
    keys = np.arange(200)
    assert np.array_equal(
        first_tables[name].lookup(keys, insert=False),
        resumed_tables[name].lookup(keys, insert=False),
    )
# A shard loaded on another rank is refused on every rank, nothing changed.
other = torch.load(os.path.join(where, f"rank{(R + 1) % N}.pt"), weights_only=True)
before = resumed.module.state_dict()
with pytest.raises(RuntimeError, match="belongs to rank"):
    resumed.module.load_state_dict(other["model"])
after = resumed.module.state_dict()
assert all(torch.equal(before[k], after[k]) for k in before)

# DDP's reducer holds the process group: it goes first, or its thread is
# still running when the group is destroyed (a C++ terminate at exit).
del ours, opt_ours, first, opt_first, resumed, opt_resumed
gc.collect()

print(f"rank {R}: gloo suite passed ({N} ranks, {t.stats()['global_rows']} rows)", flush=True)
dist.barrier()
dist.destroy_process_group()
# The process ends as any script does: the watchdog's thread is joined and
# the transports let go of their groups at exit, before the teardown.
