"""The index's kernels once each on 1M keys, for a kernel profiler to
measure (time, and bytes moved against the HBM limit): finds with rows
(``find8``, ``find4``, ``find2``: tiles of 8, 4, 2 lanes a key;
``find_rows``: a warp a key) and insert_or_assign of new keys
(``upsert_find8``, ``upsert_plan``, ``put_rows8``), on an index of 32M
slots at load 0.5, dim 64. The index is filled with the other kernels, so
that a filter on these names profiles these calls alone:

    ncu --clock-control none -k 'regex:find[842]|find_rows|upsert|put_rows8' \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        python benches/probes/gpu_index_profile.py

Needs CuPy and a GPU.
"""

from __future__ import annotations

import cupy  # type: ignore[import-not-found, unused-ignore]
import numpy as np

from embstore.gpu.index import BucketIndex


def main() -> None:
    rng = np.random.default_rng(0)
    index = BucketIndex(cupy, 1 << 25)
    ix = index
    dim, batch = 64, 1 << 20
    rows = cupy.zeros((index.capacity, dim), dtype=cupy.float32)
    ones = cupy.ones((batch, dim), dtype=cupy.float32)
    ix._cuda.tile, ix.fused = 0, False  # the fill: none of the kernels profiled
    tick = 0
    while index.used < index.capacity // 2:
        tick += 1
        keys = cupy.asarray(rng.integers(-(2**62), 2**62, batch, dtype=np.int64))
        index.insert_or_assign(keys, ones, rows, tick)
    held = index.keys[index.slots_in_use()]
    probe = held[cupy.asarray(rng.integers(0, int(held.shape[0]), batch))]
    new = cupy.asarray(rng.integers(-(2**62), 2**62, batch, dtype=np.int64))
    for tile in (8, 4, 2, 0):
        ix._cuda.tile = tile
        ix._cuda.find_rows(probe, ix.keys, ix.digest, ix.buckets, ix.bucket_size, rows)
    ix._cuda.tile, ix.fused = None, True
    index.insert_or_assign(new, ones, rows, tick + 1)
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
