"""Setup honours ``timeout=``: constructing an ``ObjectChannel`` or a ``MetadataBroadcaster`` on a
gloo group never waits past its timeout, and ranks that disagree get a clear error naming them.

Before: the setup collectives ran on the user's group with only the process group's timeout
(gloo's default: 30 min): ranks that disagreed on ``src`` hung in the ring setup, a rank that
never constructed left the others waiting 40 s with ``timeout=5``. Now the setup exchange
(``cpmeta/transport/_setup.py``) puts every member's ``src`` and ``agree=`` settings in the rendezvous
store, where every member checks them, every wait bounded.

One world of 3 real gloo ranks runs every scenario in order, each on a fresh gloo group (a timed
out gloo wait closes its group's connections), and records what each rank saw and how long its
constructor took; the tests below check one scenario each.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest

from multiproc import run_ranks

pytestmark = [pytest.mark.timeout(240), pytest.mark.long]  # fault injection waits out timeouts: .ci/run runs the long suite

TIMEOUT_S = 3.0  # the constructors' timeout= in every scenario
SLACK_S = 2.0  # a loaded 2-core machine: scheduling on top of the bound
LATE_S = 1.0  # "late": rank 2 constructs this long after the others (inside the timeout)
SCENARIOS = ("src", "src-broadcaster", "agree", "absent", "driver-absent", "late",
             "broadcaster-absent")


def _construct(scenario: str, rank: int, group: Any) -> Any:
    """What rank ``rank`` builds in ``scenario`` (None: it does not take part)."""
    import cpmeta
    from cpmeta.transport import ObjectChannel

    if scenario == "src":
        return ObjectChannel(group, src=1 if rank == 2 else 0, timeout=TIMEOUT_S)
    if scenario == "src-broadcaster":
        return cpmeta.MetadataBroadcaster(group=group, src=1 if rank == 2 else 0, timeout=TIMEOUT_S)
    if scenario == "agree":
        return ObjectChannel(group, 0, timeout=TIMEOUT_S, agree={"checksum": rank == 1})
    if scenario == "absent" and rank == 2 or scenario == "driver-absent" and rank == 0:
        return None
    if scenario == "broadcaster-absent":
        return None if rank == 2 else cpmeta.MetadataBroadcaster(group=group, timeout=TIMEOUT_S)
    if scenario == "late" and rank == 2:
        time.sleep(LATE_S)
    return ObjectChannel(group, 0, timeout=TIMEOUT_S)


def _scenarios(rank: int, world: int) -> dict[str, dict]:
    import torch.distributed as dist

    out = {}
    for scenario in SCENARIOS:
        group = dist.new_group(list(range(world)), backend="gloo", timeout=timedelta(seconds=60))
        rec: dict = {"etype": None, "error": None, "elapsed": None, "got": None}
        t0 = time.monotonic()
        try:
            made = _construct(scenario, rank, group)
            rec["elapsed"] = time.monotonic() - t0
            if made is None:
                time.sleep(TIMEOUT_S + 1.0)  # absent until the others gave up on it
            else:
                if hasattr(made, "broadcast") and scenario == "late":
                    rec["got"] = made.broadcast({"ok": scenario} if rank == 0 else None)
                made.close()
        except Exception as e:  # noqa: BLE001 - what the user sees, by type and text
            rec.update(etype=type(e).__name__, error=str(e), elapsed=time.monotonic() - t0)
        out[scenario] = rec
    return out


@pytest.fixture(scope="module")
def seen() -> list[dict[str, dict]]:
    return run_ranks(_scenarios, 3, timeout=200)


def _bounded(rec: dict) -> None:
    assert rec["elapsed"] < TIMEOUT_S + SLACK_S, rec  # never past the timeout (+ scheduling)


@pytest.mark.parametrize("scenario", ["src", "src-broadcaster"])
def test_src_disagreement_is_an_error_naming_the_ranks(seen: list[dict], scenario: str) -> None:
    """Ranks 0, 1 pass src=0, rank 2 src=1: every rank raises the same ValueError at once
    (before: a hang in the ring setup)."""
    for rank, recs in enumerate(seen):
        rec = recs[scenario]
        assert rec["etype"] == "ValueError", (rank, rec)
        assert "src differs across the group: src=0 at ranks [0, 1], src=1 at ranks [2]" in rec["error"]
        assert f"rank {rank} (host " in rec["error"], rec  # the raising rank names itself
        _bounded(rec)


def test_agreed_setting_disagreement_names_the_ranks(seen: list[dict]) -> None:
    for recs in seen:
        rec = recs["agree"]
        assert rec["etype"] == "ValueError", rec
        assert "checksum differs across the group: off at ranks [0, 2], on at ranks [1]" in rec["error"]
        _bounded(rec)


@pytest.mark.parametrize("scenario", ["absent", "broadcaster-absent"])
def test_rank_that_never_constructs_is_named_within_the_timeout(seen: list[dict], scenario: str) -> None:
    """Rank 2 never constructs: ranks 0 and 1 raise TimeoutError naming rank 2 within the
    timeout (before: 40 s with timeout=5)."""
    for rank in (0, 1):
        rec = seen[rank][scenario]
        assert rec["etype"] == "TimeoutError", rec
        assert "rank(s) 2 did not join the setup" in rec["error"], rec
        _bounded(rec)


def test_missing_driver_is_named_within_the_timeout(seen: list[dict]) -> None:
    for rank in (1, 2):
        rec = seen[rank]["driver-absent"]
        assert rec["etype"] == "TimeoutError", rec
        assert "rank(s) 0 did not join the setup" in rec["error"], rec
        _bounded(rec)


def test_a_late_rank_inside_the_timeout_is_no_error(seen: list[dict]) -> None:
    for recs in seen:
        rec = recs["late"]
        assert rec["etype"] is None and rec["got"] == {"ok": "late"}, rec
