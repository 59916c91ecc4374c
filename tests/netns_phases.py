"""Rank side of tests/test_netns_hosts.py: one world on three namespace hosts, phase by phase.

World (``LAYOUT = "aabbc"``): ranks 0 (the driver) and 1 on host a, 2 and 3 on host b, 4 on host
c. Every phase builds its own gloo group (``dist.new_group``, collective over the world) and a
broadcaster on it, so a phase that breaks its group leaves the next one a fresh start -- the
rule for users too: after a process-group failure the channel is spent, build a new group.
Between phases the ranks wait for the parent's ``go.<phase>`` mark (the parent heals the links
first); each phase ends with ``done.<phase>.<rank>``.

| phase | group | fault (by the parent, after the driver marks ``ready.<phase>``) |
|---|---|---|
| equiv-2x2 | ranks 0-3 (2 hosts x 2 ranks) | none: 1,000 steps, per-step digests of what every rank holds |
| equiv-3x1 | ranks 0, 2, 4 (3 hosts x 1 rank) | same |
| replicate-2x2, replicate-3x1 | as the two above | none: the step replicated (ReplicatedBatchState), every rank builds |
| outage | all 5 | host b's link down for ``OUTAGE_S`` (< timeout), then up: nothing may be lost |
| sigstop | all 5 | SIGSTOP rank 3 (host b), SIGCONT after the others are done |
| partition | all 5 | host c's link down until every rank is done, then up |
| driver-cut | all 5 | host a's (the driver's) link down until every rank is done, then up |
| sigkill | all 5 | SIGKILL rank 4 (host c) |

Fault phases broadcast the checksummed random payloads of the other fault tests
(``reliability_cases.make_payload``: tiny to 3x the 64 KiB ring, so frames above the 8 KiB
remote head are common) and record the first error (type, text, CLOCK_MONOTONIC time) and,
after ``close()``, the segment descriptors / mappings the rank still holds (must be none).
Equivalence phases build real scheduler steps (``launch.scheduler.SyntheticScheduler``, mixed
prompt and decode) with ``persistent_outputs=True`` and digest every field of every step.
"""

from __future__ import annotations

import os
import time
import zlib
from datetime import timedelta
from operator import attrgetter
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from reliability_cases import project_fds, project_mappings
from test_faults import _mark, _step, _wait_mark

__all__ = ["LAYOUT", "PHASES", "EQUIV", "world", "record_path", "fast_digest", "TIMEOUT_S", "STEPS"]

LAYOUT = "aabbc"
EQUIV = {"equiv-2x2": [0, 1, 2, 3], "equiv-3x1": [0, 2, 4],
         # the same with the step replicated (ReplicatedBatchState): every rank builds its own
         "replicate-2x2": [0, 1, 2, 3], "replicate-3x1": [0, 2, 4]}
PHASES = ("equiv-2x2", "equiv-3x1", "replicate-2x2", "replicate-3x1", "outage", "sigstop",
          "partition", "driver-cut", "sigkill")
STEPS = 1000  # per equivalence phase
TIMEOUT_S = 3.0  # the broadcaster's timeout in fault phases
EQUIV_TIMEOUT_S = 60.0  # healthy phases: generous (a loaded 2-core machine)
GROUP_TIMEOUT_S = 60.0  # the phase groups' own (gloo) timeout: ends ops abandoned by a fault
HEALTHY_STEPS = 12  # fault phases: steps before the driver marks ready
OUTAGE_STEPS = 160  # the outage phase runs exactly this many steps ...
PACE_S = 0.01  # ... the driver pausing this long before each (the outage falls inside)
MAX_STEPS = 3000  # a fault phase whose fault is never detected fails instead of looping
MARK_TIMEOUT_S = 240.0  # a rank waits this long for the parent's go mark


# ----------------------------------------------------------------------------- digests

def fast_digest(md: Any, names: tuple[str, ...]) -> list[int]:
    """One 32-bit digest per field (``names`` in order) of dtype, shape and bytes (tensors),
    every key and value (dicts) or ``repr`` (values), then one of the aliasing (which paths
    share a tensor object): cpmeta/launch/verify.py's digest, with crc32 instead of BLAKE2b so that
    1,000 steps on every rank stay cheap (~0.1 ms a step against ~2-3 ms)."""
    out = [_feed(v) for v in attrgetter(*names)(md)]
    groups: dict[int, list[str]] = {}
    for path, v in md.to_flatten_dict().items():
        if isinstance(v, torch.Tensor):
            groups.setdefault(id(v), []).append(path)
    out.append(zlib.crc32(repr(sorted(g for g in groups.values() if len(g) > 1)).encode()))
    return out


def _feed(v: Any) -> int:
    if v is None:
        return 1
    if isinstance(v, torch.Tensor):
        c = zlib.crc32(repr((v.dtype, tuple(v.shape))).encode())
        t = v.detach().cpu().contiguous()
        return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), c)
    if isinstance(v, dict):
        c = zlib.crc32(f"D{len(v)}".encode())
        for k, x in v.items():
            c = zlib.crc32(f"K{k}:{_feed(x)}".encode(), c)
        return c
    return zlib.crc32(f"S{v!r}".encode())


# ----------------------------------------------------------------------------- phases

def _group(members: list[int], timeout_s: float) -> Any:
    """A gloo group over ``members`` (every world rank calls: ``new_group`` is collective)."""
    return dist.new_group(members, backend="gloo", timeout=timedelta(seconds=timeout_s))


def _equivalence(rank: int, world: int, tmp: str, seed: int, phase: str) -> Optional[dict]:
    """Driver: scheduler steps built, digested, broadcast; everyone: digest of what it got."""
    import cpmeta
    from cpmeta.metadata import InputMetadata
    from cpmeta.launch.scheduler import SyntheticScheduler, default_config
    from cpmeta.transport import ObjectChannel

    members = EQUIV[phase]
    g = _group(members, GROUP_TIMEOUT_S)
    if rank not in members:
        return None
    with ObjectChannel(g, 0, timeout=EQUIV_TIMEOUT_S) as ch:  # the split the hosts imply
        split = {"local": ch.local_ranks, "remote": ch.remote_ranks, "hosts": ch.hosts}
    names = InputMetadata.field_names()
    cfg = default_config()
    sched = SyntheticScheduler(seed, cfg, "mixed", decode_seqs=8, prompt_seqs=2,
                               max_prompt=600) if rank == 0 else None
    sent = torch.zeros(STEPS, len(names) + 1, dtype=torch.int64)
    got_d = torch.zeros_like(sent)
    prompts = 0
    if phase.startswith("replicate"):
        return _replicated(rank, g, cfg, seed, names, split)
    with cpmeta.MetadataBroadcaster(group=g, src=0, timeout=EQUIV_TIMEOUT_S,
                                    persistent_outputs=True) as bc:
        for step in range(STEPS):
            md = None
            if sched is not None:
                is_prompt, batch = sched.next_batch()
                md = cpmeta.prepare_prompt(batch, cfg) if is_prompt else cpmeta.prepare_decode(batch, cfg)
                sent[step] = torch.tensor(fast_digest(md, names), dtype=torch.int64)
            got = bc.broadcast(md)
            got_d[step] = torch.tensor(fast_digest(got, names), dtype=torch.int64)
            prompts += bool(got.is_prompt)
    return {"split": split, "got": got_d, "sent": sent if rank == 0 else None,
            "prompt_steps": prompts, "names": list(names)}


def _replicated(rank: int, g: Any, cfg: Any, seed: int, names: tuple[str, ...], split: dict) -> dict:
    """Driver: the scheduler's calls recorded into a ReplicatedBatchState; everyone: the step
    synced (ring on the driver's host, the process group across hosts), its metadata built
    from the rank's own replica and digested (the driver's digest is the reference)."""
    import cpmeta
    from cpmeta.launch.scheduler import SyntheticScheduler

    got_d = torch.zeros(STEPS, len(names) + 1, dtype=torch.int64)
    prompts = 0
    n = SyntheticScheduler.max_seqs(8, 2)
    with cpmeta.ReplicatedBatchState(cfg, n, group=g, group_src=0, timeout=EQUIV_TIMEOUT_S,
                                     check_every=50) as rep:
        sched = SyntheticScheduler(seed, cfg, "mixed", decode_seqs=8, prompt_seqs=2, max_prompt=600,
                                   replicated=rep) if rank == 0 else None
        for step in range(STEPS):
            if sched is not None:
                sched.next_batch()
            batch = rep.sync()
            md = cpmeta.prepare_prompt(batch, cfg) if batch.is_prompt else cpmeta.prepare_decode(batch, cfg)
            got_d[step] = torch.tensor(fast_digest(md, names), dtype=torch.int64)
            prompts += bool(md.is_prompt)
    return {"split": split, "got": got_d, "sent": got_d.clone() if rank == 0 else None,
            "prompt_steps": prompts, "names": list(names)}


def _fault(rank: int, world: int, tmp: str, seed: int, phase: str) -> dict:
    """Checksummed payloads until the fault surfaces (``outage``: exactly OUTAGE_STEPS)."""
    import cpmeta

    g = _group(list(range(world)), GROUP_TIMEOUT_S)
    rec: dict = {"rank": rank, "last": -1, "etype": None, "error": None, "t_err": None}
    steps = OUTAGE_STEPS if phase == "outage" else MAX_STEPS
    with cpmeta.MetadataBroadcaster(group=g, src=0, timeout=TIMEOUT_S) as bc:
        try:
            for step in range(steps):
                if rank == 0:
                    if step == HEALTHY_STEPS:
                        _mark(tmp, f"ready.{phase}")
                    time.sleep(PACE_S)
                _step(bc, rank, seed, step, rec)
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001 - the injected fault, by whatever name it surfaces
            rec.update(t_err=time.monotonic(), etype=type(e).__name__, error=str(e))
    rec["fds"], rec["maps"] = project_fds(), project_mappings()
    return rec


PHASE_FN: dict[str, Callable[..., Any]] = {**{p: _equivalence for p in EQUIV},
                                           **{p: _fault for p in PHASES if p not in EQUIV}}


def record_path(tmp: str, phase: str, rank: int) -> str:
    """Where rank ``rank`` leaves its record of ``phase`` (a rank killed later keeps its
    earlier records; ``torch.save``: pickle, test-only data)."""
    return os.path.join(tmp, f"rec.{phase}.{rank}.pt")


def world(rank: int, world_size: int, tmp: str, seed: int, phases: list[str]) -> None:
    """The rank function: every phase in order, each after the parent's ``go`` mark; each
    phase's record saved (:func:`record_path`) before its ``done`` mark."""
    for phase in phases:
        _wait_mark(tmp, f"go.{phase}", MARK_TIMEOUT_S)
        rec = PHASE_FN[phase](rank, world_size, tmp, seed + PHASES.index(phase), phase)
        torch.save(rec, record_path(tmp, phase, rank) + ".part")
        os.replace(record_path(tmp, phase, rank) + ".part", record_path(tmp, phase, rank))
        _mark(tmp, f"done.{phase}.{rank}")
