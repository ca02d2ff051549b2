"""Size a cache before buying memory: the hit rate a cache of each size would
reach on a recorded key stream (a miss-ratio curve).

Two curves per size ``c``:

- ``lru``: the hit rate of an LRU cache of ``c`` rows, exact for one access
  after another (from LRU stack distances: an access hits when fewer than
  ``c`` other distinct keys came since the previous access to its key);
- ``static``: the hit rate of a cache that always holds the ``c`` keys most
  frequent in the stream, the bound an LFU cache approaches on a stationary
  stream.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import _convert, _core
from embstore._cli import Parser, positive_int, require
from embstore._deps import install_hint

__all__ = ["CacheCurve", "cache_curve", "main"]


@dataclass(frozen=True)
class CacheCurve:
    """Hit rates of a key stream at each cache size."""

    sizes: npt.NDArray[np.int64]
    lru: npt.NDArray[np.float64]
    static: npt.NDArray[np.float64]
    accesses: int
    distinct: int

    def table(self) -> str:
        lines = [
            f"{self.accesses:,} accesses, {self.distinct:,} distinct keys",
            f"{'rows':>12} {'% of keys':>10} {'LRU hit rate':>13} {'static top-k':>13}",
        ]
        for c, lru, st in zip(self.sizes, self.lru, self.static, strict=True):
            # A cache larger than the distinct keys holds all of them: 100%.
            share = 100 * min(int(c), self.distinct) / max(1, self.distinct)
            lines.append(f"{c:>12,} {share:>9.3f}% {lru:>13.4f} {st:>13.4f}")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Draw both curves to an image file (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError(f"drawing the curve needs matplotlib: {install_hint('plot')}") from e
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(self.sizes, self.lru, marker="o", label="LRU (exact)")
        ax.plot(self.sizes, self.static, marker="s", label="static top-k (LFU bound)")
        ax.set_xscale("log")
        ax.set_xlabel("cache rows")
        ax.set_ylabel("hit rate")
        ax.set_ylim(0, 1)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        ax.set_title(f"{self.accesses:,} accesses, {self.distinct:,} keys")
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=120)
        plt.close(fig)


def cache_curve(keys: Any, sizes: Any = None) -> CacheCurve:
    """The hit rates of the key stream ``keys`` (1-D integers, in access
    order) for caches of ``sizes`` rows (default: 12 sizes from 0.01% to all
    of the distinct keys)."""
    k = _convert.as_keys(keys)
    n = int(k.shape[0])
    if n == 0:
        raise ValueError("keys: expected a non-empty key stream")
    dist = _core.lru_stack_distances(k)
    counts = np.sort(np.unique(k, return_counts=True)[1])[::-1]
    distinct = int(counts.shape[0])
    if sizes is None:
        s = np.unique(np.geomspace(max(1, distinct // 10_000), distinct, 12).astype(np.int64))
    else:
        s = np.asarray(sizes)
        if s.ndim != 1 or s.size == 0 or not np.issubdtype(s.dtype, np.integer) or (s < 1).any():
            raise ValueError("sizes: expected a non-empty 1-D array of integers >= 1")
        s = s.astype(np.int64)
    reuse = np.sort(dist[dist >= 0])
    lru = np.searchsorted(reuse, s, side="left") / n
    top = np.concatenate([[0], np.cumsum(counts)])
    static = top[np.minimum(s, distinct)] / n
    return CacheCurve(s, lru.astype(np.float64), static.astype(np.float64), n, distinct)


def _read_keys(p: Parser, path: str) -> Any:
    """The array of the .npy file at ``path``, checked before it is read: a
    regular file (a FIFO or a device is refused without blocking) whose
    header's shape fits in its bytes (a header claiming 2^40 rows is
    refused, not allocated); ``p.error`` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        p.error(f"keys: cannot open {path}: {e.strerror}")
    # Asked of the descriptor before it becomes a file object (which a
    # directory's cannot: "[Errno 21] Is a directory: 3").
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        p.error(f"keys: {path} is {kind}; expected a .npy file of keys")
    with os.fdopen(fd, "rb") as f:
        try:
            if f.read(6) == b"\x93NUMPY":
                f.seek(0)
                version = np.lib.format.read_magic(f)
                read = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, _, dtype = read(f)
                need = int(np.prod(shape, dtype=object)) * dtype.itemsize
                if need > st.st_size - f.tell():
                    p.error(
                        f"keys: {path}'s header claims {shape} values of {dtype} ({need} bytes), "
                        f"the file holds {st.st_size} bytes"
                    )
            f.seek(0)
            return np.load(f, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            p.error(f"keys: cannot read {path} as a .npy file: {e}")


def main(argv: list[str] | None = None) -> int:
    p = Parser("python -m embstore cache-curve", __doc__)
    p.add_argument("keys", help="a .npy file of integer keys in access order (no pickles)")
    p.add_argument(
        "--sizes",
        type=positive_int,
        nargs="+",
        help="cache sizes in rows (default: 12 sizes from 0.01%% to 100%% of the distinct keys)",
    )
    p.add_argument("--png", help="also draw the curves to this image file (needs matplotlib)")
    a = p.parse_args(argv)
    if a.png:
        require(p, "matplotlib", "plot", "--png")
        if not os.path.isdir(os.path.dirname(os.path.abspath(a.png))):
            p.error(f"--png: the directory of {a.png!r} does not exist")
    keys = _read_keys(p, a.keys)
    if not isinstance(keys, np.ndarray):
        p.error(f"keys: {a.keys} is an .npz archive; expected one .npy array")
    if not np.issubdtype(keys.dtype, np.integer):
        p.error(f"keys: {a.keys} holds {keys.dtype} values; expected integer keys")
    if keys.size == 0:
        p.error(f"keys: {a.keys} holds no keys; expected a non-empty key stream")
    try:
        curve = cache_curve(np.ravel(keys), a.sizes)
    except (TypeError, ValueError, OverflowError) as e:
        p.error(str(e))
    print(curve.table())
    if a.png:
        curve.plot(a.png)
        print(f"drawn to {a.png}")
    return 0
