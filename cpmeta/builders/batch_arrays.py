"""``BatchArrays``: one batch as per-sequence and per-row int64 numpy arrays, and its row helpers.

The numpy readers of a batch (the in-place GPU path's staging, a CP rank's Engram rows, YoCo's
plan) turn it into ONE ``BatchArrays`` (:func:`cpmeta.builders.extract.extract_batch`) and work
vectorized over all sequences / rows at once; the builders' kernels read the ``SequenceBatch``
itself.

Row layout: rows are query rows in varlen order. For sequence ``s`` with ``seqlen_q = 3`` and
``seqlen_k = 10`` the rows hold local index ``j = 0, 1, 2`` and absolute positions ``7, 8, 9``
(``q_start = seqlen_k - seqlen_q = 7``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..cache import BoundedCache

__all__ = ["BatchArrays", "expand_rows", "arange_ro", "REPEAT_MIN_ROWS"]


#: Rows per sequence from which ``np.repeat`` beats a gather through ``row_seq`` (measured: 8
#: sequences x 4096 rows, repeat ~13 us vs gather ~47 us; 256 x 3 rows, gather 1.5 vs 3 us).
REPEAT_MIN_ROWS = 8


def expand_rows(x: np.ndarray, counts: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """``x[seq]`` where ``seq = repeat(arange(len(x)), counts)``: a repeat when the rows are long
    (few sequences, many rows each: the prompt), else the gather. Same values either way."""
    if len(seq) >= REPEAT_MIN_ROWS * len(x):
        return np.repeat(x, counts)
    return x[seq]


_ARANGE: BoundedCache[int, np.ndarray] = BoundedCache(16)


def arange_ro(n: int) -> np.ndarray:
    """``np.arange(n)`` int64, cached read-only (a prompt step needs arange(total_q) for 32k
    rows: ~20 us to make each time)."""
    a = _ARANGE.get(n)
    if a is None:
        a = np.arange(n, dtype=np.int64)
        a.flags.writeable = False
        _ARANGE.put(n, a)
    return a


@dataclass(slots=True)
class BatchArrays:
    """Per-sequence ([n_seq]) and per-row ([total_q]) int64 numpy arrays of one batch.

    Derived from a :class:`~cpmeta.state.batch.SequenceBatch` (whose token / compressed windows
    it shares without a copy) by :func:`~cpmeta.builders.extract.extract_batch`.

    ``bt_flat`` holds each sequence's first ``bt_need[s]`` block ids (``blocks_needed``) back to
    back, starting at ``bt_start[s]``, plus ONE trailing 0 that masked lookups point at, so a
    gather never needs a bounds branch.
    """

    n_seq: int
    total_q: int
    seqlen_q: np.ndarray  # [n_seq] int64
    seqlen_k: np.ndarray  # [n_seq] int64
    q_start: np.ndarray  # [n_seq] int64, seqlen_k - seqlen_q
    state_id: np.ndarray  # [n_seq] int64
    is_placeholder: np.ndarray  # [n_seq] bool
    cu_q: np.ndarray  # [n_seq+1] int64, exclusive prefix sums of seqlen_q
    cu_k: np.ndarray  # [n_seq+1] int64, exclusive prefix sums of seqlen_k
    bt_flat: np.ndarray  # [sum(bt_need) + 1] int64, needed block ids + a trailing 0
    bt_start: np.ndarray  # [n_seq] int64, offset of each table in bt_flat
    bt_need: np.ndarray  # [n_seq] int64, blocks_needed(seqlen_k)
    input_ids: np.ndarray  # [total_q] int64
    row_seq: np.ndarray  # [total_q] int64, sequence of each row
    row_pos: np.ndarray  # [total_q] int64, absolute position q_start + j
    tok_flat: np.ndarray  # [sum window] int64, token window [tok_lo, seqlen_k) of each sequence
    tok_off: np.ndarray  # [n_seq+1] int64, offsets of the windows in tok_flat
    tok_lo: np.ndarray  # [n_seq] int64, first position of each window, max(0, q_start - lookback)
    comp_flat: np.ndarray  # [sum comp_len] int64, Engram compressed ids of positions [tok_lo, tok_lo + comp_len)
    comp_len: Optional[np.ndarray]  # [n_seq] int64; None without Engram (max_ngram_size == 0)
    is_prompt: bool
