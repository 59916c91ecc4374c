"""Faults on the forced process-group (gloo) path, and the exact identification of ring segments
the leak checks rely on. Split from tests/test_faults.py (scenario helpers shared through it).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from reliability_cases import project_fds, project_mappings
from test_faults import (HEALTHY_STEPS, MAX_STEPS, STALL_LONG_S, TIMEOUT_S, _kill, _killed_between_steps,
                         _mark, _run, _seed, _spawn, _step, _ttd, _wait_file)

pytestmark = [pytest.mark.timeout(150), pytest.mark.long]  # fault injection waits out timeouts: .ci/run runs the long suite


@pytest.mark.parametrize("sleeper", [0, 2], ids=["driver-frozen", "follower"])
def test_stall_on_process_group_path(tmp_path: Path, sleeper: int) -> None:
    """Forced remote path: the transport timeout (3 s), not the process group's (90 s here,
    30 min by default), bounds every wait, and the error names the rank that stalls. A driver
    frozen by SIGSTOP (sends no heartbeat: a frozen or vanished host looks the same) is named
    by each follower within the timeout; the driver names exactly the follower that did not
    take the message (each follower's send is its own work handle), not its healthy neighbour,
    and that neighbour gets the driver's reason instead of blaming the driver."""
    with _spawn(_remote_stall, str(tmp_path), _seed(), sleeper) as group:
        if sleeper == 0:
            _wait_file(group, tmp_path, "stalled")
            time.sleep(STALL_LONG_S)
            group.kill(0, signal.SIGCONT)
        recs = group.results()
    t_stall = float((tmp_path / "stalled").read_text())
    waiting = [r for r in recs if r["rank"] != sleeper and r["etype"] is not None]
    assert recs[0]["segment"] is None  # no ring on this path
    assert len(waiting) == 2, recs
    for rec in waiting:
        assert rec["etype"] in ("TimeoutError", "PeerError"), rec
        if sleeper == 0:
            assert rec["etype"] == "TimeoutError", rec
            assert "rank 0 (src, host " in rec["error"], rec
            assert "sent no message or heartbeat within 3 s" in rec["error"], rec
        ttd = _ttd(f"stall-process-group-path[{'driver-frozen' if sleeper == 0 else 'follower'}]",
                   rec, t_stall)
        assert ttd < STALL_LONG_S  # raised while the sleeper was still asleep
    if sleeper == 2:
        driver, healthy = recs[0], recs[1]
        assert driver["etype"] == "TimeoutError", driver
        assert "rank 2 (host " in driver["error"] and "did not take message" in driver["error"], driver
        assert "rank 1 " not in driver["error"], driver
        assert healthy["etype"] == "PeerError" and "stopped the channel" in healthy["error"], healthy
        assert "rank 2 (host " in healthy["error"], healthy  # the driver's reason, not a blame


def _remote_stall(rank: int, world: int, tmp: str, seed: int, sleeper: int) -> dict:
    """Forced remote path: before step HEALTHY_STEPS rank ``sleeper`` sleeps STALL_LONG_S (a
    follower) or stops itself with SIGSTOP until the parent's SIGCONT (the driver)."""

    def body(bc: Any, rec: dict) -> None:
        for step in range(MAX_STEPS):
            if rank == sleeper and step == HEALTHY_STEPS:
                _mark(tmp, "stalled")
                if sleeper == 0:
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    time.sleep(STALL_LONG_S)
            _step(bc, rank, seed, step, rec)

    return _run(rank, body, force_remote=True)


def test_driver_idle_longer_than_timeout_on_process_group_path(tmp_path: Path) -> None:
    """Forced remote path: the driver's main thread sleeps 5 s (timeout 3 s) before step 12,
    then sends 30 more steps: an idle driver, not a dead one -- its heartbeats keep the
    followers waiting, no rank raises, every step arrives once and in order. On 4ac8a65 both
    followers raised ``TimeoutError ... rank 0 (src, host vm) sent no message within 3 s``."""
    with _spawn(_driver_idles, str(tmp_path), _seed()) as group:
        recs = group.results()
    t_idle = float((tmp_path / "idle").read_text())
    for rec in recs:
        assert rec["etype"] is None and rec["last"] == HEALTHY_STEPS + 29, rec
        assert rec["rank"] == 0 or rec["t_step"] - t_idle >= STALL_LONG_S, rec  # they waited it out


def _driver_idles(rank: int, world: int, tmp: str, seed: int) -> dict:
    def body(bc: Any, rec: dict) -> None:
        for step in range(HEALTHY_STEPS + 30):
            if rank == 0 and step == HEALTHY_STEPS:
                _mark(tmp, "idle")
                time.sleep(STALL_LONG_S)
            _step(bc, rank, seed, step, rec)
            if step == HEALTHY_STEPS:
                rec["t_step"] = time.monotonic()

    return _run(rank, body, force_remote=True)


def test_follower_killed_on_process_group_path(tmp_path: Path) -> None:
    """Forced remote path (gloo bytes instead of the ring): the kill is seen at once through the
    TCP connection; ObjectChannel names the dead rank (same-host pids exchanged at setup)."""
    with _spawn(_killed_between_steps, str(tmp_path), _seed(), False, True) as group:
        _wait_file(group, tmp_path, "ready")
        t_kill = _kill(group, tmp_path, 2)
        driver, survivor, _ = group.results(allow_dead=[2])
    assert driver["segment"] is None  # no ring at all on this path
    for name, rec in (("driver", driver), ("survivor", survivor)):
        assert rec["etype"] == "PeerError" and "rank 2" in rec["error"] and "died" in rec["error"], rec
        assert _ttd(f"follower-killed-process-group-path/{name}", rec, t_kill) < TIMEOUT_S


# ----------------------------------------------------------------------------- segment identification
# The leak checks above must count the ring's segments only: a clone in a directory called
# ``cpmeta`` (venv inside) maps torch's libraries from paths containing "cpmeta" too.

FAKE_CLONE_MAPS = [
    "7f0000000000-7f0000100000 r-xp 00000000 08:01 1234 /home/u/cpmeta/.venv/lib/python3.12/"
    "site-packages/torch/lib/libtorch_cpu.so\n",
    "7f0000100000-7f0000200000 r--p 00000000 08:01 1235 /home/u/cpmeta/.venv/lib/python3.12/"
    "site-packages/numpy/core/_multiarray_umath.cpython-312-x86_64-linux-gnu.so\n",
    "7f0000200000-7f0000300000 r--p 00000000 08:01 1236 /home/u/cpmeta/cpmeta-ring\n",
    "7f0000300000-7f0000400000 rw-s 00000000 00:05 77 /tmp/cpmeta/cpmeta-effffffc-4121-" + "ab" * 16 + "\n",
    "7f0000400000-7f0000500000 rw-s 00000000 00:05 78 /memfd:cpmeta-ring-other (deleted)\n",
    "7f0000500000-7f0000600000 rw-p 00000000 00:00 0 \n",
]
REAL_SEGMENT_MAPS = [
    "7f0000600000-7f0000700000 rw-s 00000000 00:01 99 /memfd:cpmeta-ring (deleted)\n",
    "7f0000700000-7f0000800000 rw-s 00000000 00:17 98 /dev/shm/cpmeta-effffffc-4121-" + "0f" * 16 + "\n",
    "7f0000800000-7f0000900000 rw-s 00000000 00:17 97 /dev/shm/cpmeta-effffffc-4121-" + "0f" * 16 + " (deleted)\n",
]


def test_segment_identification_ignores_a_clone_named_cpmeta() -> None:
    got = project_mappings(lines=FAKE_CLONE_MAPS + REAL_SEGMENT_MAPS)
    assert got == [line.strip() for line in REAL_SEGMENT_MAPS], got


def test_segment_identification_on_this_process(tmp_path: Path) -> None:
    """Real check: a file mapped (and held open) from ``<tmp>/cpmeta/.venv/...`` is not counted;
    a live ring's segment is, and nothing is left after close."""
    import mmap

    from cpmeta.transport import ShmRing

    lib = tmp_path / "cpmeta" / ".venv" / "lib" / "libfake.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\0" * mmap.PAGESIZE)
    fd = os.open(lib, os.O_RDONLY)
    mapped = mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ)
    try:
        with open("/proc/self/maps") as f:
            assert any(str(lib) in line for line in f)
        maps, fds = project_mappings(), project_fds()  # [] unless an earlier test leaked a ring
        assert not any(str(tmp_path) in x for x in maps + fds), (maps, fds)
        ring = ShmRing.create(1, slot_size=64, num_slots=4)
        try:
            assert len(project_mappings()) > len(maps) and len(project_fds()) > len(fds)
        finally:
            ring.close()
        assert (project_mappings(), project_fds()) == (maps, fds)
    finally:
        mapped.close()
        os.close(fd)
