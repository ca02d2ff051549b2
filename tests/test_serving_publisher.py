"""embstore.serving: the Publisher a trainer runs beside training (a
publish that fails is kept and tried again, never ending the thread), and
the old import path of MappedTable."""

from __future__ import annotations

import pathlib
import time
from typing import Any

import numpy as np
import pytest

import embstore
from embstore import optim
from embstore.serving import MappedTable, Publisher


def test_a_failed_publish_is_kept_and_the_next_period_publishes(tmp_path: pathlib.Path) -> None:
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.1), seed=1)
    t.lookup(np.arange(10))
    path = str(tmp_path / "ckpt")
    save = t.save
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the first background publish
            raise OSError("disk full (injected)")
        return save(*args, **kwargs)

    t.save = flaky  # type: ignore[method-assign]
    pub = Publisher(t, path, every=0.05)
    deadline = time.monotonic() + 20
    while pub.failures == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pub.failures == 1
    t.lookup(np.arange(10, 20))
    while (pub.error is not None or not pub.seconds) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    pub.stop()
    assert pub.error is None, pub.error
    served = embstore.Table.load(path, mmap=True)
    assert isinstance(served, MappedTable)
    assert served.contains(np.arange(20)).all()


def test_the_old_import_path_of_mapped_table_warns_and_gives_the_same_class() -> None:
    import embstore.mapped as old

    with pytest.warns(DeprecationWarning, match="embstore.serving.MappedTable"):
        assert old.MappedTable is embstore.MappedTable
    with pytest.raises(AttributeError):
        _ = old.Publisher  # type: ignore[attr-defined]
