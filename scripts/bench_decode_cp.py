#!/usr/bin/env python
"""CP decode step: one staging broadcast + kernels on every rank, against broadcasting built metadata.

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

    python scripts/bench_decode_cp.py --worlds 1 2 3                      # CPU / gloo
    python scripts/bench_decode_cp.py --backend nccl --worlds 1           # one GPU, NCCL
    python scripts/bench_decode_cp.py --device cuda --worlds 2 3          # gloo ranks sharing cuda:0
    python scripts/bench_decode_cp.py --methods staged_state --worlds 2   # one method
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_meta import run_meta  # noqa: E402  (scripts/bench_meta.py: the run block)

from bench_broadcast import Method, init_rank, latency_us, run_world_procs, time_cell  # noqa: E402  (same timing protocol)
from bench_build import _state_from, decode_batch  # noqa: E402  (same batches and states as the builders' bench)

TARGET_US = 150.0
METHODS = ("staged", "staged_state", "replicate_inplace", "bcast")


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


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
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


def run_world(world: int, args: argparse.Namespace) -> list[dict]:
    return run_world_procs(world, args, rank_main)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="gloo ranks: cpu, or all on cuda:0")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--n-seqs", type=int, default=256)
    ap.add_argument("--drafts", type=int, default=0)
    ap.add_argument("--np-tables", action="store_true", help="block tables as int32 numpy arrays")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--budget", type=float, default=20.0, help="seconds per (world, method) cell")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 sequences, 10 steps")
    ap.add_argument("--out", default="", help="JSON output path ('' = none)")
    args = ap.parse_args(argv)
    if args.quick:
        args.n_seqs, args.steps, args.warmup, args.budget = 16, 10, 2, 5.0
    results: list[dict] = []
    for w in args.worlds:
        results += run_world(w, args)
    print(f"\n{'world':>5} {'backend':>8} {'device':>7} " + " ".join(f"{m + ' p50':>16}" for m in args.methods)
          + f"   (us, {args.n_seqs} seqs, goal staged(_state) <= {TARGET_US:.0f})")
    for w in args.worlds:
        cells = {r["method"]: r for r in results if r["world"] == w}
        print(f"{w:>5} {args.backend:>8} {args.device:>7} "
              + " ".join(f"{cells[m]['p50_us']:16.1f}" for m in args.methods if m in cells))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "run": run_meta(argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "torch": torch.__version__, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
