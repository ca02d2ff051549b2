"""embstore.distributed.wire: the encodings of rows and gradients on the
wire between ranks, against oracles nobody here wrote (torch's bfloat16
rounding, NumPy's float16), and the int8 map's error bound."""

from __future__ import annotations

import numpy as np
import pytest

from embstore.distributed import wire


def _rows(n: int = 300, dim: int = 17) -> np.ndarray:
    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((n, dim)) * np.exp(rng.uniform(-20, 20, (n, 1)))).astype(np.float32)
    rows[0] = 0.0
    rows[1] = 3.0  # a constant row: scale 0
    rows[2, 0] = -0.0
    return rows


def test_bfloat16_rounds_as_torch_does() -> None:
    torch = pytest.importorskip("torch")
    rows = _rows()
    got = wire.decode(wire.encode(rows, "bfloat16"), "bfloat16", rows.shape[1])
    want = torch.from_numpy(rows).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_float16_rounds_as_numpy_does_and_saturates() -> None:
    rows = _rows()
    rows[3, :3] = [1e6, -1e6, 65504.0]
    got = wire.decode(wire.encode(rows, "float16"), "float16", rows.shape[1])
    want = np.clip(rows, -65504, 65504).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all()


def test_int8_keeps_each_value_within_half_a_step() -> None:
    rows = _rows()
    got = wire.decode(wire.encode(rows, "int8"), "int8", rows.shape[1])
    step = (rows.max(axis=1) - rows.min(axis=1)) / 255
    assert (np.abs(got - rows) <= step[:, None] * 0.5001 + 1e-30).all()
    np.testing.assert_array_equal(got[1], rows[1])  # a constant row exactly
    np.testing.assert_array_equal(got.min(axis=1), rows.min(axis=1))


@pytest.mark.parametrize("w", wire.WIRE_DTYPES)
def test_sizes_and_empty_batches(w: str) -> None:
    rows = _rows(7, 64)
    coded = wire.encode(rows, w)
    assert coded.nbytes == 7 * wire.row_bytes(w, 64)
    if w == "float32":
        assert coded is rows or np.shares_memory(coded, rows)  # nothing copied
    empty = wire.decode(wire.encode(np.empty((0, 64), np.float32), w), w, 64)
    assert empty.shape == (0, 64)
    assert empty.dtype == np.float32


def test_bfloat16_puts_at_most_055x_float32s_bytes_of_a_step_on_the_link() -> None:
    # Per key owned elsewhere: its 8-byte key, its row back, its gradient out.
    for dim in (16, 64, 128):
        f32 = 8 + 2 * wire.row_bytes("float32", dim)
        assert (8 + 2 * wire.row_bytes("bfloat16", dim)) / f32 <= 0.55


def test_a_bad_wire_dtype_is_named() -> None:
    with pytest.raises(ValueError, match="wire_dtype"):
        wire.check_wire_dtype("fp8")
