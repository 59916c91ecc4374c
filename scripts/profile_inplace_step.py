#!/usr/bin/env python
"""Host time of the in-place decode step from a ``BatchState``, piece by piece (issue 18 goal:
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

    python scripts/profile_inplace_step.py --out $OUT/inplace_step.json     # on the H200
    python scripts/profile_inplace_step.py --repeat 50                      # CPU smoke run
    python scripts/profile_inplace_step.py --cp --out $OUT/step.json        # + the CP driver, world 1

Cases: 0 and 2 drafts per request (counts as an array, int64 ids), and ``d2_count``: 2 drafts
given as ONE count for all requests with int32 ids (an engine with a fixed MTP depth).
Without CUDA only ``stage_host`` and ``stage`` are timed (the CUDA pieces need a GPU).
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

from bench_build import _state_from, decode_batch  # noqa: E402
from bench_decode_inplace import write_run  # noqa: E402
from cpmeta import MetadataConfig  # noqa: E402
from cpmeta.gpu.decode_staging import stage_decode  # noqa: E402
from cpmeta.gpu.decode_inplace import (  # noqa: E402
    DecodeStaging, capture_decode_graph, launch_decode_inplace, prepare_decode_inplace, staging_capacity,
)


def _interleaved(fns: dict[str, Callable[[], Any]], repeat: int, sync: Callable[[], None]) -> dict[str, dict]:
    """p50 / min (us) of every function, one call of each per round (order shuffled per round)."""
    rng = random.Random(0)
    names = list(fns)
    ts: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(3):
        for k in names:
            fns[k]()
        sync()
    for _ in range(repeat):
        rng.shuffle(names)
        for k in names:
            sync()
            t0 = time.perf_counter()
            fns[k]()
            ts[k].append((time.perf_counter() - t0) * 1e6)
    return {k: {"p50_us": float(np.median(v)), "min_us": float(np.min(v))} for k, v in ts.items()}


def run_case(drafts: int, repeat: int, dev: torch.device, count: bool = False) -> dict[str, Any]:
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
    res = _interleaved(fns, repeat, lambda: None)  # no sync between pieces: host time, as a loop runs
    sync()
    return {"drafts": drafts, "n_seqs": 256, "total_q": 256 * (1 + drafts), **res}


def run_cp(drafts: int, repeat: int, dev: torch.device) -> dict[str, Any]:
    """The CP driver's step at world 1 (NCCL on CUDA, else gloo), piece by piece:
    ``cp_step`` (``broadcast_state``: fill from the state + send + upload + kernels, host time),
    ``cp_step_sync`` (+ device sync: what ``bench_decode_cp`` measures), ``cp_fill``
    (``stage_decode(upload=False)``), ``cp_finish`` (``finish_staged``: upload + kernels) and
    ``cp_follower`` (a follower's work once the ring message is read: ``check_staged_layout``,
    ``staging.load``, upload + kernels; ``cp_follower_sync`` with the device sync)."""
    import os

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
    res = _interleaved(fns, repeat, lambda: None)
    sync()
    sb.close()
    return {"drafts": drafts, "n_seqs": 256, **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1000)
    ap.add_argument("--out", default="")
    ap.add_argument("--cp", action="store_true", help="also the CP driver's step at world 1 (run_cp)")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {f"decode_256_d{d}": run_case(d, a.repeat, dev) for d in (0, 2)}
    results["decode_256_d2_count"] = run_case(2, a.repeat, dev, count=True)
    if a.cp:
        results.update({f"cp_world1_d{d}": run_cp(d, a.repeat, dev) for d in (0, 2)})
    for name, r in results.items():
        print(name, "  ".join(f"{k} {v['p50_us']:.1f}/{v['min_us']:.1f}" for k, v in r.items() if isinstance(v, dict)))
    print("(p50/min us, host time; goal: step <= 50 us at 256 sequences on the H200 host)")
    if a.out:
        write_run(a.out, results, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


if __name__ == "__main__":
    main()
