"""Benchmark the transport package against the torch.distributed calls a user would otherwise use.

Usage: ``python scripts/bench_transport.py [--quick] [--out docs/benchmarks/transport.json]``

Measured in one run, on real processes (gloo, one host):

1. object broadcast latency, ``ObjectChannel.broadcast`` vs ``broadcast_object_list``, payload
   256 B .. 4 MiB, 1..3 readers;
2. a decode-like list of 25 CPU tensors (~300 KB): ``TensorChannel.broadcast`` (one coalesced
   gloo collective) vs one ``dist.broadcast`` per tensor vs ``ObjectChannel.broadcast_packed``
   (tensors inside the shared-memory message);
3. the packed-vs-collective threshold: one tensor of 1 KiB .. 4 MiB, packed in the ring message
   vs ``TensorChannel``.

Latency = time from the source starting the call until the LAST follower holds the result
(``time.perf_counter_ns`` is CLOCK_MONOTONIC, shared by the processes of one host); every
iteration starts after a barrier and a 2 ms busy pause of the source (it stays warm, like a
driver building metadata), so messages never queue and followers are measured waking from their
wait. p50/p90 over iterations.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from cpmeta.transport import ObjectChannel, TensorChannel
from bench_meta import run_meta  # noqa: E402  (scripts/bench_meta.py: the run block)

SIZES = [256, 4096, 65536, 1 << 20, 4 << 20]
QUICK_SIZES = [256, 4096, 65536, 1 << 20]
THRESHOLD_SIZES = [1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
SETTLE_S = 2e-3  # source pause after each barrier: followers have left it and are waiting
DECODE_ROWS = 512  # rows of the decode-like payload
DECODE_BLOCKS = 128  # block-table columns (int32): 512 * 128 * 4 B = 256 KiB


def _iters(size: int, quick: bool) -> int:
    base = 40 if quick else 200
    return max(10, base // 8) if size >= (1 << 20) else base


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _latency(rank: int, iters: int, step: Callable[[int], int]) -> tuple[float, float]:
    """Run ``step(t0)`` ``iters`` times (after a barrier each); ``step`` returns the t0 the
    follower saw. Returns (p50, p90) in µs of the slowest follower per iteration (rank 0)."""
    lat = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters + 3):
        dist.barrier()
        if rank == 0:  # busy, like a driver building metadata (a sleep would cool its caches)
            end = time.perf_counter() + SETTLE_S
            while time.perf_counter() < end:
                pass
        t0 = time.perf_counter_ns()
        seen = step(t0)
        if i >= 3 and rank != 0:
            lat[i - 3] = (time.perf_counter_ns() - seen) / 1e3
    dist.all_reduce(lat, op=dist.ReduceOp.MAX)
    xs = lat.tolist()
    return _pct(xs, 0.5), _pct(xs, 0.9)


def _bench_objects(rank: int, quick: bool, ch: ObjectChannel) -> list[dict]:
    rows = []
    for size in (QUICK_SIZES if quick else SIZES):
        blob = os.urandom(size)
        ids = list(range(64))

        def ours(t0: int) -> int:
            obj = ch.broadcast({"t0": t0, "ids": ids, "blob": blob} if rank == 0 else None)
            return obj["t0"]

        def torch_bol(t0: int) -> int:
            box = [{"t0": t0, "ids": ids, "blob": blob} if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            return box[0]["t0"]

        n = _iters(size, quick)
        p50, p90 = _latency(rank, n, ours)
        b50, b90 = _latency(rank, n, torch_bol)
        rows.append({"size": size, "iters": n, "channel_p50_us": p50, "channel_p90_us": p90,
                     "bol_p50_us": b50, "bol_p90_us": b90, "speedup_p50": b50 / p50})
    return rows


def _decode_like() -> list[torch.Tensor]:
    """25 tensors shaped like a decode step's metadata, ~300 KB in all."""
    r = DECODE_ROWS
    ts = [torch.zeros(1, dtype=torch.int64)]  # slot for t0
    ts.append(torch.randint(0, 1000, (r, DECODE_BLOCKS), dtype=torch.int32))  # block_tables
    ts += [torch.randint(0, 1 << 20, (r,), dtype=torch.int32) for _ in range(14)]
    ts += [torch.randint(0, 1 << 20, (r, 2), dtype=torch.int32) for _ in range(4)]
    ts += [torch.ones(r, dtype=torch.bool) for _ in range(2)]
    ts += [torch.randint(0, 9, (r + 1,), dtype=torch.int32) for _ in range(3)]
    return ts


def _tensor_methods(rank: int, ch: ObjectChannel, tc: TensorChannel,
                    ts: list[torch.Tensor]) -> dict[str, Callable[[int], int]]:
    specs = [(t.dtype, tuple(t.shape)) for t in ts]

    def coalesced(t0: int) -> int:
        ts[0][0] = t0
        return int(tc.broadcast(ts if rank == 0 else specs)[0][0])

    def per_tensor(t0: int) -> int:
        ts[0][0] = t0
        bufs = ts if rank == 0 else [torch.empty(s, dtype=d) for d, s in specs]
        for b in bufs:
            dist.broadcast(b, src=0)
        return int(bufs[0][0])

    def packed(t0: int) -> int:
        ts[0][0] = t0
        return int(ch.broadcast_packed(None, ts if rank == 0 else None)[1][0][0])

    return {"tensor_channel": coalesced, "per_tensor_broadcast": per_tensor, "packed_in_ring": packed}


def _bench_tensors(rank: int, quick: bool, ch: ObjectChannel, tc: TensorChannel) -> dict:
    ts = _decode_like()
    n = 30 if quick else 200
    out: dict[str, Any] = {"num_tensors": len(ts), "bytes": sum(t.numel() * t.element_size() for t in ts)}
    for name, fn in _tensor_methods(rank, ch, tc, ts).items():
        p50, p90 = _latency(rank, n, fn)
        out[name] = {"p50_us": p50, "p90_us": p90}
    out["speedup_p50_vs_per_tensor"] = out["per_tensor_broadcast"]["p50_us"] / out["tensor_channel"]["p50_us"]
    return out


def _bench_threshold(rank: int, quick: bool, ch: ObjectChannel, tc: TensorChannel) -> list[dict]:
    rows = []
    for size in THRESHOLD_SIZES:
        ts = [torch.zeros(1, dtype=torch.int64), torch.randint(0, 255, (size,), dtype=torch.uint8)]
        m = _tensor_methods(rank, ch, tc, ts)
        n = _iters(size, quick)
        pk, _ = _latency(rank, n, m["packed_in_ring"])
        co, _ = _latency(rank, n, m["tensor_channel"])
        rows.append({"size": size, "packed_p50_us": pk, "tensor_channel_p50_us": co})
    return rows


def _worker(rank: int, world: int, port: int, quick: bool, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ch = ObjectChannel(None, 0)
    tc = TensorChannel(None, 0)
    res: dict[str, Any] = {"readers": world - 1, "objects": _bench_objects(rank, quick, ch),
                           "tensors": _bench_tensors(rank, quick, ch, tc)}
    if world == 3:
        res["threshold"] = _bench_threshold(rank, quick, ch, tc)
    ch.close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(res, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, quick: bool, tmp_dir: str) -> dict:
    path = os.path.join(tmp_dir, f"bench_{world}.json")
    tmp.spawn(_worker, args=(world, _free_port(), quick, path), nprocs=world, join=True)
    with open(path) as f:
        return json.load(f)


def _print(results: list[dict]) -> None:
    print(f"{'readers':>7} {'size':>9} {'channel p50/p90 µs':>20} {'bcast_object_list p50/p90 µs':>29} {'x':>6}")
    for r in results:
        for o in r["objects"]:
            print(f"{r['readers']:>7} {o['size']:>9} {o['channel_p50_us']:>9.0f}/{o['channel_p90_us']:<9.0f} "
                  f"{o['bol_p50_us']:>14.0f}/{o['bol_p90_us']:<14.0f} {o['speedup_p50']:>6.1f}")
    print(f"\n{'readers':>7} {'tensor_channel':>15} {'per_tensor':>11} {'packed_in_ring':>15} {'x':>6}  (p50 µs)")
    for r in results:
        t = r["tensors"]
        print(f"{r['readers']:>7} {t['tensor_channel']['p50_us']:>15.0f} {t['per_tensor_broadcast']['p50_us']:>11.0f} "
              f"{t['packed_in_ring']['p50_us']:>15.0f} {t['speedup_p50_vs_per_tensor']:>6.1f}")
    for r in results:
        for row in r.get("threshold", []):
            print(f"threshold (2 readers) size {row['size']:>8}: packed {row['packed_p50_us']:>8.0f} µs, "
                  f"tensor channel {row['tensor_channel_p50_us']:>8.0f} µs")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    ap.add_argument("--out", default="docs/benchmarks/transport.json")
    ap.add_argument("--max-readers", type=int, default=3)
    args = ap.parse_args(argv)
    tmp_dir = os.path.dirname(os.path.abspath(args.out)) or "."
    os.makedirs(tmp_dir, exist_ok=True)
    results = [_run(r + 1, args.quick, tmp_dir) for r in range(1, args.max_readers + 1)]
    for r in range(1, args.max_readers + 1):
        os.unlink(os.path.join(tmp_dir, f"bench_{r + 1}.json"))
    _print(results)
    doc = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "python": platform.python_version(), "torch": torch.__version__,
                       "load_avg_at_end": os.getloadavg()},
           "results": results, "run": run_meta(argv)}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
