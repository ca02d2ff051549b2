"""A table's large row columns and indexes ask the kernel for transparent
huge pages (MADV_HUGEPAGE), so that a kernel in THP mode ``madvise`` (the
Debian and Ubuntu default) backs them with 2 MiB pages as it does NumPy's
large arrays; so do the large output arrays of batch calls (a Collection's
pooled output, written feature by feature, rows 6.6 KiB apart).
``EMBSTORE_HUGE_PAGES=0`` turns the advice off. Measured in fresh
processes by the growth of ``AnonHugePages``."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    try:
        return THP.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


CHILD = """
import numpy as np
import embstore

def huge_mib():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) // 1024
    return 0

before = huge_mib()
# One shard of 300,000 rows of 256 bytes: segments of 64 rows doubling,
# those of 16,384 rows (4 MiB) and more ask for huge pages.
t = embstore.Table(64, num_shards=1)
keys = np.arange(300_000)
t.assign(keys, np.ones((keys.size, 64), np.float32))
assert float(t.lookup(keys[::997], insert=False).sum()) == 64 * keys[::997].size
print(huge_mib() - before)
"""


OUTPUT_CHILD = """
import numpy as np
import embstore

def huge_mib():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) // 1024
    return 0

# A table of small rows (its own memory well under the output's), then a
# pooled lookup whose output is 64 MiB: 4 features x 65,536 bags x dim 64.
t = embstore.Table(64, num_shards=1)
t.assign(np.arange(1000), np.ones((1000, 64), np.float32))
coll = embstore.Collection({f"f{i}": t for i in range(4)})
ids = np.arange(65_536) % 1000
before = huge_mib()
out = coll.lookup_pooled({f"f{i}": ids for i in range(4)}, insert=False)
assert out.shape == (65_536, 256) and float(out[:, ::64].sum()) == 4 * 65_536
print(huge_mib() - before)
"""


def huge_growth(advice: str, child: str = CHILD) -> int:
    env = {**os.environ, "EMBSTORE_HUGE_PAGES": advice}
    out = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    thp_mode() not in ("madvise", "always"),
    reason=f"the kernel gives no transparent huge pages here (mode {thp_mode()})",
)
def test_large_row_columns_get_huge_pages_where_the_kernel_gives_them() -> None:
    grown = huge_growth("1")
    # The rows' 83 MiB include segments of 4 MiB and more (the last partly
    # written); at least 16 MiB of them are in huge pages.
    assert grown >= 16, grown
    if thp_mode() == "madvise":
        # Off, nothing asks: the kernel gives none (in "always" it would).
        assert huge_growth("0") == 0


@pytest.mark.skipif(
    thp_mode() not in ("madvise", "always"),
    reason=f"the kernel gives no transparent huge pages here (mode {thp_mode()})",
)
def test_large_outputs_get_huge_pages_where_the_kernel_gives_them() -> None:
    grown = huge_growth("1", OUTPUT_CHILD)
    # The output's 64 MiB, all written: nearly all in huge pages.
    assert grown >= 48, grown
    if thp_mode() == "madvise":
        assert huge_growth("0", OUTPUT_CHILD) < 8
