"""Checks that make a diverged replica impossible to miss, at a few microseconds a step.

- per step, :func:`batch_check`: one 64-bit digest per sequence and part of the step's
  ``SequenceBatch`` -- everything its build reads: lengths, state ids, valid starts, placeholder
  flags, confirmed-token counts, the whole token window (a prompt chunk's every id), the whole
  block table and the Engram window (:mod:`cpmeta.replicate.digest_njit`, one kernel call per batch). The driver's
  digests ride in the step frame; every follower compares its own batch's before ``sync()``
  returns, so a replica whose batch -- what the metadata is built from -- differs is refused at
  the step it happens, naming the first differing request and part (:func:`first_difference`).
- every ``check_every`` steps, :func:`replica_digest`: crc32 of every count array the state
  keeps and of one BAND of its rows (band ``k`` of ``N_BANDS``: slots ``[k R, (k + 1) R)``,
  ``R = cdiv(max_seqs, N_BANDS)``) of every per-request array -- token history, block table,
  Engram ids -- so every byte of the replica is compared once every ``N_BANDS`` checks, what no
  step has read yet included. The ranks all-gather it; on a mismatch :func:`slot_digests` (one
  crc32 per slot of the band) names the first differing request. Whole arrays are hashed, stale
  rows of finished requests too: replicas that applied the same calls hold the same bytes there
  as well.

Neither is a signature: they catch accidental divergence (a lost or reordered op, a stray write
into a replica), not an adversary, who could also write the frames. Example: a band of 32 slots
of ``token_ids`` [256, 4096] int64 is 1 MiB: one crc32 call.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional, Sequence

import numpy as np

from ..state import BatchState, SequenceBatch
from .digest_njit import PARTS, seq_digests

__all__ = ["batch_check", "first_difference", "where_differs", "replica_digest", "snapshot", "slot_digests", "N_BANDS",
           "PARTS"]

N_BANDS = 8  # row bands of replica_digest
_I64 = np.int64


def _one_check(b: SequenceBatch) -> np.ndarray:
    """``[1 + n_seq, 4]`` int64: the header row ``[is_prompt, n_seq, lookback, 0]``, then one
    row of :data:`PARTS` digests per sequence (see :func:`batch_check`)."""
    n = len(b)
    out = np.empty((n + 1, 4), _I64)
    out[0] = (int(b.is_prompt), n, b.lookback, 0)
    a = np.asarray
    seq_digests(out[1:], a(b.seqlen_q, _I64), a(b.seqlen_k, _I64), a(b.num_tokens, _I64),
                a(b.state_id, _I64), a(b.swa_valid_start, _I64), a(b.is_placeholder, np.bool_),
                a(b.tokens, _I64), a(b.token_offsets, _I64), a(b.compressed, _I64),
                a(b.compressed_offsets, _I64), a(b.block_tables, _I64), a(b.block_table_offsets, _I64))
    return out


_NONE = np.zeros((0, 4), _I64)


def batch_check(batches: Sequence[SequenceBatch]) -> np.ndarray:
    """The step's check: for each batch in order a header row ``[is_prompt, n_seq, lookback,
    0]`` and one row per sequence of its :data:`PARTS` digests (``[sum(1 + n_seq), 4]`` int64;
    ``[0, 4]`` for a step without a batch): one kernel call per batch. Example: a decode batch
    of 2 sequences -> 3 rows; a follower whose second sequence's table differs in one id
    differs in row 2, column 2 only."""
    if not batches:
        return _NONE
    if len(batches) == 1:
        return _one_check(batches[0])
    return np.concatenate([_one_check(b) for b in batches])


def first_difference(mine: np.ndarray, want: np.ndarray) -> Optional[tuple[int, int, str]]:
    """Where two :func:`batch_check` arrays first differ: ``(batch, sequence, what)`` --
    ``sequence`` -1 for the batch itself (its kind, size or look-back, or a different number
    of batches: ``batch`` -1 then), ``what`` the differing parts (``"token window, block
    table"``); ``None`` when equal. Example: rows ``[hdr, s0, s1]`` differing in row 2, column
    2 -> ``(0, 1, "block table")``."""
    if mine.shape == want.shape and (mine.tobytes() == want.tobytes() if mine.dtype == want.dtype
                                     else np.array_equal(mine, want)):  # bytes: ~3x cheaper after an idle
        return None
    k, at = 0, 0
    while at < len(mine) and at < len(want):
        n_mine, n_want = int(mine[at, 1]), int(want[at, 1])
        if not np.array_equal(mine[at], want[at]) or n_mine != n_want:
            return k, -1, "kind, number of sequences or look-back"
        bad = np.flatnonzero((mine[at + 1:at + 1 + n_mine] != want[at + 1:at + 1 + n_mine]).any(1))
        if bad.size:
            i = int(bad[0])
            row = at + 1 + i
            return k, i, ", ".join(p for j, p in enumerate(PARTS) if mine[row, j] != want[row, j])
        at += 1 + n_mine
        k += 1
    return -1, -1, "number of batches"


def where_differs(diff: tuple[int, int, str], specs: Sequence[Any], st: BatchState) -> str:
    """Words for :func:`first_difference`'s ``(batch, sequence, part)`` of a step whose batch
    specs are ``specs`` (``StepSpec`` s: their slots name the request in ``st``). Example:
    ``(0, 1, "block table")`` -> ``"request 'b' (slot 4), sequence 1 of batch 0: block table"``."""
    k, i, what = diff
    if i < 0:
        return f"batch {k}'s {what}" if k >= 0 else f"the {what}"
    slots = specs[k].slots if k < len(specs) else ()
    who = (f"request {st.request_of(int(slots[i]))!r} (slot {int(slots[i])})" if i < len(slots)
           else f"placeholder sequence {i - len(slots)}")
    return f"{who}, sequence {i} of batch {k}: {what}"


def _crc(a: np.ndarray, c: int = 0) -> int:
    """crc32 of an array's bytes (made contiguous first when it is not), continuing ``c``."""
    a = np.ascontiguousarray(a)
    return zlib.crc32(a.reshape(-1).view(np.uint8).data, c) if a.size else zlib.crc32(b"", c)


def _band(st: BatchState, band: int) -> slice:
    r = -(-st.max_seqs // N_BANDS)
    k = band % N_BANDS
    return slice(k * r, min((k + 1) * r, st.max_seqs))


_COUNTS = ("num_tokens", "num_computed", "prompt_len", "num_blocks", "num_compressed", "state_id",
           "swa_valid_start", "active")
_ROWS = ("token_ids", "block_table", "compressed")


def replica_digest(st: BatchState, band: int) -> int:
    """One int of the replica (see the module docstring): its counts and row band ``band``."""
    c = 0
    for name in _COUNTS:
        c = _crc(getattr(st, name), c)
    sl = _band(st, band)
    for name in _ROWS:
        c = _crc(getattr(st, name)[sl], c)
    return c


def snapshot(st: BatchState, band: int) -> tuple[list[np.ndarray], list[np.ndarray], slice]:
    """Copies of what :func:`replica_digest` covers for ``band`` (counts, the band's rows): the
    driver keeps one from its step's spec for :func:`slot_digests`, should the check fail."""
    sl = _band(st, band)
    return ([getattr(st, n).copy() for n in _COUNTS],
            [getattr(st, n)[sl].copy() for n in _ROWS], sl)


def slot_digests(snap: tuple[list[np.ndarray], list[np.ndarray], slice]) -> np.ndarray:
    """``[max_seqs]`` int64 of a :func:`snapshot`: one crc32 per slot of its counts and, in the
    band, its rows (the slow path that names the first differing request)."""
    counts, rows, sl = snap
    n = len(counts[0])
    out = np.zeros(n, np.int64)
    for s in range(n):
        c = 0
        for a in counts:
            c = _crc(a[s:s + 1], c)
        if sl.start <= s < sl.stop:
            for r in rows:
                c = _crc(r[s - sl.start], c)
        out[s] = c
    return out
