"""Per-rank step loop: the step's metadata on every rank, mirror, verify, report.

Run under torchrun (or ``python -m cpmeta.launch``, which calls torchrun's machinery)::

    torchrun --nproc-per-node 2 -m cpmeta.launch.worker --workload mixed --steps 50 --verify

Rank 0 (the driver) alone runs the seeded :class:`~launch.scheduler.SyntheticScheduler`; the
followers never see a scheduler object. ``--strategy broadcast`` (default): the driver builds
``InputMetadata`` and broadcasts it; ``--strategy replicate``: every rank keeps the same
``BatchState``, the driver sends the step's ops and every rank builds its own metadata
(:mod:`launch.strategies`). With ``--cp-mirror`` every rank keeps its zigzag share
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
import cpmeta.cp
import cpmeta.constants
from cpmeta.metadata import InputMetadata
from cpmeta import jit
from cpmeta.transport.envs import FOREVER_S

from . import comm
from . import envs
from .scheduler import MODELS, WORKLOADS, model_config
from .strategies import STRATEGIES, build, make_strategy
from .verify import VerifyError, expected_table, verify_step

__all__ = ["main", "build_parser", "check_args"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_WARMUP = 5
MIN_PROMPT = 16  # SyntheticScheduler draws prompt lengths from [16, --max-prompt]
MAX_SEQS = 4096  # --decode-seqs / --prompt-seqs: a state of 4,096 rows of the seed model's history is ~270 MB


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpmeta.launch.worker", description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=WORKLOADS, default="mixed")
    p.add_argument("--model", choices=MODELS, default="seed",
                   help="seed = compressed KV, sliding window, Engram (block 128); plain = a paged-KV model "
                        "(Llama-like, block 16) whose KV is sharded over the ranks in runs of --kv-interleave")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=None,
                   help=f"steps excluded from the timing table (default {DEFAULT_WARMUP}, at most --steps - 1)")
    p.add_argument("--cp-mirror", action="store_true", help="each rank keeps its zigzag share")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where received metadata lives: auto = cuda with nccl, cpu with gloo; "
                        "cuda with gloo = ranks sharing this host's GPUs (the follower paths on one GPU)")
    p.add_argument("--verify", action="store_true",
                   help="the driver rebuilds each step; every rank checks what it holds against digests of it")
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
    p.add_argument("--strategy", choices=STRATEGIES, default="broadcast",
                   help="broadcast = the driver builds and broadcasts the metadata; replicate = every rank "
                        "keeps the BatchState, the driver sends the step's ops, every rank builds; "
                        "replicate-defer = the same, the driver applying its ops after the send "
                        "(defer_apply)")
    p.add_argument("--metrics", action="store_true",
                   help="print every rank's broadcast metrics (MetadataBroadcaster.stats(): steps, bytes, "
                        "layouts, send/wait/land p50/p99, follower lag, refusals, arenas)")
    return p


def check_args(args: Any, nproc: int) -> Optional[str]:
    """The first problem with the parsed ``args`` for ``nproc`` ranks on this node, or None.

    Checked before anything is spawned (``python -m cpmeta.launch``) and again in every rank: ranges,
    ``--kv-interleave`` dividing the KV block size the slot mapping uses (``block_size`` of the
    ``--model``'s config: seed 128, so 0 = off, 1, 2, 4, ..., 128 pass and 3 fails; plain 16),
    ``--model plain`` with the ``yoco`` workload (no sliding window to truncate), ``--backend
    nccl`` needing one CUDA device per rank, and ``--json``'s directory.
    Fills an unset ``--warmup`` with ``min(DEFAULT_WARMUP, steps - 1)`` (``--steps 3`` -> 2).
    """
    if args.warmup is None and args.steps >= 1:
        args.warmup = min(DEFAULT_WARMUP, args.steps - 1)
    for name, value, low in (("--steps", args.steps, 1), ("--warmup", args.warmup or 0, 0),
                             ("--decode-seqs", args.decode_seqs, 1),
                             ("--prompt-seqs", args.prompt_seqs, 1),
                             ("--max-prompt", args.max_prompt, MIN_PROMPT),
                             ("--kv-interleave", args.kv_interleave, 0)):
        if value < low:
            return f"{name}: expected >= {low}, got {value}"
    for name, value in (("--decode-seqs", args.decode_seqs), ("--prompt-seqs", args.prompt_seqs)):
        if value > MAX_SEQS:  # each rank's state holds a token history row per sequence
            return f"{name}: expected <= {MAX_SEQS}, got {value}"
    if args.warmup >= args.steps:
        return f"--warmup: expected < --steps ({args.steps}), got {args.warmup}"
    if not 0 < args.timeout <= FOREVER_S:  # (a larger one overflowed the platform's time_t)
        return f"--timeout: expected a finite number of seconds > 0 (at most {FOREVER_S:.0f}), got {args.timeout}"
    if args.model == "plain" and args.workload == "yoco":
        return "--workload yoco: needs the sliding window of --model seed; a plain model has none"
    block = model_config(args.model, workload=args.workload).block_size
    if args.kv_interleave and block % args.kv_interleave:
        return f"--kv-interleave: expected 0 (off) or a divisor of the KV block size {block}, got {args.kv_interleave}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device on this machine"
    if args.device == "cpu" and args.backend == "nccl":
        return "--device cpu: NCCL moves CUDA tensors; use --backend gloo (or auto without GPUs)"
    if args.backend == "nccl":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < nproc:
            return f"--backend nccl: needs one CUDA device per rank ({nproc}), found {have}"
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        return f"--json: directory of {args.json!r} does not exist"
    return None


def resolve_backend(name: str) -> str:
    """``auto`` = NCCL when every local rank can have its own GPU, else gloo."""
    if name != "auto":
        return name
    local_world = envs.local_world_size()
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return "nccl"
    return "gloo"


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
    # every prompt step carries these; a sparse ratio's ks comes with its ke (docs/design.md sections 4 and 8)
    assert mine.positions is not None and full.positions is not None
    assert mine.mirror_cp_reverse_index is not None
    rows = {"positions": (mine.positions, full.positions)}
    for r, t in (mine.ks or {}).items():
        assert mine.ke is not None and full.ks is not None and full.ke is not None
        rows[f"ks.{r}"] = (t, full.ks[r])
        rows[f"ke.{r}"] = (mine.ke[r], full.ke[r])
    for name, (part, whole) in rows.items():
        part = part.to(device).contiguous()
        gathered = comm.all_gather(part)
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
    sm = cpmeta.cp.compute_slot_mapping_from_metadata(md, cfg.block_size, cp_world_size=world, cp_rank=rank,
                                                   cp_interleave=args.kv_interleave)
    owned = comm.all_reduce((sm != cpmeta.constants.PAD_SLOT_ID).to(torch.int32).to(device))
    assert md.valid_token_mask is not None  # every step's metadata carries it (docs/design.md section 4)
    want = md.valid_token_mask.to(device=device, dtype=torch.int32)
    bad = int((owned != want).sum())
    return [f"{bad} tokens are not owned by exactly one rank"] if bad else []


def run_steps(args: Any, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """The per-step loop. Only rank 0 (the driver) owns the scheduler; the followers work from
    what the strategy gives them alone (the broadcast metadata, or the metadata they build from
    their replicated state): mirror, slot mapping, attention check, verify."""
    cfg = model_config(args.model, workload=args.workload, cp_world_size=world, kv_interleave=args.kv_interleave)
    attn_cfg = cfg if args.attn_info else None
    t_build, t_bcast, t_mirror, nbytes = [], [], [], []
    attn_err = {"prefill": 0.0, "decode": 0.0}  # max |CP - single rank| seen (--attention-check)
    strategy = make_strategy(args.strategy, args, rank, cfg, device)
    try:
        for step in range(args.steps):
            expected = None
            got, dt_build, dt_move, batch = strategy.step()
            t2 = time.perf_counter()
            mine = None
            if args.cp_mirror and got.is_prompt:
                mine = cpmeta.prepare_for_mirror_cp(got, rank, world)
                if args.attn_info:
                    mine.compute_attn_info(cfg)
            t3 = time.perf_counter()
            if step >= args.warmup:
                if rank == 0 or args.strategy != "broadcast":  # who builds
                    t_build.append(dt_build)
                t_bcast.append(dt_move)
                if mine is not None:
                    t_mirror.append(t3 - t2)
                nbytes.append(_nbytes(got))
            if args.verify:
                if batch is not None:  # an independent rebuild on the driver is the reference
                    expected = expected_table(build(batch, cfg, args.attn_info), world, args.cp_mirror, attn_cfg)
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
        metrics = strategy.metrics() if args.metrics else None
    finally:
        strategy.close()
    return {"build": t_build, "broadcast": t_bcast, "mirror": t_mirror, "bytes": nbytes,
            "attn_err": attn_err, "metrics": metrics}


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
    gathered = comm.all_gather(t)
    if dist.get_rank() != 0:
        return None
    rows = [g.cpu().tolist() for g in gathered]
    return {"ranks": rows, "columns": [f"{k}_{p}_us" for k in keys for p in ("p50", "p90")] + ["bytes"]}


def _print_table(summary: dict[str, Any], args: Any, backend: str, world: int) -> None:
    rows = summary["ranks"]
    move = "bcast" if args.strategy == "broadcast" else "sync"
    out = [
        f"cpmeta launch: strategy={args.strategy} workload={args.workload} steps={args.steps} "
        f"({args.steps - args.warmup} timed after {args.warmup} warm-up) world={world} backend={backend} model={args.model} "
        f"cp_mirror={args.cp_mirror} verify={args.verify}",
        f"kernels ready in {summary['warm_s']:.1f} s (rank 0: compiled, or loaded from numba's cache: "
        "cpmeta.jit.warm_all)",
        f"bytes per step (avg): {rows[0][-1]:.0f}",
        f"{'rank':>4} {'build p50':>10} {'build p90':>10} {move + ' p50':>10} {move + ' p90':>10} "
        f"{'mirror p50':>10} {'mirror p90':>10}   (microseconds; nan: the rank has no such phase)",
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


def _record_failure(e: BaseException) -> bool:
    """Under torchrun: write ``e`` (message + traceback) to this rank's error file, which the
    launcher prints once, first, above torchrun's report. False when there is no such file."""
    if not envs.error_file():
        return False
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(e)
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry of one rank; exit code 0, 1 (an error), 2 (bad arguments) or 3 (verify failed)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_args(args, envs.local_world_size())
    if problem:
        parser.error(problem)
    try:
        return _run(args)
    except Exception as e:  # noqa: BLE001 - recorded for the launcher, else re-raised
        code = 3 if isinstance(e, VerifyError) else 1
        if _record_failure(e):
            return code
        if isinstance(e, VerifyError):
            print(f"VERIFY FAILED: {e}", file=sys.stderr, flush=True)
            return code
        raise


def _run(args: Any) -> int:
    logging.basicConfig(level=logging.WARNING)
    backend = resolve_backend(args.backend)
    t0 = time.perf_counter()  # every kernel compiled (a cold cache, shared out) or loaded, before the
    jit.warm_all()            # group's timeout starts and before the first step: none in a timed one
    warm_s = time.perf_counter() - t0
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(args.timeout, 30)))
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        local = envs.local_rank()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    elif args.device == "cuda":  # gloo ranks sharing the host's GPUs (round robin)
        local = envs.local_rank() % torch.cuda.device_count()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    try:
        stats = run_steps(args, rank, world, device)
        summary = summarize(stats, world, device)
        if summary is not None:
            summary["attn_err"], summary["warm_s"] = stats["attn_err"], warm_s
            summary.update(strategy=args.strategy, workload=args.workload, model=args.model, steps=args.steps, world=world, backend=backend,
                           host=socket.gethostname(), date=datetime.date.today().isoformat())
            _print_table(summary, args, backend, world)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(summary, f, indent=1)
        if args.metrics:  # every rank's bc.stats() row, gathered and printed by rank 0
            from cpmeta.broadcast.metrics import format_table

            row = stats["metrics"]
            rows = comm.all_gather(torch.tensor(row or [float("nan")], dtype=torch.float64, device=device))
            if rank == 0:
                print(format_table([r.cpu().tolist() for r in rows]) if row is not None else
                      f"--metrics: --strategy {args.strategy} has no MetadataBroadcaster to report", flush=True)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
