#!/usr/bin/env python
"""What sharing ONE GPU between processes costs a synchronised step (where the time of a CP group
of gloo ranks on one GPU goes).

``--procs N`` processes run at the same time, with no communication between them, each in a loop
for ``--seconds``; every step is timed from its start to its device sync:

  step   the in-place decode step of one rank: ``stage_decode(staging, state, ..., upload=False)``
         + ``staging.replay_uploading(g)`` (ONE graph replay: the H2D copy and both kernels,
         ``scripts/profile_inplace_step.py``'s ``step_graph_upload``) + ``torch.cuda.synchronize()``
  tiny   one 1-element ``add_`` + ``torch.cuda.synchronize()``: the floor of any step that waits
         for the GPU

With one process these are the in-place step's latency and a launch + sync round trip; with two
or three, each process's step also waits while the GPU runs the other processes' contexts (time
slicing, no MPS). A CP group with one GPU per rank does not pay that. Results: p50 / p90 of every
process's steps pooled, per (procs, method).

    python scripts/bench_gpu_sharing.py --procs 1 2 3 --out $OUT/gpu_sharing.json     # on the H200
    python scripts/bench_gpu_sharing.py --procs 1 2 --seconds 1                        # CPU smoke run

Without CUDA both methods run on the CPU (the torch emulation of the kernels, no sync): a smoke
run of the script, not a measurement of GPU sharing.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_broadcast import latency_us  # noqa: E402
from bench_decode_inplace import write_run  # noqa: E402

METHODS = ("step", "tiny")


def _step_fn(method: str, dev: torch.device) -> Callable[[], None]:
    """The function a process times (built and warmed up before the start barrier)."""
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if method == "tiny":
        x = torch.zeros(1, device=dev)

        def tiny() -> None:
            x.add_(1)
            sync()

        return tiny
    from bench_build import _state_from, decode_batch
    from cpmeta import MetadataConfig
    from cpmeta.gpu.decode_staging import stage_decode
    from cpmeta.gpu.decode_inplace import (
        DecodeStaging, capture_decode_graph, launch_decode_inplace, prepare_decode_inplace, staging_capacity,
    )

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


def _proc(rank: int, method: str, seconds: float, barrier: Any, q: Any) -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fn = _step_fn(method, dev)
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


def run(procs: int, method: str, seconds: float) -> dict[str, Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_proc, args=(r, method, seconds, barrier, q)) for r in range(procs)]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    results = []
    for method in a.methods:
        for n in a.procs:
            r = run(n, method, a.seconds)
            results.append(r)
            print(f"procs={n} {method:>5}: p50 {r['p50_us']:8.1f} us  p90 {r['p90_us']:8.1f} us  "
                  f"({r['n']} steps; per process p50 {', '.join(f'{x:.0f}' for x in r['per_proc_p50_us'])})",
                  flush=True)
    if a.out:
        write_run(a.out, results, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


if __name__ == "__main__":
    main()
