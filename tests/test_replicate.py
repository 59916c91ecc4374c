"""``ReplicatedBatchState`` (issue 30, docs/design.md section 15): replicate the step, every rank builds its own.

Real gloo ranks run random scheduler traces (tests/replicate_trace.py: adds, finishes with slot
reuse, chunked prefill, decode with drafts, placeholders, block growth, Engram ids, moved state
ids, refused calls) for hundreds of steps on the plain and the seed config; every rank digests
the metadata it builds from its own replica every step (``launch.verify.metadata_digest``), and
the driver also drives a plain ``BatchState`` with the same seed as a reference: all must be
equal, step for step. A planted divergence (a follower's replica changed behind its back) is
caught and named: rank, step, request. Gaps and replays of the step numbers are refused.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any, Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multiproc import run_ranks

pytestmark = pytest.mark.timeout(300)


def _config(name: str) -> Any:
    from cpmeta.launch.scheduler import default_config, plain_config

    return plain_config(max_model_len=1024) if name == "plain" else default_config(max_model_len=1024)


def _build(batch: Any, cfg: Any) -> Any:
    import cpmeta

    if batch is None:
        return None
    return cpmeta.prepare_prompt(batch, cfg) if batch.is_prompt else cpmeta.prepare_decode(batch, cfg)


def _digest(md: Any) -> int:
    from cpmeta.launch.verify import metadata_digest

    if md is None:
        return 0
    return hash(tuple(metadata_digest(md).tolist()))


def _trace_rank(rank: int, world: int, seed: int, cfg_name: str, steps: int, max_seqs: int,
                defer: bool = False, announce: bool = False, metadata: bool = False,
                bulk: Optional[int] = None) -> dict:
    import cpmeta
    import cpmeta.replicate.replicated as replicated
    from cpmeta.launch.strategies import SchedulerTee
    from replicate_trace import drive

    if bulk is not None:  # frames above ``bulk`` bytes get the replay's entry alone (a prompt step's)
        replicated.WARM_BULK_BYTES = bulk

    cfg = _config(cfg_name)
    out: dict = {"digests": [], "refusals": [], "ref": [], "mine": [], "mirrors": [], "warmed": 0, "warm_done": 0,
                 "dry_reads": 0, "decode_steps": 0, "direct": 0, "direct_refused": 0}
    if rank == 0:  # the driver's frames claimed, written and published in the ring by one compiled call
        import cpmeta.replicate.step_frame as step_frame

        def counted_send(*a: Any, send: Any = step_frame.send_step_frame) -> int:
            got = send(*a)
            out["direct" if got >= 0 else "direct_refused"] += 1
            return got
        step_frame.send_step_frame = counted_send
    arenas = cpmeta.OutputArenas()
    with cpmeta.ReplicatedBatchState(cfg, max_seqs, max_tokens=1024, check_every=16, timeout=60,
                                     defer_apply=defer) as rep:
        ring = rep._ch.objects.ring  # noqa: SLF001 - counting the follower's warm calls
        if ring is not None and ring.warm is not None:
            def counted(f: Any = ring.warm) -> Any:
                out["warmed"] += 1
                f()
                out["warm_done"] += 1  # (a hook that raised would be dropped by the ring)
            ring.warm = counted
            reader = rep._reader  # noqa: SLF001 - counting the warm's reads of the last frame
            if reader is not None:
                def read(*a: Any, f: Any = reader.read, **k: Any) -> Any:
                    out["dry_reads"] += bool(k.get("dry"))
                    return f(*a, **k)
                reader.read = read
        ref = cpmeta.BatchState(cfg, max_seqs, max_tokens=1024) if rank == 0 else None
        # deferred: driven as an engine drives it, the scheduler's own state validating each call
        target = SchedulerTee(cpmeta.BatchState(cfg, max_seqs, max_tokens=1024), rep) if defer else rep
        rng, rng_ref = random.Random(seed), random.Random(seed)
        held = []  # every step's spec, as an engine may keep it: it stays that step's
        for _ in range(steps):
            if rank == 0 and announce:  # the scheduler decides for 2 ms: followers warm ~20 times
                rep.begin_step()
                time.sleep(0.002)
            if rank == 0:
                drive(target, cfg, rng, out["refusals"])
                _, want = drive(ref, cfg, rng_ref, [])
                out["ref"].append(_digest(_build(want, cfg)))
            if metadata:  # the replay's call builds a decode step of a shape built before
                md = rep.sync_metadata(arenas)
                if len(out["digests"]) % 3 == 0:  # read every 3rd step (else left unmade)
                    assert _digest(md) == _digest(_build(rep.batches[0] if rep.batches else None, cfg))
            else:
                md = _build(rep.sync(), cfg)
            out["digests"].append(_digest(md))
            if rep.spec is not None:
                held.append((rep.spec, _spec_values(rep.spec)))
            out["decode_steps"] += md is not None and not md.is_prompt
            if md is not None and md.is_prompt and world > 1:  # every rank's own zigzag share
                out["mine"].append(_digest(cpmeta.prepare_for_mirror_cp(md, rank, world)))
                if rank == 0:  # and the driver's view of every rank's share
                    out["mirrors"].append([_digest(cpmeta.prepare_for_mirror_cp(md, r, world))
                                           for r in range(world)])
        out["specs_changed"] = [i for i, (sp, values) in enumerate(held) if _spec_values(sp) != values]
        out["fused"] = rep._sink.filled if rep._sink is not None else 0  # noqa: SLF001 - the replay's builds
        out["compiled_reads"] = rep._reader.taken if rep._reader is not None else 0  # noqa: SLF001
        out["read_fused"] = rep._reader.fused.count if rep._reader is not None else 0  # noqa: SLF001 - in one call
        out["written"] = rep._written  # noqa: SLF001 - the driver's frames written by one compiled call
    return out


def _spec_values(spec: Any) -> list:
    return [None if x is None else np.asarray(x).tolist() for x in spec[1:5]]


def _check_trace(out: list[dict]) -> None:
    drv = out[0]
    for r, got in enumerate(out[1:], 1):
        bad = [i for i, (a, b) in enumerate(zip(drv["digests"], got["digests"])) if a != b]
        assert not bad and len(got["digests"]) == len(drv["digests"]), f"rank {r} differs at {bad[:5]}"
        assert got["mine"] == [m[r] for m in drv["mirrors"]], f"rank {r}: its zigzag share differs"
        assert not got["specs_changed"], f"rank {r}: specs kept from steps {got['specs_changed'][:5]} changed"
    bad = [i for i, (a, b) in enumerate(zip(drv["digests"], drv["ref"])) if a != b]
    assert not bad, f"the driver's replica differs from a plain BatchState at steps {bad[:5]}"
    assert all(not k.endswith("accepted") for k in drv["refusals"]), drv["refusals"]


@pytest.mark.parametrize("cfg_name,world,defer", [("seed", 2, False), ("plain", 3, False), ("seed", 3, True),
                                                  ("plain", 2, True)])
def test_named_trace_every_rank_builds_the_drivers_metadata(cfg_name: str, world: int, defer: bool) -> None:
    """Every rank's metadata equals the driver's every step; ``defer``: the driver records only
    and applies after sending (``defer_apply``), its calls validated by its scheduler's state."""
    out = run_ranks(_trace_rank, world, 7, cfg_name, 240, 9, defer, timeout=240)
    _check_trace(out)
    assert sum(1 for d in out[0]["digests"] if d) > 150  # most steps carried a batch


@pytest.mark.parametrize("cfg_name,world,defer", [("seed", 3, False), ("plain", 2, True)])
def test_sync_metadata_builds_the_drivers_metadata(cfg_name: str, world: int, defer: bool) -> None:
    """``sync_metadata``: every rank's metadata equals the driver's every step and what building
    its own ``rep.batches`` gives; on followers (and a ``defer_apply`` driver) most decode steps
    are built inside the replay's call (those of a shape built before with the same rows and
    sequences: this trace's batch size comes and goes, ~3 in 4 in one process), on a validating
    driver by one kernel call too (``DecodeSink.fill``)."""
    out = run_ranks(_trace_rank, world, 7, cfg_name, 240, 9, defer, False, True, timeout=240)
    _check_trace(out)
    for r, got in enumerate(out):
        if r:  # a follower's frames without an added request: read by the compiled read
            assert got["compiled_reads"] >= len(got["digests"]) // 3, (r, got["compiled_reads"])
        else:  # and written whole by the driver's compiled writer, published by the same call
            assert got["written"] >= len(got["digests"]) // 3, got["written"]
            assert got["direct"] == got["written"] and not got["direct_refused"], got
        # most decode steps built by one kernel call into a kept arena (the replay's, or DecodeSink.fill's)
        assert got["fused"] >= got["decode_steps"] // 2, (r, got["fused"], got["decode_steps"])
        if r or defer:
            # of those, the steps of appends and one decode spec: replayed and built in the call that read
            # them (a follower's compiled read; a defer_apply driver's own apply of the columns it packed)
            assert got["read_fused"] >= got["decode_steps"] // 3, (r, got["read_fused"], got["decode_steps"])
        else:  # the driver validated each call: its batches exist before the send, nothing to replay
            assert got["read_fused"] == 0


@pytest.mark.parametrize("env", [{"CPMETA_FORCE_REMOTE": "1"}, {"CPMETA_CHECKSUM": "1"}], ids=["remote", "checksum"])
def test_named_trace_over_the_process_group_and_with_checksums(env: dict[str, str]) -> None:
    """The same trace with the step frames sent through the process group (``force_remote``, as
    to followers on another host), and with every frame's crc32 over its whole length stamped and
    verified (``CPMETA_CHECKSUM``: the region the op log packs is covered): every rank builds the
    driver's metadata every step; nothing warms (no ring / a checksummed frame); the compiled
    read takes the common frames from the process group (not the checksummed ones)."""
    out = run_ranks(_trace_rank, 2, 7, "plain", 80, 9, True, env=env, timeout=240)
    _check_trace(out)
    assert out[1]["warmed"] == 0
    # the compiled read takes the frames from the process group too; with the checksum the parser reads them all
    assert (out[1]["compiled_reads"] == 0) == ("CPMETA_CHECKSUM" in env), out[1]["compiled_reads"]
    assert (out[0]["written"] == 0) == ("CPMETA_CHECKSUM" in env), out[0]["written"]
    assert out[0]["direct"] == out[0]["direct_refused"] == 0  # no ring / a checksummed frame: the Python path


def test_a_small_ring_sends_the_frames_a_claim_refuses_through_the_python_path() -> None:
    """A ring of three 512-byte slots: the driver's compiled send claims the frames that fit before
    the ring's end with their slots free and leaves the others (a pad, a wait for the follower, a
    prompt step larger than the ring) to the transport's Python path; every rank builds the
    driver's metadata every step either way."""
    env = {"CPMETA_SHM_NUM_SLOTS": "3", "CPMETA_SHM_SLOT_SIZE": "512"}
    out = run_ranks(_trace_rank, 2, 7, "plain", 120, 9, True, False, True, env=env, timeout=240)
    _check_trace(out)
    assert out[0]["direct"] > 20 and out[0]["direct_refused"] > 5, out[0]


@pytest.mark.parametrize("defer,metadata,bulk", [(False, False, None), (True, False, None), (True, True, None),
                                                 (True, True, 0)])
def test_followers_warming_for_announced_steps_change_nothing(defer: bool, metadata: bool,
                                                              bulk: Optional[int]) -> None:
    """Followers spinning for announced steps read the last step's frame again, read-only
    (``ReplicatedBatchState.warm``: the compiled read into its other buffer, the replay entered
    at the end of its runs) dozens of times a step: every rank still builds the driver's
    metadata every step (and the replicas still compare equal every 16 steps), and the warm
    hook ran to its end -- it never raised (the ring drops a hook that does). ``metadata``:
    ``sync_metadata``, its batches built in the replay's call left unmade until read. ``bulk``
    0: every frame counts as a prompt step's (``WARM_BULK_BYTES``), warmed by the replay's
    entry alone."""
    # world 2: a follower warms only with a core of its own (2 ranks on a 2-core machine)
    out = run_ranks(_trace_rank, 2, 11, "seed", 120, 9, defer, True, metadata, bulk, timeout=240)
    _check_trace(out)
    assert out[1]["warmed"] >= 120, out[1]["warmed"]
    assert out[1]["warm_done"] == out[1]["warmed"], out[1]
    # the last frame read again by the compiled read (not after a frame over ``bulk`` bytes)
    assert (out[1]["dry_reads"] >= 100) if bulk is None else (out[1]["dry_reads"] == 0), out[1]["dry_reads"]


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), cfg_name=st.sampled_from(["seed", "plain"]),
       world=st.integers(2, 4), max_seqs=st.integers(2, 12))
def test_random_traces(seed: int, cfg_name: str, world: int, max_seqs: int) -> None:
    out = run_ranks(_trace_rank, world, seed, cfg_name, 150, max_seqs, timeout=240)
    _check_trace(out)


def _reference_rank(rank: int, world: int, seed: int) -> list[int]:
    """The driver's replica builds what a plain BatchState driven by the same calls builds."""
    import cpmeta
    from replicate_trace import drive

    cfg = _config("seed")
    res = []
    with cpmeta.ReplicatedBatchState(cfg, 8, max_tokens=1024, timeout=60) as rep:
        ref = cpmeta.BatchState(cfg, 8, max_tokens=1024)
        r1, r2 = random.Random(seed), random.Random(seed)
        for _ in range(120):
            if rank == 0:
                drive(rep, cfg, r1, [])
            got = _digest(_build(rep.sync(), cfg))
            want = _digest(_build(drive(ref, cfg, r2, [])[1], cfg)) if rank == 0 else got
            res.append(int(got == want))
    return res


def test_driver_replica_equals_a_plain_batch_state() -> None:
    out = run_ranks(_reference_rank, 2, 3, timeout=180)
    assert out[0] == [1] * 120, out[0]


def _planted(rank: int, world: int, where: str, defer: bool = False) -> str:
    """Follower rank 1 changes its replica behind its back at step 30; what every rank sees."""
    import cpmeta
    from cpmeta.launch.strategies import SchedulerTee
    from replicate_trace import drive

    cfg = _config("plain")
    rng = random.Random(11)
    every = 0 if where == "table" else 4  # the per-step check alone (the others then meet no replica check)
    with cpmeta.ReplicatedBatchState(cfg, 6, max_tokens=1024, check_every=every, timeout=30, defer_apply=defer) as rep:
        target = SchedulerTee(cpmeta.BatchState(cfg, 6, max_tokens=1024), rep) if defer else rep
        arenas = cpmeta.OutputArenas()
        try:
            for step in range(1, 200):
                if rank == 0:
                    drive(target, cfg, rng, [])
                if rank == 1 and step == 30:
                    st = rep.state
                    live = [int(s) for s in st.active.nonzero()[0]]
                    s = live[0]
                    if where == "last token":  # the token before the step's appends
                        st.token_ids[s, st.num_tokens[s] - 1] += 1
                    elif where == "table":  # what the next decode of s reads (its whole table)
                        st.block_table[s, 0] += 1
                    else:  # deep in its history: only the whole-replica check can see it
                        st.token_ids[s, 0] += 1
                if where == "table":  # a follower's decode step of a shape built before: one compiled call
                    rep.sync_metadata(arenas)
                else:
                    rep.sync()
        except RuntimeError as e:
            fused = rep._reader.fused.count if rep._reader is not None else 0  # noqa: SLF001
            return f"sync {step} fused {fused}: {e}"
    return "not caught"


def _last_check_at_close(rank: int, world: int) -> str:
    """Follower rank 1 changes its replica's history behind its back at step 30; the run ends
    right after step 32, a replica check step whose verdict no sync takes: close() does."""
    import cpmeta
    from replicate_trace import drive

    cfg = _config("plain")
    rng = random.Random(11)
    try:
        with cpmeta.ReplicatedBatchState(cfg, 6, max_tokens=1024, check_every=4, timeout=30) as rep:
            for step in range(1, 33):
                if rank == 0:
                    drive(rep, cfg, rng, [])
                if rank == 1 and step == 30:
                    st = rep.state
                    st.token_ids[int(st.active.nonzero()[0][0]), 0] += 1
                rep.sync()
    except RuntimeError as e:
        return str(e)
    return "not caught"


def test_the_last_replica_check_is_judged_at_close() -> None:
    out = run_ranks(_last_check_at_close, 2, timeout=120)
    for r in (0, 1):
        assert f"rank {r}: step 32: replica digests differ" in out[r], out[r]
        assert "rank 1 first differs at slot" in out[r], out[r]


def _check_ready_rank(rank: int, world: int) -> list:
    """After construction: is the channel's helper thread running, and are the replica digest's
    kernels loaded (within 10 s) -- with check_every 4, then 0."""
    import threading

    import cpmeta
    from cpmeta.replicate import digest_njit

    out = []
    for every in (4, 0):
        before = {t.ident for t in threading.enumerate() if t.name == "cpmeta-background"}
        with cpmeta.ReplicatedBatchState(_config("plain"), 6, max_tokens=1024, check_every=every, timeout=30):
            helper = any(t.name == "cpmeta-background" and t.ident not in before for t in threading.enumerate())
            deadline = time.monotonic() + 10
            while every and not digest_njit.replica_slot_digests.signatures and time.monotonic() < deadline:
                time.sleep(0.01)
            out.append((every, helper, bool(digest_njit.replica_slot_digests.signatures)))
    return out


def test_a_checking_replica_loads_its_digest_kernels_when_made() -> None:
    """The first replica check used to start the channel's helper thread and load the digest
    kernels from numba's cache (~8 ms on the VM; the step after the first check cost 2.8 ms at
    world 2, 8.1 ms at world 3, against ~0.4-0.8 after later checks): both happen at
    construction now, and only when the state checks at all."""
    for got in run_ranks(_check_ready_rank, 2, timeout=120):
        assert got[0] == (4, True, True) and got[1][:2] == (0, False), got


def _store_keys_rank(rank: int, world: int) -> list[int]:
    """40 steps with a replica check every 2nd: the rendezvous store's key count after each
    check's verdict (the sync after it)."""
    import cpmeta
    from cpmeta.transport._dist import store_of
    from replicate_trace import drive

    cfg = _config("plain")
    rng = random.Random(5)
    counts = []
    with cpmeta.ReplicatedBatchState(cfg, 6, max_tokens=1024, check_every=2, timeout=30) as rep:
        for step in range(1, 41):
            if rank == 0:
                drive(rep, cfg, rng, [])
            rep.sync()
            if step % 2 == 1 and step > 1:
                counts.append(store_of().num_keys())
    return counts


def test_replica_checks_leave_one_check_of_keys_in_the_store() -> None:
    """Each check's digests meet in the rendezvous store; a rank deletes its keys of the last
    check at the next, so a long run does not grow the store (it held 4 keys more per check)."""
    out = run_ranks(_store_keys_rank, 2, timeout=120)
    for counts in out:  # a rank a step ahead may have set its next check's key (one per rank)
        assert len(counts) == 19 and max(counts[2:]) - min(counts[2:]) <= 2, counts


@pytest.mark.parametrize("where", ["last token", "history"])
def test_planted_divergence_is_caught_and_named(where: str) -> None:
    from multiproc import spawn_ranks

    with spawn_ranks(_planted, 3, where, timeout=120) as g:
        out = g.results(allow_dead=(0, 2) if where == "last token" else ())
    fol = out[1]
    assert "rank 1" in fol and "step" in fol and ("request" in fol or "slot" in fol), fol
    if where == "history":  # the collective check: every rank raises the same verdict
        for r in (0, 2):
            assert "rank 1 first differs at slot" in out[r], out[r]


@pytest.mark.parametrize("defer", [False, True])
def test_planted_table_divergence_is_refused_by_the_step_check(defer: bool) -> None:
    """A follower's changed block-table entry is refused by the per-step batch check at the next
    step whose build reads that table, named with the table as the part; with ``defer_apply``
    (the driver's check of step k rides in step k + 1's frame) at the sync after that step, still
    naming the step whose batch differs."""
    from multiproc import spawn_ranks

    with spawn_ranks(_planted, 3, "table", defer, timeout=120) as g:
        out = g.results(allow_dead=(0, 2))
    m = re.match(r"sync (\d+) fused (\d+): rank 1: step (\d+): this replica's batch differs from the driver's "
                 r"\(rank 0\) at request .*: block table", out[1])
    assert m and int(m.group(3)) >= 30 and int(m.group(1)) == int(m.group(3)) + defer, out[1]
    assert int(m.group(2)) >= 1, out[1]  # decode steps read, replayed and built in one call


def _steady_decode(rank: int, world: int, defer: bool) -> list[str]:
    """Four requests decode one token a step (appends and one decode spec of one shape: a
    follower reads, replays and builds each step in one compiled call); before step 12 follower
    rank 1 changes a block-table entry of slot 0, which every decode build reads. What each
    rank sees at each step, and how many steps took the one-call path."""
    import numpy as np

    import cpmeta

    cfg = _config("plain")
    seen: list[str] = []
    arenas = cpmeta.OutputArenas()
    with cpmeta.ReplicatedBatchState(cfg, 4, max_tokens=1024, check_every=0, timeout=30, defer_apply=defer) as rep:
        slots = np.arange(4, dtype=np.int64)
        for step in range(1, 20):
            try:
                if rank == 0 and step == 1:
                    for i in range(4):
                        rep.add_request(f"r{i}", list(range(1, 41)), list(range(8 * i, 8 * i + 8)), i,
                                        num_computed=40)
                elif rank == 0:
                    rep.append_tokens_batch(slots, np.full(4, step, np.int64), np.ones(4, np.int64))
                if rank == 0:
                    rep.decode_batch(slots)
                if rank == 1 and step == 12:
                    rep.state.block_table[0, 1] += 1
                rep.sync_metadata(arenas)
                seen.append(f"step {step}: ok")
            except RuntimeError as e:
                seen.append(f"step {step}: {e}")
                break
    return seen + [f"fused {rep._reader.fused.count if rep._reader is not None else 0}"]  # noqa: SLF001


@pytest.mark.parametrize("defer", [False, True])
def test_a_divergence_in_a_one_call_step_is_refused(defer: bool) -> None:
    """The per-step check on the follower's one-call decode step (its check's digests made in
    that call; under ``defer_apply`` compared at the next step): a changed block-table entry is
    refused at step 12, or at 13 naming step 12; the others go on."""
    from multiproc import spawn_ranks

    with spawn_ranks(_steady_decode, 3, defer, timeout=120) as g:
        out = g.results(allow_dead=(0, 2))
    fol = out[1]
    at = 12 + defer
    assert fol[:at - 1] == [f"step {i}: ok" for i in range(1, at)], fol
    assert fol[at - 1].startswith(f"step {at}: rank 1: step 12: this replica's batch differs from the driver's "
                                  "(rank 0) at request 'r0' (slot 0), sequence 0 of batch 0: block table"), fol
    assert int(fol[-1].split()[1]) >= 8, fol  # the steps before it took the one-call path


def _diverged_at_step_2(rank: int, world: int, what: str) -> list[str]:
    """Step 1 schedules request ``"a"``; before step 2 follower rank 1's replica re-adds it with
    one value changed that step 2's build reads (a prompt token inside the chunk being prefilled,
    or a block-table entry a decode reads, neither one a sequence's last), through the state's
    own public calls; what every rank sees at each step."""
    import torch

    import cpmeta

    cfg = _config("plain")
    prompt = list(range(100, 164))  # 64 tokens: chunks [0, 32) at step 1, [32, 64) at step 2
    seen = []
    with cpmeta.ReplicatedBatchState(cfg, 4, max_tokens=1024, check_every=0, timeout=30) as rep:
        for step in (1, 2, 3):
            if rank == 0:
                if what == "prompt token":
                    if step == 1:
                        a = rep.add_request("a", prompt, [4, 5, 6, 7], 0)
                    if step < 3:
                        rep.prompt_batch([a], [32])
                    else:  # prefilled: its first token, and a decode
                        rep.append_tokens(a, [1])
                        rep.append_blocks(a, [8])
                        rep.decode_batch([a])
                else:
                    if step == 1:
                        a = rep.add_request("a", prompt, [4, 5, 6, 7, 8], 0, num_computed=64)
                    else:
                        rep.append_tokens(a, [step])
                    rep.decode_batch([a])
            if rank == 1 and step == 2:  # this replica, behind the driver's back
                st = rep.state
                s = st.slot_of("a")
                toks = st.token_ids[s, :st.num_tokens[s]].copy()
                table = st.block_table[s, :st.num_blocks[s]].copy()
                if what == "prompt token":
                    toks[40] += 1  # inside step 2's chunk [32, 64), not its last token
                else:
                    table[1] = 9  # the decode build reads the whole table; not its last entry
                n_comp = int(st.num_computed[s])
                st.finish(s)
                assert st.add_request("a", toks, table, 0, num_computed=n_comp) == s
            try:
                batch = rep.sync()
                seen.append(f"step {step}: {len(batch)}")
            except RuntimeError as e:
                seen.append(f"step {step}: {e}")
                break
        torch.distributed.barrier()  # every follower has read step 3 before the driver closes
    return seen


@pytest.mark.parametrize("what,part", [("prompt token", "token window"), ("block table", "block table")])
def test_divergence_the_build_reads_is_refused_at_that_step(what: str, part: str) -> None:
    """Issue 38 item 6: a follower whose replica would build different metadata at step 2 -- a
    prompt token inside the chunk being prefilled, a block-table entry the decode build reads --
    is refused AT step 2, naming the rank, the step, the request and the part; the other
    follower and the driver go on. Fails on 4ac8a65, whose per-step check read only each token
    window's and block table's last id: rank 1 returned step 2's batch and built different
    metadata (found only by the periodic replica digest, steps later)."""
    out = run_ranks(_diverged_at_step_2, 3, what, timeout=120)
    assert out[0] == out[2] == ["step 1: 1", "step 2: 1", "step 3: 1"], out
    assert out[1][0] == "step 1: 1" and len(out[1]) == 2, out[1]
    msg = out[1][1]
    assert msg.startswith("step 2: rank 1: step 2: this replica's batch differs from the driver's (rank 0)"), msg
    assert "request 'a' (slot 0)" in msg and msg.endswith(f"{part}; the replicas diverged, this replica "
                                                          "refuses further steps"), msg


def _step_skew(rank: int, world: int, skew: int) -> str:
    import cpmeta

    cfg = _config("plain")
    with cpmeta.ReplicatedBatchState(cfg, 4, max_tokens=1024, timeout=20) as rep:
        if rank == 0:
            rep.add_request(1, [5, 6, 7], [0], 0)
            rep.prompt_batch([0], [3])
        rep.sync()
        if rank == 1:
            rep.step += skew  # as if this follower had missed (or seen twice) a frame
        try:
            rep.sync()
        except RuntimeError as e:
            return str(e)
    return "accepted"


@pytest.mark.parametrize("skew,word", [(-1, "a gap"), (1, "a replay")])
def test_gap_and_replay_refused(skew: int, word: str) -> None:
    out = run_ranks(_step_skew, 2, skew, timeout=90)
    assert out[0] == "accepted" and "rank 1" in out[1] and word in out[1], out


def _follower_api(rank: int, world: int) -> list[str]:
    import cpmeta

    cfg = _config("plain")
    res = []
    with cpmeta.ReplicatedBatchState(cfg, 4, max_tokens=1024, timeout=20) as rep:
        if rank == 1:
            for call in (lambda: rep.add_request(1, [1], [0], 0), lambda: rep.finish(0),
                         lambda: rep.decode_batch([0])):
                try:
                    call()
                    res.append("accepted")
                except RuntimeError as e:
                    res.append(str(e))
        else:
            try:
                rep.add_request(object(), [1], [0], 0)  # type: ignore[arg-type]
            except TypeError as e:
                res.append(str(e))
            try:  # past int64: the followers' value check would refuse the frame (the send trusts the ids)
                rep.add_request(1 << 63, [1], [0], 0)
            except ValueError as e:
                res.append(str(e))
            rep.add_request("a", [1, 2, 3], [0], 0)
            rep.add_request("b", [4, 5], [1], 1, num_computed=2)
            rep.append_tokens(1, [6])
            rep.prompt_batch([0], [1])  # a mixed step: a prompt chunk ...
            rep.append_tokens(1, [7])   # (a call between the two specs stays in this step)
            rep.decode_batch([1])       # ... and a decode batch
            rep.append_tokens(1, [8])   # after the last spec: travels with the next step
        got = rep.sync()
        assert isinstance(got, tuple), got
        res.append(",".join(f"{b.is_prompt}:{b.seqlen_k.tolist()}" for b in got))
        res.append(str(int(rep.state.num_tokens[1])))
        assert rep.spec is not None and rep.spec.is_prompt and len(rep.specs) == 2
    return res


def test_followers_cannot_mutate_and_mixed_steps() -> None:
    drv, fol = run_ranks(_follower_api, 2, timeout=90)
    assert "int or a str" in drv[0] and "fits int64" in drv[1] and str(1 << 63) in drv[1], drv
    assert drv[2] == "True:[1],False:[4]" and drv[3] == "5", drv
    # the follower stands where the driver stood at its last spec: token 8 comes next step
    assert all("driver's call" in m for m in fol[:3]) and fol[3:] == ["True:[1],False:[4]", "4"], fol


def _mismatched_config(rank: int, world: int) -> str:
    import cpmeta

    try:
        cpmeta.ReplicatedBatchState(_config("plain"), 4 + rank, timeout=20)
    except ValueError as e:
        return str(e)
    return "constructed"


def test_replicas_must_agree_on_config_and_capacity() -> None:
    for msg in run_ranks(_mismatched_config, 2, timeout=60):
        assert "state setting differs" in msg and "[0]" in msg and "[1]" in msg, msg


def _fault_rank(rank: int, world: int, fault: str) -> dict:
    """A replicated trace where rank 2 dies (SIGKILL) or freezes (sleeps past the timeout) at
    step 20; what every other rank sees, how soon, and whether it still holds a segment."""
    import os
    import signal
    import time as _time

    import cpmeta
    from reliability_cases import project_fds, project_mappings
    from replicate_trace import drive

    cfg = _config("plain")
    rng = random.Random(3)
    out: dict = {"etype": None, "error": None, "t_fault": None, "t_err": None}
    rep = cpmeta.ReplicatedBatchState(cfg, 6, max_tokens=1024, timeout=3.0)
    try:
        for step in range(1, 2000):
            if rank == 2 and step == 20:
                if fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                _time.sleep(8)  # stalled well past the 3 s timeout
            if rank == 0:
                drive(rep, cfg, rng, [])
            if step == 20:
                out["t_fault"] = _time.monotonic()
            rep.sync()
    except Exception as e:  # noqa: BLE001 - the injected fault, by whatever name it surfaces
        out.update(etype=type(e).__name__, error=str(e)[:300], t_err=_time.monotonic())
    rep.close()
    out["held"] = (project_fds(), project_mappings())
    return out


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_dead_or_stalled_follower_is_named(fault: str) -> None:
    from multiproc import spawn_ranks
    from reliability_cases import project_shm_entries

    before = project_shm_entries()
    with spawn_ranks(_fault_rank, 3, fault, timeout=120) as g:
        if fault == "stall":
            out = g.results(allow_dead=(1, 2))
        else:
            out = g.results(allow_dead=(2,))
    drv = out[0]
    assert drv["etype"] in ("PeerError", "TimeoutError"), drv
    assert "rank 2" in drv["error"], drv
    assert drv["t_err"] - drv["t_fault"] < 10.0, drv  # within the 3 s timeout (plus the ring's slack)
    assert drv["held"] == ([], []), drv
    assert project_shm_entries() <= before


def _killed_after_check(rank: int, world: int, defer: bool, remote: bool, timeout: Optional[float] = 60,
                        victim: int = 2) -> dict:
    """Rank ``victim`` dies (SIGKILL) right after step 20, a replica check step, with a 60 s
    timeout (or ``timeout``); the others meet its absence in the check's verdict at step 21's
    sync: how, and how soon."""
    import os
    import signal
    import time as _time

    import cpmeta
    from cpmeta.launch.strategies import SchedulerTee
    from replicate_trace import drive

    cfg = _config("plain")
    rng = random.Random(3)
    out: dict = {"etype": None, "error": None, "t_fault": None, "t_err": None}
    with cpmeta.ReplicatedBatchState(cfg, 6, max_tokens=1024, timeout=timeout, check_every=4,
                                     defer_apply=defer, force_remote=remote) as rep:
        # deferred: the scheduler's own state validates each call (as _trace_rank drives it)
        target = SchedulerTee(cpmeta.BatchState(cfg, 6, max_tokens=1024), rep) if defer else rep
        try:
            for step in range(1, 40):
                if step == 21:  # (a dying driver before it records: its helper thread, which posts
                    if rank == victim:  # its check's value, then gets no time to end the gather)
                        os.kill(os.getpid(), signal.SIGKILL)
                    out["t_fault"] = _time.monotonic()
                if rank == 0:
                    drive(target, cfg, rng, [])
                rep.sync()
        except Exception as e:  # noqa: BLE001 - the fault, by whatever name it surfaces
            out.update(etype=type(e).__name__, error=str(e)[:400], t_err=_time.monotonic(), step=step)
            if rank == 0:  # the store's host (as an engine logging its error) outlives the others' reads
                _time.sleep(1.0)
    return out


@pytest.mark.parametrize("defer,remote,hosts,timeout", [
    (False, False, (), 60), (True, False, (), 60), (False, True, (), 60),
    (False, False, ("a", "a", "b", "c"), 60), (False, False, ("a", "a", "b", "c"), None)],
    ids=["default", "defer", "process-group", "other-hosts", "other-hosts-unbounded"])
def test_a_rank_dead_after_a_check_is_named_at_the_verdict_not_the_timeout(
        defer: bool, remote: bool, hosts: tuple, timeout: Optional[float]) -> None:
    """The verdict of a replica check waits for every rank's digests (the rendezvous store, up to
    the timeout); a member that died meanwhile is named as soon as a rank can see it gone -- the
    driver its reader's process (or, on the process-group path, its same-host member's, or a
    member on another host whose connection closed: with no timeout too, where the verdict
    would wait for ever) -- not after the 60 s; a member that can see nothing of it (a ring
    reader, whose writer lives on; ``other-hosts``: rank 3 alone on host c, rank 2 on b) hears
    it from the one that saw it."""
    from multiproc import spawn_ranks

    ids = [{"CPMETA_HOST_ID": h} for h in hosts] if hosts else None
    with spawn_ranks(_killed_after_check, len(hosts) or 3, defer, remote, timeout, timeout=120, rank_env=ids) as g:
        out = g.results(allow_dead=(2,))
    drv, fol = out[0], out[1]
    assert drv["step"] == 21 and drv["etype"] == "PeerError", drv
    gone = "closed its connection" if hosts else "died"
    assert "step 20: replica check" in drv["error"] and "rank 2" in drv["error"] and gone in drv["error"], drv
    assert drv["t_err"] - drv["t_fault"] < 15.0, drv  # the timeout is 60 s
    assert fol["step"] == 21 and fol["etype"] == "PeerError", fol  # same-host members of the process-group
    assert "rank 2" in fol["error"], fol  # path watch each other; a ring reader is told by the driver
    assert fol["t_err"] - fol["t_fault"] < 15.0, fol
    if hosts:  # told by the driver (through the store, before the driver raised)
        far = out[3]
        assert far["step"] == 21 and far["etype"] == "PeerError", far
        assert "rank 0 saw rank 2 (host b) closed its connection" in far["error"], far
        assert far["t_err"] - far["t_fault"] < 15.0, far


@pytest.mark.parametrize("timeout", [60, None], ids=["bounded", "unbounded"])
def test_a_driver_dead_after_a_check_is_named_by_far_followers_while_the_store_lives(
        timeout: Optional[float]) -> None:
    """Followers on other hosts than the driver, the store outliving the driver (torchrun's
    agent holds it): each one's verdict wait watches its connection to the driver
    (``LinkWatch``) and names the driver as soon as it closes -- where it waited out the 60 s
    timeout (``TimeoutError`` naming the driver absent) or, with no timeout, for ever."""
    from datetime import timedelta

    import torch.distributed as dist

    from multiproc import spawn_ranks

    master = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=120))
    ids = [{"CPMETA_HOST_ID": h} for h in ("a", "b", "c")]
    agent = {"MASTER_PORT": str(master.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}  # as torchrun's
    with spawn_ranks(_killed_after_check, 3, False, False, timeout, 0, timeout=120, env=agent,
                     rank_env=ids) as g:
        out = g.results(allow_dead=(0,))
    for fol in out[1:]:
        assert fol["step"] == 21 and fol["etype"] == "PeerError", fol
        assert "replica-check-20" in fol["error"] and "rank 0 (src, host a) closed its connection" \
            in fol["error"], fol
        assert fol["t_err"] - fol["t_fault"] < 15.0, fol  # the timeout is 60 s (or none)


def _deferred_refusal(rank: int, world: int) -> list[str]:
    """``defer_apply``: a call the state refuses is only found at ``sync()``, on every rank."""
    import cpmeta

    cfg = _config("plain")
    seen = []

    def i64(v: list[int]) -> np.ndarray:
        return np.array(v, np.int64)

    with cpmeta.ReplicatedBatchState(cfg, 4, max_tokens=1024, timeout=30, defer_apply=True) as rep:
        if rank == 0:
            a = rep.add_request("a", [1, 2, 3], [5], 0, num_computed=3)
            seen.append(f"slot {a}")
            try:  # an argument's own bounds are checked as the call is recorded: nothing recorded
                rep.decode_batch([a], num_placeholders=2**31)
            except ValueError as e:
                seen.append(f"at once: {e}")
            rep.decode_batch([a])
        batch = rep.sync()
        seen.append(f"n={len(batch)}")
        if rank == 0:
            rep.append_tokens(a, [7] * 1100)  # past max_tokens: recorded, sent, refused by every state
        for _ in range(2):
            try:
                rep.sync()
                seen.append("synced")
            except (ValueError, RuntimeError) as e:
                seen.append(f"{type(e).__name__}: {e}")
    return seen


def test_deferred_apply_refused_call_breaks_every_replica() -> None:
    out = run_ranks(_deferred_refusal, 2, timeout=120)
    assert out[0][:3] == ["slot 0", "at once: num_placeholders: expected <= 65536 (rows padding one batch), got "
                          "2147483648", "n=1"] and out[1][0] == "n=1", out
    assert out[0][3].startswith("ValueError: ReplicatedBatchState (defer_apply): step 2: the state refused"), out[0]
    assert "1103 tokens exceed max_tokens=1024" in out[0][3] and "rebuild" in out[0][3], out[0]
    assert out[1][1].startswith("RuntimeError: rank 1: step 2: this replica cannot apply") and \
        "refused it too" in out[1][1], out[1]
    for seen in out:  # and every later step is refused
        assert seen[-1].startswith("RuntimeError: rank ") and "diverged earlier" in seen[-1], seen


def _deferred_bad_arguments(rank: int, world: int) -> list[str]:
    """``defer_apply``: what a call's arguments alone show is refused at the call, naming the
    argument, and records nothing (nor takes a slot): the step that follows is every rank's."""
    import cpmeta
    from cpmeta.testing import assert_same_on_ranks

    cfg = _config("plain")
    seen = []

    def i64(v: list[int]) -> np.ndarray:
        return np.array(v, np.int64)

    with cpmeta.ReplicatedBatchState(cfg, 4, max_tokens=1024, timeout=30, defer_apply=True) as rep:
        if rank == 0:
            a = rep.add_request("a", [1, 2, 3], [5], 0, num_computed=3)
            for call in (lambda: rep.add_request("b", [1, 2], "x", 1),  # was: int('x'), slot 1 taken
                         lambda: rep.add_request("b", [1, 2], [6], 1.5),
                         lambda: rep.append_tokens(1.5, [7]),  # was: recorded for slot 1
                         lambda: rep.append_tokens_batch([a], [7], [-1]),  # was: a frame no rank could read
                         lambda: rep.append_blocks_batch([a], [7.0], [1]),
                         lambda: rep.set_state_id(a, 2.5),
                         lambda: rep.finish(0.0),
                         lambda: rep.decode_batch([0.0]),
                         lambda: rep.decode_batch([a], [7], 1.5),
                         lambda: rep.decode_batch([a], [7, 8], 1),
                         lambda: rep.prompt_batch([a], [0]),
                         lambda: rep.append_tokens(a, [5, -1]),  # (a rejected draft's -1, say)
                         lambda: rep.add_request("b", [1, -2], [6], 1),
                         lambda: rep.add_request("a", [1], [6], 1),  # was: refused at sync, every replica broken
                         lambda: rep.finish(3),
                         lambda: rep.append_tokens(2, [7]),  # was: refused at sync (no request there)
                         lambda: rep.append_tokens_batch([a, 3], [7, 8], [1, 1]),
                         lambda: rep.set_state_id(1, 5),
                         lambda: rep.decode_batch([a, a]),
                         lambda: rep.prompt_batch([2], [1]),
                         # flat int64 arrays: straight to the recording kernel, which checks the same
                         lambda: rep.append_tokens_batch(i64([a, 3]), i64([7, 8]), i64([1, 1])),
                         lambda: rep.append_blocks_batch(i64([a, a]), i64([7, 8]), i64([1, 1])),
                         lambda: rep.append_blocks_batch(i64([a]), i64([7]), i64([2])),
                         lambda: rep.decode_batch(i64([a, 2]), i64([7, 8]), 1),
                         lambda: rep.add_requests_batch("bc", [1, 2], [1, 1], [6, 7], [1, 1], [2, 3])):  # was: 'b', 'c'
                try:
                    call()
                    seen.append("recorded")
                except (TypeError, ValueError) as e:
                    seen.append(f"{type(e).__name__}: {e}")
            c = rep.add_request("c", [4, 5], [6], 1, num_computed=2)
            seen.append(f"slots {a} {c}")
            rep.decode_batch([a, c], [7, 8], 1)
        batch = rep.sync()
        assert_same_on_ranks(cpmeta.prepare(batch, cfg))
        seen.append(f"c in slot {rep.state.slot_of('c')}")
    return seen


def test_deferred_calls_refuse_bad_arguments_at_the_call() -> None:
    drv, fol = run_ranks(_deferred_bad_arguments, 2, timeout=120)
    assert drv[:25] == [
        "TypeError: request 'b': block_table: expected ints, got <U1 values",
        "TypeError: request 'b': state_id: expected an int, got 1.5",
        "TypeError: slot: expected an int, got 1.5",
        "ValueError: counts: expected 1 counts >= 0 summing to 1 tokens",
        "TypeError: block ids: expected ints, got float64 values",
        "TypeError: state_id: expected an int, got 2.5",
        "TypeError: slot: expected an int, got 0.0",
        "TypeError: slots: expected ints, got float64 values",
        "TypeError: num_drafts: expected ints, got float64 values",
        "ValueError: num_drafts: expected 1 counts >= 0 (or one count for all) summing to 2 drafts",
        "ValueError: chunk_lens: expected 1 chunk lengths >= 1, got [0]",
        "ValueError: slot 0: tokens: expected ids >= 0, got -1 at index 1",
        "ValueError: request 'b': prompt_token_ids: expected ids >= 0, got -2 at index 1",
        "ValueError: request 'a': already in the batch state (slot 0)",
        "ValueError: slot 3: no live request there",
        "ValueError: slot 2: no live request there",
        "ValueError: slots: expected slots of live requests, got [3] without one",
        "ValueError: slot 1: no live request there",
        "ValueError: slots: request 'a' (slot 0) appears twice in one step",
        "ValueError: slots: expected slots of live requests, got [2] without one",
        "ValueError: slots: expected slots of live requests, got [3] without one",
        "ValueError: slots: request 'a' (slot 0) appears twice in one step",
        "ValueError: counts: expected 1 counts >= 0 summing to 1 block ids",
        "ValueError: slots: expected slots of live requests, got [2] without one",
        "TypeError: req_ids: expected a sequence of request ids, got 'bc'"], drv
    assert drv[25:] == ["slots 0 1", "c in slot 1"] and fol == ["c in slot 1"], (drv, fol)
