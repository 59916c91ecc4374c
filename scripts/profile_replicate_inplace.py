#!/usr/bin/env python
"""Where the replicated in-place decode step's time goes, against the staged broadcast.

One process (world 1; ``--backend nccl`` on a GPU, gloo on CPU), the batches of
``scripts/bench_decode_cp.py``: cProfile of ``--steps`` steps of ``replicate_inplace`` and
``staged_state``, the mean step time of each, and the top entries by cumulative time.

    python scripts/profile_replicate_inplace.py --backend nccl --steps 200
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--top", type=int, default=22)
    a = p.parse_args()
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group(a.backend, rank=0, world_size=1)
    device = torch.device("cuda", 0) if a.backend == "nccl" else torch.device("cpu")
    import cpmeta
    from bench_build import decode_batch
    from bench_decode_cp import ReplicateInplaceMethod, StagedStateMethod

    cfg = cpmeta.MetadataConfig.compressed_swa()
    seqs = decode_batch(random.Random(0), cfg, 256, 2)
    for cls in (StagedStateMethod, ReplicateInplaceMethod):
        m = cls(0, device, cfg, seqs)
        for _ in range(10):
            m.step(seqs)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            m.step(seqs)
        sync()
        dt = (time.perf_counter() - t0) / a.steps * 1e6
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            m.step(seqs)
        sync()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(a.top)
        print(f"== {cls.__name__}: {dt:.1f} us a step (mean of {a.steps})")
        print("\n".join(s.getvalue().splitlines()[6:6 + a.top + 2]))
        m.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
