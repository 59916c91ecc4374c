"""Soak: thousands of consecutive broadcasts of checksummed random metadata across 3 ranks.

Payloads (``reliability_cases.make_payload``) range from a few bytes to three times the
shared-memory ring (16 slots of 4 KiB here, so about one message in twelve is streamed slot by
slot); every follower checks the step number and the crc32 of every field of every message, and
every tenth message byte for byte against a local regeneration. RSS of every rank is sampled from
step 200 on and must stay flat.

The default suite runs a short soak on the ring path and on the forced process-group path; the
full 20,000-broadcast soak is ``@pytest.mark.slow`` (``pytest -m slow tests/test_soak.py -s``),
and ``scripts/soak.py`` runs it with more options and writes the numbers recorded in
docs/reliability.md.
"""

from __future__ import annotations

import random
import sys

import pytest

from multiproc import run_ranks
from reliability_cases import project_shm_entries, soak_rank

WORLD = 3
SLOT_SIZE, NUM_SLOTS = 4096, 16
RING_BYTES = SLOT_SIZE * NUM_SLOTS
RING_ENV = {"CPMETA_SHM_SLOT_SIZE": str(SLOT_SIZE), "CPMETA_SHM_NUM_SLOTS": str(NUM_SLOTS)}
CHECK_EVERY = 10  # every 10th message is also compared with a regenerated payload, byte for byte
SHORT_STEPS = 500
FULL_STEPS = 20_000
RSS_GROWTH_LIMIT = 16 << 20  # bytes an RSS may grow between step 200 and the end


def _soak(steps: int, force_remote: bool, timeout: float) -> list[dict]:
    seed = random.randrange(1 << 30)
    before = project_shm_entries()
    out = run_ranks(soak_rank, WORLD, seed, steps, RING_BYTES, CHECK_EVERY, 60.0, force_remote,
                    env={**RING_ENV, "CPMETA_CHECKSUM": "1"}, timeout=timeout)
    assert project_shm_entries() <= before, "the soak left /dev/shm entries behind"
    for r in out:
        growth = r["rss"][-1] - r["rss"][0]
        print(f"SOAK steps={steps} remote={force_remote} seed={seed} rank={r['rank']} "
              f"mismatches={r['mismatches']} MiB={r['bytes'] / 2**20:.1f} over_ring={r['over_ring']} "
              f"min={r['min_bytes']} max={r['max_bytes']} seconds={r['seconds']:.1f} "
              f"rss_start={r['rss'][0] >> 20}MiB rss_end={r['rss'][-1] >> 20}MiB "
              f"growth={growth / 2**20:+.1f}MiB peak={r['rss_peak'] >> 20}MiB "
              f"fds={r['fds'][0]}->{r['fds'][-1]}", file=sys.stderr)
        assert r["mismatches"] == 0, r["errors"]
        assert growth < RSS_GROWTH_LIMIT, f"rank {r['rank']}: RSS grew by {growth} bytes"
        assert r["fds"][-1] <= r["fds"][0], f"rank {r['rank']}: open fds {r['fds']}"
    followers = out[1:]
    assert all(f["exact_checks"] >= steps // CHECK_EVERY for f in followers)
    # the size range really was covered: tiny messages and messages larger than the ring
    assert all(r["min_bytes"] < 1024 and r["max_bytes"] > RING_BYTES and r["over_ring"] > 0 for r in out)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("force_remote", [False, True], ids=["ring", "process-group"])
def test_soak_short(force_remote: bool) -> None:
    _soak(SHORT_STEPS, force_remote, timeout=150)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("force_remote", [False, True], ids=["ring", "process-group"])
def test_soak_full(force_remote: bool) -> None:
    _soak(FULL_STEPS, force_remote, timeout=1700)
