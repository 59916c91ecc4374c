#!/usr/bin/env python
"""Where one ``MetadataBroadcaster.broadcast`` step spends its time, per phase, on both sides.

No hook sits in the library's hot path: this script wraps the broadcaster's and the transport's
phase functions (listed in ``PHASES``; names missing from the current code are skipped) with
``perf_counter_ns`` timers, in real processes over gloo, and reports the p50 of each phase
(inclusive: a phase that calls another includes it). The wrapper itself costs ~0.3 us a call.

Cross-process times use CLOCK_MONOTONIC (``time.perf_counter`` on Linux, one clock per host):
``wake`` = follower sees the message - driver stored the new head (``_publish`` entry);
``last done`` = last follower holds the metadata - driver called ``broadcast``.

Two modes: ``engine`` (followers have been parked in their receive call for ``--park-ms`` when
the driver starts: the inference engine case) and ``b2b`` (a barrier right before the step, so
followers are still spinning when the message lands).

The driver's payload is what an engine building with ``out=OutputArenas()`` hands over each step
(outside the timed region): the SAME tensor objects, refilled in place with this step's values
(``bench_broadcast.step_values``), in a NEW ``InputMetadata`` with new dicts and a new
``max_seqlen_k``, so a persistent driver's collect memo hits as it does in that engine.
``--reuse-md`` passes the one refilled object every step instead (``bench_broadcast``'s case).
Note on the driver's first phases in ``engine`` mode: they run right after the driver idled
``--park-ms`` (cold caches, a core clocked down), so they cost several times their in-process
time (``scripts/ab_broadcast_steps.py``); ``--park-ms 0`` shows how much of a phase that is.

    python scripts/profile_broadcast.py --world 2 --payload decode-64 --steps 200
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_meta import run_meta  # noqa: E402  (scripts/bench_meta.py: the run block)

# (label, module, attribute) -- "Class.method" attributes are wrapped on the class.
PHASES: list[tuple[str, str, str]] = [
    ("D broadcast (total)", "cpmeta.broadcast.broadcaster", "MetadataBroadcaster._send"),
    ("D begin_step", "cpmeta.broadcast.broadcaster", "MetadataBroadcaster.begin_step"),
    ("D collect by path", "cpmeta.broadcast.broadcaster", "collect"),
    ("D layout", "cpmeta.broadcast.broadcaster", "_layout"),
    ("D layout", "cpmeta.broadcast.broadcaster", "MetadataBroadcaster._layout"),
    ("D sizes (run offsets)", "cpmeta.broadcast.plan", "Plan.sizes"),
    ("D pack tensors", "cpmeta.broadcast.broadcaster", "_pack"),
    ("D pack tensors", "cpmeta.broadcast.broadcaster", "pack_tensors"),
    ("D encode (codec)", "cpmeta.transport.object_channel", "encode"),
    ("D encode values", "cpmeta.transport", "encode_body"),
    ("D frame crc32", "cpmeta.broadcast.broadcaster", "frame_crc"),
    ("D seal (meta crc, + crc32 with checksum)", "cpmeta.broadcast.wire", "seal"),
    ("C check values (schema; both sides)", "cpmeta.broadcast.schema", "ValueCheck.__call__"),
    ("F check frame (limits, policy, crcs)", "cpmeta.broadcast.wire", "read_head"),
    ("F check tensors (exact sizes)", "cpmeta.broadcast.plan", "Plan.check_tensors"),
    ("D ring write (copy+publish)", "cpmeta.transport._ring_io", "RingIO.write"),
    ("D ring reserve", "cpmeta.transport._ring_io", "RingIO.reserve"),
    ("D ring commit (publish)", "cpmeta.transport._ring_io", "RingIO.commit"),
    ("D wake syscall", "cpmeta.transport._ring_io", "futex_wake"),
    ("D liveness poll", "cpmeta.transport._ring_io", "RingIO._check_alive_readers"),
    ("F receive (total)", "cpmeta.broadcast.broadcaster", "MetadataBroadcaster._receive"),
    ("F wait for data", "cpmeta.transport._ring_io", "RingIO._wait_data"),
    ("F decode (codec)", "cpmeta.transport.object_channel", "ObjectChannel._decode"),
    ("F copy out + views", "cpmeta.transport.object_channel", "ObjectChannel._unpack"),
    ("F check+parse frame, copy out", "cpmeta.broadcast.broadcaster", "MetadataBroadcaster._consume"),
    ("F decode (codec)", "cpmeta.transport", "decode_body"),
    ("F validate", "cpmeta.broadcast.broadcaster", "_check_message"),
    ("F validate", "cpmeta.broadcast.broadcaster", "_parse_layout"),
    ("F validate", "cpmeta.broadcast.broadcaster", "_check_packed_bounds"),
    ("F unpack views", "cpmeta.broadcast.broadcaster", "_unpack"),
    ("F unpack views", "cpmeta.broadcast.plan", "Plan.views"),
    ("F assemble InputMetadata", "cpmeta.broadcast.broadcaster", "_assemble"),
    ("F assemble InputMetadata", "cpmeta.broadcast.plan", "Plan.assemble"),
    ("D collect by path", "cpmeta.broadcast.collect_memo", "CollectMemo.__call__"),
    ("D collect by path", "cpmeta.broadcast.collect_memo", "CollectMemo.step"),
    ("P arena lookup (both)", "cpmeta.broadcast.persistent", "PersistentArenas.get"),
    ("P arena lookup (both)", "cpmeta.broadcast.persistent", "PersistentArenas.driver_arena"),
    ("P follower: span frame lookup + land", "cpmeta.broadcast.broadcaster", "land_span"),
    ("P driver: tensors into the slot", "cpmeta.broadcast.persistent", "LayoutArena.write"),
    ("P driver: own copy after the publish", "cpmeta.broadcast.persistent", "LayoutArena.take"),
    ("P follower: slot into its arena", "cpmeta.broadcast.persistent", "LayoutArena.land"),
    ("P finish (H2D, restore check, values)", "cpmeta.broadcast.persistent", "LayoutArena.finish"),
]


def _install(log: dict[str, list[int]], marks: dict[str, int]) -> None:
    for label, mod_name, attr in PHASES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        owner: Any = mod
        *outer, name = attr.split(".")
        for o in outer:
            owner = getattr(owner, o, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None or getattr(fn, "_profiled", False):
            continue
        setattr(owner, name, _timed(fn, label, log, marks))
    ring_io = importlib.import_module("cpmeta.transport._ring_io")
    pub = ring_io.RingIO._publish

    def publish(self: Any, head: int) -> None:
        marks["publish"] = time.perf_counter_ns()
        pub(self, head)

    ring_io.RingIO._publish = publish
    wait = ring_io.RingIO._wait_data

    def wait_data(self: Any, target: int, deadline: float) -> int:
        h = wait(self, target, deadline)
        marks.setdefault("visible", time.perf_counter_ns())
        return h

    wait_data._profiled = True  # type: ignore[attr-defined]
    ring_io.RingIO._wait_data = _timed(wait_data, "F wait for data", log, marks)


def _timed(fn: Callable, label: str, log: dict[str, list[int]], marks: dict[str, int]) -> Callable:
    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            log.setdefault(label, []).append(time.perf_counter_ns() - t0)

    wrapper._profiled = True  # type: ignore[attr-defined]
    return wrapper


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    import cpmeta
    from bench_broadcast import make_payload, step_values

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    _, md = make_payload(args.payload, False)
    log: dict[str, list[int]] = {}
    marks: dict[str, int] = {}
    _install(log, marks)
    bc = cpmeta.MetadataBroadcaster(src=0, timeout=120, persistent_outputs=args.persistent)
    rows = []
    dict_fields = [n for n in md.field_names() if isinstance(getattr(md, n), dict)]
    base_k = md.max_seqlen_k
    for i in range(args.warmup + args.steps):
        if rank == 0:  # the engine's build, untimed: same tensors refilled, a new md, new dicts
            step_values(md, i, base_k)
            step_md = md if args.reuse_md else md.replace(
                **{n: dict(getattr(md, n)) for n in dict_fields})
        dist.barrier()
        log.clear()
        marks.clear()
        t0 = time.perf_counter_ns()
        if rank == 0:
            if args.mode == "engine":
                time.sleep(args.park_ms * 1e-3)  # the driver schedules while followers park
                t0 = time.perf_counter_ns()
            if args.begin_step and hasattr(bc, "begin_step"):
                bc.begin_step()
                time.sleep(args.build_us * 1e-6)  # building the metadata
            bc.broadcast(step_md)
        else:
            bc.broadcast(None)
        t1 = time.perf_counter_ns()
        if i >= args.warmup:
            rows.append({"t0": t0, "t1": t1, "publish": marks.get("publish", 0),
                         "visible": marks.get("visible", 0),
                         "phases": {k: sum(v) for k, v in log.items()}})
    bc.close()
    import torch as _t
    blob = _t.tensor([[r["t0"], r["t1"], r["publish"], r["visible"]] for r in rows], dtype=_t.int64)
    gathered = [_t.empty_like(blob) for _ in range(world)]
    dist.all_gather(gathered, blob)
    labels = sorted({k for r in rows for k in r["phases"]})
    Path(f"{out}.{rank}.json").write_text(json.dumps({"labels": labels, "phases": [
        [r["phases"].get(k, 0) for k in labels] for r in rows]}))
    if rank == 0:
        Path(f"{out}.times.json").write_text(json.dumps([g.tolist() for g in gathered]))
    dist.barrier()
    dist.destroy_process_group()


def _p50(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def run(args: argparse.Namespace) -> dict[str, float]:
    import multiprocessing as mp
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "p")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, args.world, port, args, out))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if any(p.exitcode for p in procs):
            raise SystemExit("a rank failed")
        res: dict[str, float] = {}
        for r in range(args.world):
            data = json.loads(Path(f"{out}.{r}.json").read_text())
            for j, k in enumerate(data["labels"]):
                if (k.startswith("D") and r == 0) or (k.startswith("F") and r == 1):
                    res[k] = _p50([row[j] / 1e3 for row in data["phases"]])
                elif k.startswith(("P", "C")) and r <= 1:  # persistent phases, checks: both sides
                    res[f"{k} [{'driver' if r == 0 else 'follower 1'}]"] = _p50(
                        [row[j] / 1e3 for row in data["phases"]])
        times = json.loads(Path(f"{out}.times.json").read_text())
        start = [row[0] for row in times[0]]
        publish = [row[2] for row in times[0]]
        res["X wake (follower 1 sees message - driver publish)"] = _p50(
            [(times[1][i][3] - publish[i]) / 1e3 for i in range(len(start))])
        res["X follower 1 busy (done - sees message)"] = _p50(
            [(times[1][i][1] - times[1][i][3]) / 1e3 for i in range(len(start))])
        res["X last rank done - driver call"] = _p50(
            [(max(times[r][i][1] for r in range(args.world)) - start[i]) / 1e3
             for i in range(len(start))])
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--payload", default="decode-64")
    p.add_argument("--mode", choices=("engine", "b2b"), default="engine")
    p.add_argument("--park-ms", type=float, default=3.0)
    p.add_argument("--begin-step", action="store_true", help="driver calls begin_step() first")
    p.add_argument("--build-us", type=float, default=300.0, help="driver work after begin_step")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--persistent", action="store_true", help="persistent_outputs=True")
    p.add_argument("--reuse-md", action="store_true",
                   help="the driver passes one InputMetadata object every step (refilled in place)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    res = run(args)
    print(f"world {args.world} {args.payload} mode={args.mode} begin_step={args.begin_step} "
          f"persistent={args.persistent} reuse_md={args.reuse_md} park_ms={args.park_ms} "
          f"(p50 us over {args.steps} steps, inclusive per phase)")
    for k in sorted(res):
        print(f"  {k:<52} {res[k]:8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"run": run_meta(), "args": vars(args), "p50_us": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
