"""A seeded synthetic scheduler: realistic per-step batches for the launch loop.

Every rank constructs the same ``SyntheticScheduler(seed, ...)`` and so produces the same batch
sequence; that is what ``--verify`` relies on (each rank rebuilds the driver's batch locally).

Requests go through chunked prefill (prompt steps), then decode with 0-2 MTP draft tokens
(decode steps). Batches carry placeholders now and then, Engram look-back is on (an image
sentinel sits inside some prompts), and some requests have ``swa_valid_start > 0``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from cpmeta import MetadataConfig, SequenceMetadata
from cpmeta.sequence import blocks_needed

__all__ = ["SyntheticScheduler", "default_config", "WORKLOADS", "IMAGE_TOKEN_ID", "VOCAB_SIZE"]

WORKLOADS = ("decode", "prompt", "mixed", "yoco")
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


@dataclass
class _Request:
    slot: int  # request slot: owns state_id == slot and a fixed block range
    prompt: list[int]
    chunk: int  # prefill chunk size
    done: int = 0  # prompt tokens already prefilled
    generated: list[int] = field(default_factory=list)
    swa_valid_start: int = 0

    @property
    def in_prefill(self) -> bool:
        return self.done < len(self.prompt)

    def confirmed(self) -> list[int]:
        return self.prompt + self.generated


class SyntheticScheduler:
    """Deterministic batches for ``workload`` in {decode, prompt, mixed, yoco}.

    ``next_batch()`` returns ``(is_prompt, seqs)``. ``decode_seqs`` / ``prompt_seqs`` size the
    batches; ``max_prompt`` bounds prompt lengths (chunked by 256..2048 tokens).
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
        self._next_slot = 0
        self._free_slots: list[int] = []
        self.prefill: list[_Request] = []
        self.decoding: list[_Request] = []

    # ---- request lifecycle ---------------------------------------------------------------
    def _slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._next_slot += 1
        return self._next_slot - 1

    def _new_request(self) -> _Request:
        r = self.rng
        n = r.randint(16, self.max_prompt)
        prompt = [r.randrange(1, VOCAB_SIZE - 1) for _ in range(n)]
        if r.random() < 0.3:  # an image span somewhere in the prompt
            at = r.randrange(n)
            for i in range(at, min(n, at + r.randint(1, 8))):
                prompt[i] = IMAGE_TOKEN_ID
        req = _Request(self._slot(), prompt, chunk=r.choice((256, 512, 1024, 2048)))
        if r.random() < 0.2:
            req.swa_valid_start = r.randrange(n)
        return req

    def _block_table(self, req: _Request, seqlen_k: int) -> list[int]:
        base = req.slot * self.blocks_per_slot
        need = blocks_needed(seqlen_k, self.cfg)
        # a scattered but deterministic physical layout: reverse order inside the slot's range
        return [base + self.blocks_per_slot - 1 - b for b in range(need)]

    def _placeholder(self, is_prompt: bool) -> SequenceMetadata:
        k = 1
        return SequenceMetadata(
            seqlen_q=1, seqlen_k=k, block_table=[0] * blocks_needed(k, self.cfg), state_id=0,
            token_ids=[0] * (k if is_prompt else 1), is_placeholder=True,
        )

    # ---- batches ---------------------------------------------------------------------------
    def next_batch(self) -> tuple[bool, list[SequenceMetadata]]:
        self.step += 1
        w = self.workload
        is_prompt = w in ("prompt", "yoco") or (w == "mixed" and self.step % 4 == 1)
        seqs = self._prompt_batch() if is_prompt else self._decode_batch()
        if self.rng.random() < self.placeholder_rate:
            seqs.append(self._placeholder(is_prompt))
        return is_prompt, seqs

    def _prompt_batch(self) -> list[SequenceMetadata]:
        while len(self.prefill) < self.prompt_seqs:
            self.prefill.append(self._new_request())
        seqs = []
        for req in list(self.prefill):
            q_start = req.done
            q = min(req.chunk, len(req.prompt) - q_start)
            k = q_start + q
            seqs.append(SequenceMetadata(
                seqlen_q=q, seqlen_k=k, block_table=self._block_table(req, k), state_id=req.slot,
                token_ids=req.prompt, swa_valid_start=req.swa_valid_start,
                compressed_token_ids=(),
            ))
            req.done = k
            if not req.in_prefill:
                self.prefill.remove(req)
                req.generated.append(self.rng.randrange(1, VOCAB_SIZE - 1))
                self.decoding.append(req)
        while len(self.decoding) > self.decode_seqs:
            self._finish(self.decoding.pop(0))
        return seqs

    def _decode_batch(self) -> list[SequenceMetadata]:
        while len(self.decoding) < self.decode_seqs:
            req = self._new_request()  # pretend its prompt was prefilled earlier
            req.done = len(req.prompt)
            req.generated.append(self.rng.randrange(1, VOCAB_SIZE - 1))
            self.decoding.append(req)
        seqs = []
        r = self.rng
        for req in list(self.decoding):
            toks = req.confirmed()
            drafts = [r.randrange(1, VOCAB_SIZE - 1) for _ in range(r.choice((0, 1, 2)))]
            q = 1 + len(drafts)
            k = len(toks) - 1 + q
            if k > self.cfg.max_model_len:
                self.decoding.remove(req)
                self._finish(req)
                continue
            seqs.append(SequenceMetadata(
                seqlen_q=q, seqlen_k=k, block_table=self._block_table(req, k), state_id=req.slot,
                token_ids=toks, draft_tokens=drafts, swa_valid_start=req.swa_valid_start,
            ))
            req.generated.extend(drafts[: r.randint(0, len(drafts))])  # accepted drafts
            req.generated.append(r.randrange(1, VOCAB_SIZE - 1))  # the bonus token
        if not seqs:
            seqs.append(self._placeholder(False))
        return seqs

    def _finish(self, req: _Request) -> None:
        self._free_slots.append(req.slot)


def batch_summary(is_prompt: bool, seqs: list[SequenceMetadata]) -> dict[str, int]:
    """Small dict describing a batch (for logs)."""
    return {
        "is_prompt": int(is_prompt),
        "num_seqs": len(seqs),
        "total_q": sum(s.seqlen_q for s in seqs),
        "placeholders": sum(1 for s in seqs if s.is_placeholder),
    }
