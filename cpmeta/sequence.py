"""``SequenceMetadata`` (one scheduled sequence) and batch validation.

Validation lives in one place, :func:`validate_batch`, so every error names the sequence index
and the field: ``ValueError("seqs[3].seqlen_q: expected 1 <= seqlen_q <= seqlen_k (7), got 9")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .config import MetadataConfig, blocks_needed

__all__ = ["SequenceMetadata", "validate_batch", "check_distinct_state_ids", "blocks_needed"]

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


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
    """An int (a numpy integer counts, a bool does not) within int64 (the arrays' type)."""
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise _bad(i, field, "an int", v)
    if not INT64_MIN <= v <= INT64_MAX:
        raise _bad(i, field, "an int within int64", v)


def validate_batch(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, *, is_prompt: bool) -> None:
    """Raise ``ValueError`` naming ``seqs[i].field`` for the first bad input in the batch.

    Checks (docs/design.md section 3): non-empty batch; ints (Python or numpy integers, never bools)
    with ``1 <= seqlen_q <= seqlen_k <= max_model_len``; ``state_id >= 0`` (and, with the
    sliding-window state cache, ``<= cfg.max_state_id`` so its ring slots fit int32);
    ``swa_valid_start >= 0``; token/draft counts per path; block table long enough for
    :func:`blocks_needed`; with the state cache, no two non-placeholder sequences sharing a
    ``state_id`` (:func:`check_distinct_state_ids`). The id VALUES (token, draft and block ids)
    are checked where they are read into arrays (``SequenceBatch.from_sequences`` /
    ``validate``, the builders' table read); int32 overflow of the totals by the builders.
    """
    if isinstance(seqs, SequenceMetadata) or not isinstance(seqs, Sequence):
        raise TypeError(f"seqs: expected a list of SequenceMetadata, got {type(seqs).__name__}")
    if len(seqs) == 0:
        raise ValueError("seqs: expected at least one sequence, got an empty batch")
    for i, s in enumerate(seqs):
        if not isinstance(s, SequenceMetadata):
            raise TypeError(f"seqs[{i}]: expected SequenceMetadata, got {type(s).__name__}")
        _check_sequence(i, s, cfg, is_prompt)
    if cfg.has_swa and len(seqs) > 1:
        check_distinct_state_ids(np.array([int(s.state_id) for s in seqs], np.int64),
                                 np.array([s.is_placeholder for s in seqs], bool), cfg)


def _check_sequence(i: int, s: SequenceMetadata, cfg: MetadataConfig, is_prompt: bool) -> None:
    """The checks of one sequence (``validate_batch``'s loop body)."""
    q, k = s.seqlen_q, s.seqlen_k
    _check_int(i, "seqlen_q", q)
    _check_int(i, "seqlen_k", k)
    _check_int(i, "state_id", s.state_id)
    _check_int(i, "swa_valid_start", s.swa_valid_start)
    if type(s.is_placeholder) is not bool:
        raise _bad(i, "is_placeholder", "a bool", s.is_placeholder)
    if q < 1:
        raise _bad(i, "seqlen_q", ">= 1", q)
    if k < 1:  # seqlen_k counts this step's queries: never below 1, whatever seqlen_q is
        raise _bad(i, "seqlen_k", ">= 1 (it counts this step's queries)", k)
    if q > k:
        raise _bad(i, "seqlen_q", f"<= seqlen_k ({k})", q)
    if k > cfg.max_model_len:
        raise _bad(i, "seqlen_k", f"<= max_model_len ({cfg.max_model_len})", k)
    if s.state_id < 0:
        raise _bad(i, "state_id", ">= 0", s.state_id)
    if cfg.has_swa and s.state_id > cfg.max_state_id:
        raise _bad(i, "state_id", f"<= {cfg.max_state_id} (slot_mapping_store_swa int32 overflow: "
                   f"state_id * swa_block_size + swa_block_size - 1 must be <= 2**31 - 1, "
                   f"swa_block_size={cfg.swa_block_size})", s.state_id)
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


def check_distinct_state_ids(state_id: np.ndarray, is_placeholder: np.ndarray, cfg: MetadataConfig) -> None:
    """With the sliding-window state cache (``cfg.has_swa``), raise ``ValueError`` naming the
    later of two non-placeholder sequences that share a ``state_id``: both would write the
    same ``slot_mapping_store_swa`` slots (``state_id * S + pos % S``) and read each other's
    ring. Placeholders (they write no KV) are exempt. Without the state cache a state id is
    read by no field, so sharing one is allowed (an engine without state may pass 0 for all).

    One sort of the ``[n_seq]`` ids (C, ~2 us at 256) decides; only a clash is located.
    Example: state ids ``[4, 7, 4]``, no placeholders -> ``seqs[2].state_id: ... seqs[0]``;
    ``[4, 7, 4]`` with seqs[0] a placeholder -> fine.
    """
    if not cfg.has_swa or len(state_id) < 2:
        return
    real = None if not is_placeholder.any() else np.flatnonzero(~is_placeholder)
    ids = state_id if real is None else state_id[real]
    srt = np.sort(ids)
    if not np.count_nonzero(srt[1:] == srt[:-1]):
        return
    first: dict[int, int] = {}
    for k, sid in enumerate(ids.tolist()):  # error path only: name the clash in batch order
        i = k if real is None else int(real[k])
        j = first.setdefault(sid, i)
        if j != i:
            raise _bad(i, "state_id", f"a state id no other sequence of the batch holds (seqs[{j}] holds "
                       f"it; both would write the same slot_mapping_store_swa slots)", sid)
    raise AssertionError("sorted ids repeat but no clash was found")  # pragma: no cover


def _share(cfg: MetadataConfig) -> str:
    """How the block count was reached, for the block_table message (sharded KV only)."""
    if cfg.kv_cp_world_size == 1:
        return ""
    return (f" (rank 0's share under kv_cp_world_size={cfg.kv_cp_world_size}, "
            f"kv_cp_interleave={cfg.kv_cp_interleave}, block_size={cfg.block_size})")
