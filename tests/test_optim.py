"""Optimizers against oracles nobody here wrote: torch.optim.SparseAdam and
torch.optim.Adagrad on a dense tensor holding the same initial rows, and
NumPy references of the published formulas for the others. Every SIMD
backend the CPU supports is checked (the ``simd`` fixture)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import embstore
from embstore import optim
from tests.conftest import batch, key_pool

DIM = 16
STEPS = 32
POOL = 300
N = 96


def run_table(
    opt: optim.Optimizer, rng: np.random.Generator
) -> tuple[embstore.Table, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """Trains a table on random batches; returns it, the key pool and the batches."""
    pool = key_pool(rng, POOL)
    table = embstore.Table(DIM, optimizer=opt, seed=5, num_shards=7)
    steps = []
    for _ in range(STEPS):
        keys = batch(rng, pool, N)
        grads = rng.normal(size=(N, DIM)).astype(np.float32)
        table.apply_gradients(keys, grads)
        steps.append((keys, grads))
    return table, pool, steps


def initial_rows(pool: np.ndarray) -> np.ndarray:
    """The rows a fresh table with seed 5 gives the pool's keys."""
    return embstore.Table(DIM, seed=5).lookup(pool, insert=False)


def dense_index(pool: np.ndarray, keys: np.ndarray) -> np.ndarray:
    order = np.argsort(pool)
    return order[np.searchsorted(pool[order], keys)]


def touched(pool: np.ndarray, steps: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    return np.unique(np.concatenate([k for k, _ in steps]))


def check_rows(table: embstore.Table, pool: np.ndarray, steps: list, weights: np.ndarray) -> None:
    keys, rows = table.export()
    np.testing.assert_array_equal(keys, touched(pool, steps))
    expect = weights[dense_index(pool, keys)]
    np.testing.assert_allclose(rows, expect, rtol=1e-5, atol=1e-6)


def torch_oracle(
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    pool: np.ndarray,
    steps: list[tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, torch.optim.Optimizer, torch.Tensor]:
    w = torch.nn.Parameter(torch.from_numpy(initial_rows(pool)))
    opt = make([w])
    for keys, grads in steps:
        idx = torch.from_numpy(dense_index(pool, keys))
        w.grad = torch.sparse_coo_tensor(
            idx[None, :], torch.from_numpy(grads), w.shape, check_invariants=True
        )
        opt.step()
    return w.detach().numpy(), opt, w


def test_adam_matches_torch_sparse_adam(rng: np.random.Generator, simd: str) -> None:
    table, pool, steps = run_table(optim.Adam(lr=0.01), rng)
    assert table.simd == simd
    weights, opt, w = torch_oracle(
        lambda p: torch.optim.SparseAdam(p, lr=0.01, betas=(0.9, 0.999), eps=1e-8), pool, steps
    )
    check_rows(table, pool, steps, weights)
    keys, _, state = table.export(with_state=True)
    idx = dense_index(pool, keys)
    st = opt.state[w]
    np.testing.assert_allclose(state[:, :DIM], st["exp_avg"].numpy()[idx], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(state[:, DIM:], st["exp_avg_sq"].numpy()[idx], rtol=1e-5, atol=1e-7)
    assert table.step == STEPS
    assert table.state_names == ["exp_avg", "exp_avg_sq"]


def test_adagrad_matches_torch_adagrad(rng: np.random.Generator, simd: str) -> None:
    table, pool, steps = run_table(
        optim.Adagrad(lr=0.1, initial_accumulator_value=0.05, eps=1e-10), rng
    )
    weights, opt, w = torch_oracle(
        lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.05, eps=1e-10),
        pool,
        steps,
    )
    check_rows(table, pool, steps, weights)
    keys, _, state = table.export(with_state=True)
    np.testing.assert_allclose(
        state, opt.state[w]["sum"].numpy()[dense_index(pool, keys)], rtol=1e-5
    )


# -- NumPy references of the formulas in DESIGN.md ---------------------------


def numpy_reference(
    update: Callable[[np.ndarray, np.ndarray, np.ndarray, int], None],
    state_init: Callable[[int], np.ndarray],
    pool: np.ndarray,
    steps: list[tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray]:
    """Applies ``update(w_rows, state_rows, g, t)`` to the distinct keys of each batch."""
    w = initial_rows(pool).astype(np.float64)
    state = state_init(len(pool))
    for t, (keys, grads) in enumerate(steps, start=1):
        idx = dense_index(pool, keys)
        uniq, inv = np.unique(idx, return_inverse=True)
        g = np.zeros((len(uniq), DIM))
        np.add.at(g, inv, grads.astype(np.float64))
        wr, sr = w[uniq], state[uniq]
        update(wr, sr, g, t)
        w[uniq], state[uniq] = wr, sr
    return w, state


def test_sgd_matches_numpy(rng: np.random.Generator, simd: str) -> None:
    table, pool, steps = run_table(optim.SGD(lr=0.05), rng)

    def upd(w: np.ndarray, s: np.ndarray, g: np.ndarray, t: int) -> None:
        w -= 0.05 * g

    w, _ = numpy_reference(upd, lambda n: np.zeros((n, 0)), pool, steps)
    check_rows(table, pool, steps, w)
    assert table.state_len == 0


def test_rowwise_adagrad_matches_numpy(rng: np.random.Generator, simd: str) -> None:
    table, pool, steps = run_table(optim.RowWiseAdagrad(lr=0.1, eps=1e-10), rng)

    def upd(w: np.ndarray, s: np.ndarray, g: np.ndarray, t: int) -> None:
        s += np.mean(g * g, axis=1, keepdims=True)
        w -= 0.1 * g / (np.sqrt(s) + 1e-10)

    w, s = numpy_reference(upd, lambda n: np.zeros((n, 1)), pool, steps)
    check_rows(table, pool, steps, w)
    keys, _, state = table.export(with_state=True)
    np.testing.assert_allclose(state, s[dense_index(pool, keys)], rtol=1e-5)


def test_adamw_matches_numpy(rng: np.random.Generator, simd: str) -> None:
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.99, 1e-8, 0.1
    table, pool, steps = run_table(
        optim.AdamW(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd), rng
    )

    def upd(w: np.ndarray, s: np.ndarray, g: np.ndarray, t: int) -> None:
        m, v = s[:, :DIM], s[:, DIM:]
        w *= 1 - lr * wd
        m += (g - m) * (1 - b1)
        v *= b2
        v += (1 - b2) * g * g
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        w -= lr / bc1 * m / (np.sqrt(v) / np.sqrt(bc2) + eps)

    w, s = numpy_reference(upd, lambda n: np.zeros((n, 2 * DIM)), pool, steps)
    check_rows(table, pool, steps, w)
    keys, _, state = table.export(with_state=True)
    np.testing.assert_allclose(state, s[dense_index(pool, keys)], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("l1", "l2", "beta"), [(0.0, 0.0, 0.0), (0.05, 0.1, 0.5)])
def test_ftrl_matches_numpy(
    rng: np.random.Generator, simd: str, l1: float, l2: float, beta: float
) -> None:
    lr, acc0 = 0.1, 0.1
    table, pool, steps = run_table(
        optim.Ftrl(lr=lr, l1=l1, l2=l2, beta=beta, initial_accumulator_value=acc0), rng
    )

    def upd(w: np.ndarray, s: np.ndarray, g: np.ndarray, t: int) -> None:
        # tf.keras.optimizers.Ftrl, learning_rate_power = -0.5
        z, n = s[:, :DIM], s[:, DIM:]
        n_new = n + g * g
        z += g - (np.sqrt(n_new) - np.sqrt(n)) / lr * w
        n[:] = n_new
        quadratic = np.sqrt(n_new) / lr + 2 * (l2 + beta / (2 * lr))
        w[:] = np.where(np.abs(z) > l1, (np.sign(z) * l1 - z) / quadratic, 0.0)

    def init(n: int) -> np.ndarray:
        return np.concatenate([np.zeros((n, DIM)), np.full((n, DIM), acc0)], axis=1)

    w, s = numpy_reference(upd, init, pool, steps)
    check_rows(table, pool, steps, w)
    keys, _, state = table.export(with_state=True)
    np.testing.assert_allclose(state, s[dense_index(pool, keys)], rtol=1e-5, atol=1e-6)


def test_untouched_rows_do_not_change(rng: np.random.Generator) -> None:
    """Lazy updates: Adam must not decay the moments of rows absent from a batch."""
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=0.1))
    table.apply_gradients([1, 2], np.ones((2, DIM)))
    before = table.export(with_state=True)
    table.apply_gradients([3], np.ones((1, DIM)))
    after = table.export(with_state=True)
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a[:2], b)


def test_step_counts_calls_not_keys() -> None:
    table = embstore.Table(4, optimizer=optim.SGD(lr=1.0), seed=0)
    table.apply_gradients([7, 7, 7], np.ones((3, 4)))
    assert table.step == 1
    np.testing.assert_allclose(
        table.lookup([7]), embstore.Table(4, seed=0).lookup([7], insert=False) - 3.0, rtol=1e-6
    )


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (lambda: optim.SGD(lr=0.0), "lr"),
        (lambda: optim.SGD(lr=float("nan")), "lr"),
        (lambda: optim.Adam(beta1=1.0), "beta1"),
        (lambda: optim.Adam(beta2=-0.1), "beta2"),
        (lambda: optim.Adam(eps=-1.0), "eps"),
        (lambda: optim.Adagrad(lr=0.1, initial_accumulator_value=-1), "initial_accumulator_value"),
        (lambda: optim.AdamW(weight_decay=-0.5), "weight_decay"),
        (lambda: optim.Ftrl(lr=0.1, l1=-1.0), "l1"),
        (lambda: optim.Ftrl(lr=0.1, initial_accumulator_value=0.0), "initial_accumulator_value"),
        (lambda: optim.RowWiseAdagrad(lr=-1.0), "lr"),
    ],
)
def test_bad_hyper_parameters_name_the_argument(make: Callable[[], object], arg: str) -> None:
    with pytest.raises(ValueError, match=f"^{arg}: expected"):
        make()


def test_non_number_hyper_parameter_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="lr: expected a real number"):
        optim.SGD(lr="0.1")  # type: ignore[arg-type]


# -- weight_decay: coupled L2 on the touched rows ------------------------------


def run_all_touched(
    opt: optim.Optimizer, rng: np.random.Generator
) -> tuple[embstore.Table, np.ndarray, list[np.ndarray]]:
    """Every batch touches every key of a small set (with repeats), so that
    torch's dense optimizers, which decay every row, are the oracle of a
    sparse update restricted to the touched rows."""
    keys = np.sort(key_pool(rng, 40))
    table = embstore.Table(DIM, optimizer=opt, seed=5, num_shards=3)
    summed = []
    for _ in range(12):
        b = np.concatenate([keys, rng.choice(keys, 60)])
        grads = rng.normal(size=(len(b), DIM)).astype(np.float32)
        table.apply_gradients(b, grads)
        g = np.zeros((len(keys), DIM), np.float32)
        np.add.at(g, np.searchsorted(keys, b), grads)
        summed.append(g)
    return table, keys, summed


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (
            optim.SGD(lr=0.05, weight_decay=0.3),
            lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=0.3),
        ),
        (
            optim.Adagrad(lr=0.1, initial_accumulator_value=0.05, weight_decay=0.2),
            lambda p: torch.optim.Adagrad(
                p, lr=0.1, initial_accumulator_value=0.05, eps=1e-10, weight_decay=0.2
            ),
        ),
        (
            optim.Adam(lr=0.01, weight_decay=0.5),
            lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-8, weight_decay=0.5),
        ),
    ],
    ids=["SGD", "Adagrad", "Adam"],
)
def test_weight_decay_matches_torch(
    rng: np.random.Generator,
    simd: str,
    ours: optim.Optimizer,
    theirs: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
) -> None:
    table, keys, summed = run_all_touched(ours, rng)
    w = torch.nn.Parameter(torch.from_numpy(embstore.Table(DIM, seed=5).lookup(keys)))
    opt = theirs([w])
    for g in summed:
        w.grad = torch.from_numpy(g)
        opt.step()
    got_keys, rows = table.export()
    np.testing.assert_array_equal(got_keys, keys)
    np.testing.assert_allclose(rows, w.detach().numpy(), rtol=2e-5, atol=1e-6)
    # without the decay the rows differ: the test sees the parameter
    plain, _, _ = run_all_touched(type(ours)(**{**vars(ours), "weight_decay": 0.0}), rng)
    assert not np.allclose(plain.export()[1], rows, atol=1e-4)


def test_rowwise_adagrad_weight_decay_matches_numpy(rng: np.random.Generator, simd: str) -> None:
    lr, wd = 0.1, 0.25
    table, pool, steps = run_table(optim.RowWiseAdagrad(lr=lr, weight_decay=wd), rng)

    def upd(w: np.ndarray, s: np.ndarray, g: np.ndarray, t: int) -> None:
        g = g + wd * w  # FBGEMM's L2 weight decay mode
        s += np.mean(g * g, axis=1, keepdims=True)
        w -= lr * g / (np.sqrt(s) + 1e-10)

    w, _ = numpy_reference(upd, lambda n: np.zeros((n, 1)), pool, steps)
    check_rows(table, pool, steps, w)  # untouched keys have no row; touched rows decay


def test_ftrl_weight_decay_matches_numpy(rng: np.random.Generator, simd: str) -> None:
    lr, acc0, wd = 0.1, 0.1, 0.3
    table, pool, steps = run_table(optim.Ftrl(lr=lr, weight_decay=wd), rng)

    def upd(w: np.ndarray, s: np.ndarray, g: np.ndarray, t: int) -> None:
        g = g + wd * w
        z, n = s[:, :DIM], s[:, DIM:]
        n_new = n + g * g
        z += g - (np.sqrt(n_new) - np.sqrt(n)) / lr * w
        n[:] = n_new
        w[:] = np.where(np.abs(z) > 0.0, -z / (np.sqrt(n_new) / lr), 0.0)

    def init(n: int) -> np.ndarray:
        return np.concatenate([np.zeros((n, DIM)), np.full((n, DIM), acc0)], axis=1)

    w, _ = numpy_reference(upd, init, pool, steps)
    check_rows(table, pool, steps, w)


def test_weight_decay_is_refused_when_negative_and_saved_in_checkpoints(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="weight_decay"):
        optim.Adam(weight_decay=-0.1)
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.1, weight_decay=0.01))
    t.apply_gradients([1], np.ones((1, 4)))
    path = f"{tmp_path}/ckpt"
    t.save(path)
    assert embstore.Table.load(path).optimizer == optim.SGD(lr=0.1, weight_decay=0.01)


@pytest.mark.parametrize("n", [1, 200, 256, 257, 1024, 1025, 3000])
def test_adam_matches_sparse_adam_on_both_sides_of_the_small_call_threshold(n: int) -> None:
    """Batches of up to 256 keys step on the calling thread (1,024 for
    lookups), larger ones on the pool: both equal torch.optim.SparseAdam."""
    rng = np.random.default_rng(n)
    pool = np.arange(4000, dtype=np.int64) * 7919
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=0.01), seed=5, num_shards=8)
    w = torch.nn.Parameter(torch.from_numpy(table.lookup(pool, insert=False)))
    opt = torch.optim.SparseAdam([w], lr=0.01)
    for _ in range(3):
        idx = rng.integers(0, len(pool), n)
        grads = rng.normal(size=(n, DIM)).astype(np.float32)
        rows = table.lookup(pool[idx])
        np.testing.assert_allclose(rows, w.detach().numpy()[idx], rtol=1e-5, atol=1e-6)
        table.apply_gradients(pool[idx], grads)
        w.grad = torch.sparse_coo_tensor(
            torch.from_numpy(idx)[None, :],
            torch.from_numpy(grads),
            w.shape,
            check_invariants=True,
        )
        opt.step()
    keys, rows = table.export()
    np.testing.assert_allclose(
        rows, w.detach().numpy()[np.searchsorted(pool, keys)], rtol=1e-5, atol=1e-6
    )
