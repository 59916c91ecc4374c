"""Self-tests of the one N-process helper, ``cpmeta.testing`` (``tests/multiproc.py`` is its name in
the test suite)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import multiproc
from cpmeta.testing import RankFailure, run_ranks, spawn_ranks

pytestmark = pytest.mark.timeout(120)


def _allreduce(rank: int, world_size: int, scale: int) -> tuple[int, str, str, int]:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    env = os.environ
    return int(t), env["RANK"], env["EXTRA"], int(torch.randint(0, 1 << 30, (1,)))


def test_results_env_and_shared_seed() -> None:
    out = run_ranks(_allreduce, 3, 10, env={"EXTRA": "x"})
    assert [o[:3] for o in out] == [(30, "0", "x"), (30, "1", "x"), (30, "2", "x")]
    assert len({o[3] for o in out}) == 1  # every rank drew the same number from the same seed


def _fail_on_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # the healthy rank blocks on the failed one: the helper must kill it
    return rank


def test_failing_rank_traceback_and_no_hang() -> None:
    with pytest.raises(RankFailure, match="boom from rank one"):
        run_ranks(_fail_on_one, 2, timeout=60)


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def test_deadline_kills_stragglers() -> None:
    with pytest.raises(RankFailure, match="deadline"):
        run_ranks(_sleep_forever, 2, init=False, timeout=4)


def _wait_or_die(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def test_spawn_ranks_kill() -> None:
    with spawn_ranks(_wait_or_die, 2, init=False, timeout=60) as group:
        time.sleep(0.5)
        group.kill(1)
        assert group.results(allow_dead=[1]) == [0, None]


def test_multiproc_is_cpmeta_testing() -> None:
    import cpmeta.testing

    for name in multiproc.__all__:
        assert getattr(multiproc, name) is getattr(cpmeta.testing, name), name


def test_default_run_is_reproducible(request: pytest.FixtureRequest) -> None:
    """conftest: hypothesis draws the same examples every run (unless the explore profile is
    chosen), and ``random``/torch start from a seed fixed by the test's id, so the seed
    ``cpmeta.testing`` draws for its ranks repeats too."""
    import random

    from hypothesis import settings

    from conftest import EXPLORE, PROFILE, seed_for

    assert settings.get_profile("default").derandomize is True
    assert settings.get_profile("default").deadline is None
    assert settings.get_profile("default").print_blob is True
    assert settings.get_profile(EXPLORE).derandomize is False
    if PROFILE != EXPLORE:
        assert settings.default.derandomize is True
    seed = seed_for(request.node.nodeid)
    assert random.random() == random.Random(seed).random()
    assert seed_for(request.node.nodeid) == seed
