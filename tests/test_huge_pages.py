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


HUGE_MIB = """
import numpy as np
import embstore

def huge_mib():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) // 1024
    return 0
"""

CHILD = (
    HUGE_MIB
    + """
before = huge_mib()
# One shard of 300,000 rows of 256 bytes: segments of 64 rows doubling,
# those of 16,384 rows (4 MiB) and more ask for huge pages.
t = embstore.Table(64, num_shards=1)
keys = np.arange(300_000)
t.assign(keys, np.ones((keys.size, 64), np.float32))
assert float(t.lookup(keys[::997], insert=False).sum()) == 64 * keys[::997].size
print(huge_mib() - before)
"""
)


OUTPUT_CHILD = (
    HUGE_MIB
    + """
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
)


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


MAPPED_CHILD = """
import sys
import numpy as np
import embstore

path = sys.argv[1]
m = embstore.MappedTable(path)
m.lookup(np.arange(10, dtype=np.int64))
# Per mapped shard file: whether a part of its map (the advice covers the
# 2 MiB-aligned part, which the kernel splits off) has VmFlags "hg".
advised = {}
with open("/proc/self/smaps") as f:
    name = None
    for line in f:
        parts = line.split()
        if "-" in parts[0] and len(parts) >= 5:
            name = parts[-1] if len(parts) >= 6 else None
        elif parts[0] == "VmFlags:" and name is not None and name.endswith(".safetensors"):
            advised[name] = advised.get(name, False) or "hg" in parts[1:]
print(sum(advised.values()), len(advised))
"""


@pytest.mark.skipif(
    thp_mode() not in ("madvise", "always"),
    reason=f"the kernel gives no transparent huge pages here (mode {thp_mode()})",
)
def test_mapped_files_ask_for_huge_pages(tmp_path: pathlib.Path) -> None:
    """A mapped table's shard files of 4 MiB and more are mapped with
    MADV_HUGEPAGE (VmFlags ``hg``), so that a file read cold is read ahead in
    2 MiB folios and mapped whole (a file cached in small folios from an
    earlier read is not); ``EMBSTORE_HUGE_PAGES=0`` asks nothing."""
    import numpy as np

    import embstore

    t = embstore.Table(64, num_shards=2, seed=1)
    t.lookup(np.arange(60_000, dtype=np.int64))  # two files of 7.7 MB
    t.save(tmp_path / "ck", with_optimizer=False)

    def advised(mode: str) -> tuple[int, int]:
        env = {**os.environ, "EMBSTORE_HUGE_PAGES": mode}
        out = subprocess.run(
            [sys.executable, "-c", MAPPED_CHILD, str(tmp_path / "ck")],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        hg, total = out.stdout.split()
        return int(hg), int(total)

    hg, total = advised("1")
    assert total >= 2, total
    assert hg == total, (hg, total)
    assert advised("0") == (0, total)


SLOTS_CHILD = (
    HUGE_MIB
    + """
from embstore import _core
# A serving cache's slot map of 1M rows: 16 MiB of slots (key, last use,
# count), probed all over by every call.
keys = np.arange(1 << 20, dtype=np.int64) * 7919 + 3  # NumPy's own: counted before
before = huge_mib()
sm = _core.SlotMap(1 << 20)
for a in range(0, keys.size, 65_536):
    sm.admit(keys[a : a + 65_536], 1, 0)
assert len(sm) > 900_000
print(huge_mib() - before)
"""
)


@pytest.mark.skipif(
    thp_mode() not in ("madvise", "always"),
    reason=f"the kernel gives no transparent huge pages here (mode {thp_mode()})",
)
def test_a_slot_maps_slots_get_huge_pages_where_the_kernel_gives_them() -> None:
    """The slots of a ServingCache's slot map (written all over as keys are
    admitted, then probed at random by every lookup) ask for huge pages as
    an index does; off with ``EMBSTORE_HUGE_PAGES=0``."""
    grown = huge_growth("1", SLOTS_CHILD)
    assert grown >= 12, grown
    if thp_mode() == "madvise":
        assert huge_growth("0", SLOTS_CHILD) < 4
