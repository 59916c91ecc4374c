#!/usr/bin/env python
"""Long soak of MetadataBroadcaster: N consecutive broadcasts of checksummed random metadata.

Every follower checks the step number and the crc32 of every field of every message, and every
``--check-every``-th message byte for byte against a local regeneration; RSS and the open file
descriptors are sampled from step 200 to the end. Payload sizes run from 0 bytes to three times the ring (see
``tests/reliability_cases.py``). Prints one row per rank and writes JSON (``--out``).

    python scripts/soak.py                                   # 20,000 broadcasts, 3 ranks, ring path
    python scripts/soak.py --remote                          # forced process-group (gloo) path
    python scripts/soak.py --steps 2000 --slot-size 65536 --num-slots 64   # the default ring size

Exit status 1 when any rank saw a mismatch, its RSS grew by more than ``--rss-limit-mib`` or its
open file descriptors grew.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the shared multi-process helper and payload generator
from _harness.bench_meta import write_result  # noqa: E402  (scripts/_harness/bench_meta.py: the shared harness)

MIB = 1 << 20


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--slot-size", type=int, default=4096, help="bytes per ring slot")
    p.add_argument("--num-slots", type=int, default=16, help="slots per ring")
    p.add_argument("--check-every", type=int, default=10, help="exact comparison period")
    p.add_argument("--remote", action="store_true", help="force the process-group path")
    p.add_argument("--tensor-path", choices=("auto", "packed", "collective"), default="auto")
    p.add_argument("--no-checksum", action="store_true",
                   help="do not set CPMETA_CHECKSUM=1 (by default every frame carries a crc32 "
                        "that the followers verify)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--rss-limit-mib", type=float, default=16.0)
    p.add_argument("--out", type=Path, default=None, help="JSON output file")
    return p.parse_args(argv)


def _row(r: dict[str, Any]) -> str:
    growth = (r["rss"][-1] - r["rss"][0]) / MIB
    return (f"{r['rank']:>4} {r['mismatches']:>10} {r['exact_checks']:>6} {r['bytes'] / MIB:>9.1f} "
            f"{r['over_ring']:>9} {r['min_bytes']:>6} {r['max_bytes']:>8} {r['seconds']:>8.1f} "
            f"{r['rss'][0] / MIB:>9.1f} {r['rss'][-1] / MIB:>9.1f} {growth:>+7.2f} {r['rss_peak'] / MIB:>8.1f} {r['fds'][0]:>5}->{r['fds'][-1]}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from multiproc import run_ranks
    from reliability_cases import project_shm_entries, soak_rank

    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    ring_bytes = args.slot_size * args.num_slots
    env = {"CPMETA_SHM_SLOT_SIZE": str(args.slot_size), "CPMETA_SHM_NUM_SLOTS": str(args.num_slots),
           "CPMETA_TENSOR_PATH": args.tensor_path, "CPMETA_CHECKSUM": "0" if args.no_checksum else "1"}
    before = project_shm_entries()
    t0 = time.monotonic()
    out = run_ranks(soak_rank, args.world, seed, args.steps, ring_bytes, args.check_every, 120.0,
                    args.remote, env=env, timeout=max(600.0, args.steps * 0.2))
    wall = time.monotonic() - t0
    leaked = sorted(project_shm_entries() - before)
    print(f"soak: {args.steps} broadcasts, {args.world} ranks, ring {args.num_slots} x "
          f"{args.slot_size} B, remote={args.remote}, tensor_path={args.tensor_path}, "
          f"frame crc32={not args.no_checksum}, seed={seed}, "
          f"wall {wall:.1f} s")
    print("rank mismatches exact  MiB_sent over_ring    min      max  seconds "
          "rss_start   rss_end  growth rss_peak   fds")
    for r in out:
        print(_row(r))
    print(f"/dev/shm entries left: {leaked or 'none'}")
    bad = [r["rank"] for r in out if r["mismatches"]
           or r["rss"][-1] - r["rss"][0] > args.rss_limit_mib * MIB or r["fds"][-1] > r["fds"][0]]
    if args.out:
        write_result(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "seed": seed, "wall_s": wall,
                                "shm_left": leaked, "ranks": out}, argv)
    for r in out:
        for e in r["errors"]:
            print(f"rank {r['rank']}: {e}", file=sys.stderr)
    return 1 if bad or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
