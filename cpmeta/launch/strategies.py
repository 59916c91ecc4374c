"""How every rank of the launch loop gets its step's metadata: ``--strategy broadcast|replicate``.

- ``broadcast`` (the reference engine's design, docs/design.md section 15): the driver builds ``InputMetadata`` from its scheduler's
  batch and ``MetadataBroadcaster`` moves it; followers rebuild it by path.
- ``replicate`` (the field's design: vLLM v1, SGLang, TensorRT-LLM): every rank keeps the same
  ``BatchState`` (``ReplicatedBatchState``); the driver's scheduler records the step's calls,
  ``sync_metadata()`` moves them as one frame, and EVERY rank builds its own metadata from its
  replica (a decode step of a shape built before inside the replay's compiled call).
- ``replicate-defer``: the same with ``defer_apply=True`` (vLLM's order): the driver's scheduler
  keeps its own ``BatchState``, which validates each call and answers what it reads; the
  replicated state only records the call, sends the step, then applies it on every rank, the
  driver's included (:class:`SchedulerTee`).

Both give every rank bit-identical metadata (``--verify`` checks it against the driver's
independent rebuild). ``step()`` returns ``(metadata, build seconds, move seconds, batch)``, the
batch being what the driver rebuilds for ``--verify`` (None on followers); for the replicated
strategies "move" is ``sync_metadata()`` (the builds inside it), "build" the attention info and
the copy to the device after it.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import torch

import cpmeta
from cpmeta.metadata import InputMetadata

from .scheduler import SyntheticScheduler

__all__ = ["STRATEGIES", "SchedulerTee", "make_strategy", "build"]

STRATEGIES = ("broadcast", "replicate", "replicate-defer")


class SchedulerTee:
    """A ``defer_apply`` driver as an engine runs it: ``state`` (the scheduler's own
    ``BatchState``) takes each call first -- a call it refuses raises and is never sent -- then
    ``rep`` records it; ``add_request``'s (``add_requests_batch``'s) slot predicted by ``rep`` must
    be the state's."""

    def __init__(self, state: cpmeta.BatchState, rep: cpmeta.ReplicatedBatchState) -> None:
        self.state, self.rep = state, rep

    def __getattr__(self, name: str) -> Any:
        mine, recorded = getattr(self.state, name), getattr(self.rep, name)

        def call(*args: Any, **kw: Any) -> Any:
            got = mine(*args, **kw)
            slot = recorded(*args, **kw)
            if name in ("add_request", "add_requests_batch") and not np.array_equal(slot, got):
                raise RuntimeError(f"defer_apply predicted slot(s) {slot} for request(s) the scheduler's "
                                   f"state put in slot(s) {got}")
            return got

        return call


def build(batch: cpmeta.SequenceBatch, cfg: cpmeta.MetadataConfig, attn_info: bool) -> InputMetadata:
    md = cpmeta.prepare_prompt(batch, cfg) if batch.is_prompt else cpmeta.prepare_decode(batch, cfg)
    if attn_info:
        md.compute_attn_info(cfg)
    return md


class _Broadcast:
    def __init__(self, args: Any, rank: int, cfg: cpmeta.MetadataConfig, device: torch.device) -> None:
        self.cfg, self.attn = cfg, args.attn_info
        self.bc = cpmeta.MetadataBroadcaster(device=device, timeout=args.timeout,
                                             metrics=getattr(args, "metrics", False))
        self.sched = SyntheticScheduler(args.seed, cfg, args.workload, decode_seqs=args.decode_seqs,
                                        prompt_seqs=args.prompt_seqs, max_prompt=args.max_prompt) \
            if rank == 0 else None

    def step(self) -> tuple[InputMetadata, float, float, Optional[cpmeta.SequenceBatch]]:
        md, batch = None, None
        t0 = time.perf_counter()
        if self.sched is not None:  # the driver
            self.bc.begin_step()  # followers wake now, while the driver schedules and builds
            _, batch = self.sched.next_batch()  # the synthetic scheduler: not timed
            t0 = time.perf_counter()
            md = build(batch, self.cfg, self.attn)
        t1 = time.perf_counter()
        got = self.bc.broadcast(md)
        return got, t1 - t0, time.perf_counter() - t1, batch

    def metrics(self) -> Optional[list[float]]:
        """This rank's ``bc.stats()`` as one row (``cpmeta.broadcast.metrics.STATS_ROW``)."""
        return self.bc.stats().row()

    def close(self) -> None:
        self.bc.close()


class _Replicate:
    def __init__(self, args: Any, rank: int, cfg: cpmeta.MetadataConfig, device: torch.device,
                 defer: bool = False) -> None:
        self.cfg, self.attn = cfg, args.attn_info
        n = SyntheticScheduler.max_seqs(args.decode_seqs, args.prompt_seqs)
        self.rep = cpmeta.ReplicatedBatchState(cfg, n, device=device, timeout=args.timeout, defer_apply=defer)
        self.arenas = cpmeta.OutputArenas()  # the metadata's arena per batch shape, refilled every step
        ops: Any = SchedulerTee(cpmeta.BatchState(cfg, n), self.rep) if defer else self.rep
        self.sched = SyntheticScheduler(args.seed, cfg, args.workload, decode_seqs=args.decode_seqs,
                                        prompt_seqs=args.prompt_seqs, max_prompt=args.max_prompt,
                                        replicated=ops) if rank == 0 else None

    def step(self) -> tuple[InputMetadata, float, float, Optional[cpmeta.SequenceBatch]]:
        if self.sched is not None:
            self.sched.next_batch()  # records the step's calls (not timed: the scheduler's work)
        t0 = time.perf_counter()
        md = self.rep.sync_metadata(self.arenas)  # the step and its metadata (built in the replay's call)
        t1 = time.perf_counter()
        # the synthetic scheduler makes one batch spec every step
        assert isinstance(md, InputMetadata)
        if self.attn:
            md.compute_attn_info(self.cfg)
        if md.positions is not None and md.positions.device != self.rep.device:
            md = md.to(self.rep.device)
        batch = self.rep.batches[0] if self.sched is not None else None
        return md, time.perf_counter() - t1, t1 - t0, batch

    def metrics(self) -> Optional[list[float]]:
        return None  # the replicated state's channel keeps no broadcast metrics

    def close(self) -> None:
        self.rep.close()


def make_strategy(name: str, args: Any, rank: int, cfg: cpmeta.MetadataConfig, device: torch.device) -> Any:
    if name not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {name!r}")
    if name == "broadcast":
        return _Broadcast(args, rank, cfg, device)
    return _Replicate(args, rank, cfg, device, defer=name == "replicate-defer")
