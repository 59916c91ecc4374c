#!/usr/bin/env python
"""GPU decode: one command, a sub-command per question (every one also runs on a CPU-only machine,
as a smoke run of the script rather than a measurement).

    python scripts/bench_gpu.py inplace --out $OUT/h200_inplace.json       # in-place decode step vs build + copy
    python scripts/bench_gpu.py cp --backend nccl --worlds 1                # CP decode step: staged / replicated / broadcast
    python scripts/bench_gpu.py cp --device cuda --worlds 2 3               #   gloo ranks sharing cuda:0
    python scripts/bench_gpu.py overlap --device cuda --streams 2 --forward-us 300   # overlapped vs serial loop
    python scripts/bench_gpu.py sharing --procs 1 2 3 --out $OUT/h200_gpu_sharing.json  # one GPU, N processes
    python scripts/bench_gpu.py slots --out $OUT/h200_slot_mapping.json     # slot mapping: Triton vs torch
    python scripts/bench_gpu.py inplace --quick --out ''                    # CPU smoke run

``python scripts/bench_gpu.py SUB --help`` describes what a sub-command times. Every result file
carries the run block of ``scripts/_harness/bench_meta.py`` (the shared harness: timers, JSON writer);
the multi-rank ones (``cp``, ``overlap``) use ``scripts/bench_broadcast.py``'s process group
set-up and step clock (``init_rank``, ``run_world_procs``, ``time_cell``).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_broadcast import Method, init_rank, run_world_procs, time_cell  # noqa: E402  (same clock and ranks)
from bench_build import _state_from, decode_batch  # noqa: E402  (same batches as the builders' bench)
from _harness.bench_meta import latency_us, time_us, write_result  # noqa: E402  (scripts/_harness/bench_meta.py: the harness)
from cpmeta import MetadataConfig, SequenceBatch  # noqa: E402
from cpmeta.builders.decode import prepare_decode  # noqa: E402
from cpmeta.cp.slot_mapping import compute_slot_mapping  # noqa: E402
from cpmeta.cp.slot_mapping_groups import KVCacheGroup, compute_slot_mapping_groups  # noqa: E402
from cpmeta.diff import metadata_diff  # noqa: E402
from cpmeta.gpu import slot_mapping_triton as tri  # noqa: E402
from cpmeta.gpu.decode_inplace import (  # noqa: E402
    DecodeStaging, capture_decode_graph, launch_decode_inplace, prepare_decode_inplace, staging_capacity,
)
from cpmeta.gpu.decode_staging import stage_decode  # noqa: E402
from cpmeta.gpu.staging_layout import unpack_staging  # noqa: E402

logger = logging.getLogger("bench_gpu")



# ---- inplace: the in-place decode step -------------------------------------------------------

INPLACE_DOC = """In-place decode metadata (issue 12) against the eager CPU builder + ONE coalesced H2D copy.

Per case (64 / 256 sequences, 0 / 2 MTP drafts, default ``MetadataConfig``: block 128, ratios
(4,), max_model_len 8192, ``seqlen_k`` uniform in ``[1 + d, 8192]``; the batches of
``scripts/bench_build.py``) it times, p50 / p90 over ``--repeat`` steps:

- ``eager_copy``: ``prepare_decode(seqs, cfg, out=arena)`` where every output tensor is a view of
  ONE pinned host arena, then ONE ``copy_(non_blocking=True)`` of the arena to the device and a
  sync -- the best case of "build on the CPU, then copy" (no packing step);
- ``inplace``: ``prepare_decode_inplace(seqs, cfg, out=out, device=dev, staging=st)`` and a sync
  (validation + staging + ONE H2D copy + the two kernels), i.e. the per-step latency;
- ``inplace_cpu``: the same call without the sync (host time per step; the GPU work overlaps);
- breakdown: ``stage`` (validate + fill + copy enqueue), ``from_sequences``
  (``SequenceBatch.from_sequences`` alone: reading the ``SequenceMetadata`` objects), ``kernels``
  (``launch_decode_inplace``: cached graph replay of the two kernels, synced), ``kernels_cpu``
  (the same, host time only) and ``graph_replay`` (a bare ``CUDAGraph.replay`` of the kernels);
- ``from_arrays``: staging from a validated ``SequenceBatch`` + copy + kernels + sync, i.e. a step
  when the scheduler hands over per-sequence arrays instead of Python objects;
- ``from_state`` / ``from_state_cpu``: the batch from a ``BatchState`` (issue 18) then
  ``prepare_decode_inplace``, synced / host time only (goal: <= 50 us host time at 256
  sequences); ``state_staging_fill``: ``BatchState.decode_batch`` + the staging fill alone;
  ``state_stage_decode``: ``BatchState.stage_decode`` (the staging written straight from the
  state arrays + the checks + the copy enqueue, no ``SequenceBatch``), host time, to compare with
  ``state_staging_fill`` + the copy; ``from_state_fast_cpu``: ``stage_decode`` then
  ``launch_decode_inplace`` (the cached graph replay), host time of the whole step.

``decode_256_d0_np`` repeats the 256-sequence case with block tables held as int32 numpy arrays
(reading ~8k Python ints out of lists dominates the host time otherwise).

On a machine without CUDA everything runs on the CPU (the torch emulation of the kernels; no
copy): ``--quick`` makes that a smoke run. JSON to ``--out``, a table on stdout.

    python scripts/bench_gpu.py inplace --out $OUT/inplace.json      # on the H200
    python scripts/bench_gpu.py inplace --quick --out ''              # CPU smoke run
"""

INPLACE_TARGET_US = 50.0  # per step at 256 sequences, incl. staging (H200)
INPLACE_TARGET_SPEEDUP = 3.0  # against eager + copy


def _arena(schema: dict[str, torch.Tensor], pin: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One uint8 host arena and an ``out`` dict of views into it shaped like ``schema``'s buffers
    (the decode ``out=`` schema: per-ratio fields stacked)."""
    flat = schema
    align = 16
    sizes = {k: -(-v.numel() * v.element_size() // align) * align for k, v in flat.items()}
    arena = torch.empty(sum(sizes.values()), dtype=torch.uint8, pin_memory=pin)
    out, off = {}, 0
    for k, v in flat.items():
        nbytes = v.numel() * v.element_size()
        out[k] = arena[off:off + nbytes].view(v.dtype).view(v.shape)
        off += sizes[k]
    return arena, out


def _eager_copy_fn(seqs: list, cfg: MetadataConfig, dev: torch.device) -> Callable[[], Any]:
    cuda = dev.type == "cuda"
    schema: dict[str, torch.Tensor] = {}
    prepare_decode(seqs, cfg, out=schema)
    arena, out = _arena(schema, pin=cuda)
    dev_arena = torch.empty_like(arena, device=dev) if cuda else None

    def step() -> None:
        prepare_decode(seqs, cfg, out=out)
        if dev_arena is not None:
            dev_arena.copy_(arena, non_blocking=True)
            torch.cuda.synchronize()

    return step


def _graph_fn(st: DecodeStaging, cfg: MetadataConfig, out: dict) -> Optional[Callable[[], Any]]:
    """The two kernels captured in a CUDA graph (replay + sync), or None without CUDA."""
    if st.device.type != "cuda":
        return None
    g = capture_decode_graph(st, cfg, out=out)

    def replay() -> None:
        g.replay()
        torch.cuda.synchronize()

    return replay


def inplace_case(n: int, drafts: int, dev: torch.device, repeat: int, rng: random.Random,
             np_tables: bool = False) -> dict[str, Any]:
    cfg = MetadataConfig.compressed_swa()
    seqs = decode_batch(rng, cfg, n, drafts)
    if np_tables:  # an engine that keeps block tables as int32 arrays: one np.concatenate
        for s in seqs:
            s.block_table = np.asarray(s.block_table, dtype=np.int32)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    st = DecodeStaging(dev, staging_capacity(cfg, n, n * (1 + drafts)))
    out: dict[str, torch.Tensor] = {}
    md = prepare_decode_inplace(seqs, cfg, out=out, device=dev, staging=st)
    sync()
    diff = metadata_diff(md, prepare_decode(seqs, cfg), cfg=cfg)
    if diff:
        raise AssertionError(f"in-place result differs from prepare_decode: {diff}")

    def inplace() -> None:
        prepare_decode_inplace(seqs, cfg, out=out, device=dev, staging=st)
        sync()

    res: dict[str, Any] = {"n_seqs": n, "drafts": drafts, "total_q": md.total_q, "device": str(dev),
                           "block_tables": "numpy int32" if np_tables else "list"}
    res["eager_copy"] = time_us(_eager_copy_fn(seqs, cfg, dev), repeat)
    res["inplace"] = time_us(inplace, repeat)
    res["inplace_cpu"] = time_us(lambda: prepare_decode_inplace(seqs, cfg, out=out, device=dev, staging=st),
                                 repeat)
    sync()
    res["stage"] = time_us(lambda: st.stage(seqs, cfg), repeat)
    res["kernels"] = time_us(lambda: launch_decode_inplace(st, cfg, out=out), repeat, sync=cuda)
    res["kernels_cpu"] = time_us(lambda: launch_decode_inplace(st, cfg, out=out), repeat)
    sync()
    b = SequenceBatch.from_sequences(seqs, cfg, is_prompt=False)  # validated once: its checks are skipped

    def from_arrays() -> None:  # what a step costs when the scheduler hands over arrays
        st.upload(st.fill(b, cfg))
        launch_decode_inplace(st, cfg, out=out)
        sync()

    res["from_arrays"] = time_us(from_arrays, repeat)
    bs, slots, (_, drafts_, nd) = _state_from(seqs, cfg, False)  # issue 18: the batch from a BatchState

    def from_state() -> None:  # the whole step of an engine keeping a BatchState
        prepare_decode_inplace(bs.decode_batch(slots, drafts_, nd), cfg, out=out, device=dev, staging=st)
        sync()

    res["from_state"] = time_us(from_state, repeat)
    res["from_state_cpu"] = time_us(  # host time: batch + staging fill + copy enqueue + replay launch
        lambda: prepare_decode_inplace(bs.decode_batch(slots, drafts_, nd), cfg, out=out, device=dev, staging=st),
        repeat)
    sync()
    res["state_staging_fill"] = time_us(lambda: st.fill(bs.decode_batch(slots, drafts_, nd), cfg), repeat)
    sync()
    ref = st.stage(bs.decode_batch(slots, drafts_, nd), cfg)
    ref_batch = unpack_staging(st.host_buffer[:ref.used].numpy().copy(), ref, cfg)
    sync()
    got = stage_decode(st, bs, slots, drafts_, nd)
    got_batch = unpack_staging(st.host_buffer[:got.used].numpy(), got, cfg)
    if got._replace(used=0) != ref._replace(used=0) or ref_batch["sizes"] != got_batch["sizes"] or not all(
            np.array_equal(x, y) for k in ("seq", "ids") for x, y in [(ref_batch[k], got_batch[k])]) or not all(
            np.array_equal(x, y) for x, y in zip(ref_batch["tables"], got_batch["tables"])):
        raise AssertionError("BatchState.stage_decode staged another batch than decode_batch + stage")
    sync()
    res["state_stage_decode"] = time_us(lambda: stage_decode(st, bs, slots, drafts_, nd), repeat)
    sync()

    def from_state_fast() -> None:  # host time: staging straight from the state + copy + replay launch
        stage_decode(st, bs, slots, drafts_, nd)
        launch_decode_inplace(st, cfg, out=out)

    res["from_state_fast_cpu"] = time_us(from_state_fast, repeat)
    sync()
    res["from_sequences"] = time_us(lambda: SequenceBatch.from_sequences(seqs, cfg, is_prompt=False), repeat)
    replay = _graph_fn(st, cfg, out)
    if replay is not None:
        res["graph_replay"] = time_us(replay, repeat)
    res["speedup"] = res["eager_copy"]["p50_us"] / res["inplace"]["p50_us"]
    return res


def inplace_table(results: dict[str, dict[str, Any]]) -> str:
    cols = ("eager_copy", "inplace", "inplace_cpu", "stage", "from_sequences", "kernels", "kernels_cpu",
            "graph_replay", "from_arrays", "from_state", "from_state_cpu", "state_staging_fill",
            "state_stage_decode", "from_state_fast_cpu")
    head = f"{'case':<17}{'rows':>6}" + "".join(f"{c:>19}" for c in cols) + f"{'speedup':>9}"
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        vals = "".join(f"{r[c]['p50_us']:>19.1f}" if c in r else f"{'-':>19}" for c in cols)
        lines.append(f"{name:<17}{r['total_q']:>6}{vals}{r['speedup']:>8.2f}x")
    lines.append(f"(p50 us; goal on the H200: inplace p50 < {INPLACE_TARGET_US:.0f} us at 256 seqs and "
                 f">= {INPLACE_TARGET_SPEEDUP:.0f}x eager_copy)")
    return "\n".join(lines)


# ---- cp: the CP decode step on every rank ----------------------------------------------------

CP_DOC = """CP decode step: one staging broadcast + kernels on every rank, against broadcasting built metadata.

Per world size, a decode batch of ``--n-seqs`` sequences (``scripts/bench_build.py``'s batches:
``MetadataConfig.compressed_swa()``, ``seqlen_k`` uniform in ``[1, 8192]``), every step timed as

    latency = max over ranks (time the rank holds its metadata, device synced) - (driver call)

(the clock and barrier protocol of ``scripts/bench_broadcast.py``'s ``time_cell``). Methods:

  staged     ``StagedDecodeBroadcaster.broadcast(seqs, out=out)``: the driver validates and stages
             (a few KB of int32), ONE ring message, every rank uploads it and runs the kernels (or
             the cached graph of them on CUDA) into its own preallocated buffers
  staged_state
             ``StagedDecodeBroadcaster.broadcast_state(state, slots, drafts, counts, out=out)``:
             as ``staged``, but the driver keeps the batch in a ``BatchState`` (filled once from
             the same sequences, untimed: ``bench_build._state_from``) and stages straight from
             its arrays (``stage_decode(upload=False)``); followers still ``broadcast(None)``
  replicate_inplace
             every rank keeps the requests in a ``ReplicatedBatchState``; the driver records the
             step's ``decode_batch``, ``sync()`` sends only that spec, every rank stages from its
             own replica (``stage_decode``) and runs the kernels: no metadata or staging moved
  bcast      ``MetadataBroadcaster.broadcast(prepare_decode(seqs, cfg))``: the driver builds on
             the CPU, ~20 tensors travel (in the ring message; on CUDA + NCCL one collective)

``staged`` and ``bcast`` include the driver's reading of the ``SequenceMetadata`` objects
(``--np-tables`` holds the block tables as int32 numpy arrays, the cheaper input); ``staged_state``
is the engine that keeps its batch as arrays (DESIGN 13). Goal (issue 18 item 3): ``staged`` /
``staged_state`` <= 150 us at 256 sequences, world 1 NCCL and 2-3 gloo ranks (16-core host).

    python scripts/bench_gpu.py cp --worlds 1 2 3                      # CPU / gloo
    python scripts/bench_gpu.py cp --backend nccl --worlds 1           # one GPU, NCCL
    python scripts/bench_gpu.py cp --device cuda --worlds 2 3          # gloo ranks sharing cuda:0
    python scripts/bench_gpu.py cp --methods staged_state --worlds 2   # one method
"""

CP_TARGET_US = 150.0
CP_METHODS = ("staged", "staged_state", "replicate_inplace", "bcast")


class StagedMethod(Method):
    def __init__(self, rank: int, device: torch.device, cfg: Any, seqs: list) -> None:
        super().__init__(rank, device, None)
        from cpmeta.gpu import DecodeStaging, StagedDecodeBroadcaster, staging_capacity

        n, tq = len(seqs), sum(s.seqlen_q for s in seqs)
        self.cfg, self.out = cfg, {}
        st = DecodeStaging(device, staging_capacity(cfg, n, tq), fixed=True)
        self.sb = StagedDecodeBroadcaster(cfg, src=0, device=device, staging=st)
        self.sb.broadcast(seqs if rank == 0 else None, out=self.out)  # allocate + compile + capture

    def step(self, seqs: Any) -> Any:
        return self.sb.broadcast(seqs, out=self.out)

    def close(self) -> None:
        self.sb.close()


class StagedStateMethod(StagedMethod):
    """``staged`` with the driver's batch in a ``BatchState``: ``broadcast_state`` each step."""

    def __init__(self, rank: int, device: torch.device, cfg: Any, seqs: list) -> None:
        super().__init__(rank, device, cfg, seqs)  # same buffers, warmed by one seqs broadcast
        if rank == 0:
            self.state, self.slots, (_, self.drafts, self.nd) = _state_from(seqs, cfg, False)

    def step(self, seqs: Any) -> Any:
        if seqs is None:  # followers: unchanged
            return self.sb.broadcast(None, out=self.out)
        return self.sb.broadcast_state(self.state, self.slots, self.drafts, self.nd, out=self.out)


class ReplicateInplaceMethod(Method):
    """Nothing built moves: every rank keeps the requests (``ReplicatedBatchState``, filled once
    from the same sequences, untimed), the driver records ``decode_batch`` and ``sync()`` sends
    the step, every rank stages it straight from ITS replica (``stage_decode`` at ``rep.spec``)
    and runs the kernels (or the cached graph) into its own buffers."""

    def __init__(self, rank: int, device: torch.device, cfg: Any, seqs: list) -> None:
        super().__init__(rank, device, None)
        import cpmeta
        from cpmeta.gpu import DecodeStaging, stage_decode, staging_capacity
        from cpmeta.gpu.decode_inplace import finish_staged, resolve_backend

        n, tq = len(seqs), sum(s.seqlen_q for s in seqs)
        self.cfg, self.out, self.finish, self.stage = cfg, {}, finish_staged, stage_decode
        self.backend = resolve_backend("auto", device)  # Triton on CUDA, the emulation on CPU
        self.staging = DecodeStaging(device, staging_capacity(cfg, n, tq), fixed=True)
        self.rep = cpmeta.ReplicatedBatchState(cfg, n, device=device, timeout=120)
        if rank == 0:
            for i, s in enumerate(seqs):
                self.rep.add_request(i, s.token_ids, s.block_table, s.state_id, num_computed=len(s.token_ids),
                                     swa_valid_start=s.swa_valid_start)
            self.slots = np.arange(n)
            self.drafts = np.array([t for s in seqs for t in s.draft_tokens], np.int64)
            self.nd = np.array([len(s.draft_tokens) for s in seqs])
        self.rep.sync()  # the requests travel once, untimed
        self.step(seqs if rank == 0 else None)  # allocate + compile + capture

    def step(self, seqs: Any) -> Any:
        rep = self.rep
        if seqs is not None:
            rep.decode_batch(self.slots, self.drafts, self.nd)
        rep.sync()
        spec = rep.spec
        staged = self.stage(self.staging, rep.state, spec.slots, spec.draft_tokens, spec.num_drafts,
                            upload=False)  # finish_staged uploads
        return self.finish(self.staging, staged, self.cfg, out=self.out, device=self.device, backend=self.backend)

    def close(self) -> None:
        self.rep.close()


class BcastMethod(Method):
    def __init__(self, rank: int, device: torch.device, cfg: Any) -> None:
        super().__init__(rank, device, None)
        import cpmeta

        self.cfg, self.prepare_decode = cfg, cpmeta.prepare_decode
        self.mb = cpmeta.MetadataBroadcaster(src=0, device=device)

    def step(self, seqs: Any) -> Any:
        return self.mb.broadcast(self.prepare_decode(seqs, self.cfg) if seqs is not None else None)

    def close(self) -> None:
        self.mb.close()


def cp_rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    import torch.distributed as dist
    from cpmeta import MetadataConfig

    device = init_rank(rank, world, port, args.backend, cuda_with_gloo=args.device == "cuda")
    cfg = MetadataConfig.compressed_swa()
    seqs = decode_batch(random.Random(args.seed), cfg, args.n_seqs, args.drafts)
    if args.np_tables:
        for s in seqs:
            s.block_table = np.asarray(s.block_table, dtype=np.int32)
    results = []
    for name in args.methods:
        method = (BcastMethod(rank, device, cfg) if name == "bcast" else
                  {"staged_state": StagedStateMethod, "replicate_inplace": ReplicateInplaceMethod}.get(
                      name, StagedMethod)(rank, device, cfg, seqs))
        lat = sorted(time_cell(method, seqs, args.steps, args.warmup, args.budget))
        method.close()
        if rank == 0:
            r = {"world": world, "backend": args.backend, "device": str(device), "method": name,
                 "n_seqs": args.n_seqs, "drafts": args.drafts, "np_tables": args.np_tables, "n": len(lat),
                 **latency_us(lat)}
            results.append(r)
            print(f"  world={world} {args.backend}/{device.type} {name:>12}: p50 {r['p50_us']:8.1f} us  "
                  f"p90 {r['p90_us']:8.1f} us", flush=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# ---- overlap: the overlapped loop ------------------------------------------------------------

OVERLAP_DOC = """Overlap: exposed metadata time per step, the overlapped loop vs the serial loop (issue 32 item 4).

Every rank runs a "forward" of each step that reads the step's broadcast metadata:

    serial       driver builds step N, broadcast N (every rank), forward(N) to completion, next
    overlapped   forward(N) launched, then the driver builds and broadcasts step N+1 while it
                 runs; the rank then waits for forward(N). Needs the result of step N to survive
                 step N+1's broadcast: ``persistent_outputs=2`` ("valid until the broadcast
                 after next"), or fresh tensors

The forward is, on CUDA, a matmul loop on the current stream (``--forward-us`` long, calibrated)
and, without CUDA, a thread that sleeps that long (an asynchronous device: the CPU is free while it
runs). It ENDS by taking a checksum of every tensor of its step's metadata (on the device), so a
broadcast that overwrote step N while forward(N) ran shows as a wrong step; every rank compares its
checksums with the driver's checksums of what it sent. Exposed metadata time per step = the step's
wall time minus the forward alone (measured on the rank before the loop). ``--streams 2`` (CUDA)
runs each step on the other of two streams, so the device copy of step N+1 must wait for step N's
kernels on another stream (the arena's event).

    python scripts/bench_gpu.py overlap                      # CPU: world 2, sleep forward
    python scripts/bench_gpu.py overlap --device cuda --streams 2 --forward-us 300
    python scripts/bench_gpu.py overlap --cells serial:1 overlap:2 overlap:1   # depth 1 overlapped: wrong

JSON (``--out``): the run block (command, date, machine, commit), then one row per cell.
"""

_AS_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
           torch.float64: torch.int64}


def checksum(md: Any) -> torch.Tensor:
    """int64 scalar on ``md``'s device: sum over its distinct tensors (path order) of
    ``(i + 1) * sum(bits)``, floats read as integers of their size (exact on every device)."""
    total, seen = None, set()
    for _, t in md.tensors():
        if id(t) in seen:
            continue
        seen.add(id(t))
        bits = t.view(_AS_INT[t.dtype]) if t.dtype in _AS_INT else t
        s = bits.to(torch.int64).sum() * (len(seen))
        total = s if total is None else total + s
    assert total is not None
    return total


class Forward:
    """The step's "forward": ``launch(md, n)`` starts it (async), ``wait()`` blocks until done;
    its last act writes ``checksum(md)`` into ``sums[n]``."""

    def __init__(self, device: torch.device, forward_us: float, steps: int) -> None:
        self.device, self.us = device, forward_us
        self.sums = torch.zeros(steps, dtype=torch.int64, device=device)
        self._thread: Optional[threading.Thread] = None
        self._event: Any = None
        if device.type == "cuda":
            self._x = torch.randn(512, 512, device=device)
            self._y = torch.empty_like(self._x)
            self.reps = self._calibrate()

    def _matmuls(self, k: int) -> None:
        for _ in range(k):
            torch.mm(self._x, self._x, out=self._y)

    def _calibrate(self) -> int:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._matmuls(20)
        start.record()
        self._matmuls(200)
        end.record()
        end.synchronize()
        per_us = start.elapsed_time(end) * 1e3 / 200
        return max(1, round(self.us / per_us))

    def launch(self, md: Any, n: int) -> None:
        if self.device.type == "cuda":
            self._matmuls(self.reps)
            self.sums[n].copy_(checksum(md))
            self._event = torch.cuda.Event()
            self._event.record()
            return

        def run() -> None:
            time.sleep(self.us * 1e-6)
            self.sums[n] = checksum(md)
        self._thread = threading.Thread(target=run)
        self._thread.start()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        if self._thread is not None:
            self._thread.join()
        self._event = self._thread = None

    def alone_s(self, md: Any, reps: int = 20) -> float:
        """Seconds of one forward by itself (median of ``reps``)."""
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            self.launch(md, 0)
            self.wait()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[reps // 2]


def run_loop(bc: Any, rank: int, steps: int, make: Callable[[int], Any], fwd: Forward,
             overlapped: bool, streams: int = 1) -> tuple[list[float], list[int]]:
    """Every rank: ``steps`` steps (driver: ``make(n)`` builds step n), serial or overlapped;
    returns (this rank's step wall times, the driver's checksums of what it sent)."""
    cuda = fwd.device.type == "cuda"
    pool = [torch.cuda.Stream(fwd.device) for _ in range(streams)] if cuda and streams > 1 else []
    sent: list[Any] = []  # the driver's steps (fresh objects: the builders allocate per call)

    def bcast(n: int) -> Any:
        md = make(n) if rank == 0 else None
        if md is not None:
            sent.append(md)
        if pool:
            with torch.cuda.stream(pool[n % len(pool)]):
                return bc.broadcast(md)
        return bc.broadcast(md)

    def launch(md: Any, n: int) -> None:
        if pool:
            with torch.cuda.stream(pool[n % len(pool)]):
                fwd.launch(md, n)
        else:
            fwd.launch(md, n)

    times = []
    md = bcast(0) if overlapped else None
    for n in range(steps):
        t0 = time.perf_counter()
        if overlapped:
            launch(md, n)
            md = bcast(n + 1) if n + 1 < steps else None
        else:
            launch(bcast(n), n)
        fwd.wait()
        times.append(time.perf_counter() - t0)
    return times, [int(checksum(md)) for md in sent]


def decode_steps(n_seqs: int) -> Callable[[int], Any]:
    """``make(step)``: the seed config's decode metadata of ``n_seqs`` sequences at ``step`` (each
    sequence one token longer per step), built by ``prepare_decode``: a fixed batch size, so every
    step has one layout (an engine padding to a captured size) and fresh tensors."""
    import cpmeta
    from cpmeta.launch.scheduler import default_config

    cfg = default_config()
    base = [300 + 37 * i for i in range(n_seqs)]
    tokens = [[(7 * t + i) % 30000 + 1 for t in range(k + 4096)] for i, k in enumerate(base)]
    width = cpmeta.blocks_needed(cfg.max_model_len, cfg)

    def make(step: int) -> Any:
        seqs = [cpmeta.SequenceMetadata(
            seqlen_q=1, seqlen_k=k + step, state_id=i, token_ids=tokens[i][:k + step], swa_valid_start=0,
            block_table=list(range(i * width, i * width + cpmeta.blocks_needed(k + step, cfg))))
            for i, k in enumerate(base)]
        return cpmeta.prepare_decode(seqs, cfg)
    return make


def overlap_cell(rank: int, device: torch.device, args: argparse.Namespace, mode: str, depth: int) -> dict:
    import torch.distributed as dist

    import cpmeta

    steps = args.steps + 1  # (+1: the overlapped loop builds one step ahead)
    make = decode_steps(args.decode_seqs)
    fwd = Forward(device, args.forward_us, steps)
    alone = fwd.alone_s(make(0).to(device))
    with cpmeta.MetadataBroadcaster(src=0, device=device, timeout=args.timeout,
                                    persistent_outputs=depth, metrics=True) as bc:
        times, sent = run_loop(bc, rank, steps, make, fwd, mode == "overlap", args.streams)
        st = bc.stats()
    want = torch.tensor(sent if rank == 0 else [0] * steps, dtype=torch.int64)
    if dist.get_backend() == "nccl":  # a plain NCCL group moves CUDA tensors only
        want = want.to(device)
    dist.broadcast(want, src=0)
    want, got = want.cpu(), fwd.sums.cpu()
    wrong = int((got != want).sum())
    timed = sorted(times[args.warmup:])
    step_s = sum(timed) / len(timed)
    return {"rank": rank, "mode": mode, "depth": depth, "forward_us": alone * 1e6,
            "step_us": step_s * 1e6, "step_p50_us": timed[len(timed) // 2] * 1e6,
            "exposed_us": (step_s - alone) * 1e6, "wrong_steps": wrong, "steps": steps,
            "bcast_land_p50_us": st.land.p50 * 1e6,
            "bcast_first_p50_us": (st.send if rank == 0 else st.wait).p50 * 1e6}


def overlap_rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    import torch.distributed as dist

    device = init_rank(rank, world, port, "nccl" if args.device == "nccl" else "gloo",
                       cuda_with_gloo=args.device == "cuda")
    rows = []
    for cell in args.cells:
        mode, depth = cell.split(":")
        rows.append(overlap_cell(rank, device, args, mode, int(depth)))
        dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out_path).write_text(json.dumps([r for rs in gathered for r in rs]))
    dist.barrier()
    dist.destroy_process_group()


def overlap_table(rows: list[dict]) -> None:
    print(f"{'mode':>8} {'depth':>5} {'rank':>4} {'forward us':>10} {'step us':>9} "
          f"{'exposed us':>10} {'wrong':>5}")
    for r in rows:
        print(f"{r['mode']:>8} {r['depth']:>5} {r['rank']:>4} {r['forward_us']:>10.0f} "
              f"{r['step_us']:>9.0f} {r['exposed_us']:>10.0f} {r['wrong_steps']:>5}")
    print("(exposed = step wall time - the forward alone; wrong = steps whose forward read "
          "metadata other than what the driver sent)")


# ---- sharing: one GPU, several processes -----------------------------------------------------

SHARING_DOC = """What sharing ONE GPU between processes costs a synchronised step (where the time of a CP group
of gloo ranks on one GPU goes).

``--procs N`` processes run at the same time, with no communication between them, each in a loop
for ``--seconds``; every step is timed from its start to its device sync:

  step   the in-place decode step of one rank: ``stage_decode(staging, state, ..., upload=False)``
         + ``staging.replay_uploading(g)`` (ONE graph replay: the H2D copy and both kernels,
         ``scripts/profile_phases.py inplace``'s ``step_graph_upload``) + ``torch.cuda.synchronize()``
  tiny   one 1-element ``add_`` + ``torch.cuda.synchronize()``: the floor of any step that waits
         for the GPU

With one process these are the in-place step's latency and a launch + sync round trip; with two
or three, each process's step also waits while the GPU runs the other processes' contexts (time
slicing, no MPS). A CP group with one GPU per rank does not pay that. Results: p50 / p90 of every
process's steps pooled, per (procs, method).

    python scripts/bench_gpu.py sharing --procs 1 2 3 --out $OUT/gpu_sharing.json     # on the H200
    python scripts/bench_gpu.py sharing --procs 1 2 --seconds 1                        # CPU smoke run

Without CUDA both methods run on the CPU (the torch emulation of the kernels, no sync): a smoke
run of the script, not a measurement of GPU sharing.
"""

SHARING_METHODS = ("step", "tiny")


def _sharing_step_fn(method: str, dev: torch.device) -> Callable[[], None]:
    """The function a process times (built and warmed up before the start barrier)."""
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if method == "tiny":
        x = torch.zeros(1, device=dev)

        def tiny() -> None:
            x.add_(1)
            sync()

        return tiny
    cfg = MetadataConfig.compressed_swa()
    seqs = decode_batch(random.Random(0), cfg, 256, 0)
    bs, slots, (_, dr, nd) = _state_from(seqs, cfg, False)
    st = DecodeStaging(dev, staging_capacity(cfg, 256, 256), fixed=True)
    out: dict[str, torch.Tensor] = {}
    prepare_decode_inplace(bs.decode_batch(slots, dr, nd), cfg, out=out, device=dev, staging=st)
    if cuda:
        g = capture_decode_graph(st, cfg, out=out, upload=True)

        def step() -> None:
            st.replay_uploading(g, stage_decode(st, bs, slots, dr, nd, upload=False))
            sync()
    else:
        def step() -> None:
            stage_decode(st, bs, slots, dr, nd)
            launch_decode_inplace(st, cfg, out=out, backend="torch")

    return step


def _sharing_proc(rank: int, method: str, seconds: float, barrier: Any, q: Any) -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fn = _sharing_step_fn(method, dev)
    for _ in range(20):
        fn()
    barrier.wait()
    lat: list[float] = []
    end = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        if t0 > end:
            break
        fn()
        lat.append(time.perf_counter() - t0)
    q.put((rank, lat))


def sharing_run(procs: int, method: str, seconds: float) -> dict[str, Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_sharing_proc, args=(r, method, seconds, barrier, q)) for r in range(procs)]
    for p in ps:
        p.start()
    got = [q.get(timeout=seconds + 300) for _ in ps]
    for p in ps:
        p.join(60)
    if any(p.exitcode != 0 for p in ps):
        raise SystemExit(f"procs={procs} {method}: exit codes {[p.exitcode for p in ps]}")
    pooled = sorted(x for _, lat in got for x in lat)
    return {"procs": procs, "method": method, "n": len(pooled), **latency_us(pooled),
            "per_proc_p50_us": [float(np.median(lat) * 1e6) for _, lat in sorted(got)]}


# ---- slots: the slot mapping kernel ----------------------------------------------------------

SLOTS_DOC = """Slot mapping: the Triton kernel against ``backend="torch"`` (the compiled CPU kernel).

    python scripts/bench_gpu.py slots --out $OUT/slot.json          # on the GPU machine
    python scripts/bench_gpu.py slots --out /tmp/slot.json --quick  # CPU smoke run

For 1, 64 and 256 requests x 8192 and 65536 tokens, in two layouts (``plain``: block 16, no CP;
``cp``: the seed's cp=2, interleave=128, block=128, rank 1), it measures per call:

* ``gpu_us``  -- Triton only: device time, the call (with ``error_out``, so no host sync) captured
  once in a CUDA graph, replayed ``--repeat`` times between CUDA events, mean per replay
  (``backend="torch"`` runs on host copies of CUDA tensors: nothing to capture);
* ``call_us`` -- what an eager caller waits: one default call (data checks + the one 4-byte
  readback that turns a failed check into a ValueError), p50 of wall time;
* on CPU tensors only ``call_us`` of the torch path.

``--groups``: several KV-cache groups (full attention, block 16; sliding window, block 64;
a third with block 128 in a 256-token KV block) in ONE ``compute_slot_mapping_groups`` call
(one Triton launch on CUDA) against one ``compute_slot_mapping`` call per group, same timings;
rows ``layout=groups3``.

It also checks the Triton output against the CPU torch path (itself tested against the per-token
reference in tests/) on ``--cases`` random layouts and on every benchmarked batch. JSON goes to
``--out``; a short table is printed. Without CUDA or triton only the torch path runs.
"""

REQUESTS = (1, 64, 256)
TOKENS = (8192, 65536)
LAYOUTS: dict[str, dict[str, Any]] = {
    "plain": dict(block_size=16),
    "cp": dict(block_size=128, cp_world_size=2, cp_rank=1, cp_interleave=128),
}
MAX_CONTEXT = 32768  # tokens already cached before a request's chunk
MAX_BLOCK_ID = 1 << 20
TAIL_PAD = 512  # max_num_tokens = num_tokens + TAIL_PAD
#: (block_size, kv_cache_block_size, cp_world_size, cp_interleave, circular) of the random
#: equality cases: every branch, a few compiled variants (sizes are compile-time constants).
EQUALITY_CONFIGS: tuple[tuple[int, int, int, int, bool], ...] = (
    (16, 16, 1, 1, False), (1, 1, 1, 1, False), (128, 128, 1, 1, False), (16, 16, 1, 1, True),
    (128, 128, 2, 128, False), (16, 16, 2, 1, False), (16, 64, 4, 16, False), (64, 256, 3, 128, False),
    (1, 4, 8, 2, False),
)


def make_batch(num_reqs: int, num_tokens: int, layout: dict[str, Any], rng: random.Random,
               device: str) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """Chunks of consecutive positions after a random cached context; random block ids."""
    cuts = sorted(rng.sample(range(1, num_tokens), num_reqs - 1)) if num_reqs > 1 else []
    lens = [b - a for a, b in zip([0, *cuts], [*cuts, num_tokens])]
    starts = [rng.randint(0, MAX_CONTEXT) for _ in lens]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, lens)])
    bs = layout["block_size"]
    width = -(-(MAX_CONTEXT + num_tokens) // bs)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    table = torch.randint(0, MAX_BLOCK_ID, (num_reqs, width), dtype=torch.int32, generator=g)
    kw = {k: v for k, v in layout.items() if k != "block_size"}
    kw.update(block_size=bs, max_num_tokens=num_tokens + TAIL_PAD)
    return tuple(t.to(device) for t in (qsl, positions, table)), kw


def call(tensors: tuple[torch.Tensor, ...], kw: dict[str, Any], **extra: Any) -> torch.Tensor:
    qsl, pos, bt = tensors
    kw = dict(kw)
    bs = kw.pop("block_size")
    return compute_slot_mapping(qsl, pos, bt, bs, **kw, **extra)


def wall_us(fn: Callable[[], Any], repeat: int, cuda: bool) -> float:
    """p50 wall time of ``fn`` in microseconds (synchronized per call on CUDA; no warm-up)."""
    return time_us(fn, repeat, warmup=0, sync=cuda)["p50_us"]


def graph_us(fn: Callable[[], Any], repeat: int) -> float:
    """Mean device time per call: ``fn`` captured once in a CUDA graph, replayed ``repeat`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up (Triton compile, allocator) outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeat


def bench_one(name: str, layout: dict[str, Any], num_reqs: int, num_tokens: int, args: argparse.Namespace,
              use_triton: bool, cuda: bool, rng: random.Random) -> dict[str, Any]:
    cpu_tensors, kw = make_batch(num_reqs, num_tokens, layout, rng, "cpu")
    tile, warps = tri.choose_tile(num_tokens, num_reqs)
    row: dict[str, Any] = dict(layout=name, num_reqs=num_reqs, num_tokens=num_tokens, tile=tile, num_warps=warps)
    expected = call(cpu_tensors, kw)
    row["cpu_torch_call_us"] = wall_us(lambda: call(cpu_tensors, kw), args.cpu_repeat, False)
    if not cuda:
        return row
    gpu = tuple(t.cuda() for t in cpu_tensors)
    backends = ["torch"] + (["triton"] if use_triton else [])
    for backend in backends:
        out = torch.empty(kw["max_num_tokens"], dtype=torch.int32, device="cuda")
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        row[f"{backend}_equal"] = bool(torch.equal(call(gpu, kw, backend=backend).cpu(), expected))
        if backend == "triton":  # backend="torch" is the compiled CPU kernel on host copies: no graph to capture
            row["triton_gpu_us"] = graph_us(lambda: call(gpu, kw, backend=backend, out=out, error_out=err),
                                            args.repeat)
            row["triton_errors"] = int(err.item())
        row[f"{backend}_call_us"] = wall_us(lambda: call(gpu, kw, backend=backend), args.repeat, True)
    return row


GROUPS: tuple[tuple[int, int], ...] = ((16, 16), (64, 64), (128, 256))  # (block_size, kv block)


def bench_groups(num_reqs: int, num_tokens: int, args: argparse.Namespace, use_triton: bool, cuda: bool,
                 rng: random.Random) -> dict[str, Any]:
    """Fused groups call vs one call per group (same requests, one table per group)."""
    (qsl, pos, _), _ = make_batch(num_reqs, num_tokens, dict(block_size=16), rng, "cpu")
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    groups = [KVCacheGroup(torch.randint(0, MAX_BLOCK_ID, (num_reqs, -(-(MAX_CONTEXT + num_tokens) // bs)),
                                         dtype=torch.int32, generator=g), bs, kvb) for bs, kvb in GROUPS]
    mnt = num_tokens + TAIL_PAD
    row: dict[str, Any] = dict(layout=f"groups{len(groups)}", num_reqs=num_reqs, num_tokens=num_tokens)

    def fused(q: torch.Tensor, p: torch.Tensor, gs: list, **kw: Any) -> torch.Tensor:
        return compute_slot_mapping_groups(q, p, gs, max_num_tokens=mnt, **kw)

    def split(q: torch.Tensor, p: torch.Tensor, gs: list, **kw: Any) -> list:
        return [compute_slot_mapping(q, p, x.block_table, x.block_size, max_num_tokens=mnt,
                                     kv_cache_block_size=x.kv_cache_block_size, **kw) for x in gs]

    expected = torch.stack(split(qsl, pos, groups))
    row["fused_equal_cpu"] = bool(torch.equal(fused(qsl, pos, groups), expected))
    row["cpu_torch_call_us"] = wall_us(lambda: fused(qsl, pos, groups), args.cpu_repeat, False)
    row["cpu_torch_split_call_us"] = wall_us(lambda: split(qsl, pos, groups), args.cpu_repeat, False)
    if not (cuda and use_triton):
        return row
    q, p = qsl.cuda(), pos.cuda()
    gg = [KVCacheGroup(x.block_table.cuda(), x.block_size, x.kv_cache_block_size) for x in groups]
    out = torch.empty(len(gg), mnt, dtype=torch.int32, device="cuda")
    outs = [out[i] for i in range(len(gg))]
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    row["triton_equal"] = bool(torch.equal(fused(q, p, gg).cpu(), expected))
    row["triton_gpu_us"] = graph_us(lambda: fused(q, p, gg, out=out, error_out=err), args.repeat)
    row["triton_split_gpu_us"] = graph_us(lambda: [compute_slot_mapping(
        q, p, x.block_table, x.block_size, max_num_tokens=mnt, kv_cache_block_size=x.kv_cache_block_size,
        out=o, error_out=err) for x, o in zip(gg, outs)], args.repeat)
    row["triton_call_us"] = wall_us(lambda: fused(q, p, gg), args.repeat, True)
    row["triton_split_call_us"] = wall_us(lambda: split(q, p, gg), args.repeat, True)
    row["triton_errors"] = int(err.item())
    return row


def random_equality(cases: int, rng: random.Random) -> dict[str, Any]:
    """Triton vs the CPU torch path on small random layouts of every branch."""
    mismatches: list[dict[str, Any]] = []
    for i in range(cases):
        bs, kvb, world, inter, circular = rng.choice(EQUALITY_CONFIGS)
        num_reqs = rng.randint(0, 8)
        lens = [rng.randint(0, 3000) for _ in range(num_reqs)]
        pos_parts = []
        for n in lens:
            if rng.random() < 0.25:  # scattered positions exercise the out-of-window loads
                pos_parts.append(torch.randint(-5 if circular else 0, 20000, (n,)))
            else:
                s = rng.randint(0, 20000)
                pos_parts.append(torch.arange(s, s + n))
        positions = torch.cat(pos_parts) if pos_parts else torch.zeros(0, dtype=torch.int64)
        qsl = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
        width = int(positions.clamp(min=0).max()) // bs + 2 if positions.numel() else 1
        table = torch.randint(0, MAX_BLOCK_ID, (num_reqs + 1, width), dtype=torch.int32)
        kw = dict(block_size=bs, max_num_tokens=int(qsl[-1]) + rng.randint(0, 3000), kv_cache_block_size=kvb,
                  cp_world_size=world, cp_rank=rng.randrange(world), cp_interleave=inter, circular=circular,
                  pad_id=rng.choice([-1, 0]))
        cpu = call((qsl, positions, table), kw)
        gpu = call(tuple(t.cuda() for t in (qsl, positions, table)), kw, backend="triton").cpu()
        if not torch.equal(cpu, gpu):
            mismatches.append(dict(case=i, **{k: v for k, v in kw.items()}))
    return dict(cases=cases, mismatches=len(mismatches), first_mismatches=mismatches[:5])


def slots_table(rows: list[dict[str, Any]]) -> None:
    cols = ["layout", "num_reqs", "num_tokens", "triton_gpu_us", "torch_gpu_us", "triton_call_us",
            "torch_call_us", "cpu_torch_call_us"]
    if rows and rows[0]["layout"].startswith("groups"):
        cols = ["layout", "num_reqs", "num_tokens", "triton_gpu_us", "triton_split_gpu_us", "triton_call_us",
                "triton_split_call_us", "cpu_torch_call_us", "cpu_torch_split_call_us"]
    print(" | ".join(f"{c:>17}" for c in cols))
    for r in rows:
        cells = [r.get(c, "-") for c in cols]
        print(" | ".join(f"{c:>17.1f}" if isinstance(c, float) else f"{c!s:>17}" for c in cells))


# ---- the command --------------------------------------------------------------------------------


def _device(name: Optional[str]) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def inplace_main(args: argparse.Namespace, argv: list[str]) -> int:
    torch.set_num_threads(1)
    dev = _device(args.device)
    repeat = args.repeat or (10 if args.quick else 300)
    rng = random.Random(args.seed)
    results = {}
    for n in (64, 256):
        for d in (0, 2):
            name = f"decode_{n}_d{d}"
            results[name] = inplace_case(n, d, dev, repeat, rng)
            logger.info("%s: inplace p50 %.1f us, eager+copy p50 %.1f us", name,
                        results[name]["inplace"]["p50_us"], results[name]["eager_copy"]["p50_us"])
    results["decode_256_d0_np"] = inplace_case(256, 0, dev, repeat, rng, np_tables=True)
    print(inplace_table(results))
    if args.out:
        write_result(args.out, {"device": str(dev), "threads": torch.get_num_threads(), "repeat": repeat,
                                "targets": {"inplace_p50_us_256": INPLACE_TARGET_US, "speedup": INPLACE_TARGET_SPEEDUP},
                                "results": results}, argv)
    return 0


def cp_main(args: argparse.Namespace, argv: list[str]) -> int:
    if args.quick:
        args.n_seqs, args.steps, args.warmup, args.budget = 16, 10, 2, 5.0
    results: list[dict] = []
    for w in args.worlds:
        results += run_world_procs(w, args, cp_rank_main)
    print(f"\n{'world':>5} {'backend':>8} {'device':>7} " + " ".join(f"{m + ' p50':>16}" for m in args.methods)
          + f"   (us, {args.n_seqs} seqs, goal staged(_state) <= {CP_TARGET_US:.0f})")
    for w in args.worlds:
        cells = {r["method"]: r for r in results if r["world"] == w}
        print(f"{w:>5} {args.backend:>8} {args.device:>7} "
              + " ".join(f"{cells[m]['p50_us']:16.1f}" for m in args.methods if m in cells))
    if args.out:
        write_result(args.out, {"results": results}, argv)
    return 0


def overlap_main(args: argparse.Namespace, argv: list[str]) -> int:
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.forward_us is None:
        args.forward_us = 10000.0 if args.device == "cpu" else 300.0
    rows = run_world_procs(args.world, args, overlap_rank_main)
    if args.out:
        write_result(args.out, {"device": args.device, "world": args.world, "forward_us": args.forward_us,
                                "decode_seqs": args.decode_seqs, "rows": rows}, argv)
    overlap_table(rows)
    return 0 if not any(r["wrong_steps"] for r in rows if r["mode"] == "serial" or r["depth"] > 1) else 1


def sharing_main(args: argparse.Namespace, argv: list[str]) -> int:
    results = []
    for method in args.methods:
        for n in args.procs:
            r = sharing_run(n, method, args.seconds)
            results.append(r)
            print(f"procs={n} {method:>5}: p50 {r['p50_us']:8.1f} us  p90 {r['p90_us']:8.1f} us  "
                  f"({r['n']} steps; per process p50 {', '.join(f'{x:.0f}' for x in r['per_proc_p50_us'])})",
                  flush=True)
    if args.out:
        write_result(args.out, {"device": str(_device(None)), "results": results}, argv)
    return 0


def slots_main(args: argparse.Namespace, argv: list[str]) -> int:
    if args.quick:
        args.repeat, args.cpu_repeat, args.cases = 10, 3, 20
    cuda = torch.cuda.is_available()
    use_triton = cuda and tri.triton_available()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    if args.groups:
        rows = [bench_groups(r, t, args, use_triton, cuda, rng) for r in REQUESTS for t in TOKENS]
    else:
        rows = [bench_one(name, layout, r, t, args, use_triton, cuda, rng)
                for name, layout in LAYOUTS.items() for r in REQUESTS for t in TOKENS]
    report: dict[str, Any] = dict(cuda=cuda, device=torch.cuda.get_device_name() if cuda else "cpu",
                                  cpu_threads=torch.get_num_threads(), tile_tiers=tri.TILE_TIERS, results=rows)
    if use_triton and not args.groups:
        report["random_equality"] = random_equality(args.cases, rng)
    if args.out:
        write_result(args.out, report, argv)
    slots_table(rows)
    if args.groups:
        ok = all(r["fused_equal_cpu"] and r.get("triton_equal", True) and not r.get("triton_errors")
                 for r in rows)
        print(f"fused groups equal to per-group calls on every batch: {ok}")
        return 0 if ok else 1
    if use_triton:
        eq = report["random_equality"]
        bench_ok = all(r.get("triton_equal", True) and r.get("torch_equal", True) for r in rows)
        print(f"triton vs CPU: {eq['cases'] - eq['mismatches']}/{eq['cases']} random cases equal; "
              f"benchmark batches equal: {bench_ok}")
        return 0 if eq["mismatches"] == 0 and bench_ok else 1
    print("no CUDA/triton: torch path on CPU only")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("inplace", description=INPLACE_DOC, formatter_class=fmt, help="in-place decode step")
    p.add_argument("--quick", action="store_true", help="few repeats (CPU smoke run)")
    p.add_argument("--repeat", type=int, default=None, help="timed steps per measurement (default 300, quick 10)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="JSON output path ('' = none)")

    p = sub.add_parser("cp", description=CP_DOC, formatter_class=fmt, help="CP decode step on every rank")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="gloo ranks: cpu, or all on cuda:0")
    p.add_argument("--methods", nargs="+", choices=CP_METHODS, default=list(CP_METHODS))
    p.add_argument("--n-seqs", type=int, default=256)
    p.add_argument("--drafts", type=int, default=0)
    p.add_argument("--np-tables", action="store_true", help="block tables as int32 numpy arrays")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--budget", type=float, default=20.0, help="seconds per (world, method) cell")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 16 sequences, 10 steps")
    p.add_argument("--out", default="", help="JSON output path ('' = none)")

    p = sub.add_parser("overlap", description=OVERLAP_DOC, formatter_class=fmt, help="overlapped vs serial loop")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "nccl"), default="auto",
                   help="cpu: sleep forward; cuda: ranks share cuda:0 over gloo; nccl: a GPU per rank")
    p.add_argument("--cells", nargs="+", default=["serial:1", "overlap:2"],
                   help="mode:depth (mode serial or overlap; depth: persistent_outputs=depth)")
    p.add_argument("--forward-us", type=float, default=None,
                   help="forward length (default: 300 on CUDA, 10000 for the CPU sleep)")
    p.add_argument("--decode-seqs", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--streams", type=int, default=1, help="CUDA: steps alternate over this many streams")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="", help="JSON output path ('' = none)")

    p = sub.add_parser("sharing", description=SHARING_DOC, formatter_class=fmt, help="one GPU, N processes")
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--methods", nargs="+", choices=SHARING_METHODS, default=list(SHARING_METHODS))
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--out", default="", help="JSON output path ('' = none)")

    p = sub.add_parser("slots", description=SLOTS_DOC, formatter_class=fmt, help="slot mapping kernel")
    p.add_argument("--out", default="", help="JSON output path ('' = none)")
    p.add_argument("--repeat", type=int, default=200, help="GPU timing iterations")
    p.add_argument("--cpu-repeat", type=int, default=20, help="CPU timing iterations")
    p.add_argument("--cases", type=int, default=200, help="random equality cases (GPU only)")
    p.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", action="store_true", help="fused KV-cache groups vs one call per group")

    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run = {"inplace": inplace_main, "cp": cp_main, "overlap": overlap_main, "sharing": sharing_main,
           "slots": slots_main}[args.cmd]
    return run(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
