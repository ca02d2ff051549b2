"""The chaos run of tests/chaos.py for about a minute (issue 13): 8 threads
mixing every public method of Table, Collection (tables shared in opposite
orders), DeviceCache, save/load/export/reserve/evict, under a watchdog; then
exact SGD totals and loadable checkpoints. The seed is printed
(``EMBSTORE_CHAOS_SEED`` replays it; ``EMBSTORE_CHAOS_SECONDS`` sets the
length)."""

from __future__ import annotations

import os
import pathlib
import random

import pytest

from . import chaos


@pytest.mark.timeout(600)
def test_chaos_mixing_every_method_loses_nothing_and_never_hangs(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seed = int(os.environ.get("EMBSTORE_CHAOS_SEED", random.SystemRandom().getrandbits(31)))
    seconds = float(os.environ.get("EMBSTORE_CHAOS_SECONDS", 60))
    with capsys.disabled():
        result = chaos.run(seconds, threads=8, seed=seed, root=tmp_path)
    assert result["hangs"] == 0
    assert result["lost_updates"] == 0
    assert result["rows_checked"] > 1000
    # Every kind of operation ran.
    assert len(result["by_op"]) == len(chaos.World(tmp_path / "x").ops()), result["by_op"]
