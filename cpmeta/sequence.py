"""``SequenceMetadata`` (one scheduled sequence) and batch validation.

Validation lives in one place, :func:`validate_batch`, so every error names the sequence index
and the field: ``ValueError("seqs[3].seqlen_q: expected 1 <= seqlen_q <= seqlen_k (7), got 9")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .config import MetadataConfig, blocks_needed

__all__ = ["SequenceMetadata", "validate_batch", "blocks_needed"]


@dataclass(slots=True)
class SequenceMetadata:
    """Scheduler state of one sequence for one engine step.

    ``seqlen_k`` counts this step's queries. Prompt: ``token_ids`` holds at least ``seqlen_k``
    tokens (the whole prompt when YoCo is on). Decode: ``token_ids`` holds exactly
    ``seqlen_k - seqlen_q + 1`` confirmed tokens and ``draft_tokens`` the ``seqlen_q - 1`` MTP
    drafts, e.g. ``seqlen_q=3, seqlen_k=10``: 8 confirmed tokens, 2 drafts, positions 7, 8, 9.
    """

    seqlen_q: int  # query rows this step
    seqlen_k: int  # keys after this step (includes this step's queries)
    block_table: Sequence[int]  # physical block ids of the paged (compressed) KV
    state_id: int  # SWA ring / state slot
    token_ids: Sequence[int]  # confirmed tokens
    is_placeholder: bool = False  # padding sequence: computes, writes no KV
    swa_valid_start: int = 0  # SWA keys before this absolute position are invalid (zeroed)
    draft_tokens: Sequence[int] = ()  # decode: MTP drafts, seqlen_q - 1 of them
    compressed_token_ids: Sequence[int] = ()  # Engram: compressed history ids


def _bad(i: int, field: str, expected: str, got: object) -> ValueError:
    return ValueError(f"seqs[{i}].{field}: expected {expected}, got {got!r}")


def _check_int(i: int, field: str, v: object) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(i, field, "an int", v)


def validate_batch(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, *, is_prompt: bool) -> None:
    """Raise ``ValueError`` naming ``seqs[i].field`` for the first bad input in the batch.

    Checks (DESIGN section 3): non-empty batch; ``1 <= seqlen_q <= seqlen_k <= max_model_len``;
    ``state_id >= 0``; ``swa_valid_start >= 0``; token/draft counts per path; block table long
    enough for :func:`blocks_needed`. Int32 overflow is checked by the builders, which know the
    totals.
    """
    if isinstance(seqs, SequenceMetadata) or not isinstance(seqs, Sequence):
        raise TypeError(f"seqs: expected a list of SequenceMetadata, got {type(seqs).__name__}")
    if len(seqs) == 0:
        raise ValueError("seqs: expected at least one sequence, got an empty batch")
    for i, s in enumerate(seqs):
        if not isinstance(s, SequenceMetadata):
            raise TypeError(f"seqs[{i}]: expected SequenceMetadata, got {type(s).__name__}")
        q, k = s.seqlen_q, s.seqlen_k
        _check_int(i, "seqlen_q", q)
        _check_int(i, "seqlen_k", k)
        _check_int(i, "state_id", s.state_id)
        _check_int(i, "swa_valid_start", s.swa_valid_start)
        if type(s.is_placeholder) is not bool:
            raise _bad(i, "is_placeholder", "a bool", s.is_placeholder)
        if q < 1:
            raise _bad(i, "seqlen_q", ">= 1", q)
        if q > k:
            raise _bad(i, "seqlen_q", f"<= seqlen_k ({k})", q)
        if k > cfg.max_model_len:
            raise _bad(i, "seqlen_k", f"<= max_model_len ({cfg.max_model_len})", k)
        if s.state_id < 0:
            raise _bad(i, "state_id", ">= 0", s.state_id)
        if s.swa_valid_start < 0:
            raise _bad(i, "swa_valid_start", ">= 0", s.swa_valid_start)
        n_tok, n_draft = len(s.token_ids), len(s.draft_tokens)
        if is_prompt:
            if n_tok < k:
                raise _bad(i, "token_ids", f"at least seqlen_k ({k}) tokens", n_tok)
            if n_draft:
                raise _bad(i, "draft_tokens", "none on the prompt path", n_draft)
        else:
            if n_tok != k - q + 1:
                raise _bad(i, "token_ids", f"exactly seqlen_k - seqlen_q + 1 ({k - q + 1}) tokens", n_tok)
            if n_draft != q - 1:
                raise _bad(i, "draft_tokens", f"seqlen_q - 1 ({q - 1}) drafts", n_draft)
        need = blocks_needed(k, cfg)
        if len(s.block_table) < need:
            raise _bad(i, "block_table", f"at least {need} blocks for seqlen_k={k}{_share(cfg)}",
                       len(s.block_table))


def _share(cfg: MetadataConfig) -> str:
    """How the block count was reached, for the block_table message (sharded KV only)."""
    if cfg.kv_cp_world_size == 1:
        return ""
    return (f" (rank 0's share under kv_cp_world_size={cfg.kv_cp_world_size}, "
            f"kv_cp_interleave={cfg.kv_cp_interleave}, block_size={cfg.block_size})")
