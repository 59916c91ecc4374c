#!/usr/bin/env python
"""Slot mapping (DESIGN section 11): the Triton kernel against the vectorized torch path.

    python scripts/bench_slot_mapping.py --out $OUT/slot.json          # on the GPU machine
    python scripts/bench_slot_mapping.py --out /tmp/slot.json --quick  # CPU smoke run

For 1, 64 and 256 requests x 8192 and 65536 tokens, in two layouts (``plain``: block 16, no CP;
``cp``: the seed's cp=2, interleave=128, block=128, rank 1), it measures per call:

* ``gpu_us``  -- device time only: the call (with ``error_out``, so no host sync) captured once
  in a CUDA graph, replayed ``--repeat`` times between CUDA events, mean per replay;
* ``call_us`` -- what an eager caller waits: one default call (data checks + the one 4-byte
  readback that turns a failed check into a ValueError), p50 of wall time;
* on CPU tensors only ``call_us`` of the torch path.

``--groups``: several KV-cache groups (full attention, block 16; sliding window, block 64;
a third with block 128 in a 256-token KV block) in ONE ``compute_slot_mapping_groups`` call
(one Triton launch on CUDA) against one ``compute_slot_mapping`` call per group, same timings;
rows ``layout=groups3``.

It also checks the Triton output against the CPU torch path (itself tested against the per-token
reference in tests/) on ``--cases`` random layouts and on every benchmarked batch. JSON goes to
``--out``; a short table is printed. Without CUDA or triton only the torch path runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpmeta.cp.slot_mapping import compute_slot_mapping  # noqa: E402
from cpmeta.cp.slot_mapping_groups import KVCacheGroup, compute_slot_mapping_groups  # noqa: E402
from cpmeta.gpu import slot_mapping_triton as tri  # noqa: E402
from bench_meta import run_meta  # noqa: E402  (scripts/bench_meta.py: the run block)

REQUESTS = (1, 64, 256)
TOKENS = (8192, 65536)
LAYOUTS: dict[str, dict[str, Any]] = {
    "plain": dict(block_size=16),
    "cp": dict(block_size=128, cp_world_size=2, cp_rank=1, cp_interleave=128),
}
MAX_CONTEXT = 32768  # tokens already cached before a request's chunk
MAX_BLOCK_ID = 1 << 20
TAIL_PAD = 512  # max_num_tokens = num_tokens + TAIL_PAD
#: (block_size, kv_cache_block_size, cp_world_size, cp_interleave, circular) of the random
#: equality cases: every branch, a few compiled variants (sizes are compile-time constants).
EQUALITY_CONFIGS: tuple[tuple[int, int, int, int, bool], ...] = (
    (16, 16, 1, 1, False), (1, 1, 1, 1, False), (128, 128, 1, 1, False), (16, 16, 1, 1, True),
    (128, 128, 2, 128, False), (16, 16, 2, 1, False), (16, 64, 4, 16, False), (64, 256, 3, 128, False),
    (1, 4, 8, 2, False),
)


def make_batch(num_reqs: int, num_tokens: int, layout: dict[str, Any], rng: random.Random,
               device: str) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """Chunks of consecutive positions after a random cached context; random block ids."""
    cuts = sorted(rng.sample(range(1, num_tokens), num_reqs - 1)) if num_reqs > 1 else []
    lens = [b - a for a, b in zip([0, *cuts], [*cuts, num_tokens])]
    starts = [rng.randint(0, MAX_CONTEXT) for _ in lens]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, lens)])
    bs = layout["block_size"]
    width = -(-(MAX_CONTEXT + num_tokens) // bs)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    table = torch.randint(0, MAX_BLOCK_ID, (num_reqs, width), dtype=torch.int32, generator=g)
    kw = {k: v for k, v in layout.items() if k != "block_size"}
    kw.update(block_size=bs, max_num_tokens=num_tokens + TAIL_PAD)
    return tuple(t.to(device) for t in (qsl, positions, table)), kw


def call(tensors: tuple[torch.Tensor, ...], kw: dict[str, Any], **extra: Any) -> torch.Tensor:
    qsl, pos, bt = tensors
    kw = dict(kw)
    bs = kw.pop("block_size")
    return compute_slot_mapping(qsl, pos, bt, bs, **kw, **extra)


def wall_us(fn: Callable[[], Any], repeat: int, cuda: bool) -> float:
    """p50 wall time of ``fn`` in microseconds (synchronized per call on CUDA)."""
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def graph_us(fn: Callable[[], Any], repeat: int) -> float:
    """Mean device time per call: ``fn`` captured once in a CUDA graph, replayed ``repeat`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up (Triton compile, allocator) outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeat


def bench_one(name: str, layout: dict[str, Any], num_reqs: int, num_tokens: int, args: argparse.Namespace,
              use_triton: bool, cuda: bool, rng: random.Random) -> dict[str, Any]:
    cpu_tensors, kw = make_batch(num_reqs, num_tokens, layout, rng, "cpu")
    tile, warps = tri.choose_tile(num_tokens, num_reqs)
    row: dict[str, Any] = dict(layout=name, num_reqs=num_reqs, num_tokens=num_tokens, tile=tile, num_warps=warps)
    expected = call(cpu_tensors, kw)
    row["cpu_torch_call_us"] = wall_us(lambda: call(cpu_tensors, kw), args.cpu_repeat, False)
    if not cuda:
        return row
    gpu = tuple(t.cuda() for t in cpu_tensors)
    backends = ["torch"] + (["triton"] if use_triton else [])
    for backend in backends:
        out = torch.empty(kw["max_num_tokens"], dtype=torch.int32, device="cuda")
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        row[f"{backend}_equal"] = bool(torch.equal(call(gpu, kw, backend=backend).cpu(), expected))
        row[f"{backend}_gpu_us"] = graph_us(lambda: call(gpu, kw, backend=backend, out=out, error_out=err),
                                            args.repeat)
        row[f"{backend}_call_us"] = wall_us(lambda: call(gpu, kw, backend=backend), args.repeat, True)
        row[f"{backend}_errors"] = int(err.item())
    return row


GROUPS: tuple[tuple[int, int], ...] = ((16, 16), (64, 64), (128, 256))  # (block_size, kv block)


def bench_groups(num_reqs: int, num_tokens: int, args: argparse.Namespace, use_triton: bool, cuda: bool,
                 rng: random.Random) -> dict[str, Any]:
    """Fused groups call vs one call per group (same requests, one table per group)."""
    (qsl, pos, _), _ = make_batch(num_reqs, num_tokens, dict(block_size=16), rng, "cpu")
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    groups = [KVCacheGroup(torch.randint(0, MAX_BLOCK_ID, (num_reqs, -(-(MAX_CONTEXT + num_tokens) // bs)),
                                         dtype=torch.int32, generator=g), bs, kvb) for bs, kvb in GROUPS]
    mnt = num_tokens + TAIL_PAD
    row: dict[str, Any] = dict(layout=f"groups{len(groups)}", num_reqs=num_reqs, num_tokens=num_tokens)

    def fused(q: torch.Tensor, p: torch.Tensor, gs: list, **kw: Any) -> torch.Tensor:
        return compute_slot_mapping_groups(q, p, gs, max_num_tokens=mnt, **kw)

    def split(q: torch.Tensor, p: torch.Tensor, gs: list, **kw: Any) -> list:
        return [compute_slot_mapping(q, p, x.block_table, x.block_size, max_num_tokens=mnt,
                                     kv_cache_block_size=x.kv_cache_block_size, **kw) for x in gs]

    expected = torch.stack(split(qsl, pos, groups))
    row["fused_equal_cpu"] = bool(torch.equal(fused(qsl, pos, groups), expected))
    row["cpu_torch_call_us"] = wall_us(lambda: fused(qsl, pos, groups), args.cpu_repeat, False)
    row["cpu_torch_split_call_us"] = wall_us(lambda: split(qsl, pos, groups), args.cpu_repeat, False)
    if not (cuda and use_triton):
        return row
    q, p = qsl.cuda(), pos.cuda()
    gg = [KVCacheGroup(x.block_table.cuda(), x.block_size, x.kv_cache_block_size) for x in groups]
    out = torch.empty(len(gg), mnt, dtype=torch.int32, device="cuda")
    outs = [out[i] for i in range(len(gg))]
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    row["triton_equal"] = bool(torch.equal(fused(q, p, gg).cpu(), expected))
    row["triton_gpu_us"] = graph_us(lambda: fused(q, p, gg, out=out, error_out=err), args.repeat)
    row["triton_split_gpu_us"] = graph_us(lambda: [compute_slot_mapping(
        q, p, x.block_table, x.block_size, max_num_tokens=mnt, kv_cache_block_size=x.kv_cache_block_size,
        out=o, error_out=err) for x, o in zip(gg, outs)], args.repeat)
    row["triton_call_us"] = wall_us(lambda: fused(q, p, gg), args.repeat, True)
    row["triton_split_call_us"] = wall_us(lambda: split(q, p, gg), args.repeat, True)
    row["triton_errors"] = int(err.item())
    return row


def random_equality(cases: int, rng: random.Random) -> dict[str, Any]:
    """Triton vs the CPU torch path on small random layouts of every branch."""
    mismatches: list[dict[str, Any]] = []
    for i in range(cases):
        bs, kvb, world, inter, circular = rng.choice(EQUALITY_CONFIGS)
        num_reqs = rng.randint(0, 8)
        lens = [rng.randint(0, 3000) for _ in range(num_reqs)]
        pos_parts = []
        for n in lens:
            if rng.random() < 0.25:  # scattered positions exercise the out-of-window loads
                pos_parts.append(torch.randint(-5 if circular else 0, 20000, (n,)))
            else:
                s = rng.randint(0, 20000)
                pos_parts.append(torch.arange(s, s + n))
        positions = torch.cat(pos_parts) if pos_parts else torch.zeros(0, dtype=torch.int64)
        qsl = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
        width = int(positions.clamp(min=0).max()) // bs + 2 if positions.numel() else 1
        table = torch.randint(0, MAX_BLOCK_ID, (num_reqs + 1, width), dtype=torch.int32)
        kw = dict(block_size=bs, max_num_tokens=int(qsl[-1]) + rng.randint(0, 3000), kv_cache_block_size=kvb,
                  cp_world_size=world, cp_rank=rng.randrange(world), cp_interleave=inter, circular=circular,
                  pad_id=rng.choice([-1, 0]))
        cpu = call((qsl, positions, table), kw)
        gpu = call(tuple(t.cuda() for t in (qsl, positions, table)), kw, backend="triton").cpu()
        if not torch.equal(cpu, gpu):
            mismatches.append(dict(case=i, **{k: v for k, v in kw.items()}))
    return dict(cases=cases, mismatches=len(mismatches), first_mismatches=mismatches[:5])


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["layout", "num_reqs", "num_tokens", "triton_gpu_us", "torch_gpu_us", "triton_call_us",
            "torch_call_us", "cpu_torch_call_us"]
    if rows and rows[0]["layout"].startswith("groups"):
        cols = ["layout", "num_reqs", "num_tokens", "triton_gpu_us", "triton_split_gpu_us", "triton_call_us",
                "triton_split_call_us", "cpu_torch_call_us", "cpu_torch_split_call_us"]
    print(" | ".join(f"{c:>17}" for c in cols))
    for r in rows:
        cells = [r.get(c, "-") for c in cols]
        print(" | ".join(f"{c:>17.1f}" if isinstance(c, float) else f"{c!s:>17}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON output path")
    ap.add_argument("--repeat", type=int, default=200, help="GPU timing iterations")
    ap.add_argument("--cpu-repeat", type=int, default=20, help="CPU timing iterations")
    ap.add_argument("--cases", type=int, default=200, help="random equality cases (GPU only)")
    ap.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--groups", action="store_true", help="fused KV-cache groups vs one call per group")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeat, args.cpu_repeat, args.cases = 10, 3, 20
    cuda = torch.cuda.is_available()
    use_triton = cuda and tri.triton_available()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    if args.groups:
        rows = [bench_groups(r, t, args, use_triton, cuda, rng) for r in REQUESTS for t in TOKENS]
    else:
        rows = [bench_one(name, layout, r, t, args, use_triton, cuda, rng)
                for name, layout in LAYOUTS.items() for r in REQUESTS for t in TOKENS]
    report: dict[str, Any] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        run=run_meta(argv), torch=torch.__version__, cuda=cuda,
        device=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        triton=__import__("triton").__version__ if use_triton else None,
        cpu_threads=torch.get_num_threads(), tile_tiers=tri.TILE_TIERS,
        results=rows,
    )
    if use_triton and not args.groups:
        report["random_equality"] = random_equality(args.cases, rng)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(rows)
    if args.groups:
        ok = all(r["fused_equal_cpu"] and r.get("triton_equal", True) and not r.get("triton_errors")
                 for r in rows)
        print(f"fused groups equal to per-group calls on every batch: {ok}")
        return 0 if ok else 1
    if use_triton:
        eq = report["random_equality"]
        bench_ok = all(r.get("triton_equal", True) and r.get("torch_equal", True) for r in rows)
        print(f"triton vs CPU: {eq['cases'] - eq['mismatches']}/{eq['cases']} random cases equal; "
              f"benchmark batches equal: {bench_ok}")
        return 0 if eq["mismatches"] == 0 and bench_ok else 1
    print("no CUDA/triton: torch path on CPU only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
