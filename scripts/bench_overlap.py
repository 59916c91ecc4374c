"""Overlap: exposed metadata time per step, the overlapped loop vs the serial loop (issue 32 item 4).

Every rank runs a "forward" of each step that reads the step's broadcast metadata:

    serial       driver builds step N, broadcast N (every rank), forward(N) to completion, next
    overlapped   forward(N) launched, then the driver builds and broadcasts step N+1 while it
                 runs; the rank then waits for forward(N). Needs the result of step N to survive
                 step N+1's broadcast: ``PersistentPolicy(depth=2)`` ("valid until the broadcast
                 after next"), or fresh tensors

The forward is, on CUDA, a matmul loop on the current stream (``--forward-us`` long, calibrated)
and, without CUDA, a thread that sleeps that long (an asynchronous device: the CPU is free while it
runs). It ENDS by taking a checksum of every tensor of its step's metadata (on the device), so a
broadcast that overwrote step N while forward(N) ran shows as a wrong step; every rank compares its
checksums with the driver's checksums of what it sent. Exposed metadata time per step = the step's
wall time minus the forward alone (measured on the rank before the loop). ``--streams 2`` (CUDA)
runs each step on the other of two streams, so the device copy of step N+1 must wait for step N's
kernels on another stream (the arena's event).

    python scripts/bench_overlap.py                        # CPU: world 2, sleep forward
    python scripts/bench_overlap.py --device cuda --streams 2 --forward-us 300
    python scripts/bench_overlap.py --cells serial:1 overlap:2 overlap:1   # depth 1 overlapped: wrong

JSON (``--out``): the run block (command, date, machine, commit), then one row per cell.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_broadcast import init_rank, run_world_procs  # noqa: E402
from bench_meta import run_meta  # noqa: E402  (scripts/bench_meta.py: the run block)

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


def _cell(rank: int, device: torch.device, args: argparse.Namespace, mode: str, depth: int) -> dict:
    import torch.distributed as dist

    import cpmeta
    from cpmeta.broadcast import PersistentPolicy

    steps = args.steps + 1  # (+1: the overlapped loop builds one step ahead)
    make = decode_steps(args.decode_seqs)
    fwd = Forward(device, args.forward_us, steps)
    alone = fwd.alone_s(make(0).to(device))
    with cpmeta.MetadataBroadcaster(src=0, device=device, timeout=args.timeout,
                                    persistent_outputs=PersistentPolicy(depth=depth), metrics=True) as bc:
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


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    import torch.distributed as dist

    device = init_rank(rank, world, port, "nccl" if args.device == "nccl" else "gloo",
                       cuda_with_gloo=args.device == "cuda")
    rows = []
    for cell in args.cells:
        mode, depth = cell.split(":")
        rows.append(_cell(rank, device, args, mode, int(depth)))
        dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out_path).write_text(json.dumps([r for rs in gathered for r in rs]))
    dist.barrier()
    dist.destroy_process_group()


def print_table(rows: list[dict]) -> None:
    print(f"{'mode':>8} {'depth':>5} {'rank':>4} {'forward us':>10} {'step us':>9} "
          f"{'exposed us':>10} {'wrong':>5}")
    for r in rows:
        print(f"{r['mode']:>8} {r['depth']:>5} {r['rank']:>4} {r['forward_us']:>10.0f} "
              f"{r['step_us']:>9.0f} {r['exposed_us']:>10.0f} {r['wrong_steps']:>5}")
    print("(exposed = step wall time - the forward alone; wrong = steps whose forward read "
          "metadata other than what the driver sent)")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "nccl"), default="auto",
                   help="cpu: sleep forward; cuda: ranks share cuda:0 over gloo; nccl: a GPU per rank")
    p.add_argument("--cells", nargs="+", default=["serial:1", "overlap:2"],
                   help="mode:depth (mode serial or overlap; depth of PersistentPolicy)")
    p.add_argument("--forward-us", type=float, default=None,
                   help="forward length (default: 300 on CUDA, 10000 for the CPU sleep)")
    p.add_argument("--decode-seqs", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--streams", type=int, default=1, help="CUDA: steps alternate over this many streams")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=str(ROOT / "docs/benchmarks/overlap.json"))
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.forward_us is None:
        args.forward_us = 10000.0 if args.device == "cpu" else 300.0
    rows = run_world_procs(args.world, args, rank_main)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"run": run_meta(argv), "device": args.device, "world": args.world,
                               "forward_us": args.forward_us, "decode_seqs": args.decode_seqs,
                               "rows": rows}, indent=1))
    print_table(rows)
    print(f"json: {out}")
    return 0 if not any(r["wrong_steps"] for r in rows if r["mode"] == "serial"
                        or r["depth"] > 1) else 1


if __name__ == "__main__":
    sys.exit(main())
