#!/usr/bin/env python
"""Where one step's time goes, phase by phase: one command, a sub-command per step.

    python scripts/profile_phases.py build                          # host build from a BatchState: batch, build, staging
    python scripts/profile_phases.py broadcast --world 2 --payload decode-64   # MetadataBroadcaster, both sides, real processes
    python scripts/profile_phases.py inplace --out $OUT/h200_inplace_step.json # the in-place decode step's pieces (--cp: + CP driver)
    python scripts/profile_phases.py replicate --backend nccl --steps 200      # cProfile: replicated in-place vs staged broadcast
    python scripts/profile_phases.py cold --out $OUT/cold.json                 # what an idle gap costs the next call
    python scripts/profile_phases.py sync --world 2 --defer                    # ReplicatedBatchState's step as a timeline
    python scripts/profile_phases.py replay --workload prompt                  # a step applied, recorded, replayed (one process)

Phases are timed by :func:`bench_meta.interleaved` (one call of each phase per round, shuffled,
so machine load hits them alike) or, for ``broadcast``, by timers wrapped around the library's
phase functions in every rank. ``python scripts/profile_phases.py SUB --help`` says what each
phase is. Result files (``--out``) carry ``scripts/_harness/bench_meta.py``'s run block. For the speed of
a whole step use ``bench_build.py`` / ``bench_broadcast.py`` / ``bench_step.py`` / ``bench_gpu.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import io
import json
import os
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_broadcast import init_rank, run_world_procs  # noqa: E402  (same ranks as the benchmarks)
from bench_build import _state_from, decode_batch, prompt_batch  # noqa: E402  (same batches)
from _harness.bench_meta import interleaved, write_result  # noqa: E402  (scripts/_harness/bench_meta.py: the harness)
from cpmeta import MetadataConfig, OutputArenas, prepare_decode, prepare_prompt  # noqa: E402
from cpmeta.gpu.decode_inplace import (  # noqa: E402
    DecodeStaging, capture_decode_graph, launch_decode_inplace, prepare_decode_inplace, staging_capacity,
)
from cpmeta.gpu.decode_staging import stage_decode  # noqa: E402
from cpmeta.gpu.staging_layout import StagingLayout  # noqa: E402
from cpmeta.gpu.staging_njit import REPORT_LEN  # noqa: E402
from cpmeta.metadata import InputMetadata  # noqa: E402


# ---- build: the host build's phases ----------------------------------------------------------

BUILD_DOC = """Per-phase host cost of one step from a ``BatchState``: where the build's time goes.

Decode (256 sequences, 0 / 2 drafts) and prompt (8 x 4096) batches of ``scripts/bench_build.py``,
``MetadataConfig.compressed_swa()``, single thread. Phases: ``batch`` (``BatchState.decode_batch``
/ ``prompt_batch``), ``build`` (``prepare_decode``
/ ``prepare_prompt`` of the batch: one compiled call per stage) and ``build_arena`` (the same into
reused ``OutputArenas``), ``metadata`` (``InputMetadata(**fields)``), and for decode ``staging``
(``StagingLayout.write_batch`` of the batch: the one compiled staging call, the host side of
``prepare_decode_inplace`` after the batch), ``inplace_host`` (batch + ``DecodeStaging.fill``) and
``stage_decode`` (the same staging bytes written straight from the state arrays, plus its checks);
for prompt ``count`` (the compiled count pass alone) and ``list`` (``prepare_prompt`` of the
``SequenceMetadata`` list). ``step`` is the whole step (batch + build); the phase sum differs
from it by the glue between them (and by noise).
"""


def _fields(md: InputMetadata) -> dict[str, Any]:
    return {k: getattr(md, k) for k in InputMetadata.__dataclass_fields__ if getattr(md, k) is not None}


def build_decode_phases(cfg: MetadataConfig, n: int, d: int, repeat: int, rng: random.Random) -> dict[str, Any]:
    seqs = decode_batch(rng, cfg, n, d)
    st, slots, (_, drafts, nd) = _state_from(seqs, cfg, False)
    step = lambda: st.decode_batch(slots, drafts, nd)  # noqa: E731
    sb = step()
    total_q = int(sb.seqlen_q.sum())
    arenas = OutputArenas()
    fields = _fields(prepare_decode(sb, cfg, out=arenas))
    view = np.zeros(staging_capacity(cfg, n, total_q), np.int32)
    layout, report = StagingLayout.of(cfg), np.zeros(REPORT_LEN, np.int64)
    stg = DecodeStaging("cpu", staging_capacity(cfg, n, total_q))
    return interleaved({
        "step": lambda: prepare_decode(step(), cfg),
        "batch": step,
        "build": lambda: prepare_decode(sb, cfg),
        "build_arena": lambda: prepare_decode(sb, cfg, out=arenas),
        "metadata": lambda: InputMetadata(**fields),
        "staging": lambda: layout.write_batch(view, sb, report),
        "inplace_host": lambda: stg.fill(step(), cfg),
        "stage_decode": lambda: stage_decode(stg, st, slots, drafts, nd),  # inplace_host without the batch
    }, repeat)


def build_prompt_phases(cfg: MetadataConfig, n: int, q: int, repeat: int, rng: random.Random) -> dict[str, Any]:
    from cpmeta.builders.prompt_njit import count_slots, prompt_consts, prompt_count

    seqs = prompt_batch(rng, cfg, n, q)
    st, slots, (lens, _, _) = _state_from(seqs, cfg, True)
    step = lambda: st.prompt_batch(slots, lens, advance=False)  # noqa: E731
    sb = step()
    arenas = OutputArenas()
    fields = _fields(prepare_prompt(sb, cfg, out=arenas))
    k, cnt, err = prompt_consts(cfg), np.empty(count_slots(cfg), np.int64), np.zeros(4, np.int64)
    return interleaved({
        "step": lambda: prepare_prompt(step(), cfg),
        "step_arena": lambda: prepare_prompt(step(), cfg, out=arenas),
        "list": lambda: prepare_prompt(seqs, cfg),
        "batch": step,
        "count": lambda: prompt_count(sb.seqlen_q, sb.seqlen_k, sb.state_id, sb.swa_valid_start, sb.num_tokens,
                                      sb.block_tables, sb.block_table_offsets, k, cnt, err),
        "build": lambda: prepare_prompt(sb, cfg),
        "build_arena": lambda: prepare_prompt(sb, cfg, out=arenas),
        "metadata": lambda: InputMetadata(**fields),
    }, repeat)


# ---- broadcast: one MetadataBroadcaster step, both sides -------------------------------------

BROADCAST_DOC = """Where one ``MetadataBroadcaster.broadcast`` step spends its time, per phase, on both sides.

No hook sits in the library's hot path: this script wraps the broadcaster's and the transport's
phase functions (listed in ``PHASES``; names missing from the current code are skipped) with
``perf_counter_ns`` timers, in real processes over gloo, and reports the p50 of each phase
(inclusive: a phase that calls another includes it). The wrapper itself costs ~0.3 us a call.

Cross-process times use CLOCK_MONOTONIC (``time.perf_counter`` on Linux, one clock per host):
``wake`` = follower sees the message - driver stored the new head (``_publish`` entry);
``last done`` = last follower holds the metadata - driver called ``broadcast``.

Two modes: ``engine`` (followers have been parked in their receive call for ``--park-ms`` when
the driver starts: the inference engine case) and ``b2b`` (a barrier right before the step, so
followers are still spinning when the message lands).

The driver's payload is what an engine building with ``out=OutputArenas()`` hands over each step
(outside the timed region): the SAME tensor objects, refilled in place with this step's values
(``bench_broadcast.step_values``), in a NEW ``InputMetadata`` with new dicts and a new
``max_seqlen_k``, as that engine's driver does.
``--reuse-md`` passes the one refilled object every step instead (``bench_broadcast``'s case).
Note on the driver's first phases in ``engine`` mode: they run right after the driver idled
``--park-ms`` (cold caches, a core clocked down), so they cost several times their in-process
time (measured in one process); ``--park-ms 0`` shows how much of a phase that is.

    python scripts/profile_phases.py broadcast --world 2 --payload decode-64 --steps 200
"""

PHASES: list[tuple[str, str, str]] = [
    ("D broadcast (total)", "cpmeta.broadcast.broadcaster", "MetadataBroadcaster._send"),
    ("D begin_step", "cpmeta.broadcast.broadcaster", "MetadataBroadcaster.begin_step"),
    ("D collect by path", "cpmeta.broadcast.broadcaster", "collect"),
    ("D layout", "cpmeta.broadcast.broadcaster", "_layout"),
    ("D layout", "cpmeta.broadcast.broadcaster", "MetadataBroadcaster._layout"),
    ("D sizes (run offsets)", "cpmeta.broadcast.plan", "Plan.sizes"),
    ("D pack tensors", "cpmeta.broadcast.broadcaster", "_pack"),
    ("D pack tensors", "cpmeta.broadcast.broadcaster", "pack_tensors"),
    ("D encode (codec)", "cpmeta.transport.object_channel", "encode"),
    ("D encode values", "cpmeta.transport", "encode_body"),
    ("D frame crc32", "cpmeta.broadcast.broadcaster", "frame_crc"),
    ("D seal (meta crc, + crc32 with checksum)", "cpmeta.broadcast.wire", "seal"),
    ("C check values (schema; both sides)", "cpmeta.broadcast.schema", "ValueCheck.__call__"),
    ("F check frame (limits, policy, crcs)", "cpmeta.broadcast.wire", "read_head"),
    ("F check tensors (exact sizes)", "cpmeta.broadcast.plan", "Plan.check_tensors"),
    ("D ring write (copy+publish)", "cpmeta.transport._ring_io", "RingIO.write"),
    ("D ring reserve", "cpmeta.transport._ring_io", "RingIO.reserve"),
    ("D ring commit (publish)", "cpmeta.transport._ring_io", "RingIO.commit"),
    ("D wake syscall", "cpmeta.transport._ring_io", "futex_wake"),
    ("D liveness poll", "cpmeta.transport._ring_io", "RingIO._check_alive_readers"),
    ("F receive (total)", "cpmeta.broadcast.broadcaster", "MetadataBroadcaster._receive"),
    ("F wait for data", "cpmeta.transport._ring_io", "RingIO._wait_data"),
    ("F decode (codec)", "cpmeta.transport.object_channel", "ObjectChannel._decode"),
    ("F copy out + views", "cpmeta.transport.object_channel", "ObjectChannel._unpack"),
    ("F check+parse frame, copy out", "cpmeta.broadcast.broadcaster", "MetadataBroadcaster._consume"),
    ("F decode (codec)", "cpmeta.transport", "decode_body"),
    ("F validate", "cpmeta.broadcast.broadcaster", "_check_message"),
    ("F validate", "cpmeta.broadcast.broadcaster", "_parse_layout"),
    ("F validate", "cpmeta.broadcast.broadcaster", "_check_packed_bounds"),
    ("F unpack views", "cpmeta.broadcast.broadcaster", "_unpack"),
    ("F unpack views", "cpmeta.broadcast.plan", "Plan.views"),
    ("F assemble InputMetadata", "cpmeta.broadcast.broadcaster", "_assemble"),
    ("F assemble InputMetadata", "cpmeta.broadcast.plan", "Plan.assemble"),
    ("P arena lookup (both)", "cpmeta.broadcast.persistent", "PersistentArenas.get"),
    ("P arena lookup (both)", "cpmeta.broadcast.persistent", "PersistentArenas.driver_arena"),
    ("P driver: tensors into the slot", "cpmeta.broadcast.persistent", "LayoutArena.write"),
    ("P driver: own copy after the publish", "cpmeta.broadcast.persistent", "LayoutArena.take"),
    ("P follower: slot into its arena", "cpmeta.broadcast.persistent", "LayoutArena.land"),
    ("P finish (H2D, restore check, values)", "cpmeta.broadcast.persistent", "LayoutArena.finish"),
]


#: set while a follower runs its warm hook: the phases' calls made by the warm are not the step's
_WARMING = [False]


def _install(log: dict[str, list[int]], marks: dict[str, int]) -> None:
    follower = importlib.import_module("cpmeta.broadcast.follower")
    pieces = follower.FollowerSide._warm_pieces

    def warm_pieces(self: Any) -> Any:  # the warm's calls stay out of the step's phases
        it = pieces(self)
        while True:
            _WARMING[0] = True
            try:
                next(it)
            except StopIteration:
                return
            finally:
                _WARMING[0] = False
            yield

    follower.FollowerSide._warm_pieces = warm_pieces
    for label, mod_name, attr in PHASES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        owner: Any = mod
        *outer, name = attr.split(".")
        for o in outer:
            owner = getattr(owner, o, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None or getattr(fn, "_profiled", False):
            continue
        setattr(owner, name, _timed(fn, label, log, marks))
    ring_io = importlib.import_module("cpmeta.transport._ring_io")
    pub = ring_io.RingIO._publish

    def publish(self: Any, head: int) -> None:
        marks["publish"] = time.perf_counter_ns()
        pub(self, head)

    ring_io.RingIO._publish = publish
    wait = ring_io.RingIO._wait_data

    def wait_data(self: Any, target: int, deadline: float) -> int:
        h = wait(self, target, deadline)
        marks.setdefault("visible", time.perf_counter_ns())
        return h

    wait_data._profiled = True  # type: ignore[attr-defined]
    ring_io.RingIO._wait_data = _timed(wait_data, "F wait for data", log, marks)


def _timed(fn: Callable, label: str, log: dict[str, list[int]], marks: dict[str, int]) -> Callable:
    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        if _WARMING[0]:
            return fn(*a, **k)
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            log.setdefault(label, []).append(time.perf_counter_ns() - t0)

    wrapper._profiled = True  # type: ignore[attr-defined]
    return wrapper


def broadcast_rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    import cpmeta
    from bench_broadcast import make_payload, step_values

    init_rank(rank, world, port, "gloo")
    _, md = make_payload(args.payload, False)
    log: dict[str, list[int]] = {}
    marks: dict[str, int] = {}
    _install(log, marks)
    bc = cpmeta.MetadataBroadcaster(src=0, timeout=120, persistent_outputs=args.persistent)
    rows = []
    dict_fields = [n for n in md.field_names() if isinstance(getattr(md, n), dict)]
    base_k = md.max_seqlen_k
    for i in range(args.warmup + args.steps):
        if rank == 0:  # the engine's build, untimed: same tensors refilled, a new md, new dicts
            step_values(md, i, base_k)
            step_md = md if args.reuse_md else md.replace(
                **{n: dict(getattr(md, n)) for n in dict_fields})
        dist.barrier()
        log.clear()
        marks.clear()
        t0 = time.perf_counter_ns()
        if rank == 0:
            if args.mode == "engine":
                time.sleep(args.park_ms * 1e-3)  # the driver schedules while followers park
                t0 = time.perf_counter_ns()
            if args.begin_step and hasattr(bc, "begin_step"):
                bc.begin_step()
                time.sleep(args.build_us * 1e-6)  # building the metadata
            bc.broadcast(step_md)
        else:
            bc.broadcast(None)
        t1 = time.perf_counter_ns()
        if i >= args.warmup:
            rows.append({"t0": t0, "t1": t1, "publish": marks.get("publish", 0),
                         "visible": marks.get("visible", 0),
                         "phases": {k: sum(v) for k, v in log.items()}})
    bc.close()
    blob = torch.tensor([[r["t0"], r["t1"], r["publish"], r["visible"]] for r in rows], dtype=torch.int64)
    gathered = [torch.empty_like(blob) for _ in range(world)]
    dist.all_gather(gathered, blob)
    labels = sorted({k for r in rows for k in r["phases"]})
    mine = {"labels": labels, "phases": [[r["phases"].get(k, 0) for k in labels] for r in rows]}
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, mine)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": per_rank, "times": [g.tolist() for g in gathered]}))
    dist.barrier()
    dist.destroy_process_group()


def _p50(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def broadcast_run(args: argparse.Namespace) -> dict[str, float]:
    """p50 (us) of every phase: the driver's (D) from rank 0, the follower's (F) from rank 1,
    persistent (P) and check (C) phases from both, and the cross-process intervals (X)."""
    got = run_world_procs(args.world, args, broadcast_rank_main)
    res: dict[str, float] = {}
    for r, data in enumerate(got["ranks"]):
        for j, k in enumerate(data["labels"]):
            if (k.startswith("D") and r == 0) or (k.startswith("F") and r == 1):
                res[k] = _p50([row[j] / 1e3 for row in data["phases"]])
            elif k.startswith(("P", "C")) and r <= 1:  # persistent phases, checks: both sides
                res[f"{k} [{'driver' if r == 0 else 'follower 1'}]"] = _p50([row[j] / 1e3 for row in data["phases"]])
    times = got["times"]
    start = [row[0] for row in times[0]]
    publish = [row[2] for row in times[0]]
    res["X wake (follower 1 sees message - driver publish)"] = _p50(
        [(times[1][i][3] - publish[i]) / 1e3 for i in range(len(start))])
    res["X follower 1 busy (done - sees message)"] = _p50(
        [(times[1][i][1] - times[1][i][3]) / 1e3 for i in range(len(start))])
    # driver call = after the park: with --begin-step it includes begin_step and --build-us
    res["X last rank done - driver call"] = _p50(
        [(max(times[r][i][1] for r in range(args.world)) - start[i]) / 1e3 for i in range(len(start))])
    res["X driver's call done - driver call"] = _p50([(times[0][i][1] - start[i]) / 1e3 for i in range(len(start))])
    for r in range(1, args.world):  # each follower: is the last one a straggler, or are all late?
        res[f"X follower {r} sees message - driver publish"] = _p50(
            [(times[r][i][3] - publish[i]) / 1e3 for i in range(len(start))])
        res[f"X follower {r} done - driver call"] = _p50([(times[r][i][1] - start[i]) / 1e3 for i in range(len(start))])
    return res


# ---- inplace: the in-place decode step's pieces ----------------------------------------------

INPLACE_DOC = """Host time of the in-place decode step from a ``BatchState``, piece by piece (issue 18 goal:
<= 50 us per step at 256 sequences including staging, H2D and replay, on the H200 host).

The step an engine runs: ``stage_decode(staging, st, slots, drafts, counts)`` (the staging
buffer written straight from the state, ONE non-blocking H2D copy, event recorded), then a
replay of the graph it captured over ``launch_decode_inplace`` (``staging.replay(g)``). Timed per
case (256 sequences, 0 / 2 drafts; the batches of ``scripts/bench_build.py``), p50 / min over
``--repeat`` steps, all pieces interleaved in each round so load hits them alike:

- ``step``: stage_decode + staging.replay(g), host time (the GPU work overlaps the next step);
- ``step_sync``: the same plus a device sync (the latency of one step);
- ``stage``: stage_decode alone (host fill + wait for the previous upload + copy enqueue);
- ``stage_host``: stage_decode into a CPU staging buffer (the numpy part: no CUDA call);
- ``upload``: ``staging.upload`` alone (stream lookup, two slices, copy_, event record);
- ``replay``: ``staging.replay(g)`` (event waits around ``g.replay()``); ``replay_bare``: ``g.replay()``;
- ``launch``: ``launch_decode_inplace`` with its cached graph (host time);
- ``step_graph_upload``: ``stage_decode(upload=False)`` + ``staging.replay_uploading(g_up)``, the
  graph captured with ``staging.upload_in_graph()`` before the kernels (the copy is a graph node);
  ``stage_fill``: the fill alone (same buffer, CUDA staging: includes the wait for the last use);
  ``replay_uploading``: the replay alone (stream lookup, ordering, ``g_up.replay()``, event record);
- the CUDA calls inside the staging's bookkeeping: ``cur_stream`` (``torch.cuda.current_stream()``),
  ``cur_stream_cached`` (the staging's ``_current_stream()``: the same ``Stream`` object while the
  current stream stays), ``event_record`` (``Event.record()``: looks the current stream up),
  ``event_record_on`` (``Event.record(stream)``, what the staging calls), ``event_sync``
  (``Event.synchronize()`` of a done event).

    python scripts/profile_phases.py inplace --out $OUT/inplace_step.json     # on the H200
    python scripts/profile_phases.py inplace --repeat 50                      # CPU smoke run
    python scripts/profile_phases.py inplace --cp --out $OUT/step.json        # + the CP driver, world 1

Cases: 0 and 2 drafts per request (counts as an array, int64 ids), and ``d2_count``: 2 drafts
given as ONE count for all requests with int32 ids (an engine with a fixed MTP depth).
Without CUDA only ``stage_host`` and ``stage`` are timed (the CUDA pieces need a GPU).
"""

def inplace_case(drafts: int, repeat: int, dev: torch.device, count: bool = False) -> dict[str, Any]:
    """``count``: the drafts as an engine with a fixed MTP depth passes them -- ONE count for all
    requests (``num_drafts=drafts``) and int32 ids -- instead of a count per request and int64 ids."""
    cfg = MetadataConfig.compressed_swa()
    seqs = decode_batch(random.Random(drafts), cfg, 256, drafts)
    bs, slots, (_, dr, nd) = _state_from(seqs, cfg, False)
    if count:
        dr, nd = dr.astype(np.int32), drafts
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cap = staging_capacity(cfg, 256, 256 * (1 + drafts))
    st = DecodeStaging(dev, cap, fixed=True)
    host_st = DecodeStaging("cpu", cap)
    out: dict[str, torch.Tensor] = {}
    prepare_decode_inplace(bs.decode_batch(slots, dr, nd), cfg, out=out, device=dev, staging=st)
    sync()
    fns: dict[str, Callable[[], Any]] = {
        "stage": lambda: stage_decode(st, bs, slots, dr, nd),
        "stage_host": lambda: stage_decode(host_st, bs, slots, dr, nd),
    }
    if cuda:
        g = capture_decode_graph(st, cfg, out=out)
        staged = stage_decode(st, bs, slots, dr, nd)

        def step() -> None:
            stage_decode(st, bs, slots, dr, nd)
            st.replay(g)

        def step_sync() -> None:
            step()
            torch.cuda.synchronize()

        g_up = capture_decode_graph(st, cfg, out=out, upload=True)  # the H2D copy inside the graph

        def step_graph_upload() -> None:  # fill only, then ONE replay that copies and runs the kernels
            st.replay_uploading(g_up, stage_decode(st, bs, slots, dr, nd, upload=False))

        ev = torch.cuda.Event()
        ev.record()
        cur = torch.cuda.current_stream()
        fns.update(step=step, step_sync=step_sync, upload=lambda: st.upload(staged), replay=lambda: st.replay(g),
                   replay_bare=g.replay, launch=lambda: launch_decode_inplace(st, cfg, out=out),
                   step_graph_upload=step_graph_upload,
                   stage_fill=lambda: stage_decode(st, bs, slots, dr, nd, upload=False),
                   replay_uploading=lambda: st.replay_uploading(g_up, staged),
                   cur_stream=torch.cuda.current_stream, event_record=ev.record, event_sync=ev.synchronize,
                   cur_stream_cached=st._current_stream, event_record_on=lambda: ev.record(cur))
    res = interleaved(fns, repeat, lambda: None)  # no sync between pieces: host time, as a loop runs
    sync()
    return {"drafts": drafts, "n_seqs": 256, "total_q": 256 * (1 + drafts), **res}


def inplace_cp_case(drafts: int, repeat: int, dev: torch.device) -> dict[str, Any]:
    """The CP driver's step at world 1 (NCCL on CUDA, else gloo), piece by piece:
    ``cp_step`` (``broadcast_state``: fill from the state + send + upload + kernels, host time),
    ``cp_step_sync`` (+ device sync: what ``bench_gpu.py cp`` measures), ``cp_fill``
    (``stage_decode(upload=False)``), ``cp_finish`` (``finish_staged``: upload + kernels) and
    ``cp_follower`` (a follower's work once the ring message is read: ``check_staged_layout``,
    ``staging.load``, upload + kernels; ``cp_follower_sync`` with the device sync)."""

    import torch.distributed as dist

    from cpmeta.gpu import StagedDecodeBroadcaster
    from cpmeta.gpu.decode_cp import check_staged_layout
    from cpmeta.gpu.decode_inplace import finish_staged

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    cfg = MetadataConfig.compressed_swa()
    seqs = decode_batch(random.Random(drafts), cfg, 256, drafts)
    bs, slots, (_, dr, nd) = _state_from(seqs, cfg, False)
    st = DecodeStaging(dev, staging_capacity(cfg, 256, 256 * (1 + drafts)), fixed=True)
    sb = StagedDecodeBroadcaster(cfg, src=0, device=dev, staging=st)
    out: dict[str, torch.Tensor] = {}
    sb.broadcast_state(bs, slots, dr, nd, out=out)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    staged = stage_decode(st, bs, slots, dr, nd, upload=False)

    def step_sync() -> None:
        sb.broadcast_state(bs, slots, dr, nd, out=out)
        sync()

    msg = st.host_buffer[:staged.used].clone()  # the ring message's tensor, as a follower receives it

    def follower() -> None:  # a follower's work once the message is in: check, load, upload + kernels
        assert check_staged_layout(msg.numpy(), staged, cfg) is None
        st.load(msg)
        finish_staged(st, staged, cfg, out=out, device=dev, backend=sb.backend)

    def follower_sync() -> None:
        follower()
        sync()

    fns = {"cp_step": lambda: sb.broadcast_state(bs, slots, dr, nd, out=out), "cp_step_sync": step_sync,
           "cp_fill": lambda: stage_decode(st, bs, slots, dr, nd, upload=False),
           "cp_finish": lambda: finish_staged(st, staged, cfg, out=out, device=dev, backend=sb.backend),
           "cp_follower": follower, "cp_follower_sync": follower_sync}
    res = interleaved(fns, repeat, lambda: None)
    sync()
    sb.close()
    return {"drafts": drafts, "n_seqs": 256, **res}


# ---- replicate: cProfile of the replicated step ----------------------------------------------

REPLICATE_DOC = """Where the replicated in-place decode step's time goes, against the staged broadcast.

One process (world 1; ``--backend nccl`` on a GPU, gloo on CPU), the batches of
``scripts/bench_gpu.py cp``: cProfile of ``--steps`` steps of ``replicate_inplace`` and
``staged_state``, the mean step time of each, and the top entries by cumulative time.

    python scripts/profile_phases.py replicate --backend nccl --steps 200
"""


def replicate_main(args: argparse.Namespace, argv: list[str]) -> int:
    import torch.distributed as dist

    from bench_gpu import ReplicateInplaceMethod, StagedStateMethod

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group(args.backend, rank=0, world_size=1)
    device = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    cfg = MetadataConfig.compressed_swa()
    seqs = decode_batch(random.Random(0), cfg, 256, 2)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for cls in (StagedStateMethod, ReplicateInplaceMethod):
        m = cls(0, device, cfg, seqs)
        for _ in range(10):
            m.step(seqs)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            m.step(seqs)
        sync()
        dt = (time.perf_counter() - t0) / args.steps * 1e6
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.steps):
            m.step(seqs)
        sync()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(args.top)
        print(f"== {cls.__name__}: {dt:.1f} us a step (mean of {args.steps})")
        print("\n".join(s.getvalue().splitlines()[6:6 + args.top + 2]))
        m.close()
    dist.destroy_process_group()
    return 0


# ---- the command --------------------------------------------------------------------------------


def build_main(args: argparse.Namespace, argv: list[str]) -> int:
    torch.set_num_threads(1)
    cfg, rng = MetadataConfig.compressed_swa(), random.Random(0)
    load0 = os.getloadavg()[0]
    res = {f"decode_256_d{d}": build_decode_phases(cfg, 256, d, args.repeat, rng) for d in (0, 2)}
    res["prompt_8x4096"] = build_prompt_phases(cfg, 8, 4096, max(args.repeat // 10, 20), rng)
    for name, ph in res.items():
        print(name)
        for k, v in ph.items():
            print(f"  {k:<18}{v['p50_us']:>9.1f} us p50 {v['min_us']:>9.1f} us min")
    if args.out:
        write_result(args.out, {"loadavg_1m_start_end": [load0, os.getloadavg()[0]], "repeat": args.repeat,
                                "results": res}, argv)
    return 0


def broadcast_main(args: argparse.Namespace, argv: list[str]) -> int:
    res = broadcast_run(args)
    print(f"world {args.world} {args.payload} mode={args.mode} begin_step={args.begin_step} "
          f"persistent={args.persistent} reuse_md={args.reuse_md} park_ms={args.park_ms} "
          f"(p50 us over {args.steps} steps, inclusive per phase)")
    for k in sorted(res):
        print(f"  {k:<52} {res[k]:8.1f}")
    if args.out:
        write_result(args.out, {"args": vars(args), "p50_us": res}, argv)
    return 0


def inplace_main(args: argparse.Namespace, argv: list[str]) -> int:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {f"decode_256_d{d}": inplace_case(d, args.repeat, dev) for d in (0, 2)}
    results["decode_256_d2_count"] = inplace_case(2, args.repeat, dev, count=True)
    if args.cp:
        results.update({f"cp_world1_d{d}": inplace_cp_case(d, args.repeat, dev) for d in (0, 2)})
    for name, r in results.items():
        print(name, "  ".join(f"{k} {v['p50_us']:.1f}/{v['min_us']:.1f}" for k, v in r.items() if isinstance(v, dict)))
    print("(p50/min us, host time; goal: step <= 50 us at 256 sequences on the H200 host)")
    if args.out:
        write_result(args.out, {"device": str(dev), "results": results}, argv)
    return 0


# ---- cold: what an idle gap costs the next call ------------------------------------------------

COLD_DOC = """What an idle gap before a call costs it, one process: p50 of each probe right after a gap.

Probes: ``njit1`` (a compiled call of one int: the dispatch alone), ``py200`` (a 200-iteration
Python loop), ``np64k`` (a numpy sum over 64 KB), ``gather`` (``BatchState.decode_batch`` of 64
sequences, plain config), ``build`` (``prepare_decode`` of that batch into reused
``OutputArenas``) and ``replay`` (a replica applying that decode step's frame:
``cpmeta.replicate.apply.apply_step``, state restored untimed). Gaps: ``sleep`` (``time.sleep``,
how a parked rank idles), ``busy`` (a Python spin on the clock: the core stays awake) and ``warm``
(the sleep, then the probe once and a 150 us spin before the timed call: what a warming follower
does, ``CPMETA_WARM``), 0 to 10 ms. A probe that costs the same after any gap is bound by its own work; one that grows with the
gap is bound by what the machine evicted meanwhile (caches, TLB, predictors) -- on the 2-core VM a
one-int compiled call goes from ~0.6 us to ~17 us after 3 ms of sleep.
"""


def cold_main(args: argparse.Namespace, argv: list[str]) -> int:
    from cpmeta.base_njit import blocks_needed_one
    from cpmeta.launch.scheduler import plain_config
    from cpmeta.replicate.apply import apply_step
    from cpmeta.replicate.ops import BLK, COLUMNS, TOK, OpLog

    cfg = plain_config()
    seqs = decode_batch(random.Random(0), cfg, 64, 0)
    st, slots, _ = _state_from(seqs, cfg, False)
    rep, _, _ = _state_from(seqs, cfg, False)
    arenas, sb = OutputArenas(), st.decode_batch(slots)
    log, rng = OpLog(64), np.random.default_rng(0)
    log.ragged(TOK, slots, np.ones(64, np.int64), rng.integers(0, 1000, 64))
    log.ragged(BLK, slots[::8].copy(), np.ones(8, np.int64), rng.integers(0, 1000, 8))
    log.batch_spec(False, slots, np.zeros(0, np.int64), np.zeros(0, np.int64), 0, True, -2)
    cols, specs, meta0 = log.pack(np.zeros((0, 4), np.int64)), list(log.specs), rep._meta.copy()
    assert len(cols.named) == len(COLUMNS)
    big = np.ones(8192)

    def replay() -> None:
        apply_step(rep, cols, [], specs)

    probes: dict[str, Callable[[], Any]] = {
        "njit1": lambda: blocks_needed_one(300, 128, 4, 1, 1),
        "py200": lambda: sum(i for i in range(200)),
        "np64k": big.sum,
        "gather": lambda: st.decode_batch(slots),
        "build": lambda: prepare_decode(sb, cfg, out=arenas),
        "replay": replay,
    }
    results: dict[str, Any] = {}
    for mode in ("sleep", "busy", "warm"):
        for gap_ms in args.gaps_ms:
            row = {}
            for name, fn in probes.items():
                for _ in range(5):
                    fn()
                ts = []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    if mode != "busy":
                        time.sleep(gap_ms / 1e3)
                    else:
                        while time.perf_counter() - t0 < gap_ms / 1e3:
                            pass
                    if mode == "warm":  # the call once, then a 150 us spin (a warming follower)
                        fn()
                        rep._meta[:] = meta0
                        t2 = time.perf_counter()
                        while time.perf_counter() - t2 < 150e-6:
                            pass
                    t1 = time.perf_counter()
                    fn()
                    ts.append((time.perf_counter() - t1) * 1e6)
                    rep._meta[:] = meta0  # the replica back where the frame applies (untimed)
                row[name] = float(np.median(ts))
            results[f"{mode}_{gap_ms:g}ms"] = row
            print(f"{mode:5s} {gap_ms:5g} ms  " + "  ".join(f"{k} {v:7.1f}" for k, v in row.items()))
    print("(p50 us of one call right after the gap)")
    if args.out:
        write_result(args.out, {"results": results}, argv)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("build", description=BUILD_DOC, formatter_class=fmt, help="host build from a BatchState")
    p.add_argument("--repeat", type=int, default=500)
    p.add_argument("--out", default="", help="JSON output path ('' = none)")

    p = sub.add_parser("broadcast", description=BROADCAST_DOC, formatter_class=fmt, help="one broadcast, both sides")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--payload", default="decode-64")
    p.add_argument("--mode", choices=("engine", "b2b"), default="engine")
    p.add_argument("--park-ms", type=float, default=3.0)
    p.add_argument("--begin-step", action="store_true", help="driver calls begin_step() first")
    p.add_argument("--build-us", type=float, default=300.0, help="driver work after begin_step")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--persistent", action="store_true", help="persistent_outputs=True")
    p.add_argument("--reuse-md", action="store_true",
                   help="the driver passes one InputMetadata object every step (refilled in place)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="", help="JSON output path ('' = none)")

    p = sub.add_parser("inplace", description=INPLACE_DOC, formatter_class=fmt, help="in-place decode step's pieces")
    p.add_argument("--repeat", type=int, default=1000)
    p.add_argument("--cp", action="store_true", help="also the CP driver's step at world 1")
    p.add_argument("--out", default="", help="JSON output path ('' = none)")

    p = sub.add_parser("replicate", description=REPLICATE_DOC, formatter_class=fmt,
                       help="cProfile: replicated in-place vs staged")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--top", type=int, default=22)

    from _harness.sync_timeline import __doc__ as sync_doc, sync_main

    p = sub.add_parser("sync", description=sync_doc, formatter_class=fmt,
                       help="ReplicatedBatchState's step as a timeline, both sides")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", choices=("plain", "seed"), default="plain")
    p.add_argument("--workload", default="decode-64")
    p.add_argument("--defer", action="store_true", help="defer_apply=True (the replicate-defer strategy)")
    p.add_argument("--park-ms", type=float, default=3.0)
    p.add_argument("--spin-us", type=float, default=None, help="CPMETA_SHM_SPIN_US for the ranks")
    p.add_argument("--split-read", action="store_true",
                   help="followers' compiled read without the replay; apply_step's call replays and builds")
    p.add_argument("--lean", action="store_true",
                   help="stamp only the publish, the compiled calls and each rank's end (what the stages cost)")
    p.add_argument("--check-every", type=int, default=64, help="ReplicatedBatchState's check_every")
    p.add_argument("--max-model-len", type=int, default=8192, help="the config's (the replica's token rows)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="", help="JSON output path ('' = none)")

    from _harness.replay_parts import __doc__ as replay_doc, replay_main

    p = sub.add_parser("replay", description=replay_doc, formatter_class=fmt,
                       help="one process: a step's calls applied, recorded, replayed")
    p.add_argument("--workload", default="prompt", choices=("decode-64", "decode-256", "mixed", "prompt"))
    p.add_argument("--model", choices=("plain", "seed"), default="plain")
    p.add_argument("--gap-ms", type=float, default=0.0, help="sleep before each timed part")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--build", action="store_true",
                   help="a follower's whole step (replay and build), its compiled calls alone, and the step replayed then built")
    p.add_argument("--out", default="", help="JSON output path ('' = none)")

    p = sub.add_parser("cold", description=COLD_DOC, formatter_class=fmt, help="what an idle gap costs a call")
    p.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 0.3, 1, 3, 10])
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--out", default="", help="JSON output path ('' = none)")

    args = ap.parse_args(argv)
    run = {"build": build_main, "broadcast": broadcast_main, "inplace": inplace_main,
           "replicate": replicate_main, "cold": cold_main, "sync": sync_main, "replay": replay_main}[args.cmd]
    return run(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
