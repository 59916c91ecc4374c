"""A CP group across real (network-namespace) hosts: equivalence, then faults, on one world.

tests/netns.py makes hosts a, b, c (namespaces on one bridge, each rank told its host by
``CPMETA_HOST_ID``); tests/netns_phases.py is what the ranks run. One world of 5 ranks
(``aabbc``: ranks 0, 1 on a; 2, 3 on b; 4 on c) goes through every phase in order -- spawning
torch processes is most of the cost on a 2-core machine, so they are spawned once -- and each
test below checks one phase's records:

- equivalence, 2 hosts x 2 ranks and 3 hosts x 1 rank, 1,000 mixed prompt/decode steps with
  ``persistent_outputs=True``: every rank's per-step digests equal the driver's;
- faults, each named by rank and host within the timeout (3 s), the survivors closing cleanly,
  no /dev/shm name or segment mapping left: a link down for 0.5 s (nothing lost), a follower
  SIGSTOPped, a host partitioned, the driver's host cut off, a follower SIGKILLed.

Each fault prints ``TTD netns-<phase> rank<r> <seconds> <error>`` (from the fault to the
exception); docs/reliability.md collects them (``pytest -s tests/test_netns_hosts.py | grep TTD``).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import netns_phases as ph
from multiproc import RankGroup
from netns import NetnsHosts, netns_hosts
from reliability_cases import project_shm_entries
from test_faults import RING_ENV, _assert_clean, _ttd, _wait_file

pytestmark = [pytest.mark.timeout(400), pytest.mark.long]  # .ci/run runs the long suite after the README command

WORLD_TIMEOUT_S = 360.0  # the whole world: spawn and every phase
MARK_WAIT_S = 180.0  # the parent waits this long for a phase's marks
OUTAGE_S = 0.5  # outage phase: host b's link down this long (a TCP retransmit absorbs it)
VICTIM = {"sigstop": 3, "sigkill": 4}
CUT = {"outage": "b", "partition": "c", "driver-cut": "a"}
BOUND_S = ph.TIMEOUT_S + 1.5  # detection bound: the timeout plus a step of slack
ENV = {**RING_ENV, "TORCH_CPP_LOG_LEVEL": "ERROR"}  # c10d warns of hosts without reverse DNS


@pytest.fixture(scope="module")
def hosts() -> Iterator[NetnsHosts]:
    with netns_hosts(3) as h:
        yield h


def _wait_done(group: RankGroup, tmp: Path, phase: str, ranks: list[int]) -> None:
    """Parent: every rank of ``ranks`` marked ``done.<phase>`` (a crash fails at once)."""
    end = time.monotonic() + MARK_WAIT_S
    for r in ranks:
        while not (tmp / f"done.{phase}.{r}").exists():
            if not group.procs[r].is_alive():
                group.results(allow_dead=VICTIM.values())  # raises with the rank's traceback
            if time.monotonic() > end:
                raise AssertionError(f"rank {r} never finished phase {phase}")
            time.sleep(0.01)


def _inject(phase: str, hosts: NetnsHosts, group: RankGroup, tmp: Path) -> dict[str, Any]:
    """Parent: run ``phase`` (go mark, fault, heal) and return when its ranks are done."""
    (tmp / f".go.{phase}").write_text(repr(time.monotonic()))
    os.replace(tmp / f".go.{phase}", tmp / f"go.{phase}")
    everyone = list(range(len(ph.LAYOUT)))
    if phase in ph.EQUIV:
        _wait_done(group, tmp, phase, everyone)
        return {}
    _wait_file(group, tmp, f"ready.{phase}")
    t_fault = time.monotonic()
    victim = VICTIM.get(phase)
    if phase in CUT:
        hosts.link_down(CUT[phase])
    elif phase == "sigstop":
        group.kill(victim, signal.SIGSTOP)
    elif phase == "sigkill":
        group.kill(victim)
    if phase == "outage":
        time.sleep(OUTAGE_S)
        hosts.link_up(CUT[phase])
    others = [r for r in everyone if r != victim]
    _wait_done(group, tmp, phase, others)
    if phase == "sigstop":
        group.kill(victim, signal.SIGCONT)
        _wait_done(group, tmp, phase, [victim])
    hosts.heal()
    return {"t_fault": t_fault}


@pytest.fixture(scope="module")
def run(hosts: NetnsHosts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Spawn the world once, drive every phase, collect everything."""
    tmp = tmp_path_factory.mktemp("netns")
    before = project_shm_entries()
    faults: dict[str, Any] = {}
    with hosts.spawn(ph.world, ph.LAYOUT, str(tmp), random.randrange(1 << 30), list(ph.PHASES),
                     timeout=WORLD_TIMEOUT_S, env=ENV) as group:
        try:
            for phase in ph.PHASES:
                faults[phase] = _inject(phase, hosts, group, tmp)
        finally:
            hosts.heal()
            if group.procs[VICTIM["sigstop"]].is_alive():
                group.kill(VICTIM["sigstop"], signal.SIGCONT)
        group.results(allow_dead=[VICTIM["sigkill"]])
    recs = {p: [_load(ph.record_path(str(tmp), p, r)) for r in range(len(ph.LAYOUT))]
            for p in ph.PHASES}
    return {"recs": recs, "faults": faults, "before": before}


def _load(path: str) -> Any:
    """A rank's phase record, or the marker of a rank that never wrote one (killed)."""
    return torch.load(path, weights_only=False) if os.path.exists(path) else "no record"


def _phase(run: dict[str, Any], phase: str) -> list[Any]:
    """Per rank: its record of ``phase`` (None: not a member)."""
    return run["recs"][phase]


def _ttds(run: dict[str, Any], phase: str) -> dict[int, float]:
    """Rank -> time to detection (printed), every rank that saw an error."""
    t = run["faults"][phase]["t_fault"]
    return {rec["rank"]: _ttd(f"netns-{phase}", rec, t) for rec in _phase(run, phase)
            if isinstance(rec, dict) and rec["etype"] is not None}


# ----------------------------------------------------------------------------- equivalence

@pytest.mark.parametrize("phase", list(ph.EQUIV))
def test_every_rank_holds_the_drivers_metadata_on_every_step(run: dict[str, Any], phase: str) -> None:
    members = ph.EQUIV[phase]
    recs = [rec for rec in _phase(run, phase) if rec is not None]
    assert [r for r, rec in enumerate(_phase(run, phase)) if rec is not None] == members
    driver = recs[0]
    same_host = [r for r in members[1:] if ph.LAYOUT[r] == ph.LAYOUT[0]]
    for rec in recs:  # hosts told apart by CPMETA_HOST_ID: ring on a, process group elsewhere
        assert rec["split"]["local"] == same_host, rec["split"]
        assert rec["split"]["remote"] == [r for r in members[1:] if r not in same_host]
        assert rec["split"]["hosts"] == {r: ph.LAYOUT[r] for r in members}
    assert 0 < driver["prompt_steps"] < ph.STEPS  # both prompt and decode steps
    sent = driver["sent"]
    for r, rec in zip(members, recs):
        bad = (rec["got"] != sent).nonzero().tolist()
        assert not bad, (f"rank {r} (host {ph.LAYOUT[r]}) differs from the driver at step "
                         f"{bad[0][0]} in {(rec['names'] + ['<aliasing>'])[bad[0][1]]}")
        assert rec["prompt_steps"] == driver["prompt_steps"]


# ----------------------------------------------------------------------------- faults

def _check_clean(run: dict[str, Any], phase: str) -> None:
    _assert_clean(run["before"], [rec for rec in _phase(run, phase) if isinstance(rec, dict)])


def test_link_down_shorter_than_the_timeout_loses_nothing(run: dict[str, Any]) -> None:
    """Host b's link is down for 0.5 s while the driver sends: TCP retransmits after the link
    comes back, every step arrives once and in order, and the group simply continues."""
    for rec in _phase(run, "outage"):
        assert rec["etype"] is None and rec["last"] == ph.OUTAGE_STEPS - 1, rec
    _check_clean(run, "outage")


def _expect(run: dict[str, Any], phase: str) -> dict[int, dict]:
    """Every rank of ``phase`` saw a transport error (detected within the bound unless it is the
    frozen victim), closed, and holds no segment; nothing is left in /dev/shm."""
    recs = {rec["rank"]: rec for rec in _phase(run, phase) if isinstance(rec, dict)}
    ttd = _ttds(run, phase)
    for r, rec in recs.items():
        assert rec["etype"] in ("PeerError", "RingClosedError", "TimeoutError"), rec
        if r != VICTIM.get(phase):  # a frozen victim only sees its error when it thaws
            assert ttd[r] < BOUND_S, (r, ttd[r], rec["error"])
    _check_clean(run, phase)
    return recs


def test_frozen_follower_is_named_by_the_driver(run: dict[str, Any]) -> None:
    """SIGSTOP rank 3 (host b): the driver names rank 3 -- not its healthy neighbour rank 2 on
    the same host -- and tells the other remote followers why it stopped."""
    recs = _expect(run, "sigstop")
    assert recs[0]["etype"] == "TimeoutError", recs[0]
    assert "rank 3 (host b) did not take message" in recs[0]["error"], recs[0]
    assert "rank 2 " not in recs[0]["error"] and "rank 4 " not in recs[0]["error"], recs[0]
    for r in (2, 4):
        assert recs[r]["etype"] == "PeerError", recs[r]
        assert "rank 0 (src, host a) stopped the channel" in recs[r]["error"], recs[r]
        assert "rank 3 (host b)" in recs[r]["error"], recs[r]


def test_partitioned_host_is_named_on_both_sides(run: dict[str, Any]) -> None:
    """Host c's cable pulled: the driver names rank 4 (host c), rank 4 names the driver, the
    followers on host b get the driver's reason."""
    recs = _expect(run, "partition")
    assert "rank 4 (host c) did not take message" in recs[0]["error"], recs[0]
    assert "rank 2 " not in recs[0]["error"] and "rank 3 " not in recs[0]["error"], recs[0]
    assert recs[4]["etype"] == "TimeoutError", recs[4]  # no message, or cut in mid-frame
    assert "rank 0 (src, host a) " in recs[4]["error"] and "within 3 s" in recs[4]["error"], recs[4]
    for r in (2, 3):
        assert "rank 4 (host c)" in recs[r]["error"], recs[r]


def test_driver_host_cut_off_is_named_by_every_remote_follower(run: dict[str, Any]) -> None:
    """Host a (driver and rank 1) cut off: every follower on b and c names rank 0 (host a);
    the driver names every remote follower (from its side they all vanished)."""
    recs = _expect(run, "driver-cut")
    for r in (2, 3, 4):  # "sent no message", or "did not send the rest" when cut mid-frame
        assert recs[r]["etype"] == "TimeoutError", recs[r]
        assert "rank 0 (src, host a) " in recs[r]["error"], recs[r]
        assert "within 3 s" in recs[r]["error"], recs[r]
    for r in (2, 3, 4):
        assert f"rank {r} (host {ph.LAYOUT[r]})" in recs[0]["error"], recs[0]


def test_killed_follower_is_named_and_the_survivors_close(run: dict[str, Any]) -> None:
    """SIGKILL rank 4 (host c): the driver names rank 4 at its next send; the other remote
    followers get its reason; the ring follower sees the driver close."""
    assert _phase(run, "sigkill")[4] == "no record"  # the victim never reported
    recs = _expect(run, "sigkill")
    assert recs[0]["etype"] == "PeerError" and "rank 4 (host c)" in recs[0]["error"], recs[0]
    for r in (2, 3):
        assert "rank 4 (host c)" in recs[r]["error"], recs[r]
