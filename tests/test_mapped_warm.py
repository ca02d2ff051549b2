"""Warming a mapped table (``MappedTable.warm``, ``warm=True``): its files
read in at open and by each refresh before serving, reads unchanged, a
copy cached in 4 KiB pages read in again in 2 MiB pages where the kernel
gives a file map huge pages, and the option checked and kept by pickling."""

from __future__ import annotations

import os
import pathlib
import pickle

import numpy as np
import pytest

import embstore

from .test_mapped import DIM, assert_reads_equal, row_files, trained
from .test_mapped_refresh import churn, publish


def copy_in_small_writes(src: pathlib.Path, dst: pathlib.Path) -> None:
    """``src`` copied file by file in 4 KiB writes (as a download tool
    writes): the page cache holds the copy in 4 KiB pages."""
    dst.mkdir()
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        with open(dst / f.name, "wb") as out:
            for o in range(0, len(data), 4096):
                out.write(data[o : o + 4096])


def large(path: pathlib.Path) -> embstore.Table:
    """A table whose shard files are several 2 MiB pages each (400,000
    rows of dim 64: about 13 MB a file), saved for serving at ``path``."""
    t = embstore.Table(64, seed=3)
    t.lookup(np.arange(400_000))
    t.save(path, with_optimizer=False)
    return t


def test_warm_reads_every_file_once_and_serves_the_same_rows(tmp_path) -> None:
    t = trained()
    path = tmp_path / "serve"
    t.save(path, with_optimizer=False)
    plain = embstore.MappedTable(path)
    first = plain.warm()
    assert first["files"] == len(row_files(path))
    assert first["bytes"] == plain.stats()["mapped_bytes"]
    # Once is enough: a second warm reads nothing.
    assert plain.warm()["files"] == 0
    assert_reads_equal(t, plain)
    # Warmed at open.
    warm = embstore.MappedTable(path, warm=True)
    assert warm.warm()["files"] == 0
    assert_reads_equal(t, warm)


@pytest.mark.parametrize("warm", [False, True])
def test_a_refresh_warms_the_files_it_maps_when_asked(tmp_path, warm: bool) -> None:
    t = trained()
    path = tmp_path / "serve"
    t.save(path, with_optimizer=False)
    mapped = embstore.Table.load(path, mmap=True, warm=warm)
    mapped.warm()
    rng = np.random.default_rng(4)
    for _ in range(3):
        churn(t, rng)
        m = publish(t, path)
        new = len(m["chain"][-1]["files"])
        assert mapped.refresh() is True
        assert_reads_equal(t, mapped)
        # Left for warm() to read unless the refresh did.
        assert mapped.warm()["files"] == (0 if warm else new)


def test_a_copy_cached_in_small_pages_is_read_in_again_in_huge_pages(tmp_path) -> None:
    t = large(tmp_path / "saved")
    # What this kernel and file system give a file map: a checkpoint save
    # wrote (large writes) is warmed on 2 MiB pages where they can be had.
    probe = embstore.MappedTable(tmp_path / "saved").warm()
    if not probe["huge_page_bytes"]:
        pytest.skip(
            f"no 2 MiB pages for file maps here (huge_page_bytes {probe['huge_page_bytes']}: "
            "not Linux, THP off, or a file system without large folios)"
        )
    copy = tmp_path / "copied"
    copy_in_small_writes(tmp_path / "saved", copy)
    mapped = embstore.MappedTable(copy)
    report = mapped.warm()
    files = len(row_files(copy))
    assert report["files"] == files
    assert report["recached_files"] == files, report
    assert report["recached_bytes"] == report["bytes"]
    # As much of it on 2 MiB pages as of the saved files.
    assert report["huge_page_bytes"] >= 0.9 * probe["huge_page_bytes"], (report, probe)
    keys = np.random.default_rng(5).integers(0, 450_000, 20_000)
    np.testing.assert_array_equal(mapped.lookup(keys), t.lookup(keys, insert=False))


def test_the_warm_option_is_checked_and_survives_pickling(tmp_path) -> None:
    t = trained()
    path = tmp_path / "serve"
    t.save(path, with_optimizer=False)
    with pytest.raises(TypeError, match="warm"):
        embstore.MappedTable(path, warm="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warm: only a table loaded with mmap=True"):
        embstore.Table.load(path, warm=True)  # type: ignore[call-overload]
    copy = pickle.loads(pickle.dumps(embstore.MappedTable(path, warm=True)))
    assert copy._warm is True
    assert copy.warm()["files"] == 0
    assert os.fspath(copy.path) == os.fspath(path.resolve())
    assert copy.dim == DIM
