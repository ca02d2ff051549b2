"""The optimizer bounds over a grid: for every optimizer, learning rate,
gradient magnitude (zero, subnormal, tiny, ordinary, huge) and row dtype, a
step either applies and leaves every row and state finite, or is refused
with ValueError and changes nothing. At 7e7142d RowWiseAdagrad with lr >=
1e30 and a zero or tiny gradient made rows NaN or inf (lr / (sqrt(h)+eps)
overflowed before it met the gradient)."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore import optim

DIM = 8
LRS = [1e-3, 1.0, 1e10, 1e30, 3e38]
GRADS = [0.0, 1e-45, 1e-30, 1e-3, 1.0, 1e20, 3e38]


def optimizers(lr: float) -> list[optim.Optimizer]:
    return [
        optim.SGD(lr=lr),
        optim.Adagrad(lr=lr),
        optim.RowWiseAdagrad(lr=lr),
        optim.Adam(lr=lr),
        # lr * weight_decay must stay below 1 (refused at construction).
        optim.AdamW(lr=lr, weight_decay=min(0.01, 0.5 / lr)),
        optim.Ftrl(lr=lr),
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_step_is_finite_or_refused_whole(dtype: str) -> None:
    bad = []
    for lr in LRS:
        for opt in optimizers(lr):
            for g in GRADS:
                t = embstore.Table(DIM, optimizer=opt, dtype=dtype, seed=1)
                keys = np.array([1, 2, 3])
                t.lookup(keys)
                grads = np.full((3, DIM), g, np.float32)
                grads[1] *= -1
                before = t.export(with_state=True)
                for _ in range(2):  # a second step meets the first's state
                    try:
                        t.apply_gradients(keys, grads)
                    except ValueError:
                        after = t.export(with_state=True)
                        for x, y in zip(before, after, strict=True):
                            np.testing.assert_array_equal(x, y)
                        break
                    before = t.export(with_state=True)
                    _, rows, state = before
                    if not (np.isfinite(rows).all() and np.isfinite(state).all()):
                        bad.append((type(opt).__name__, lr, g))
                        break
    assert not bad, f"steps that left a non-finite row or state: {bad}"
