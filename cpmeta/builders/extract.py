"""``extract_batch``: a batch (list of ``SequenceMetadata`` or ``SequenceBatch``) -> ``BatchArrays``.

A list is first read into a :class:`~cpmeta.state.batch.SequenceBatch` (ONE Python pass, the
checks of ``validate_batch`` vectorized), so both inputs share one array path
(:func:`as_sequence_batch`, what the compiled builders call; ``extract_batch`` serves the numpy
readers: the in-place GPU path's staging and a CP rank's Engram rows). From a
``SequenceBatch`` the extraction is a handful of numpy operations over ``[n_seq]`` arrays: prefix
sums, the row index arrays, a gather of the input ids out of the token windows, and (only when a
table is longer than needed) a compaction of the block tables. No Python loop over sequences.
"""

from __future__ import annotations

import logging
from typing import Sequence, Union

import numpy as np

from ..cache import BoundedCache

from ..config import MetadataConfig, blocks_needed_array
from ..sequence import SequenceMetadata
from .batch_arrays import BatchArrays, arange_ro, expand_rows
from ..state.batch import SequenceBatch

__all__ = ["extract_batch", "as_sequence_batch", "BatchInput"]

logger = logging.getLogger(__name__)

#: What every builder accepts as its batch.
BatchInput = Union[Sequence[SequenceMetadata], SequenceBatch]


def as_sequence_batch(seqs: BatchInput, cfg: MetadataConfig, *, is_prompt: bool) -> SequenceBatch:
    """``seqs`` itself (validated for ``cfg``) when it is a ``SequenceBatch`` of the right path,
    else ``SequenceBatch.from_sequences``. A batch of the other path is a ``ValueError``."""
    if isinstance(seqs, SequenceBatch):
        if seqs.is_prompt != is_prompt:
            want, got = ("prompt", "decode") if is_prompt else ("decode", "prompt")
            raise ValueError(f"seqs: expected a {want} SequenceBatch, got a {got} one")
        seqs.validate(cfg)
        return seqs
    return SequenceBatch.from_sequences(seqs, cfg, is_prompt=is_prompt)


#: ``n -> (arange(n), zeros(n))`` read-only: ``row_seq`` / ``row_j`` of a one-row-per-sequence batch.
_IDENTITY: BoundedCache[int, tuple[np.ndarray, np.ndarray]] = BoundedCache(64)


def _identity(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(arange(n), zeros(n))`` int64, read-only, cached: ``row_seq`` / ``row_j`` of a
    one-row-per-sequence batch (and ``arange(n + 1)`` its ``cu_q``)."""
    hit = _IDENTITY.get(n)
    if hit is None:
        hit = _IDENTITY.put(n, (np.arange(n, dtype=np.int64), np.zeros(n, np.int64)))
        for a in hit:
            a.flags.writeable = False
    return hit


def _row_arrays(n: int, total_q: int, sq: np.ndarray, cu_q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``row_seq`` and ``row_j`` ([total_q] int64); one row per sequence is the common decode case."""
    if total_q == n:  # identity rows: cached read-only arrays (the builders never write them)
        return _identity(n)
    row_seq = np.repeat(np.arange(n, dtype=np.int64), sq)
    return row_seq, arange_ro(total_q) - expand_rows(cu_q[:-1], sq, row_seq)


def extract_batch(seqs: BatchInput, cfg: MetadataConfig, *, is_prompt: bool) -> BatchArrays:
    """Validate ``seqs`` (same errors as ``validate_batch``) and derive the arrays the numpy
    readers of a batch use (the in-place GPU path's staging, a CP rank's Engram rows).

    Example: 2 decode sequences ``(seqlen_q, seqlen_k) = (1, 5), (3, 9)`` give ``cu_q = [0, 1, 4]``,
    ``row_seq = [0, 1, 1, 1]``, ``row_pos = [4, 6, 7, 8]``; without
    Engram their token windows are ``[t4]`` and ``[t6, d0, d1]`` (positions q_start..seqlen_k-1),
    which ARE the input ids, so no gather is needed.
    """
    sb = as_sequence_batch(seqs, cfg, is_prompt=is_prompt)
    n = len(sb)
    sq, sk = sb.seqlen_q, sb.seqlen_k
    cu_k = np.zeros(n + 1, np.int64)
    np.add.accumulate(sk, out=cu_k[1:])
    if len(sb.tokens) == n:  # every window holds >= seqlen_q >= 1 ids: one row per sequence
        cu_q, total_q = _identity(n + 1)[0], n
    else:
        cu_q = np.zeros(n + 1, np.int64)
        np.add.accumulate(sq, out=cu_q[1:])
        total_q = int(cu_q[-1])
    q_start = sk - sq
    need = blocks_needed_array(sk, cfg)
    bt_flat, bt_start = _flat_tables(sb, need, cfg)
    row_seq, row_j = _row_arrays(n, total_q, sq, cu_q)
    row_pos = q_start if total_q == n else expand_rows(q_start, sq, row_seq) + row_j  # one row each: q_start
    toks, tok_off = sb.tokens, sb.token_offsets
    if sb.lookback == 0 or len(toks) == total_q:  # windows start at q_start: they are the input ids
        input_ids = toks
        tok_lo = q_start
    else:
        tok_lo = np.maximum(q_start - sb.lookback, 0)
        input_ids = toks[expand_rows(tok_off[:-1] - tok_lo, sq, row_seq) + row_pos] if total_q != n else \
            toks[tok_off[:-1] - tok_lo + row_pos]
    return BatchArrays(
        n_seq=n, total_q=total_q, seqlen_q=sq, seqlen_k=sk, q_start=q_start,
        state_id=sb.state_id,
        is_placeholder=sb.is_placeholder, cu_q=cu_q, cu_k=cu_k,
        bt_flat=bt_flat, bt_start=bt_start, bt_need=need, input_ids=input_ids,
        row_seq=row_seq, row_pos=row_pos,
        tok_flat=toks, tok_off=tok_off, tok_lo=tok_lo,
        comp_flat=sb.compressed, is_prompt=is_prompt,
        comp_len=np.diff(sb.compressed_offsets) if cfg.max_ngram_size > 0 else None,  # Engram only
    )


def _flat_tables(sb: SequenceBatch, need: np.ndarray, cfg: MetadataConfig) -> tuple[np.ndarray, np.ndarray]:
    """The first ``need[s]`` block ids of every table back to back, plus one trailing 0; every
    one of them in ``[0, cfg.max_block_id]`` (else ``ValueError`` naming ``seqs[i].block_table``:
    a negative id, or one whose KV slots pass int32).

    Example: tables ``[[7, 8, 9], [4]]``, need ``[2, 1]`` -> ``bt_flat = [7, 8, 4, 0]``,
    ``bt_start = [0, 2]``. When every table is exactly as long as needed this is one copy.
    """
    off = sb.block_table_offsets
    start = np.zeros(len(need) + 1, np.int64)
    np.add.accumulate(need, out=start[1:])
    total = int(start[-1])
    flat = np.empty(total + 1, np.int64)
    if int(off[-1]) == total:  # every table has exactly `need` blocks (need <= len is validated)
        flat[:total] = sb.block_tables
    else:
        seq = np.repeat(np.arange(len(need)), need)
        flat[:total] = sb.block_tables[off[:-1][seq] + np.arange(total) - start[:-1][seq]]
    flat[total] = 0
    if total and (flat[:total].min() < 0 or flat[:total].max() > cfg.max_block_id):
        _bad_block_id(flat[:total], start, cfg)
    return flat, start[:-1]


def _bad_block_id(ids: np.ndarray, start: np.ndarray, cfg: MetadataConfig) -> None:
    """The ``seqs[i].block_table`` error for the first needed block id outside ``[0,
    max_block_id]`` (error path only): id ``f`` of the flat needed ids belongs to the sequence
    ``i`` with ``start[i] <= f < start[i + 1]``, entry ``f - start[i]`` of its table. Example:
    needs ``[2, 1]`` -> ``start = [0, 2, 3]``; a bad id at ``f = 2`` -> ``searchsorted([2, 3], 2,
    "right") = 1``: ``seqs[1].block_table`` entry ``2 - 2 = 0``."""
    f = int(np.argmax((ids < 0) | (ids > cfg.max_block_id)))
    i = int(np.searchsorted(start[1:], f, side="right"))
    got, at = int(ids[f]), f - int(start[i])
    if got < 0:
        raise ValueError(f"seqs[{i}].block_table: expected block ids >= 0, got {got} at index {at}")
    bc = cfg.block_size // cfg.min_ratio
    what = "slot_mapping_store_ca" if cfg.has_compressed_kv else "the paged KV slot"
    raise ValueError(
        f"seqs[{i}].block_table: expected block ids <= {cfg.max_block_id}, got {got} at index {at} "
        f"({what} int32 overflow: block id * b_c + b_c - 1 must be <= 2**31 - 1, "
        f"b_c = block_size // min_ratio = {bc})")
