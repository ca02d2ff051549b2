"""The device cache's 8-bit row codec on a GPU: decode (gather at slots and
dequantize) and encode (range, draws, codes) of 500,000 rows of dim 64, the
CUDA kernels of gpu/_cuda_int8.py against the array code they equal (CuPy
element-wise kernels), medians of 20 calls between CUDA events.

    python benches/probes/int8_codec_gpu.py
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np


def main() -> None:
    import cupy  # type: ignore[import-not-found, unused-ignore]

    from embstore.gpu import _xp as X
    from embstore.gpu._int8 import Int8Rows

    xp = X.namespace(cupy)
    n, dim = 500_000, 64
    rng = np.random.default_rng(0)
    w = cupy.asarray(rng.standard_normal((n, dim)).astype(np.float32))
    keys = cupy.asarray(rng.integers(0, 10**9, n))
    slots = cupy.asarray(rng.integers(0, n, n))

    def timed(f: Callable[[], object]) -> float:
        ms = []
        for _ in range(20):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record()
            f()
            b.record()
            b.synchronize()
            ms.append(cupy.cuda.get_elapsed_time(a, b))
        return float(np.median(ms))

    for name, kernels in (("kernels", True), ("array code", False)):
        codec = Int8Rows(xp, dim, 1, kernels)
        stored = codec.encode_step(w, keys, 3, cupy.asnumpy)
        enc = timed(partial(codec.encode_step, w, keys, 3, cupy.asnumpy))
        dec = timed(partial(codec.decode_at, stored, slots))
        gb = n * dim * 4 / 1e9
        print(
            f"{name}: encode {enc:.3f} ms ({gb / enc * 1e3:.0f} GB/s of float32 rows in), "
            f"decode at slots {dec:.3f} ms ({gb / dec * 1e3:.0f} GB/s of float32 rows out)",
            flush=True,
        )


if __name__ == "__main__":
    main()
