"""What naming the stalled follower costs: the process-group path's point-to-point sends (one
per follower, each its own work handle: gloo's "receiver ready" notice is the acknowledgement
word) against the gloo broadcast they replaced, in the same processes, rounds alternated.

    python tests/reliability_remote_cost.py [--worlds 2 3 4] [--steps 300] [--rounds 5]

Per world and frame size (1 KiB; 41 KiB = a decode-64 metadata frame; 256 KiB; 2.4 MiB = a
prompt-32k frame) it prints p50 microseconds per step over the rounds for ``new`` (this tree's
``transport._dist.bcast_frame``: head + rest point-to-point) and ``old`` (the broadcast
``bcast_frame`` of commit 92d6f17: the head, then the rest, in two async gloo broadcasts waited
with the timeout), and new / old. A step = the source's call returns and every follower holds
the frame (a barrier-free loop: the source runs ahead at most one step). A measurement helper,
not a test (no timed assertion anywhere): docs/reliability.md quotes its output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from multiproc import run_ranks  # noqa: E402

SIZES = (1024, 41 * 1024, 256 * 1024, 2_400_000)
INLINE = 8192  # transport._dist.REMOTE_INLINE_BYTES


def _old_bcast_frame(frame: Any, src: int, group: Any, timeout_s: float) -> Any:
    """The replaced algorithm (92d6f17): a [data | length] head broadcast, then the rest."""
    import struct

    import torch
    import torch.distributed as dist

    from cpmeta.transport.coalesce import tensor_memoryview

    length = struct.Struct("<Q")

    def bcast(t: Any) -> None:
        dist.broadcast(t, src=src, group=group, async_op=True).wait(timedelta(seconds=timeout_s))

    head = torch.empty(INLINE + 8, dtype=torch.uint8)
    if frame is not None:
        n = frame.numel()
        length.pack_into(tensor_memoryview(head), INLINE, n)
        head[:min(n, INLINE)] = frame[:INLINE]
        bcast(head)
        if n > INLINE:
            bcast(frame[INLINE:])
        return frame
    bcast(head)
    (n,) = length.unpack_from(tensor_memoryview(head), INLINE)
    if n <= INLINE:
        return head[:n]
    out = torch.empty(n, dtype=torch.uint8)
    out[:INLINE] = head[:INLINE]
    bcast(out[INLINE:])
    return out


def _rank(rank: int, world: int, steps: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist

    from cpmeta.transport._dist import bcast_frame

    group = dist.new_group(list(range(world)), backend="gloo")
    out: dict = {}
    for size in SIZES:
        frame = torch.zeros(size, dtype=torch.uint8) if rank == 0 else None
        n = max(10, steps * 41 * 1024 // max(size, 41 * 1024))  # fewer steps for big frames
        algos = {"new": lambda: bcast_frame(frame, 0, group, 60.0),
                 "old": lambda: _old_bcast_frame(frame, 0, group, 60.0)}
        for _ in range(rounds):
            for name, step in algos.items():
                for _ in range(5):
                    step()
                dist.barrier(group=group)
                t0 = time.perf_counter()
                for _ in range(n):
                    step()
                dist.barrier(group=group)
                out.setdefault((size, name), []).append((time.perf_counter() - t0) / n * 1e6)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} cpus={os.cpu_count()} "
          f"load={os.getloadavg()[0]:.1f}")
    print(f"{'world':>5} {'bytes':>9} {'new p50 us':>11} {'old p50 us':>11} {'new/old':>8}")
    for world in args.worlds:
        res = run_ranks(_rank, world, args.steps, args.rounds, timeout=1800)[0]
        for size in SIZES:
            new, old = (statistics.median(res[(size, k)]) for k in ("new", "old"))
            print(f"{world:>5} {size:>9} {new:>11.0f} {old:>11.0f} {new / old:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
