#!/usr/bin/env python
"""End-to-end metadata broadcast: cpmeta against what engines use today, in one run.

For each world size, payload and method, every step is timed as

    latency = max over ranks (time the rank holds the whole metadata) - (time the driver called)

Ranks agree on time through CLOCK_MONOTONIC, which is one clock for every process of a host
(``time.monotonic()``). Two timing modes (``--modes``):
  barrier  a barrier right before each step: followers are still running when the driver starts
  engine   after the barrier the driver idles ``--park-ms`` (scheduling) while the followers sit
           in their receive call and park, as in an inference engine; the clock starts at the
           driver's call. ``cpmeta+bs`` is cpmeta with ``begin_step()`` called before that idle
           time (the driver announces the step before it builds).
Per-step samples are gathered as a float tensor (no pickle) after the run. Before every step (not
timed) the driver writes new values into its metadata in place (the first element of every tensor,
``max_seqlen_k``): same layout, new content, so no method can serve a step from a cache; after a
cell every rank checks that the last step's values arrived.

Methods (same group, same payloads):
  cpmeta      cpmeta.MetadataBroadcaster (shm ring; CPU tensors inside the ring message, or one
              NCCL broadcast for CUDA)
  cpmeta+p    cpmeta with persistent_outputs=True (and begin_step() in engine mode): a repeated
              layout lands in per-layout arenas, the cached InputMetadata is returned
  bol         torch.distributed.broadcast_object_list([md]) -- the whole object pickled
  tdict       vLLM's broadcast_tensor_dict scheme, re-implemented from its description: metadata
              list with tensor descriptors via broadcast_object_list, then one async broadcast per
              tensor (CPU tensors on the gloo group, CUDA tensors on the NCCL group)
  mq          vLLM's shared-memory MessageQueue carrying the whole metadata pickled (only when
              the ``vllm`` package is importable; never required)
  floor       one broadcast of a preallocated buffer of the same total bytes + one 4 KiB message

mq without vllm installed: ``bash /work/shared/tools/mq_bundle.sh mq_bundle 3.12`` builds a
carryable bundle; run with ``PYTHONPATH=.:mq_bundle`` (``VLLM_TARGET_DEVICE=cpu`` is set here).

    python scripts/bench_broadcast.py                  # worlds 2 3 4, all payloads, CPU/gloo
    python scripts/bench_broadcast.py --quick          # smoke run (CI)
    python scripts/bench_broadcast.py --backend nccl --worlds 1   # on a GPU machine
    python scripts/bench_broadcast.py transport [--quick]         # the channels under the broadcaster:
                                                                  # ObjectChannel / tensor paths vs torch.distributed
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
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpmeta.metadata import InputMetadata  # noqa: E402
from cpmeta.transport import ObjectChannel  # noqa: E402
from _harness.bench_meta import latency_us, run_meta, write_result  # noqa: E402  (scripts/_harness/bench_meta.py: the shared harness)

METHODS = ("cpmeta", "cpmeta+bs", "cpmeta+p", "cpmeta-tdict", "bol", "tdict", "mq", "floor")
MODES = ("barrier", "engine")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # mq: the vllm bundle imports without CUDA


# ---- payloads ---------------------------------------------------------------------------------


def _prompt_seqs(total_q: int, n_seqs: int, cfg: Any) -> list:
    from cpmeta import SequenceMetadata
    from cpmeta.sequence import blocks_needed

    per = total_q // n_seqs
    seqs = []
    for i in range(n_seqs):
        q_start = (i % 3) * 256  # a mix of first chunks and continued chunks
        k = q_start + per
        seqs.append(SequenceMetadata(
            seqlen_q=per, seqlen_k=k, block_table=list(range(i * 64, i * 64 + blocks_needed(k, cfg))),
            state_id=i, token_ids=[(7 * t + i) % 30000 + 1 for t in range(k)],
            swa_valid_start=0))
    return seqs


def make_payload(name: str, attn_info: bool) -> tuple[Any, Any]:
    """``(cfg, InputMetadata)`` for a named payload (deterministic, identical on every rank)."""
    import cpmeta
    from cpmeta.launch.scheduler import SyntheticScheduler, default_config

    cfg = default_config()
    kind, n = name.split("-")
    if kind == "decode":
        sched = SyntheticScheduler(0, cfg, "decode", decode_seqs=int(n), placeholder_rate=0.0)
        _, seqs = sched.next_batch()
        md = cpmeta.prepare_decode(seqs, cfg)
    else:
        total_q = int(n.rstrip("k")) * 1024
        md = cpmeta.prepare_prompt(_prompt_seqs(total_q, 8, cfg), cfg)
    if attn_info:
        md.compute_attn_info(cfg)
    return cfg, md



from _harness.broadcast_methods import Method, make_method, payload_bytes  # noqa: E402  (scripts/ is on sys.path)


# ---- the per-rank run --------------------------------------------------------------------------


def _sync_device(md: Any, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()


def _unique_tensors(md: Any) -> list[torch.Tensor]:
    seen = {id(t): t for _, t in md.tensors()}
    return [t for t in seen.values() if t.numel()]


def step_values(md: Any, i: int, base_k: int) -> None:
    """Write step ``i``'s values into ``md`` in place (identical on every rank for a given i):
    every tensor's first element and ``max_seqlen_k``. Layout unchanged."""
    for t in _unique_tensors(md):
        t[(0,) * t.dim()] = bool(i % 2) if t.dtype == torch.bool else i % 100
    if md.max_seqlen_k is not None:
        md.max_seqlen_k = base_k + i % 2


def check_values(got: Any, md: Any, i: int, base_k: int, what: str) -> None:
    """The received metadata holds step ``i``'s values (raises otherwise)."""
    if got is None or got is md or not hasattr(got, "tensors"):
        return
    want = [bool(i % 2) if t.dtype == torch.bool else i % 100 for t in _unique_tensors(md)]
    have = [t[(0,) * t.dim()].item() for t in _unique_tensors(got)]
    if want != have or (md.max_seqlen_k is not None and got.max_seqlen_k != base_k + i % 2):
        raise RuntimeError(f"{what}: step {i} values did not arrive ({have[:4]} vs {want[:4]})")


def time_cell(method: Method, md: Any, steps: int, warmup: int, budget_s: float,
              park_s: float = 0.0) -> list[float]:
    """Per-step latencies (seconds), identical list on every rank (gathered max - driver start).
    ``park_s`` > 0: engine mode (the driver idles that long after the barrier)."""
    import torch.distributed as dist

    starts, ends = [], []
    t_begin = time.monotonic()
    n_done = 0
    vary = isinstance(md, InputMetadata)  # other payloads (bench_gpu.py cp's sequence lists) as given
    base_k = md.max_seqlen_k if vary else 0
    got = None
    for i in range(warmup + steps):
        if method.rank == 0 and vary:
            step_values(md, i, base_k)
        dist.barrier()
        if park_s and method.rank == 0:
            method.announce()
            time.sleep(park_s)
        t0 = time.monotonic()
        got = method.step(md if method.rank == 0 else None)
        _sync_device(got, method.device)
        t1 = time.monotonic()
        if i >= warmup:
            starts.append(t0)
            ends.append(t1)
            n_done += 1
        # every rank must agree on stopping early: decide on the driver's clock, then share it
        stop = torch.tensor([1 if (time.monotonic() - t_begin > budget_s and n_done >= 5) else 0])
        dist.broadcast(stop, src=0)
        if int(stop):
            break
    if vary:
        if method.rank != 0:  # followers regenerate the driver's last step on their copy of the payload
            step_values(md, i, base_k)
        check_values(got, md, i, base_k, f"{type(method).__name__} rank {method.rank}")
    t = torch.tensor([starts, ends], dtype=torch.float64)
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    start0 = gathered[0][0]
    last = torch.stack([g[1] for g in gathered]).max(0).values
    return (last - start0).tolist()


def init_rank(rank: int, world: int, port: int, backend: str, cuda_with_gloo: bool = False) -> torch.device:
    """Join the benchmark's process group as ``rank`` (one thread) and return its device: rank's
    GPU with NCCL, ``cuda:0`` with gloo when ``cuda_with_gloo`` (ranks sharing one GPU), else CPU.
    gloo carries the timing loop's control collectives in every case."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cuda", 0) if cuda_with_gloo else torch.device("cpu")
    dist.init_process_group("gloo" if backend == "gloo" else "cuda:nccl,cpu:gloo")
    return device


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    import torch.distributed as dist

    device = init_rank(rank, world, port, args.backend)
    results = []
    for payload, attn, mode in [(p, a, m) for p in args.payloads for a in args.attn_info
                                for m in args.modes]:
        cfg, md = make_payload(payload, attn)
        if device.type == "cuda" and args.md_on_device:
            md = md.to(device)
        nbytes = payload_bytes(md)
        big = nbytes > (8 << 20)
        for mname in args.methods:
            if mname == "cpmeta+bs" and mode != "engine":
                continue
            method = make_method(mname, rank, device)
            if method is None:
                continue
            drv = method.prepare(md)
            steps = max(5, args.steps // (8 if big else 1))
            park = args.park_ms * 1e-3 if mode == "engine" else 0.0
            lat = time_cell(method, drv, steps, 1 if big else args.warmup, args.budget, park)
            method.close()
            if rank == 0:
                s = sorted(lat)
                results.append({
                    "world": world, "payload": payload, "attn_info": attn, "method": mname,
                    "mode": mode,
                    "bytes": nbytes, "n": len(s), **latency_us(s),
                    "mean_us": sum(s) / len(s) * 1e6,
                })
                r = results[-1]
                print(f"  world={world} {payload:>10} attn={int(attn)} {mode:>7} {mname:>9}: "
                      f"p50 {r['p50_us']:10.1f} us  p90 {r['p90_us']:10.1f} us  ({nbytes} B)", flush=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_entry(target: Any, *args: Any) -> None:
    """A spawned rank: ``target(*args)``, then ``os._exit`` -- as ``cpmeta.testing`` and
    ``cpmeta.launch`` end their ranks: the interpreter's teardown of torch / gloo objects after
    ``destroy_process_group`` aborted a rank now and then ("terminate called without an active
    exception", ~1 in 20 runs of ``profile_phases.py sync --world 3``), after its work was done."""
    import traceback

    code = 0
    try:
        target(*args)
    except BaseException:  # noqa: BLE001 - printed, and the exit code says it failed
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_world_procs(world: int, args: argparse.Namespace, target: Any = None) -> list[dict]:
    """Run ``target(rank, world, port, args, out_path)`` (default :func:`rank_main`) on ``world``
    spawned processes; rank 0 writes the JSON results to ``out_path``, returned here."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        port = _free_port()  # one per world, taken right before the ranks bind it
        procs = [ctx.Process(target=_rank_entry, args=(target or rank_main, r, world, port, args, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(args.timeout)
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        for p in procs:
            if p.is_alive():
                p.kill()
        if bad:
            raise SystemExit(f"world {world}: ranks {bad} failed")
        return json.loads(Path(out).read_text())


# ---- transport: the channels under the broadcaster ---------------------------------------------

TRANSPORT_DOC = """Benchmark the transport package against the torch.distributed calls a user would otherwise use.

Usage: ``python scripts/bench_broadcast.py transport [--quick] [--out docs/benchmarks/transport.json]``

Measured in one run, on real processes (gloo, one host):

1. object broadcast latency, ``ObjectChannel.broadcast`` vs ``broadcast_object_list``, payload
   256 B .. 4 MiB, 1..3 readers;
2. a decode-like dict of 25 CPU tensors (~300 KB) through ``MetadataBroadcaster(schema=dict)``:
   ``tensor_path="collective"`` (the frame, then its tensor region as one gloo collective) vs
   one ``dist.broadcast`` per tensor vs ``"packed"`` (the region inside the shared-memory frame);
3. the packed-vs-collective threshold (``CPMETA_PACKED_MAX_BYTES``): one tensor of 1 KiB .. 4
   MiB, both paths.

Latency = time from the source starting the call until the LAST follower holds the result
(``time.perf_counter_ns`` is CLOCK_MONOTONIC, shared by the processes of one host); every
iteration starts after a barrier and a 2 ms busy pause of the source (it stays warm, like a
driver building metadata), so messages never queue and followers are measured waking from their
wait. p50/p90 over iterations.
"""

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


def _tensor_methods(rank: int, paths: dict[str, Any],
                    ts: list[torch.Tensor]) -> dict[str, Callable[[int], int]]:
    """``collective``: the tensors as a tensor dict through ``MetadataBroadcaster`` with
    ``tensor_path="collective"`` (the frame, then its tensor region as ONE gloo broadcast);
    ``packed_in_ring``: the same with ``"packed"`` (the region inside the frame, in the ring);
    ``per_tensor_broadcast``: one ``dist.broadcast`` per tensor (vLLM's tensor loop)."""
    from cpmeta.broadcast.dict_schema import TREE_KEY, encode_tree

    specs = [(t.dtype, tuple(t.shape)) for t in ts]
    tokens, tensors, labels = encode_tree({f"t{i}": t for i, t in enumerate(ts)})  # broadcast_tensor_dict's frame
    flat: dict[str, Any] = {TREE_KEY: tokens, **dict(zip(labels, tensors))}
    first = labels[next(i for i, t in enumerate(tensors) if t is ts[0])]

    def via(bc: Any) -> Callable[[int], int]:
        def step(t0: int) -> int:
            ts[0][0] = t0
            return int(bc.broadcast(flat if rank == 0 else None)[first][0])
        return step

    def per_tensor(t0: int) -> int:
        ts[0][0] = t0
        bufs = ts if rank == 0 else [torch.empty(s, dtype=d) for d, s in specs]
        for b in bufs:
            dist.broadcast(b, src=0)
        return int(bufs[0][0])

    return {"collective": via(paths["collective"]), "per_tensor_broadcast": per_tensor,
            "packed_in_ring": via(paths["packed"])}


def _bench_tensors(rank: int, quick: bool, paths: dict[str, Any]) -> dict:
    ts = _decode_like()
    n = 30 if quick else 200
    out: dict[str, Any] = {"num_tensors": len(ts), "bytes": sum(t.numel() * t.element_size() for t in ts)}
    for name, fn in _tensor_methods(rank, paths, ts).items():
        p50, p90 = _latency(rank, n, fn)
        out[name] = {"p50_us": p50, "p90_us": p90}
    out["speedup_p50_vs_per_tensor"] = out["per_tensor_broadcast"]["p50_us"] / out["collective"]["p50_us"]
    return out


def _bench_threshold(rank: int, quick: bool, paths: dict[str, Any]) -> list[dict]:
    rows = []
    for size in THRESHOLD_SIZES:
        ts = [torch.zeros(1, dtype=torch.int64), torch.randint(0, 255, (size,), dtype=torch.uint8)]
        m = _tensor_methods(rank, paths, ts)
        n = _iters(size, quick)
        pk, _ = _latency(rank, n, m["packed_in_ring"])
        co, _ = _latency(rank, n, m["collective"])
        rows.append({"size": size, "packed_p50_us": pk, "collective_p50_us": co})
    return rows


def transport_rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    from cpmeta import MetadataBroadcaster

    init_rank(rank, world, port, "gloo")
    ch = ObjectChannel(None, 0)
    paths = {p: MetadataBroadcaster(src=0, schema=dict, tensor_path=p) for p in ("collective", "packed")}
    res: dict[str, Any] = {"readers": world - 1, "objects": _bench_objects(rank, args.quick, ch),
                           "tensors": _bench_tensors(rank, args.quick, paths)}
    if world == 3:
        res["threshold"] = _bench_threshold(rank, args.quick, paths)
    ch.close()
    for bc in paths.values():
        bc.close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(res))


def transport_table(results: list[dict]) -> None:
    print(f"{'readers':>7} {'size':>9} {'channel p50/p90 µs':>20} {'bcast_object_list p50/p90 µs':>29} {'x':>6}")
    for r in results:
        for o in r["objects"]:
            print(f"{r['readers']:>7} {o['size']:>9} {o['channel_p50_us']:>9.0f}/{o['channel_p90_us']:<9.0f} "
                  f"{o['bol_p50_us']:>14.0f}/{o['bol_p90_us']:<14.0f} {o['speedup_p50']:>6.1f}")
    print(f"\n{'readers':>7} {'collective':>15} {'per_tensor':>11} {'packed_in_ring':>15} {'x':>6}  (p50 µs)")
    for r in results:
        t = r["tensors"]
        print(f"{r['readers']:>7} {t['collective']['p50_us']:>15.0f} {t['per_tensor_broadcast']['p50_us']:>11.0f} "
              f"{t['packed_in_ring']['p50_us']:>15.0f} {t['speedup_p50_vs_per_tensor']:>6.1f}")
    for r in results:
        for row in r.get("threshold", []):
            print(f"threshold (2 readers) size {row['size']:>8}: packed {row['packed_p50_us']:>8.0f} µs, "
                  f"collective {row['collective_p50_us']:>8.0f} µs")



def transport_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_broadcast.py transport", description=TRANSPORT_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    ap.add_argument("--out", default=str(ROOT / "docs/benchmarks/transport.json"))
    ap.add_argument("--max-readers", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    results = [run_world_procs(r + 1, args, transport_rank_main) for r in range(1, args.max_readers + 1)]
    transport_table(results)
    if args.out:
        write_result(args.out, {"load_avg_at_end": os.getloadavg(), "results": results}, ["transport", *argv])
    return 0


# ---- the broadcast benchmark's table, plot and command ----------------------------------------


def print_table(results: list[dict]) -> None:
    """p50 of every method per cell, then cpmeta's and cpmeta+p's ratios to mq and floor."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in results:
        cells.setdefault((r["world"], r["payload"], r["attn_info"], r["bytes"], r.get("mode", "barrier")),
                         {})[r["method"]] = r
    ratios = [(a, b) for a in ("cpmeta", "cpmeta+p") for b in ("mq", "floor")] + [
        ("cpmeta-tdict", "tdict"), ("cpmeta-tdict", "mq")]
    hdr = f"{'world':>5} {'payload':>11} {'attn':>4} {'bytes':>9} {'mode':>7}" + "".join(
        f" {m:>10}" for m in METHODS) + "".join(f" {a + '/' + b:>15}" for a, b in ratios)
    print(hdr)
    for (w, p, a, b, mode), ms in sorted(cells.items()):
        line = f"{w:>5} {p:>11} {int(a):>4} {b:>9} {mode:>7}"
        for m in METHODS:
            line += f" {ms[m]['p50_us']:>8.0f}us" if m in ms else f" {'-':>10}"
        for x, y in ratios:
            line += (f" {ms[x]['p50_us'] / ms[y]['p50_us']:>15.3f}" if x in ms and y in ms
                     else f" {'-':>15}")
        print(line)
    print("(p50 per method; ratios below 1 mean cpmeta / cpmeta+p is faster than mq / the floor)")


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    worlds = sorted({r["world"] for r in results})
    fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 4), squeeze=False)
    for ax, w in zip(axes[0], worlds):
        for m in METHODS:
            for mode, style in (("barrier", "o-"), ("engine", "s--")):
                pts = sorted((r["bytes"], r["p50_us"]) for r in results if r["world"] == w
                             and r["method"] == m and r.get("mode", "barrier") == mode)
                if pts:
                    ax.loglog([p[0] for p in pts], [p[1] for p in pts], style, label=f"{m} ({mode})")
        ax.set_title(f"world size {w}")
        ax.set_xlabel("payload bytes")
        ax.set_ylabel("p50 latency (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["transport"]:
        return transport_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--payloads", nargs="+", default=["decode-64", "decode-256", "prompt-8k", "prompt-32k"])
    p.add_argument("--attn-info", type=int, nargs="+", default=[0, 1], help="0: before, 1: after compute_attn_info")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="barrier: followers running at the start; engine: followers parked")
    p.add_argument("--park-ms", type=float, default=3.0, help="engine mode: driver idle before a step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--budget", type=float, default=1.5, help="seconds per cell before stopping early")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--md-on-device", action="store_true", help="NCCL: metadata already on the GPU")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="smoke run: world 2, decode-64 only, few steps")
    p.add_argument("--out", default=str(ROOT / "docs/benchmarks/broadcast.json"))
    p.add_argument("--plot", default=None, help="PNG path (default: beside --out)")
    args = p.parse_args(argv)
    if args.quick:
        args.worlds, args.payloads, args.attn_info, args.modes = [2], ["decode-64"], [0], ["barrier"]
        args.steps, args.warmup, args.budget = 8, 2, 0.5
    args.attn_info = [bool(a) for a in args.attn_info]
    results = []
    for w in args.worlds:
        print(f"world size {w} ({args.backend})", flush=True)
        results += run_world_procs(w, args)
    run = run_meta(argv)
    meta = {
        "date": datetime.date.today().isoformat(), "host": run["host"],
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "torch": torch.__version__,
        "command": "python scripts/bench_broadcast.py " + " ".join(argv),
        "backend": args.backend, "timed": "max over ranks of completion - driver start (CLOCK_MONOTONIC)",
        "modes": {"barrier": "barrier right before each step",
                  "engine": f"driver idles {args.park_ms} ms after the barrier; followers parked"},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"run": run, "meta": meta, "results": results}, indent=1))
    print_table(results)
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    if not args.quick and plot(results, png):
        print(f"plot: {png}")
    print(f"json: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
