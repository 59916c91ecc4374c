#!/usr/bin/env python
"""End-to-end step: from the scheduler's decision to the LAST rank holding its metadata.

One figure per cell (world x workload x strategy), p50 and p90 over steps:

    step latency = max over ranks (time the rank holds the metadata it attends with)
                   - (time the driver holds the step's ops)

perf_counter is CLOCK_MONOTONIC, one clock for every process of a host; each rank records its
times, gathered after the run. Before each step: a barrier, then the driver idles ``--park-ms``
(default 3 ms) while the followers sit parked in their receive call -- asleep (``--park sleep``,
its core idles: the step meets cold caches) or spinning on its core (``--park busy``: an engine
thread that stays busy between steps, scheduling or waiting on the GPU); every step has new values
(``step_methods.StepTrace``: adds with new prompts, accepted tokens, block growth, finishes).
The strategies (scripts/_harness/step_methods.py) run interleaved on the same ranks, one process group
per world, their order rotated every step. Host metadata, or with ``--device cuda`` device
metadata (gloo ranks sharing cuda:0, ``non_blocking`` copies then a sync; NCCL with
``--backend nccl``). For the best strategy per cell, the phases (p50 of each, the slowest
follower's for follower phases); then the cold-step cost on the driver: apply + build after an
idle gap (``--cold-gaps-ms``) against back-to-back steps and a warm loop of one batch.

mq strategies need vLLM's MessageQueue (never a dependency): ``bash ../shared/tools/mq_bundle.sh
mq_bundle 3.11`` and ``PYTHONPATH=$PWD:$PWD/mq_bundle VLLM_TARGET_DEVICE=cpu``; without it they
are skipped with a printed note.

    python scripts/bench_step.py --worlds 2 4                 # CPU / gloo, plain config
    python scripts/bench_step.py --model seed --worlds 2 4 8
    python scripts/bench_step.py --device cuda --worlds 2 3   # gloo ranks sharing cuda:0
    python scripts/bench_step.py --device cuda --backend nccl --worlds 1
    python scripts/bench_step.py --quick --out /tmp/s.json    # smoke run (tests)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # mq: the vllm bundle imports without CUDA

from bench_broadcast import init_rank, latency_us, run_world_procs  # noqa: E402  (scripts/ on sys.path)
from _harness.bench_meta import run_meta  # noqa: E402  (scripts/_harness/bench_meta.py: the run block)
from _harness.step_methods import (APPLY, BUILD, END, H2D, RECV, SEND, SEND0, STRATEGIES, T0,  # noqa: E402
                          WORKLOADS, StepTrace, apply_ops, build, install_apply_timer, make_strategy)

PHASES = ("driver_apply", "driver_build", "send", "wake_recv", "apply", "build", "h2d")
PHASE_NOTE = ("driver_apply: the driver applies (broadcast, mq-*), applies and records (replicate) or only "
              "records (replicate-defer) the ops; "
              "driver_build: its build (before the send for broadcast / mq-broadcast, after it "
              "otherwise; replicate: inside send; replicate-defer: the builds its apply left); send: its "
              "send call(s) (replicate: sync_metadata()'s send and builds; replicate-defer: to the end of "
              "the own apply after the send, a decode step's build inside it); wake_recv: driver's first "
              "send start -> the slowest follower holds the bytes (broadcast / mq-broadcast: the "
              "metadata, replicate: the parsed frame, mq-replicate: the unpickled ops); apply, build: "
              "the slowest follower's replay of the ops (replicate: a decode step's build inside it) and "
              "build (the rest); h2d: the slowest rank's copy to the device")


def _config(model: str) -> Any:
    from cpmeta.launch.scheduler import default_config, plain_config

    return plain_config() if model == "plain" else default_config()


# ---- the per-rank run --------------------------------------------------------------------------


def _gather(t: torch.Tensor, ctrl: Any) -> torch.Tensor:
    import torch.distributed as dist

    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t, group=ctrl)
    return torch.stack(got)


def idle(seconds: float, how: str) -> None:
    """The driver's gap between steps: ``sleep`` (its core idles) or ``busy`` (it spins)."""
    if how == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def pin_rank(rank: int, world: int, how: str) -> Optional[set[int]]:
    """``--pin core``: this rank's main thread on one core of its own (rank r on the r-th of
    ``world`` evenly spaced usable cores; gloo's threads keep the full mask) -- an engine that
    binds each rank, and a step that meets the caches of the core it last ran on. Returns the
    mask to restore (``None``: not pinned)."""
    if how == "none":
        return None
    cores = os.sched_getaffinity(0)
    usable = sorted(cores)
    os.sched_setaffinity(0, {usable[(rank * len(usable)) // world]})
    return cores


def run_workload(rank: int, world: int, wl: str, args: argparse.Namespace, device: torch.device,
                 ctrl: Any) -> tuple[list[dict], list[str]]:
    """Every strategy of ``args.strategies`` on one workload, interleaved: rank 0 returns the
    cells (others: empty) and the strategies skipped."""
    import torch.distributed as dist

    from cpmeta.launch.verify import metadata_digest

    cfg = _config(args.model)
    trace = StepTrace(cfg, wl, args.seed) if rank == 0 else None
    shape = trace or StepTrace(cfg, wl)  # followers: only its sizes
    made = [(n, make_strategy(n, rank, cfg, device, shape.max_seqs, shape.n_specs, args.timeout))
            for n in args.strategies]
    skipped = [n for n, s in made if s is None]
    strats = [(n, s) for n, s in made if s is not None]
    cores = pin_rank(rank, world, args.pin)  # after the strategies: their rings saw the full mask
    total = args.warmup + args.steps
    recs = np.zeros((len(strats), total, 8))
    last: list[Any] = [None] * len(strats)
    t_begin, n = time.perf_counter(), 0
    nbytes = {}
    for i in range(total):
        ops = trace.next_step() if trace is not None else None
        k = i % len(strats)
        for j in list(range(k, len(strats))) + list(range(k)):
            dist.barrier(group=ctrl)
            rec = recs[j, i]
            if rank == 0:
                idle(args.park_ms * 1e-3, args.park)
                rec[T0] = time.perf_counter()
                last[j] = strats[j][1].driver(ops, rec)
            else:
                last[j] = strats[j][1].follower(rec)
            rec[END] = time.perf_counter()
        n = i + 1
        if n == args.warmup:  # the budget counts measured steps only: first calls (numba cache
            t_begin = time.perf_counter()  # loads, lazy imports) once cut a first cell to 5 samples
        stop = torch.tensor([int(i >= args.warmup + 4 and time.perf_counter() - t_begin > args.budget)])
        dist.broadcast(stop, src=0, group=ctrl)
        if int(stop):
            break
    if rank == 0:
        import pickle

        from _harness.broadcast_methods import payload_bytes

        nbytes = {"ops_pickled": len(pickle.dumps(ops)), "metadata": sum(payload_bytes(m) for m in last[0])}
    # every rank's last metadata of every strategy equals the driver's broadcast (new values arrived)
    digs = torch.stack([torch.cat([metadata_digest(m) for m in mds]) for mds in last])
    all_digs = _gather(digs, ctrl)
    g = _gather(torch.from_numpy(recs[:, args.warmup:n].copy()), ctrl).numpy()
    for _, s in strats:
        s.close()
    if cores is not None:
        os.sched_setaffinity(0, cores)
    if rank != 0:
        return [], skipped
    bad = [(r, strats[j][0]) for r in range(world) for j in range(len(strats))
           if not torch.equal(all_digs[r, j], all_digs[0, 0])]
    if bad:
        raise RuntimeError(f"{wl}: last step's metadata differs from the driver's on {bad}")
    cells = []
    for j, (name, _) in enumerate(strats):
        cells.append(_cell(g[:, j], world, wl, name, args, nbytes))
    return cells, skipped


def _cell(r: np.ndarray, world: int, wl: str, name: str, args: argparse.Namespace,
          nbytes: dict) -> dict:
    """One cell from ``r`` [world, steps, REC] (rank 0 = the driver)."""
    lat = sorted((r[:, :, END].max(0) - r[0, :, T0]).tolist())
    fol = r[1:]
    ph = {"driver_apply": r[0, :, APPLY], "driver_build": r[0, :, BUILD], "send": r[0, :, SEND],
          "h2d": r[:, :, H2D].max(0)}
    if world > 1:
        ph.update(wake_recv=(fol[:, :, RECV] - r[0, :, SEND0]).max(0), apply=fol[:, :, APPLY].max(0),
                  build=fol[:, :, BUILD].max(0))
    return {"world": world, "workload": wl, "strategy": name, "model": args.model, "device": args.device,
            "backend": args.backend, "n": len(lat), **latency_us(lat), "mean_us": float(np.mean(lat)) * 1e6,
            "phases_p50_us": {k: float(np.median(ph[k])) * 1e6 if k in ph else None for k in PHASES},
            "bytes": nbytes}


def cold_costs(wl: str, args: argparse.Namespace) -> dict:
    """Driver-local: apply + build p50 after an idle gap of each ``--cold-gaps-ms`` against
    back-to-back steps (gap 0) and a warm loop building one batch again and again."""
    import cpmeta

    cfg, out = _config(args.model), {"world": None, "workload": wl, "model": args.model}
    for gap in [0.0] + list(args.cold_gaps_ms):
        trace = StepTrace(cfg, wl, args.seed + 1)
        st, arenas = cpmeta.BatchState(cfg, trace.max_seqs), cpmeta.OutputArenas()
        ta, tb = [], []
        for i in range(args.warmup + args.cold_steps):
            ops = trace.next_step()
            time.sleep(gap * 1e-3)
            t = time.perf_counter()
            batches = apply_ops(st, ops)
            t1 = time.perf_counter()
            build(batches, cfg, arenas)
            if i >= args.warmup:
                ta.append(t1 - t)
                tb.append(time.perf_counter() - t1)
        key = "back_to_back" if gap == 0 else f"gap_{gap:g}ms"
        out[key] = {"apply_p50_us": float(np.median(ta)) * 1e6, "build_p50_us": float(np.median(tb)) * 1e6}
    loop = []
    for _ in range(args.cold_steps):
        t = time.perf_counter()
        build(batches, cfg, arenas)
        loop.append(time.perf_counter() - t)
    out["warm_loop"] = {"build_p50_us": float(np.median(loop)) * 1e6}
    return out


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    import torch.distributed as dist

    device = init_rank(rank, world, port, args.backend, cuda_with_gloo=args.device == "cuda")
    ctrl = dist.new_group(backend="gloo")
    install_apply_timer()
    results: list[dict] = []
    for wl in args.workloads:
        cells, skipped = run_workload(rank, world, wl, args, device, ctrl)
        results += cells
        if rank == 0:
            results += [{"world": world, "workload": wl, "strategy": s, "skipped":
                         "vllm's MessageQueue does not import"} for s in skipped]
            for c in cells:
                print(f"  world={world} {wl:>10} {c['strategy']:>12}: p50 {c['p50_us']:9.1f} us  "
                      f"p90 {c['p90_us']:9.1f} us  (n={c['n']})", flush=True)
            if skipped:
                print(f"  world={world} {wl:>10}: skipped {', '.join(skipped)} (vllm's MessageQueue does "
                      "not import: see the docstring for the bundle)", flush=True)
            if not args.no_cold and world == min(args.worlds):
                results.append({"cold": cold_costs(wl, args)})
        dist.barrier(group=ctrl)
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier(group=ctrl)
    dist.destroy_process_group()


# ---- report --------------------------------------------------------------------------------------


def best_of(cells: list[dict]) -> dict[tuple, dict]:
    best: dict[tuple, dict] = {}
    for c in cells:
        k = (c["world"], c["workload"])
        if k not in best or c["p50_us"] < best[k]["p50_us"]:
            best[k] = c
    return best


_SHORT = {"replicate": "repl", "replicate-defer": "rdef", "broadcast": "broa"}


def print_table(cells: list[dict], cold: list[dict]) -> None:
    by = {(c["world"], c["workload"], c["strategy"]): c for c in cells}
    keys = sorted({(c["world"], c["workload"]) for c in cells}, key=lambda k: (k[0], list(WORKLOADS).index(k[1])))
    ratios = (("replicate", "broadcast"), ("replicate", "mq-replicate"), ("replicate-defer", "mq-replicate"),
              ("replicate", "mq-broadcast"), ("broadcast", "mq-broadcast"))
    print(f"{'world':>5} {'workload':>10}" + "".join(f" {s + ' p50/p90':>22}" for s in STRATEGIES)
          + "".join(f" {_SHORT.get(a, a) + '/' + b:>16}" for a, b in ratios))
    for w, wl in keys:
        line = f"{w:>5} {wl:>10}"
        for s in STRATEGIES:
            c = by.get((w, wl, s))
            line += f" {c['p50_us']:>11.0f}/{c['p90_us']:<7.0f}us" if c else f" {'-':>22}"
        for a, b in ratios:
            ca, cb = by.get((w, wl, a)), by.get((w, wl, b))
            line += f" {ca['p50_us'] / cb['p50_us']:>16.2f}" if ca and cb else f" {'-':>16}"
        print(line)
    print("(p50/p90 us, driver holds the ops -> the last rank holds its metadata; ratios of p50, "
          "below 1: the first is faster)")
    print("\nbest strategy per cell, phases (p50 us): " + ", ".join(PHASES))
    for (w, wl), c in sorted(best_of(cells).items(), key=lambda kv: (kv[0][0], list(WORKLOADS).index(kv[0][1]))):
        ph = c["phases_p50_us"]
        print(f"{w:>5} {wl:>10} {c['strategy']:>12} {c['p50_us']:>8.0f}:" + "".join(
            f" {k}={ph[k]:.0f}" for k in PHASES if ph[k] is not None))
    if cold:
        print("\ncold step on the driver (p50 us: apply / build)")
        for c in cold:
            parts = [f"{k}: {v['apply_p50_us']:.0f} / {v['build_p50_us']:.0f}" for k, v in c.items()
                     if isinstance(v, dict) and "apply_p50_us" in v]
            print(f"  {c['workload']:>10}  " + "  ".join(parts) + f"  warm loop build {c['warm_loop']['build_p50_us']:.0f}")


def plot(cells: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    worlds = sorted({c["world"] for c in cells})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4), squeeze=False)
    wls = [w for w in WORKLOADS if any(c["workload"] == w for c in cells)]
    for ax, w in zip(axes[0], worlds):
        for i, s in enumerate(STRATEGIES):
            pts = [next((c for c in cells if c["world"] == w and c["workload"] == wl and c["strategy"] == s), None)
                   for wl in wls]
            xs = [x + 0.2 * i - 0.3 for x, c in zip(range(len(wls)), pts) if c]
            p50 = [c["p50_us"] for c in pts if c]
            err = [c["p90_us"] - c["p50_us"] for c in pts if c]
            if xs:
                ax.bar(xs, p50, 0.2, yerr=[[0] * len(err), err], label=s, capsize=2)
        ax.set_xticks(range(len(wls)), wls)
        ax.set_title(f"world {w}: decision -> last rank holds metadata")
        ax.set_ylabel("p50 us (whisker to p90)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def machine() -> dict:
    facts = {"node": platform.node(), "platform": platform.platform(), "machine": platform.machine(),
             "processor": platform.processor(), "python": platform.python_version(), "cpus": os.cpu_count(),
             "cpus_usable": len(os.sched_getaffinity(0)), "loadavg_start": os.getloadavg(),
             "torch": torch.__version__}
    try:
        facts["cpu_model"] = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                                  if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
    return facts


def git_commit() -> dict:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    # a shared checkout: the code that ran is HEAD plus these uncommitted changes
    dirty = git("diff", "--name-only", "HEAD", "--", "cpmeta", "scripts").split()
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_code": dirty}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=None, help="default 2 4 8 (--quick: 2)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--model", choices=("plain", "seed"), default="plain")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--steps", type=int, default=60, help="timed steps per workload (per strategy)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--budget", type=float, default=30.0,
                   help="seconds of measured steps per workload (the warmup not counted) before stopping early")
    p.add_argument("--park-ms", type=float, default=3.0, help="driver idle after the barrier (followers park)")
    p.add_argument("--park", choices=("sleep", "busy"), default="sleep",
                   help="how the driver idles --park-ms: asleep, or spinning on its core")
    p.add_argument("--pin", choices=("none", "core"), default="none",
                   help="core: each rank's main thread on a core of its own while its steps are timed")
    p.add_argument("--cold-gaps-ms", type=float, nargs="+", default=[3.0, 30.0])
    p.add_argument("--cold-steps", type=int, default=20)
    p.add_argument("--no-cold", action="store_true", help="skip the cold-step measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="smoke run: world 2, a handful of steps")
    p.add_argument("--out", default=str(ROOT / "docs/benchmarks/step.json"))
    p.add_argument("--plot", default=None, help="PNG path (default: beside --out)")
    args = p.parse_args(argv)
    if args.backend == "nccl":
        args.device = "cuda"
    if args.quick:
        args.worlds, args.steps, args.warmup, args.cold_steps, args.cold_gaps_ms = args.worlds or [2], 4, 2, 3, [3.0]
    args.worlds = args.worlds or [2, 4, 8]
    meta = {"command": "python scripts/bench_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(), **git_commit(),
            "timed": "max over ranks (rank holds its metadata) - driver holds the step's ops (perf_counter)",
            "park_ms": args.park_ms, "park": args.park, "pin": args.pin, "phases": PHASE_NOTE, "workloads": {
                w: dict(zip(("decode_seqs", "drafts", "prefill_seqs", "chunk"), v)) for w, v in WORKLOADS.items()}}
    results: list[dict] = []
    for w in args.worlds:
        print(f"world {w} ({args.backend}, {args.device}, model {args.model})", flush=True)
        results += run_world_procs(w, args, rank_main)
    meta["loadavg_end"] = os.getloadavg()
    cells = [r for r in results if "p50_us" in r]
    cold = [r["cold"] for r in results if "cold" in r]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"run": run_meta(argv), "meta": meta, "results": cells, "skipped": [r for r in results if "skipped" in r],
                               "best": [{"world": k[0], "workload": k[1], "strategy": c["strategy"]}
                                        for k, c in best_of(cells).items()], "cold": cold}, indent=1))
    print_table(cells, cold)
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    if not args.quick and plot(cells, png):
        print(f"plot: {png}")
    print(f"json: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
