"""The chaos run of tests/chaos.py for about a minute (issue 13): 8 threads
mixing every public method of Table, Collection (tables shared in opposite
orders), DeviceCache, save/load/export/reserve/evict, under a watchdog; then
exact SGD totals and loadable checkpoints. ``--chaos-seed N`` fixes the
seed (CI does), ``--chaos-seconds S`` sets the length; the seed is printed
first (not shown from an xdist worker) and named in every failure's
message, so a failure replays with the same choices."""

from __future__ import annotations

import pathlib
import random

import pytest

from . import chaos


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_mixing_every_method_loses_nothing_and_never_hangs(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    given = request.config.getoption("--chaos-seed")
    seed = random.SystemRandom().getrandbits(31) if given == "random" else int(given)
    seconds = float(request.config.getoption("--chaos-seconds"))
    with capsys.disabled():
        result = chaos.run(seconds, threads=8, seed=seed, root=tmp_path)
    replay = f"--chaos-seed {seed} --chaos-seconds {seconds:g}: {result}"
    assert result["hangs"] == 0, replay
    assert result["lost_updates"] == 0, replay
    assert result["rows_checked"] > 1000, replay
    # Every kind of operation ran.
    assert len(result["by_op"]) == len(chaos.World(tmp_path / "x").ops()), replay
