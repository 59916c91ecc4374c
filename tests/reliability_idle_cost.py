"""What the process-group path's heartbeat costs per message: ``bcast_frame`` of this tree (the
source posts under a lock and stamps ``Heartbeat.last``; a follower checks each head's length
for a heartbeat; one heartbeat thread per follower, period 0.75 s = timeout 3 s / 4) against
``bcast_frame`` of commit 69c8305 (before heartbeats; loaded from git), in the same processes,
message by message alternated (each on its own gloo group).

    python tests/reliability_idle_cost.py [--worlds 2 3] [--iters 300] [--rounds 4] [--bytes 41984]

A message = the source starts the call after a barrier and a 2 ms pause (the followers already
wait, as an idle engine's do) until the LAST follower holds the frame (CLOCK_MONOTONIC is shared
by the processes of one host). Prints p50 / p90 microseconds per world and algorithm, and
after / before. A measurement helper, not a test: docs/reliability.md quotes its output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from multiproc import run_ranks  # noqa: E402

BEFORE = "69c8305"  # the last commit before the heartbeat
SETTLE_S = 2e-3


def _rank(rank: int, world: int, nbytes: int, iters: int, rounds: int, old_src: str) -> dict:
    import torch
    import torch.distributed as dist

    from cpmeta.transport import _dist

    old = types.ModuleType("old_dist")
    exec(compile(old_src, f"{BEFORE}:_dist.py", "exec"), old.__dict__)
    group = dist.new_group(list(range(world)), backend="gloo")
    plain = dist.new_group(list(range(world)), backend="gloo")  # the old algorithm's: no heartbeats
    sync = dist.new_group(list(range(world)), backend="gloo")  # barriers and stamps: neither one's
    followers = list(range(1, world))
    hb = _dist.Heartbeat(group, followers, 0.75) if rank == 0 else None
    frame = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8) if rank == 0 else None
    algos = {"after": lambda: _dist.bcast_frame(frame, 0, group, 3.0, followers=followers, heartbeat=hb),
             "before": lambda: old.bcast_frame(frame, 0, plain, 3.0, followers=followers)}
    stamp = torch.zeros(1, dtype=torch.float64)
    out: dict[str, list[float]] = {}
    for n in range(rounds):
        for i in range(iters + 5):  # the two algorithms alternate message by message
            for name, step in sorted(algos.items(), reverse=(n + i) % 2 == 1):
                dist.barrier(group=sync)
                if rank == 0:
                    end = time.monotonic() + SETTLE_S
                    while time.monotonic() < end:
                        pass
                    t0 = time.monotonic()
                    step()
                    stamp[0] = t0
                else:
                    got = step()
                    stamp[0] = time.monotonic()
                    assert got.numel() == nbytes
                dist.all_reduce(stamp, op=dist.ReduceOp.MAX, group=sync)
                if rank == 0 and i >= 5:  # max over followers' receipt - source's start
                    out.setdefault(name, []).append((stamp.item() - t0) * 1e6)
    if hb is not None:
        hb.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--bytes", type=int, default=41 * 1024)
    args = p.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    old_src = subprocess.check_output(
        ["git", "-C", root, "show", f"{BEFORE}:cpmeta/transport/_dist.py"], text=True)
    old_src = old_src.replace("from . import ", "from cpmeta.transport import ").replace(
        "from .", "from cpmeta.transport.")
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} cpus={os.cpu_count()} "
          f"load={os.getloadavg()[0]:.1f} bytes={args.bytes}")
    print(f"{'world':>5} {'after p50':>10} {'before p50':>11} {'after p90':>10} {'before p90':>11} "
          f"{'after/before p50':>17}")
    for world in args.worlds:
        res = run_ranks(_rank, world, args.bytes, args.iters, args.rounds, old_src, timeout=1800)[0]
        q = {k: statistics.quantiles(v, n=10) for k, v in res.items()}
        a50, b50 = statistics.median(res["after"]), statistics.median(res["before"])
        print(f"{world:>5} {a50:>10.0f} {b50:>11.0f} {q['after'][8]:>10.0f} {q['before'][8]:>11.0f} "
              f"{a50 / b50:>17.3f}", flush=True)


if __name__ == "__main__":
    main()
