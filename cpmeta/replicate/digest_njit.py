"""The replicated state's digests: one per (sequence, part) of a step's batch, one per replica slot.

A step's ``SequenceBatch`` holds everything its build reads; the replicated state compares, every
step, the driver's digests with each follower's (``cpmeta.replicate.digest.batch_check``). A
digest here is FNV-1a over 64-bit words (``h = (h ^ w) * P`` from ``h = B``, ``B`` / ``P`` the
64-bit FNV offset basis and prime), finished by splitmix64's mixer, stored as int64. Parts
(columns of ``out``, :data:`PARTS`):

- 0 ``lengths and ids``: ``seqlen_q, seqlen_k, num_tokens, state_id, swa_valid_start,
  is_placeholder`` of the sequence;
- 1 ``token window``: its window of ``tokens`` (every id, the count first);
- 2 ``block table``: its whole table (the count first), as the builds read it;
- 3 ``compressed window``: its Engram ids (count first).

Worked example: one sequence ``seqlen_q = 1, seqlen_k = 5, num_tokens = 5, state 0, valid start
0, not a placeholder``, window ``[7]``, table ``[3, 4]``, no compressed ids -> part 0 digests the
words ``[1, 5, 5, 0, 0, 0]``, part 1 ``[1, 7]``, part 2 ``[2, 3, 4]``, part 3 ``[0]``; a replica
whose table reads ``[3, 9]`` differs in part 2 only.

:func:`replica_slot_digests` is the periodic whole-replica check's (``cpmeta.replicate.digest``):
one digest per slot of its counts and, in the check's band, its whole rows; :func:`fold` makes
one int of them.

These digests catch accidental divergence (a lost op, a stray write), not an adversary; they run
at about a word per cycle (four lanes) inside the kernel, no copies.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel, warmer

__all__ = ["PARTS", "seq_digests", "replica_slot_digests", "fold"]

#: what each column of a digest row covers, in order
PARTS = ("lengths and ids", "token window", "block table", "compressed window")

_BASIS = np.uint64(0xCBF29CE484222325)
_PRIME = np.uint64(0x100000001B3)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@kernel
def _word(h: np.uint64, w: np.int64) -> np.uint64:
    """One FNV-1a step over a 64-bit word."""
    return (h ^ np.uint64(w)) * _PRIME


@kernel
def _final(h: np.uint64) -> np.int64:
    """splitmix64's finalizer, as int64 (every bit depends on every word)."""
    h = (h ^ (h >> np.uint64(30))) * _M1
    h = (h ^ (h >> np.uint64(27))) * _M2
    return np.int64(h ^ (h >> np.uint64(31)))


@kernel
def _run(flat: np.ndarray, a: np.int64, b: np.int64) -> np.int64:
    """Digest of the count ``b - a`` then ``flat[a:b]``: four interleaved FNV lanes (word ``i``
    into lane ``(i - a) % 4``; the multiplies of one lane wait on each other, four lanes keep the
    multiplier busy), the tail into lane 0, the lanes folded in order (a run of under 4 words:
    lane 0 alone)."""
    h0 = _word(_BASIS, b - a)
    if b - a < 4:
        for i in range(a, b):
            h0 = _word(h0, flat[i])
        return _final(h0)
    h1 = h2 = h3 = _BASIS
    i = a  # type: ignore[assignment]  # numba: an int64 index either way
    while i + 4 <= b:
        h0 = _word(h0, flat[i])
        h1 = _word(h1, flat[i + 1])
        h2 = _word(h2, flat[i + 2])
        h3 = _word(h3, flat[i + 3])
        i += 4
    while i < b:
        h0 = _word(h0, flat[i])
        i += 1
    h = _word(_word(_word(h0, _final(h1)), _final(h2)), _final(h3))
    return _final(h)


@kernel
def seq_digests(out: np.ndarray, seqlen_q: np.ndarray, seqlen_k: np.ndarray, num_tokens: np.ndarray,
                state_id: np.ndarray, swa_valid_start: np.ndarray, is_placeholder: np.ndarray,
                tokens: np.ndarray, token_offsets: np.ndarray, compressed: np.ndarray,
                compressed_offsets: np.ndarray, block_tables: np.ndarray, block_table_offsets: np.ndarray
                ) -> None:
    """The :data:`PARTS` digests of every sequence into ``out`` ``[n_seq, 4]`` int64 (int64
    inputs, ``is_placeholder`` bool: the batch's arrays)."""
    for s in range(seqlen_q.shape[0]):
        h = _word(_BASIS, seqlen_q[s])
        h = _word(h, seqlen_k[s])
        h = _word(h, num_tokens[s])
        h = _word(h, state_id[s])
        h = _word(h, swa_valid_start[s])
        h = _word(h, np.int64(1) if is_placeholder[s] else np.int64(0))
        out[s, 0] = _final(h)
        out[s, 1] = _run(tokens, token_offsets[s], token_offsets[s + 1])
        out[s, 2] = _run(block_tables, block_table_offsets[s], block_table_offsets[s + 1])
        out[s, 3] = _run(compressed, compressed_offsets[s], compressed_offsets[s + 1])


@kernel
def replica_slot_digests(out: np.ndarray, meta: np.ndarray, n_counts: int, active: np.ndarray,
                         token_ids: np.ndarray, block_table: np.ndarray, compressed: np.ndarray, lo: int,
                         hi: int) -> None:
    """One digest per slot of a replica into ``out`` ``[max_seqs]``: the slot's counts (the first
    ``n_counts`` rows of ``meta``, then ``active``) and, for the slots of the band ``[lo, hi)``,
    its whole rows of ``token_ids``, ``block_table`` and ``compressed`` (stale ids past the
    counts included), each row a :func:`_run`."""
    zero = np.int64(0)
    for s in range(out.shape[0]):
        h = _BASIS
        for m in range(n_counts):
            h = _word(h, meta[m, s])
        h = _word(h, np.int64(1) if active[s] else zero)
        if lo <= s < hi:
            h = _word(h, _run(token_ids[s], zero, np.int64(token_ids.shape[1])))
            h = _word(h, _run(block_table[s], zero, np.int64(block_table.shape[1])))
            h = _word(h, _run(compressed[s], zero, np.int64(compressed.shape[1])))
        out[s] = _final(h)


@kernel
def fold(digests: np.ndarray) -> np.int64:
    """One digest of a digest array (:func:`_run` over it)."""
    return _run(digests, np.int64(0), np.int64(digests.shape[0]))


@warmer
def _warm() -> None:
    """The kernel on the module docstring's one sequence."""
    one = np.ones(1, np.int64)
    out = np.zeros((1, 4), np.int64)
    seq_digests(out, one, one * 5, one * 5, one * 0, one * 0, np.zeros(1, np.bool_), one * 7,
                np.array([0, 1], np.int64), one[:0], np.zeros(2, np.int64), np.array([3, 4], np.int64),
                np.array([0, 2], np.int64))
    rows, per = np.zeros((1, 2), np.int64), np.zeros(1, np.int64)
    replica_slot_digests(per, rows, 1, np.zeros(1, np.bool_), rows, rows, np.zeros((1, 0), np.int64), 0, 1)
    fold(per)
