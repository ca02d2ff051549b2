"""The serving chaos run of tests/serving_chaos.py, for 15 s (the 10-minute
run's figures are in benches/RESULTS.md): a trainer publishing (deltas with
removals, compactions, full saves) and SIGKILLed at random, three reader
processes following it (one forked while it follows). Every lookup reads
one published version whole, no reader hangs or goes back a version, a
forked follower goes on following, and the directory never holds more than
twice its longest chain's files."""

from __future__ import annotations

import pathlib
import random

import pytest

from . import serving_chaos


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readers_following_a_killed_trainer_read_whole_versions(
    tmp_path: pathlib.Path, request: pytest.FixtureRequest
) -> None:
    given = request.config.getoption("--chaos-seed")
    seed = random.SystemRandom().getrandbits(31) if given == "random" else int(given)
    r = serving_chaos.run(15.0, tmp_path, seed)
    print(r)
    assert r["hangs"] == 0, r
    assert r["mixed"] == 0, r
    assert r["trainer_kills"] >= 3, r
    assert r["versions_published"] > 20, r
    assert r["worst_beyond_bound"] <= 0, r
    for reader in r["readers"]:
        assert reader["calls"] > 10, r
        assert reader["backwards"] == 0, r
        assert reader["follow_error"] is None or "readers' lock" not in reader["follow_error"]
        # Each follower (the forked child too) served later versions as
        # they were published.
        assert reader["last"] > reader["first"], r
