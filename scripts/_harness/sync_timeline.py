"""``profile_phases.py sync``: one ``ReplicatedBatchState`` step as a timeline, both sides.

Every rank wraps the library's stage functions in its own process (nothing changes in the
library) and stamps ``perf_counter`` -- one clock for every process of a host -- at each stage's
start and end; the last call of a stage in a step wins (a follower's warm calls come before the
step's own). Rank 0 then prints the p50 of each stage on the driver and, on the follower that
held its metadata last, the stages from the driver's ring commit on (``--split-read``: a
follower's compiled read without the replay, which ``apply_step``'s own compiled call then
makes with the build, timed alone: which half of the one-call step costs what)::

    driver    record (begin_step, then its BatchState calls; announce: begin_step alone)
              | layout (the region's sizes) | prepare (the codec's frames only)
              | write (slot reserved, header, values, shapes, the columns packed into the slot:
                       for the common frame ONE compiled call, "frames written compiled")
              | commit | or, with only same-host followers, "write + publish": the common frame
                claimed, written and published by ONE compiled call (send_step_frame)
              | own apply (defer_apply; of which the fused replay + build, then apply_step) | build
    follower  commit -> read | read | -> replay | replay + step check | -> sync end | build
              (and its last warm before the read: how long, and where it ended from the publish)

where a follower's "read" is the compiled read of a common step frame (``StepReader.read``: the
header, the values and the columns in one call; for a decode step of the shape it built last
also the replay and the build: "steps built in the read" counts them), or for the other frames (the
first, checksummed ones) the parser's and ``read_region``'s ("parse", "columns": their own rows, over the steps
that took that path; "frames read compiled" counts the compiled ones among the last followers'),

with ``sync_metadata`` (a decode step's build inside the replay's call: "build" is then what the
replay left, a prompt step's build); "after the one call" is a follower's Python from that call's
return to its metadata (the steps built in the read), "send -> compiled write" the driver's
Python from ``send_step`` to its compiled write.

``--lean``: only the publish (the end of the driver's one compiled write), each follower's
compiled read and the driver's own fused replay + build are stamped, and each rank's end (every
stamp above wraps a call that the step then pays: world 2 decode-64 on the 2-vCPU VM, 132-134
µs end to end fully stamped against 126-127 lean, 2026-12-07). It prints the driver's record, its
publish, its own apply after the publish (before / in / after the fused call) and the last
follower's (the publish to its call, the call, the call to its end), with the share of steps
the driver held its metadata last.

The steps are ``bench_step.py``'s decode trace (``StepTrace``: accepted tokens, block growth,
finishes and adds every step); before each, a barrier and the driver idles ``--park-ms``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from typing import Any

import numpy as np

pc = time.perf_counter

#: (driver stage, from stamp, to stamp); ``>`` = a wrapped call's start, ``<`` its end
DRIVER = (("record", "t0", "record<"), ("announce", "begin_step>", "begin_step<"), ("layout", "layout>", "layout<"), ("prepare", "prepare>", "prepare<"),
          ("write", "publish>", "commit>"), ("commit", "commit>", "commit<"),
          ("write + publish", "direct>", "direct<"),
          ("own apply", "_apply_deferred>", "_apply_deferred<"), ("of which fused", "fused>", "fused<"),
          ("then apply_step", "apply_step>", "apply_step<"), ("build", "_sync<", "end"),
          ("send -> compiled write", "send_step>", "direct>"),
          ("check verdict", "_check_verdict>", "_check_verdict<"))
FOLLOWER = (("replay + check", "apply_step>", "apply_step<"),
            ("of which replay + build (--split-read)", "replay_decode>", "replay_decode<"),
            ("to sync end", "apply_step<", "_sync<"), ("build", "_sync<", "end"),
            ("last warm before the read", "_run_warm>", "_run_warm<"),
            ("check verdict", "_check_verdict>", "_check_verdict<"))


def _stamp(stamps: dict[str, float], lean: bool, owner: Any, name: str, as_name: str = "") -> None:
    """Wrap ``owner.name`` in this process: its last call's start / end go to ``stamps`` (under
    ``as_name`` when given: two calls that time one stage); ``lean``: only the calls :data:`LEAN`
    reads (the compiled write + publish, the driver's own fused call), the others left as they are."""
    f, key = getattr(owner, name), as_name or name
    if lean and key not in ("direct", "fused"):
        return

    def timed(*a: Any, **k: Any) -> Any:
        stamps[key + ">"] = pc()
        try:
            return f(*a, **k)
        finally:
            stamps[key + "<"] = pc()

    setattr(owner, name, timed)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from bench_broadcast import init_rank

    init_rank(rank, world, port, "gloo")
    import torch.distributed as dist

    import cpmeta
    import cpmeta.broadcast.channel as channel
    import cpmeta.broadcast.wire as wire
    import cpmeta.replicate.ops as ops
    import cpmeta.replicate.replicated as replicated
    from cpmeta.replicate.step_read_njit import F_DONE
    from _harness.step_methods import StepTrace
    from cpmeta.launch.scheduler import default_config, plain_config

    stamps: dict[str, float] = {}
    import cpmeta.replicate.step_frame as step_frame

    stamp = functools.partial(_stamp, stamps, args.lean)
    if args.split_read:  # the compiled read alone: apply_step's own call then replays and builds
        read = step_frame.StepReader.read

        def read_only(self: Any, view: Any, want: int, fuse: Any = None, dry: bool = False, *rest: Any) -> Any:
            return read(self, view, want, fuse if dry else None, dry, *rest)
        step_frame.StepReader.read = read_only
        import cpmeta.replicate.apply as apply_mod
        stamp(apply_mod, "replay_decode")
    stamp(step_frame.StepReader, "read")
    stamp(step_frame.FusedStep, "apply", "fused")  # a defer_apply driver's own replay + build
    follow = step_frame.follow_decode

    def followed(*a: Any) -> Any:  # the read's call: did it replay and build the step too?
        stamps["follow>"] = pc()
        got = follow(*a)
        stamps["follow<"] = pc()
        stamps["built in the read"] = float(got[0] == F_DONE)
        return got

    step_frame.follow_decode = followed
    stamp(step_frame, "send_step_frame", "direct")  # claimed, written and published in one call
    stamp(step_frame, "step_frame_size", "layout")  # the compiled writer's frames: its sizes,
    stamp(channel.FrameChannel, "publish_written", "publish")  # then the frame written whole
    for owner, name in ((replicated, "apply_step"), (replicated, "send_step"), (step_frame, "read_region"),
                        (channel.FrameChannel, "prepare"), (channel.FrameChannel, "publish"),
                        (wire.FrameReader, "parse"), (ops.OpLog, "layout"),
                        (replicated.ReplicatedBatchState, "_apply_deferred"),
                        (replicated.ReplicatedBatchState, "_sync"), (replicated.ReplicatedBatchState, "begin_step"),
                        (replicated.ReplicatedBatchState, "_check_verdict")):
        stamp(owner, name)
    mml = args.max_model_len
    cfg = plain_config(max_model_len=mml) if args.model == "plain" else default_config(max_model_len=mml)
    trace = StepTrace(cfg, args.workload, 0)
    rep = cpmeta.ReplicatedBatchState(cfg, trace.max_seqs, defer_apply=args.defer, timeout=args.timeout,
                                      check_every=args.check_every)
    if rep._ch.objects.ring is not None:  # noqa: SLF001 - the ring's commit is the frame's publish
        stamp(rep._ch.objects.ring, "commit")  # noqa: SLF001
        stamp(rep._ch.objects.ring, "_run_warm")  # noqa: SLF001 - a follower's warm while it spins
    arenas = cpmeta.OutputArenas()
    rows = []
    for _ in range(args.warmup + args.steps):
        step_ops = trace.next_step() if rank == 0 else None
        dist.barrier()
        stamps.clear()
        if rank == 0:
            time.sleep(args.park_ms / 1e3)
            stamps["t0"] = pc()
            rep.begin_step()
            for name, a, kw in step_ops or ():
                getattr(rep, name)(*a, **kw)
            stamps["record<"] = pc()
        rep.sync_metadata(arenas)  # the step, then what its replay did not build
        stamps["end"] = pc()
        stamps["replica check"] = float(bool(args.check_every) and rep.step % args.check_every == 0)
        stamps["written compiled"] = float(rank == 0 and "prepare>" not in stamps)
        rows.append(dict(stamps))
    every: list[Any] = [None] * world
    dist.all_gather_object(every, rows[args.warmup:])
    rep.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(every, f)
    dist.barrier()  # as every benchmark's ranks end: together, the group torn down
    dist.destroy_process_group()


def _mid_warm(f: dict[str, float], pub: Any) -> bool:
    """Whether the frame was published while the follower ran its last warm (it waited for it)."""
    return pub is not None and f.get("_run_warm>", 1e30) <= pub <= f.get("_run_warm<", 0.0)


def _p50(values: list[float]) -> float:
    return round(float(np.median(values)) * 1e6, 1) if values else float("nan")


def summarize(every: list[list[dict[str, float]]]) -> dict[str, Any]:
    """p50 µs of each stage: the driver's, and the last follower's of each step."""
    drv, n = every[0], len(every[0])
    last = [max(range(1, len(every)), key=lambda r: every[r][i]["end"]) for i in range(n)] if len(every) > 1 else []
    e2e = [max(r[i]["end"] for r in every) - drv[i]["t0"] for i in range(n)]
    out: dict[str, Any] = {"end_to_end": _p50(e2e)}
    checks = [i for i in range(n) if drv[i].get("replica check")]
    if checks:  # the steps that compare whole replicas, and the others
        out["end_to_end_check_steps"] = _p50([e2e[i] for i in checks])
        after = {i + 1 for i in checks if i + 1 < n}  # their verdicts come at the next step's sync
        out["end_to_end_after_check_steps"] = _p50([e2e[i] for i in sorted(after)])
        if after:  # a one-time cost (a kernel's first load, a thread's start) hides in the p50 above
            out["end_to_end_after_first_check"] = round(e2e[min(after)] * 1e6, 1)
        out["end_to_end_other_steps"] = _p50([e2e[i] for i in range(n) if i not in set(checks) | after])
    out["driver"] = {k: _p50([s[b] - s[a] for s in drv if a in s and b in s]) for k, a, b in DRIVER}
    out["driver"]["frames written compiled"] = f"{int(sum(s.get('written compiled', 0.0) for s in drv))}/{n}"
    if last:
        fol = [every[r][i] for i, r in enumerate(last)]
        # the step's own read is its last (the warm's come before it): compiled, or the parser's
        fast = [f.get("read<", 0.0) > f.get("parse<", 0.0) for f in fol]
        start = ["read>" if q else "parse>" for q in fast]
        end = ["read<" if q else "read_region<" for q in fast]
        # the frame's publish: the ring's commit, or the end of the one call that wrote it
        pub = [d.get("commit<", d.get("direct<")) for d in drv]
        stages = {"commit -> read": _p50([f[a] - c for f, c, a in zip(fol, pub, start) if a in f and c is not None]),
                  "read": _p50([f[b] - f[a] for f, a, b in zip(fol, start, end) if a in f and b in f]),
                  "parse": _p50([f["parse<"] - f["parse>"] for f, q in zip(fol, fast) if not q and "parse<" in f]),
                  "columns": _p50([f["read_region<"] - f["parse<"] for f, q in zip(fol, fast)
                                   if not q and "read_region<" in f]),
                  "publish -> last warm's end": _p50([f["_run_warm<"] - c for f, c in zip(fol, pub)
                                                      if "_run_warm<" in f and c is not None]),
                  "frames published mid-warm": f"{sum(_mid_warm(f, c) for f, c in zip(fol, pub))}/{len(fol)}",
                  "to replay": _p50([f["apply_step>"] - f[b] for f, b in zip(fol, end) if b in f and "apply_step>" in f])}
        stages.update({k: _p50([s[b] - s[a] for s in fol if a in s and b in s]) for k, a, b in FOLLOWER})
        stages["after the one call"] = _p50([f["end"] - f["follow<"] for f in fol  # its metadata from the call's return
                                             if f.get("built in the read") and "follow<" in f])
        stages["frames read compiled"] = f"{sum(fast)}/{len(fast)}"
        stages["steps built in the read"] = f"{int(sum(f.get('built in the read', 0.0) for f in fol))}/{len(fol)}"
        out["last follower"] = stages
    return out


#: --lean's stages: (side, name, from stamp, to stamp); "pub" is the driver's publish (its "direct<")
LEAN = (("driver", "record", "t0", "record<"), ("driver", "publish", "t0", "pub"),
        ("driver", "publish -> own fused call", "pub", "fused>"), ("driver", "own fused call", "fused>", "fused<"),
        ("driver", "fused call -> end", "fused<", "end"), ("driver", "publish -> end", "pub", "end"),
        ("last follower", "publish -> its call", "pub", "follow>"), ("last follower", "its call", "follow>", "follow<"),
        ("last follower", "call -> end", "follow<", "end"), ("last follower", "publish -> end", "pub", "end"))


def summarize_lean(every: list[list[dict[str, float]]]) -> dict[str, Any]:
    """p50 µs of :data:`LEAN`'s stages (the follower's: the one that held its metadata last)."""
    drv, n = every[0], len(every[0])
    last = [max(range(len(every)), key=lambda r: every[r][i]["end"]) for i in range(n)]
    lastf = [max(range(1, len(every)), key=lambda r: every[r][i]["end"]) for i in range(n)] if len(every) > 1 else []
    out: dict[str, Any] = {"end_to_end": _p50([every[r][i]["end"] - drv[i]["t0"] for i, r in enumerate(last)]),
                           "driver": {}, "last follower": {}}
    for side, name, a, b in LEAN:
        rows = [dict(drv[i], pub=drv[i].get("direct<")) if side == "driver" else
                dict(every[lastf[i]][i], pub=drv[i].get("direct<"), t0=drv[i]["t0"]) for i in range(len(lastf) or n)]
        out[side][name] = _p50([s[b] - s[a] for s in rows if s.get(a) is not None and s.get(b) is not None])
    out["driver"]["held its metadata last"] = f"{sum(r == 0 for r in last)}/{n}"
    return out


def sync_main(args: argparse.Namespace, argv: list[str]) -> int:
    from bench_broadcast import run_world_procs
    from _harness.bench_meta import write_result

    if args.spin_us is not None:  # the ranks inherit it (their readers' spin after a message)
        os.environ["CPMETA_SHM_SPIN_US"] = str(args.spin_us)
    res = (summarize_lean if args.lean else summarize)(run_world_procs(args.world, args, rank_main))
    print(f"world {args.world} {args.model} {args.workload} defer_apply={args.defer} park {args.park_ms} ms, "
          f"p50 us over {args.steps} steps" + (" (lean stamps)" if args.lean else ""))
    print(f"  end to end {res['end_to_end']}" + (f" (steps with a replica check {res['end_to_end_check_steps']}, "
                                                   f"the steps after them {res['end_to_end_after_check_steps']}, "
                                                   f"the first of those {res.get('end_to_end_after_first_check')}, "
                                                   f"others {res['end_to_end_other_steps']})"
                                                   if "end_to_end_check_steps" in res else ""))
    for side in ("driver", "last follower"):
        if side in res:
            print(f"  {side:13s} " + "  ".join(f"{k} {v}" for k, v in res[side].items()))
    if args.out:
        write_result(args.out, {"results": res}, argv)
    return 0
