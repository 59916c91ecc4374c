"""Digests that make a diverged replica impossible to miss.

Two checks, both vectorized numpy (no per-request Python):

- per step, :func:`batch_digest`: one 64-bit hash per SEQUENCE of the step's ``SequenceBatch``
  (its lengths, state id, valid start, placeholder flag, confirmed-token count, the token window
  it reads, its block-table length and last block, its Engram ids). The driver's hashes ride in
  the step frame; every follower compares its own batch's, so a replica whose batch -- what the
  metadata is built from -- differs is refused at the step it happens, naming the first
  differing sequence.
- every ``check_every`` steps, :func:`replica_digest`: per request SLOT, a hash of every count
  and id array the state keeps (counts, prompt length, progress, state id, valid start, liveness,
  the whole block tables, the last confirmed token) plus the token and Engram histories of a
  rotating band of slots (band ``k`` of ``n_bands`` covers slots ``s`` with ``s % n_bands == k``), so every
  slot's whole history is compared once every ``n_bands`` checks. The ranks all-gather the folded
  digest; on a mismatch they gather the per-slot hashes and name the first differing request.

Hash: ``h = sum_i v_i * (2 * i + 1) * K`` over a slot's values (uint64, wrapping), ``K`` a large
odd constant per field. Not cryptographic: it catches accidental divergence (a lost or reordered
op, a stray write into a replica), not an adversary, who could also write the frames. Example:
a slot holding tokens ``[5, 7]`` hashes them as ``5 * 1 * K + 7 * 3 * K``; ``[7, 5]`` differs.
"""

from __future__ import annotations

import numpy as np

from ..state import BatchState, SequenceBatch

__all__ = ["batch_digest", "replica_digest", "fold", "N_BANDS"]

N_BANDS = 8  # token-history bands of replica_digest
_K = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
               0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x27D4EB2F165667C5, 0x94D049BB133111EB,
               0xBF58476D1CE4E5B9, 0x62A9D9ED799705F5, 0x8CB92BA72F3D8DD7, 0xA0761D6478BD642F],
              np.uint64)


def _ragged_hash(flat: np.ndarray, off: np.ndarray, k: np.uint64) -> np.ndarray:
    """Per segment ``s``: ``sum_j flat[off[s] + j] * (2 j + 1) * k`` (uint64 wrap). Example:
    flat ``[5, 7, 9]``, off ``[0, 2, 3]`` -> ``[(5 + 21) k, 9 k]``."""
    n = len(off) - 1
    if len(flat) == 0:
        return np.zeros(n, np.uint64)
    f = flat.astype(np.uint64, copy=False)
    j = np.arange(len(flat), dtype=np.uint64) - np.repeat(off[:-1].astype(np.uint64), np.diff(off))
    cs = np.zeros(len(flat) + 1, np.uint64)
    np.cumsum(f * (2 * j + 1) * k, out=cs[1:])
    return cs[off[1:]] - cs[off[:-1]]


def batch_digest(b: SequenceBatch) -> np.ndarray:
    """``[n_seq]`` int64: one hash per sequence of the batch (see the module docstring)."""
    with np.errstate(over="ignore"):
        h = (b.seqlen_q.astype(np.uint64) * _K[0] + b.seqlen_k.astype(np.uint64) * _K[1]
             + b.state_id.astype(np.uint64) * _K[2] + b.swa_valid_start.astype(np.uint64) * _K[3]
             + b.is_placeholder.astype(np.uint64) * _K[4] + b.num_tokens.astype(np.uint64) * _K[5])
        off = b.block_table_offsets
        nb = np.diff(off)
        last = np.where(nb > 0, b.block_tables[np.maximum(off[1:] - 1, 0)] if len(b.block_tables) else 0, -1)
        h += nb.astype(np.uint64) * _K[6] + last.astype(np.uint64) * _K[7]
        h += _ragged_hash(b.tokens, b.token_offsets, _K[8])
        h += _ragged_hash(b.compressed, b.compressed_offsets, _K[9])
        h += np.uint64(int(b.is_prompt)) * _K[10]
    return h.view(np.int64)


def _rows_hash(rows: np.ndarray, counts: np.ndarray, k: np.uint64) -> np.ndarray:
    """Per row ``s``: the :func:`_ragged_hash` of ``rows[s, :counts[s]]`` (2-D, any width)."""
    if rows.shape[1] == 0 or len(rows) == 0:
        return np.zeros(len(rows), np.uint64)
    j = np.arange(rows.shape[1], dtype=np.uint64)
    w = (2 * j + 1) * k
    live = j[None, :] < counts.astype(np.uint64)[:, None]
    return (np.where(live, rows.astype(np.uint64), 0) * w).sum(axis=1, dtype=np.uint64)


def replica_digest(st: BatchState, band: int) -> np.ndarray:
    """``[max_seqs]`` int64: one hash per slot of ``st`` (see the module docstring); ``band``
    picks which slots' token histories are included this time (``band % N_BANDS``)."""
    with np.errstate(over="ignore"):
        h = np.zeros(st.max_seqs, np.uint64)
        for i, a in enumerate((st.num_tokens, st.num_computed, st.prompt_len, st.num_blocks,
                               st.num_compressed, st.state_id, st.swa_valid_start, st.active)):
            h += a.astype(np.uint64) * _K[i]
        h += _rows_hash(st.block_table, st.num_blocks, _K[8])
        live = np.flatnonzero(st.active)
        last = np.zeros(st.max_seqs, np.uint64)
        if len(live):
            last[live] = st.token_ids[live, np.maximum(st.num_tokens[live] - 1, 0)].astype(np.uint64)
        h += last * _K[10]
        mine = np.arange(band % N_BANDS, st.max_seqs, N_BANDS)
        h[mine] += _rows_hash(st.token_ids[mine], st.num_tokens[mine], _K[11]) + _rows_hash(
            st.compressed[mine], st.num_compressed[mine], _K[9])
    return h.view(np.int64)


def fold(h: np.ndarray) -> int:
    """One int64 of a per-slot / per-sequence hash array (order-sensitive)."""
    if len(h) == 0:
        return 0
    with np.errstate(over="ignore"):
        w = np.arange(1, 2 * len(h), 2, dtype=np.uint64) * _K[11]
        return int((h.view(np.uint64) * w).sum(dtype=np.uint64).view(np.int64))
