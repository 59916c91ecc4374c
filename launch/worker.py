"""Per-rank step loop: build on the driver, broadcast, mirror, verify, report.

Run under torchrun (or ``python -m launch``, which calls torchrun's machinery)::

    torchrun --nproc-per-node 2 -m launch.worker --workload mixed --steps 50 --verify

Rank 0 (the driver) alone runs the seeded :class:`~launch.scheduler.SyntheticScheduler`,
builds ``InputMetadata`` and broadcasts it; the followers never see a scheduler object and
derive everything from the broadcast. With ``--cp-mirror`` every rank keeps its zigzag share
of prompt rows; ``--verify`` checks every field of every rank bit-for-bit against the driver's
independent rebuild through all-gathered per-field digests (:mod:`launch.verify`), plus the
un-mirror and, with ``--kv-interleave``, KV ownership; ``--attention-check`` runs
:mod:`launch.attention_check`. Rank 0 prints a table at the end; ``--json`` writes it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import sys
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

import cpmeta
from cpmeta.metadata import InputMetadata

from .scheduler import WORKLOADS, SyntheticScheduler, default_config
from .verify import VerifyError, expected_table, verify_step

__all__ = ["main", "build_parser"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch.worker", description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=WORKLOADS, default="mixed")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from the timing table")
    p.add_argument("--cp-mirror", action="store_true", help="each rank keeps its zigzag share")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--verify", action="store_true", help="rebuild locally and compare bitwise")
    p.add_argument("--json", default=None, help="write the summary table here (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode-seqs", type=int, default=64)
    p.add_argument("--prompt-seqs", type=int, default=4)
    p.add_argument("--max-prompt", type=int, default=4096)
    p.add_argument("--attn-info", action="store_true", help="also run compute_attn_info each step")
    p.add_argument("--kv-interleave", type=int, default=0,
                   help="derive each rank's CP-interleaved KV slot mapping (0 = off)")
    p.add_argument("--attention-check", action="store_true",
                   help="every rank attends over its rows (prefill zigzag; decode over its interleaved "
                        "KV shard, --kv-interleave or 1) and the gathered result must equal one rank's")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck peer is an error")
    return p


def resolve_backend(name: str) -> str:
    """``auto`` = NCCL when every local rank can have its own GPU, else gloo."""
    if name != "auto":
        return name
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return "nccl"
    return "gloo"


def _build(is_prompt: bool, seqs: list, cfg: cpmeta.MetadataConfig) -> InputMetadata:
    return cpmeta.prepare_prompt(seqs, cfg) if is_prompt else cpmeta.prepare_decode(seqs, cfg)


def _nbytes(md: InputMetadata) -> int:
    seen: dict[int, int] = {}
    for _, t in md.tensors():
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _check(rank: int, step: int, what: str, diffs: list[str]) -> None:
    if diffs:
        raise VerifyError(f"rank {rank} step {step}: {what} differs: " + "; ".join(diffs))


def _verify_unmirror(full: InputMetadata, mine: InputMetadata, world: int, device: torch.device) -> list[str]:
    """all_gather every rank's mirrored rows; un-mirrored they must equal the full rows."""
    out = []
    rows = {"positions": (mine.positions, full.positions)}
    for r, t in (mine.ks or {}).items():
        rows[f"ks.{r}"] = (t, full.ks[r])
        rows[f"ke.{r}"] = (mine.ke[r], full.ke[r])
    for name, (part, whole) in rows.items():
        part = part.to(device).contiguous()
        gathered = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(gathered, part)
        restored = cpmeta.unmirror(torch.cat(gathered), mine.mirror_cp_reverse_index.to(device))
        if not torch.equal(restored.cpu(), whole.cpu()):
            out.append(f"unmirror({name}) != full {name}")
    return out


def _verify_slot_mapping(md: InputMetadata, args: Any, rank: int, world: int, cfg: Any,
                         device: torch.device) -> list[str]:
    """Each rank derives its CP-interleaved KV slots from the received metadata alone.

    Prompt metadata carries ``seq_block_tables``, decode ``block_tables``: no scheduler object
    is read. Summed over ranks, every real token must be owned exactly once and a
    placeholder's never.
    """
    sm = cpmeta.compute_slot_mapping_from_metadata(md, cfg.block_size, cp_world_size=world, cp_rank=rank,
                                                   cp_interleave=args.kv_interleave)
    owned = (sm != cpmeta.PAD_SLOT_ID).to(torch.int32).to(device)
    dist.all_reduce(owned)
    want = md.valid_token_mask.to(device=device, dtype=torch.int32)
    bad = int((owned != want).sum())
    return [f"{bad} tokens are not owned by exactly one rank"] if bad else []


def run_steps(args: Any, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """The per-step loop. Only rank 0 (the driver) owns the scheduler and its sequences; the
    followers work from the broadcast alone: mirror, slot mapping, attention check, verify."""
    cfg = default_config(yoco=args.workload == "yoco")
    sched = SyntheticScheduler(args.seed, cfg, args.workload, decode_seqs=args.decode_seqs,
                               prompt_seqs=args.prompt_seqs, max_prompt=args.max_prompt) if rank == 0 else None
    attn_cfg = cfg if args.attn_info else None
    t_build, t_bcast, t_mirror, nbytes = [], [], [], []
    attn_err = {"prefill": 0.0, "decode": 0.0}  # max |CP - single rank| seen (--attention-check)
    with cpmeta.MetadataBroadcaster(device=device, timeout=args.timeout) as bc:
        for step in range(args.steps):
            t0 = time.perf_counter()
            md, expected = None, None
            if sched is not None:  # the driver
                is_prompt, seqs = sched.next_batch()
                md = _build(is_prompt, seqs, cfg)
                if args.attn_info:
                    md.compute_attn_info(cfg)
            t1 = time.perf_counter()
            got = bc.broadcast(md)
            t2 = time.perf_counter()
            mine = None
            if args.cp_mirror and got.is_prompt:
                mine = cpmeta.prepare_for_mirror_cp(got, rank, world)
                if args.attn_info:
                    mine.compute_attn_info(cfg)
            t3 = time.perf_counter()
            if step >= args.warmup:
                if rank == 0:
                    t_build.append(t1 - t0)
                t_bcast.append(t2 - t1)
                if mine is not None:
                    t_mirror.append(t3 - t2)
                nbytes.append(_nbytes(got))
            if args.verify:
                if sched is not None:  # an independent rebuild on the driver is the reference
                    local = _build(is_prompt, seqs, cfg)
                    if args.attn_info:
                        local.compute_attn_info(cfg)
                    expected = expected_table(local, world, args.cp_mirror, attn_cfg)
                verify_step(step, rank, world, device, got, mine, expected)
                if mine is not None:
                    _check(rank, step, "un-mirror", _verify_unmirror(got, mine, world, device))
                if args.kv_interleave:
                    _check(rank, step, "kv interleave", _verify_slot_mapping(got, args, rank, world, cfg, device))
            if args.attention_check:
                from .attention_check import check_step

                kind = "prefill" if got.is_prompt else "decode"
                attn_err[kind] = max(attn_err[kind], check_step(
                    got, mine, rank, world, device, cfg.block_size, args.kv_interleave or 1, step))
    return {"build": t_build, "broadcast": t_bcast, "mirror": t_mirror, "bytes": nbytes,
            "attn_err": attn_err}


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(stats: dict[str, Any], world: int, device: torch.device) -> Optional[dict[str, Any]]:
    """Gather per-rank percentiles (as a float tensor, no pickle) and format them on rank 0."""
    keys = ("build", "broadcast", "mirror")
    mine = []
    for k in keys:
        mine += [_pct(stats[k], 0.5) * 1e6, _pct(stats[k], 0.9) * 1e6]
    mine.append(float(sum(stats["bytes"]) / max(1, len(stats["bytes"]))))
    t = torch.tensor(mine, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(gathered, t)
    if dist.get_rank() != 0:
        return None
    rows = [g.cpu().tolist() for g in gathered]
    return {"ranks": rows, "columns": [f"{k}_{p}_us" for k in keys for p in ("p50", "p90")] + ["bytes"]}


def _print_table(summary: dict[str, Any], args: Any, backend: str, world: int) -> None:
    rows = summary["ranks"]
    out = [
        f"cpmeta launch: workload={args.workload} steps={args.steps} (timed {args.steps - args.warmup}) "
        f"world={world} backend={backend} cp_mirror={args.cp_mirror} verify={args.verify}",
        f"bytes per step (avg): {rows[0][-1]:.0f}",
        f"{'rank':>4} {'build p50':>10} {'build p90':>10} {'bcast p50':>10} {'bcast p90':>10} "
        f"{'mirror p50':>10} {'mirror p90':>10}   (microseconds)",
    ]
    for r, v in enumerate(rows):
        out.append(f"{r:>4} " + " ".join(f"{x:>10.1f}" for x in v[:6]))
    if args.verify:
        out.append(f"verify: every rank bit-identical to the driver's rebuild on all {args.steps} steps")
    if args.attention_check:
        err = summary.get("attn_err", {})
        out.append(f"attention check: CP result equals single-rank attention on all {args.steps} steps "
                   f"(max |diff| prefill {err.get('prefill', 0):.3g}, decode {err.get('decode', 0):.3g}, "
                   f"kv interleave {args.kv_interleave or 1})")
    print("\n".join(out), flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    backend = resolve_backend(args.backend)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(args.timeout, 30)))
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    try:
        stats = run_steps(args, rank, world, device)
        summary = summarize(stats, world, device)
        if summary is not None:
            summary["attn_err"] = stats["attn_err"]
            summary.update(workload=args.workload, steps=args.steps, world=world, backend=backend,
                           host=socket.gethostname(), date=datetime.date.today().isoformat())
            _print_table(summary, args, backend, world)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(summary, f, indent=1)
        return 0
    except VerifyError as e:
        print(f"VERIFY FAILED: {e}", file=sys.stderr, flush=True)
        return 3
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
