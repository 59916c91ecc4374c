"""The step trace and the four strategies ``scripts/bench_step.py`` compares.

A step is the scheduler's decision as a list of ops, ``(BatchState method, args, kwargs)``,
ending in one batch spec per forward (``prompt_batch`` / ``decode_batch``; a ``mixed`` step
has both): what vLLM's ``SchedulerOutput`` carries (new requests with their prompts, the
running ones' new tokens and blocks, finished ids), in ``BatchState``'s vocabulary.
:class:`StepTrace` makes them from its own ``BatchState`` (the scheduler's view), with new
values every step. Each strategy turns one step's ops into every rank holding its metadata:

==============  =====================================================================================
strategy        driver -> followers
==============  =====================================================================================
broadcast       applies the ops to its ``BatchState``, builds (``out=OutputArenas()``), sends it with
                ``MetadataBroadcaster(persistent_outputs=True)`` (``begin_step()`` at the start)
replicate       calls the ops on ``ReplicatedBatchState``; ``sync_metadata(OutputArenas())`` sends
                them as one frame per step; EVERY rank builds from its own replica (a follower's
                decode step: replay and build in one compiled call)
mq-replicate    vLLM's ``MessageQueue`` carries the op list pickled; every rank applies it to its
                own ``BatchState`` and builds with cpmeta's builders
mq-broadcast    the driver applies and builds; ``MessageQueue`` carries the built metadata pickled
==============  =====================================================================================

Each strategy fills one record row per step and rank (:data:`REC`, perf_counter seconds);
with ``device`` CUDA the metadata goes to the device (``non_blocking`` copies, then a sync).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import torch

import cpmeta
from cpmeta.config import blocks_needed_array

__all__ = ["WORKLOADS", "STRATEGIES", "REC", "StepTrace", "apply_ops", "build", "make_strategy",
           "install_apply_timer"]

SPECS = ("prompt_batch", "decode_batch")
#: workload -> (decoding requests, MTP drafts each, prefill lanes, prefill chunk tokens)
WORKLOADS: dict[str, tuple[int, int, int, int]] = {
    "decode-64": (64, 2, 0, 0), "decode-256": (256, 2, 0, 0),
    "mixed": (64, 2, 8, 1024), "prompt": (0, 0, 8, 4096)}
STRATEGIES = ("broadcast", "replicate", "replicate-defer", "mq-replicate", "mq-broadcast")
#: one step's record columns per rank: t0 (the driver holds the ops), send0 (its first send
#: starts), recv (a follower holds the step's bytes), end (the rank holds its metadata) are
#: perf_counter times; send, apply, build, h2d durations (s)
REC = ("t0", "send0", "send", "recv", "apply", "build", "h2d", "end")
T0, SEND0, SEND, RECV, APPLY, BUILD, H2D, END = range(len(REC))
VOCAB = 32000
pc = time.perf_counter


class StepTrace:
    """Deterministic scheduler decisions for a workload of :data:`WORKLOADS`, one step at a time.

    decode-N: N requests decode with 2 drafts (1-3 tokens accepted per step); one reaching its
    length is finished and replaced by a prefilled request (its prompt in the step's ops).
    prompt: 8 new requests of 4096 tokens per step, each prefilled in one chunk, finished the
    step after. mixed: 8 prefill lanes (prompts of 1-4 chunks of 1024), a finished prompt gets
    its first token and joins the 64 decoding requests, whose oldest one finishes. Tables grow
    by ``append_blocks`` as sequences pass a block; a step's finished requests are one
    ``finish_batch``, its new requests one ``add_requests_batch``. ``next_step()`` -> the op list.
    """

    def __init__(self, cfg: cpmeta.MetadataConfig, workload: str, seed: int = 0) -> None:
        self.cfg, self.workload = cfg, workload
        self.n_dec, self.drafts, self.n_pre, self.chunk = WORKLOADS[workload]
        self.n_specs = int(self.n_dec > 0) + int(self.n_pre > 0)
        self.max_seqs = self.n_dec + 2 * self.n_pre + 2
        self.state = cpmeta.BatchState(cfg, self.max_seqs)
        self.rng = np.random.default_rng(seed)
        self.per_req = cpmeta.blocks_needed(cfg.max_model_len, cfg)
        self.homes = list(range(self.max_seqs))[::-1]  # state id + block range per live request
        self.home: dict[int, int] = {}
        self.next_id = 0
        self.dec: list[int] = []  # decoding slots, oldest first
        self.target: dict[int, int] = {}  # decode-N: length at which a request finishes
        self.pre: list[int] = []  # prefill lanes' slots
        self.accepted: Optional[tuple] = None  # (slots, tokens, counts) of the last decode step
        self.ops: list[tuple] = []

    def _do(self, name: str, *args: Any, **kw: Any) -> Any:
        self.ops.append((name, args, kw))
        return getattr(self.state, name)(*args, **kw)

    def _add(self, sizes: list[int], prefilled: bool) -> list[int]:
        """New requests with prompts of ``sizes`` tokens: ONE ``add_requests_batch`` op (an engine
        adds a step's new requests together); their slots."""
        if not sizes:
            return []
        homes = [self.homes.pop() for _ in sizes]
        ids = list(range(self.next_id + 1, self.next_id + 1 + len(sizes)))
        self.next_id += len(sizes)
        nbs = [cpmeta.blocks_needed(n, self.cfg) for n in sizes]
        blocks = np.concatenate([h * self.per_req + np.arange(nb) for h, nb in zip(homes, nbs)])
        n = np.array(sizes, np.int64)
        slots = self._do("add_requests_batch", ids, self.rng.integers(1, VOCAB, int(n.sum())), n, blocks,
                         np.array(nbs, np.int64), np.array(homes, np.int64), num_computed=n if prefilled else None)
        for s, h in zip(slots.tolist(), homes):
            self.home[s] = h
        return slots.tolist()

    def _finish(self, slots: list[int]) -> None:
        """The step's finished requests: ONE ``finish_batch`` op."""
        if slots:
            self._do("finish_batch", np.array(slots, np.int64))
        for s in slots:
            self.homes.append(self.home.pop(s))
            self.target.pop(s, None)

    def next_step(self) -> list[tuple]:
        st, rng, self.ops = self.state, self.rng, []
        joined = [s for s in self.pre if st.num_computed[s] >= st.prompt_len[s]]
        if self.accepted is not None or joined:  # last step's sampled / accepted tokens
            slots, toks, counts = self.accepted or (np.zeros(0, np.int64),) * 3
            if self.n_dec:
                slots = np.concatenate([slots, np.array(joined, np.int64)])
                toks = np.concatenate([toks, rng.integers(1, VOCAB, len(joined))])
                counts = np.concatenate([counts, np.ones(len(joined), np.int64)])
            if len(slots):
                self._do("append_tokens_batch", slots, toks, counts)
        done = []
        for s in joined:
            self.pre.remove(s)
            if self.n_dec:
                self.dec.append(s)
            else:
                done.append(s)
        while len(self.dec) > self.n_dec:  # mixed: the oldest decodes finish
            done.append(self.dec.pop(0))
        for s in [s for s in self.dec if s in self.target and st.num_tokens[s] + 3 > self.target[s]]:
            self.dec.remove(s)  # decode-N: a finished request, replaced below
            done.append(s)
        self._finish(done)
        self.pre += self._add([self.chunk * (1 if self.workload == "prompt" else int(rng.integers(1, 5)))
                               for _ in range(self.n_pre - len(self.pre))], False)
        sizes = [int(rng.integers(128, 2049)) for _ in range(self.n_dec - len(self.dec))]
        for s, n in zip(self._add(sizes, True), sizes):
            self.target[s] = min(n + int(rng.integers(64, 1025)), self.cfg.max_model_len - 8)
            self.dec.append(s)
        if self.pre:
            self._do("prompt_batch", np.array(self.pre, np.int64), np.full(self.n_pre, self.chunk, np.int64))
        self.accepted = self._decode() if self.dec else None
        return self.ops

    def _decode(self) -> tuple:
        st, d = self.state, self.drafts
        slots = np.array(self.dec, np.int64)
        need = blocks_needed_array(st.num_tokens[slots] + d, self.cfg)
        grow = np.flatnonzero(need > st.num_blocks[slots])
        if len(grow):  # every growing table in one call, as an engine with arrays makes it
            gs, have = slots[grow], st.num_blocks[slots[grow]]
            counts = need[grow] - have
            blocks = np.concatenate([self.home[int(s)] * self.per_req + np.arange(h, h + c)
                                     for s, h, c in zip(gs.tolist(), have.tolist(), counts.tolist())])
            self._do("append_blocks_batch", gs, blocks, counts)
        self._do("decode_batch", slots, self.rng.integers(1, VOCAB, d * len(slots)), d)
        counts = self.rng.integers(1, d + 2, len(slots))
        return slots, self.rng.integers(1, VOCAB, int(counts.sum())), counts


def apply_ops(target: Any, ops: list[tuple]) -> list[Any]:
    """Call the ops on ``target`` (a ``BatchState`` or the driver's ``ReplicatedBatchState``);
    the specs' results in order (batches, or None from a replicated driver)."""
    out = []
    for name, args, kw in ops:
        r = getattr(target, name)(*args, **kw)
        if name in SPECS:
            out.append(r)
    return out


def build(batches: list[Any], cfg: cpmeta.MetadataConfig, arenas: cpmeta.OutputArenas) -> list[Any]:
    """Every spec's metadata on the host, into ``arenas`` (prompt and decode, as an engine that
    reuses its output buffers builds)."""
    return [cpmeta.prepare_prompt(b, cfg, out=arenas) if b.is_prompt else cpmeta.prepare_decode(b, cfg, out=arenas)
            for b in batches]


def to_device(mds: list[Any], device: Optional[torch.device], rec: np.ndarray) -> list[Any]:
    """On CUDA: ``non_blocking`` copies (unless already there), then a stream sync (``rec[H2D]``);
    ``device`` None (host metadata): ``mds`` as they are."""
    if device is None:
        return mds
    t = pc()
    mds = [md if md.positions is not None and md.positions.device == device else md.to(device)
           for md in mds]
    torch.cuda.current_stream().synchronize()
    rec[H2D] += pc() - t
    return mds


_TIMER = {"first": 0.0, "total": 0.0}


def install_apply_timer() -> None:
    """Wrap the replica's apply (``cpmeta.replicate.replicated.apply_step``, this process only):
    the follower's replay time and when it first held a step's ops."""
    import cpmeta.replicate.replicated as rr

    orig = rr.apply_step
    if getattr(orig, "_timed", False):
        return

    def timed(*a: Any, **k: Any) -> Any:
        t = pc()
        _TIMER["first"] = _TIMER["first"] or t
        try:
            return orig(*a, **k)
        finally:
            _TIMER["total"] += pc() - t

    timed._timed = True  # type: ignore[attr-defined]
    rr.apply_step = timed


class _Strategy:
    def __init__(self, rank: int, cfg: Any, device: torch.device, max_seqs: int, n_specs: int,
                 timeout: float) -> None:
        self.rank, self.cfg, self.n_specs = rank, cfg, n_specs
        # None for host metadata: to_device then reads no torch property inside the timed step
        # (``torch.device.type`` costs ~10 us after the bench's idle on the 2-core VM)
        self.device: Optional[torch.device] = device if device.type == "cuda" else None
        self.arenas = cpmeta.OutputArenas()
        self.state = cpmeta.BatchState(cfg, max_seqs) if self.local_state(rank) else None

    def local_state(self, rank: int) -> bool:
        return rank == 0

    def _apply_build(self, ops: list[tuple], rec: np.ndarray) -> list[Any]:
        t = pc()
        batches = apply_ops(self.state, ops)
        t1 = pc()
        mds = build(batches, self.cfg, self.arenas)
        rec[APPLY], rec[BUILD] = t1 - t, pc() - t1
        return mds

    def close(self) -> None:
        pass


class Broadcast(_Strategy):
    def __init__(self, rank: int, cfg: Any, device: torch.device, max_seqs: int, n_specs: int,
                 timeout: float) -> None:
        super().__init__(rank, cfg, device, max_seqs, n_specs, timeout)
        self.bc = cpmeta.MetadataBroadcaster(device=device, timeout=timeout, persistent_outputs=True)

    def driver(self, ops: list[tuple], rec: np.ndarray) -> list[Any]:
        self.bc.begin_step()  # followers wake while the driver applies and builds
        mds = self._apply_build(ops, rec)
        rec[SEND0] = pc()
        got = [self.bc.broadcast(md) for md in mds]
        rec[SEND] = pc() - rec[SEND0]
        return to_device(got, self.device, rec)

    def follower(self, rec: np.ndarray) -> list[Any]:
        got = [self.bc.broadcast(None) for _ in range(self.n_specs)]
        rec[RECV] = pc()
        return to_device(got, self.device, rec)

    def close(self) -> None:
        self.bc.close()


def _batches(got: Any) -> list[Any]:
    """``sync()``'s result as a list (None: no spec; a tuple: a mixed step's specs)."""
    return [] if got is None else list(got) if isinstance(got, tuple) else [got]


class Replicate(_Strategy):
    """``replicate``: each call applied to the driver's replica as it is recorded, the frame sent
    at ``sync()``; ``replicate-defer`` (``defer_apply=True``): the calls only recorded (the
    trace's own state, the scheduler's, validated them), the driver's replica applies the step
    after sending it, alongside the followers."""

    def __init__(self, rank: int, cfg: Any, device: torch.device, max_seqs: int, n_specs: int,
                 timeout: float, defer: bool = False) -> None:
        super().__init__(rank, cfg, device, max_seqs, n_specs, timeout)
        self.rep = cpmeta.ReplicatedBatchState(cfg, max_seqs, device=device, timeout=timeout, defer_apply=defer)

    def local_state(self, rank: int) -> bool:
        return False

    def driver(self, ops: list[tuple], rec: np.ndarray) -> list[Any]:
        t = pc()
        self.rep.begin_step()  # parked followers wake and spin while the driver records
        for name, args, kw in ops:  # each call applied to the driver's replica and recorded
            getattr(self.rep, name)(*args, **kw)
        t1 = pc()
        rec[APPLY] += t1 - t
        rec[SEND0] = rec[SEND0] or t1
        _TIMER["first"] = _TIMER["total"] = 0.0
        got = self.rep.sync_metadata(self.arenas)  # ONE frame per step (a mixed step's two specs included)
        t2 = pc()
        # send: to the end of the apply after it (defer: a decode step's build inside), then the
        # builds it left; without defer the call's builds follow the send (counted in it)
        done = _TIMER["first"] + _TIMER["total"] if _TIMER["first"] else t2
        rec[SEND] += done - t1
        rec[BUILD] = t2 - done
        return to_device(_batches(got), self.device, rec)

    def follower(self, rec: np.ndarray) -> list[Any]:
        _TIMER["first"] = _TIMER["total"] = 0.0
        got = self.rep.sync_metadata(self.arenas)
        rec[RECV], rec[APPLY] = _TIMER["first"], _TIMER["total"]
        rec[BUILD] = pc() - (_TIMER["first"] + _TIMER["total"])  # the builds the replay's call left
        return to_device(_batches(got), self.device, rec)

    def close(self) -> None:
        self.rep.close()


class _Mq(_Strategy):
    def __init__(self, mq: Any, *a: Any) -> None:
        super().__init__(*a)
        self.mq = mq  # broadcast_methods.MessageQueueMethod: step(obj) enqueues, step(None) dequeues


class MqReplicate(_Mq):
    def local_state(self, rank: int) -> bool:
        return True

    def driver(self, ops: list[tuple], rec: np.ndarray) -> list[Any]:
        rec[SEND0] = pc()
        self.mq.step(ops)  # pickled, as vLLM sends its SchedulerOutput, before it executes
        rec[SEND] = pc() - rec[SEND0]
        return to_device(self._apply_build(ops, rec), self.device, rec)

    def follower(self, rec: np.ndarray) -> list[Any]:
        ops = self.mq.step(None)
        rec[RECV] = pc()
        return to_device(self._apply_build(ops, rec), self.device, rec)


class MqBroadcast(_Mq):
    def driver(self, ops: list[tuple], rec: np.ndarray) -> list[Any]:
        mds = self._apply_build(ops, rec)
        rec[SEND0] = pc()
        self.mq.step(mds)
        rec[SEND] = pc() - rec[SEND0]
        return to_device(mds, self.device, rec)

    def follower(self, rec: np.ndarray) -> list[Any]:
        mds = self.mq.step(None)
        rec[RECV] = pc()
        return to_device(mds, self.device, rec)


def make_strategy(name: str, rank: int, cfg: Any, device: torch.device, max_seqs: int, n_specs: int,
                  timeout: float) -> Optional[_Strategy]:
    """Collective (every rank, same order). ``None`` for an mq strategy when vllm's
    ``MessageQueue`` does not import on some rank."""
    a = (rank, cfg, device, max_seqs, n_specs, timeout)
    if name == "broadcast":
        return Broadcast(*a)
    if name in ("replicate", "replicate-defer"):
        return Replicate(*a, defer=name == "replicate-defer")
    from _harness.broadcast_methods import make_method  # scripts/ is on sys.path

    mq = make_method("mq", rank, device)
    if mq is None:
        return None
    return (MqReplicate if name == "mq-replicate" else MqBroadcast)(mq, *a)
