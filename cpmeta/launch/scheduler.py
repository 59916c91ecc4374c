"""A seeded synthetic scheduler: realistic per-step batches for the launch loop.

Every rank constructs the same ``SyntheticScheduler(seed, ...)`` and so produces the same batch
sequence; that is what ``--verify`` relies on (each rank rebuilds the driver's batch locally).
The scheduler keeps its requests in a :class:`cpmeta.BatchState` and hands out
:class:`cpmeta.SequenceBatch` steps (array input: no per-step Python over token histories).

Requests go through chunked prefill (prompt steps), then decode with 0-2 MTP draft tokens
(decode steps). Batches carry placeholders now and then, Engram look-back is on (an image
sentinel sits inside some prompts), and some requests have ``swa_valid_start > 0``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from cpmeta import BatchState, MetadataConfig, SequenceBatch
from cpmeta.sequence import blocks_needed

__all__ = ["SyntheticScheduler", "default_config", "plain_config", "model_config", "MODELS", "WORKLOADS",
           "IMAGE_TOKEN_ID", "VOCAB_SIZE"]

WORKLOADS = ("decode", "prompt", "mixed", "yoco")
#: ``--model``: ``seed`` = MetadataConfig.compressed_swa() (compressed KV, sliding window, n-gram look-back ids) or ``plain`` paged KV.
MODELS = ("seed", "plain")
#: Block size of :func:`plain_config` (a typical paged-attention block: vLLM's default).
PLAIN_BLOCK_SIZE = 16
VOCAB_SIZE = 32000
IMAGE_TOKEN_ID = VOCAB_SIZE - 1
NGRAM_VOCAB = 4096


def default_config(*, yoco: bool = False, max_model_len: int = 8192) -> MetadataConfig:
    """The model the launch loop pretends to serve (DeepSeek-V4-like ratios, Engram on)."""
    g = torch.Generator().manual_seed(1234)
    lookup = torch.randint(0, NGRAM_VOCAB, (VOCAB_SIZE,), generator=g, dtype=torch.int32)
    return MetadataConfig(
        block_size=128,
        window_size=128,
        swa_block_size=256,
        dense_compress_ratios=(4, 128),
        sparse_compress_ratios=(4,),
        max_model_len=max_model_len,
        max_ngram_size=3,
        ngram_pad_token=0,
        ngram_lookup=lookup,
        image_token_id=IMAGE_TOKEN_ID,
        yoco_keep_tokens=512 if yoco else None,
        yoco_mode="compact",
    )


def plain_config(*, max_model_len: int = 8192, kv_cp_world_size: int = 1, kv_cp_interleave: int = 1) -> MetadataConfig:
    """A plain paged-KV model (Llama, Qwen, ...: docs/design.md section 14): no compressed KV, no sliding window,
    no Engram; its KV sharded over ``kv_cp_world_size`` CP ranks in runs of ``kv_cp_interleave``
    (tables of rank 0's share). Example: ``plain_config(kv_cp_world_size=2)`` -> block 16, a
    300-token request's table holds ``cdiv(150, 16) = 10`` blocks."""
    return MetadataConfig(block_size=PLAIN_BLOCK_SIZE, window_size=0, dense_compress_ratios=(),
                          sparse_compress_ratios=(), max_model_len=max_model_len,
                          kv_cp_world_size=kv_cp_world_size, kv_cp_interleave=kv_cp_interleave)


def model_config(model: str, *, workload: str = "mixed", cp_world_size: int = 1,
                 kv_interleave: int = 0) -> MetadataConfig:
    """The launch loop's config for ``--model``: ``"seed"`` is :func:`default_config` (YoCo with
    the ``yoco`` workload), ``"plain"`` is :func:`plain_config` with its KV sharded over the
    ``cp_world_size`` ranks in runs of ``kv_interleave`` (0 = off = 1), as a DCP engine keeps it."""
    if model not in MODELS:
        raise ValueError(f"model: expected one of {MODELS}, got {model!r}")
    if model == "plain":
        if workload == "yoco":
            raise ValueError("workload: 'yoco' needs the sliding window of --model seed; a plain model has none")
        return plain_config(kv_cp_world_size=cp_world_size, kv_cp_interleave=kv_interleave or 1)
    return default_config(yoco=workload == "yoco")


@dataclass
class _Request:
    slot: int  # BatchState slot; the request also owns state_id == its first slot and a block range
    home: int  # state id / block range owner (stable for the request's life)
    prompt_len: int
    chunk: int  # prefill chunk size
    done: int = 0  # prompt tokens already prefilled


class SyntheticScheduler:
    """Deterministic batches for ``workload`` in {decode, prompt, mixed, yoco}.

    ``next_batch()`` returns ``(is_prompt, batch)`` with ``batch`` a :class:`cpmeta.SequenceBatch`
    taken from a :class:`cpmeta.BatchState`: requests are added once (prompt tokens, block
    table, state id, swa_valid_start), then each step applies deltas only -- prefill chunks,
    accepted MTP drafts + bonus token, new blocks, finished requests. ``decode_seqs`` /
    ``prompt_seqs`` size the batches; ``max_prompt`` bounds prompt lengths (chunked by
    256..2048 tokens).
    """

    def __init__(
        self,
        seed: int,
        cfg: MetadataConfig,
        workload: str = "mixed",
        *,
        decode_seqs: int = 64,
        prompt_seqs: int = 4,
        max_prompt: int = 4096,
        placeholder_rate: float = 0.1,
        replicated: Any = None,
    ) -> None:
        if workload not in WORKLOADS:
            raise ValueError(f"workload: expected one of {WORKLOADS}, got {workload!r}")
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.workload = workload
        self.decode_seqs = decode_seqs
        self.prompt_seqs = prompt_seqs
        self.max_prompt = min(max_prompt, cfg.max_model_len - 64)
        self.placeholder_rate = placeholder_rate
        self.blocks_per_slot = blocks_needed(cfg.max_model_len, cfg)
        self.step = 0
        self._next_id = 0
        self._next_home = 0
        self._free_homes: list[int] = []
        # the calls go to ``ops``: the state itself, or a ReplicatedBatchState that records them
        # for the followers (then next_batch() returns None and its sync() gives the batch)
        self.ops: Any = replicated if replicated is not None else BatchState(cfg, max_seqs=self.max_seqs(
            decode_seqs, prompt_seqs))
        self.state: BatchState = replicated.state if replicated is not None else self.ops
        self.prefill: list[_Request] = []
        self.decoding: list[_Request] = []

    @staticmethod
    def max_seqs(decode_seqs: int, prompt_seqs: int) -> int:
        """Request slots the scheduler's state needs (a ReplicatedBatchState is made with it)."""
        return decode_seqs + 2 * prompt_seqs + 1

    # ---- request lifecycle ---------------------------------------------------------------
    def _home(self) -> int:
        if self._free_homes:
            return self._free_homes.pop()
        self._next_home += 1
        return self._next_home - 1

    def _new_requests(self, k: int, prefilled: bool = False) -> list[_Request]:
        """``k`` new requests, added in ONE ``add_requests_batch`` call (an engine adds a step's
        new requests together); with ``prefilled`` each also gets its first sampled token (one
        ``append_tokens_batch``). The random draws come in the order one request at a time made them."""
        r = self.rng
        reqs, prompts, tables, firsts = [], [], [], []
        for _ in range(k):
            n = r.randint(16, self.max_prompt)
            prompt = [r.randrange(1, VOCAB_SIZE - 1) for _ in range(n)]
            if r.random() < 0.3:  # an image span somewhere in the prompt
                at = r.randrange(n)
                for i in range(at, min(n, at + r.randint(1, 8))):
                    prompt[i] = IMAGE_TOKEN_ID
            chunk = r.choice((256, 512, 1024, 2048))
            valid_start = r.randrange(n) if r.random() < 0.2 else 0
            home = self._home()
            self._next_id += 1
            prompts.append(prompt)
            tables.append(self._blocks(home, 0, self._kv_blocks(n)))  # more as it grows (append_blocks)
            reqs.append((self._next_id, _Request(-1, home, n, chunk, done=n if prefilled else 0), valid_start))
            if prefilled:  # pretend its prompt was prefilled earlier: its first token
                firsts.append(r.randrange(1, VOCAB_SIZE - 1))
        if not reqs:
            return []
        slots = self.ops.add_requests_batch(
            [i for i, _, _ in reqs], np.array([t for p in prompts for t in p], np.int64), [len(p) for p in prompts],
            np.array([b for t in tables for b in t], np.int64), [len(t) for t in tables], [q.home for _, q, _ in reqs],
            swa_valid_starts=[v for _, _, v in reqs], num_computed=[q.done for _, q, _ in reqs])
        for (_, q, _), s in zip(reqs, slots.tolist()):
            q.slot = s
        if firsts:
            self.ops.append_tokens_batch(slots, np.array(firsts, np.int64), np.ones(len(firsts), np.int64))
        return [q for _, q, _ in reqs]

    def _blocks(self, home: int, start: int, stop: int) -> list[int]:
        """Blocks ``[start, stop)`` of a request's table: a scattered but deterministic physical
        layout, reverse order inside the home's range."""
        base = home * self.blocks_per_slot
        return [base + self.blocks_per_slot - 1 - b for b in range(start, stop)]

    def _kv_blocks(self, seqlen_k: int) -> int:
        """Blocks a request holds at ``seqlen_k`` tokens: enough for the compressed KV
        (``blocks_needed``) AND for one uncompressed KV row per position (``cdiv(seqlen_k,
        block_size)``, what a full-attention cache and ``--attention-check`` write through the
        slot mapping). Example, block 128, ratio 4: 129 tokens -> compressed 1 block, KV 2.
        A plain config's ``blocks_needed`` IS its KV's need (of rank 0's share when the KV is
        sharded over the CP group: block 16, 2 ranks, 300 tokens -> 10 blocks, not 19)."""
        need = blocks_needed(seqlen_k, self.cfg)
        if self.cfg.has_compressed_kv:
            need = max(need, -(-seqlen_k // self.cfg.block_size))
        return min(need, self.blocks_per_slot)

    def _grow(self, req: _Request, seqlen_k: int) -> None:
        have, need = int(self.state.num_blocks[req.slot]), self._kv_blocks(seqlen_k)
        if need > have:
            self.ops.append_blocks(req.slot, self._blocks(req.home, have, need))

    # ---- batches ---------------------------------------------------------------------------
    def next_batch(self) -> tuple[bool, SequenceBatch]:
        """The next step's batch."""
        self.step += 1
        w = self.workload
        is_prompt = w in ("prompt", "yoco") or (w == "mixed" and self.step % 4 == 1)
        n_ph = 0
        batch = self._prompt_batch() if is_prompt else self._decode_batch()
        if batch is None or self.rng.random() < self.placeholder_rate:
            n_ph = 1
        return is_prompt, self._finish_batch(is_prompt, batch, n_ph)

    def _finish_batch(self, is_prompt: bool, pending: Any, n_ph: int) -> SequenceBatch:
        slots, lens, drafts, nd = pending if pending is not None else (np.zeros(0, np.int64),) * 4
        if is_prompt:
            batch = self.ops.prompt_batch(slots, lens, num_placeholders=n_ph)
        else:
            batch = self.ops.decode_batch(slots, drafts, nd, num_placeholders=n_ph)
        self._after_step(is_prompt)
        return batch

    def _prompt_batch(self) -> Optional[tuple]:
        self.prefill += self._new_requests(self.prompt_seqs - len(self.prefill))
        slots, lens = [], []
        for req in self.prefill:
            q = min(req.chunk, req.prompt_len - req.done)
            slots.append(req.slot)
            lens.append(q)
        self._pending_prompt = list(zip(list(self.prefill), lens))
        return np.array(slots, np.int64), np.array(lens, np.int64), None, None

    def _decode_batch(self) -> Optional[tuple]:
        self.decoding += self._new_requests(self.decode_seqs - len(self.decoding), prefilled=True)
        r, st = self.rng, self.state
        slots, nd, drafts, self._pending_decode = [], [], [], []
        done = []
        for req in list(self.decoding):
            d = [r.randrange(1, VOCAB_SIZE - 1) for _ in range(r.choice((0, 1, 2)))]
            k = int(st.num_tokens[req.slot]) + len(d)
            if k > self.cfg.max_model_len:
                self.decoding.remove(req)
                done.append(req)
                continue
            self._grow(req, k)
            slots.append(req.slot)
            nd.append(len(d))
            drafts += d
            accepted = d[: r.randint(0, len(d))] + [r.randrange(1, VOCAB_SIZE - 1)]  # + the bonus token
            self._pending_decode.append((req, accepted))
        self._finish(done)
        if not slots:
            return None
        return np.array(slots, np.int64), None, np.array(drafts, np.int64), np.array(nd, np.int64)

    def _after_step(self, is_prompt: bool) -> None:
        """The deltas the step's results bring: prefill progress, first / accepted tokens, finishes."""
        r = self.rng
        if is_prompt:
            for req, q in getattr(self, "_pending_prompt", []):
                req.done += q
                if req.done >= req.prompt_len:
                    self.prefill.remove(req)
                    self.ops.append_tokens(req.slot, [r.randrange(1, VOCAB_SIZE - 1)])
                    self.decoding.append(req)
            self._pending_prompt = []
            n = max(len(self.decoding) - self.decode_seqs, 0)
            self._finish(self.decoding[:n])
            del self.decoding[:n]
        else:
            pend = getattr(self, "_pending_decode", [])
            if pend:
                slots = np.array([req.slot for req, _ in pend], np.int64)
                counts = np.array([len(a) for _, a in pend], np.int64)
                self.ops.append_tokens_batch(slots, np.array([t for _, a in pend for t in a], np.int64), counts)
            self._pending_decode = []

    def _finish(self, reqs: list[_Request]) -> None:
        """The step's finished requests, one ``finish_batch`` (their KV homes free again)."""
        if reqs:
            self.ops.finish_batch(np.array([q.slot for q in reqs], np.int64))
            self._free_homes += [q.home for q in reqs]
