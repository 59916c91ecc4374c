"""Checks that make a diverged replica impossible to miss, at a few microseconds a step.

- per step, :func:`batch_check`: one crc32 per field of the step's ``SequenceBatch`` (lengths,
  state ids, valid starts, placeholder flags, confirmed-token counts, block-table lengths and
  last ids, the token window and Engram ids a decode step reads). The driver's check rides in the step
  frame; every follower compares its own batch's, so a replica whose batch -- what the metadata
  is built from -- differs is refused at the step it happens, naming the fields.
- every ``check_every`` steps, :func:`replica_digest`: crc32 of every count array the state
  keeps and of one BAND of its rows (band ``k`` of ``N_BANDS``: slots ``[k R, (k + 1) R)``,
  ``R = cdiv(max_seqs, N_BANDS)``) of every per-request array -- token history, block table,
  Engram ids -- so every byte of the replica is compared once every ``N_BANDS`` checks. The
  ranks all-gather it; on a mismatch :func:`slot_digests` (one crc32 per slot of the band) names
  the first differing request. Whole arrays are hashed, stale rows of finished requests too:
  replicas that applied the same calls hold the same bytes there as well.

crc32 (zlib, over contiguous memory) is not a signature: it catches accidental divergence (a
lost or reordered op, a stray write into a replica), not an adversary, who could also write the
frames. Example: a band of 32 slots of ``token_ids`` [256, 4096] int64 is 1 MiB: one crc32 call.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..state import BatchState, SequenceBatch

__all__ = ["batch_check", "replica_digest", "snapshot", "slot_digests", "check_mismatch", "N_BANDS",
           "CHECK_FIELDS"]

N_BANDS = 8  # row bands of replica_digest
#: what batch_check covers, one crc32 each, in order
CHECK_FIELDS = ("seqlen_q", "seqlen_k", "state_id", "swa_valid_start", "is_placeholder",
                "num_tokens", "block table lengths", "last blocks", "tokens", "compressed", "is_prompt")
_CRC_FIELDS = CHECK_FIELDS[:6]
_WINDOW = 8  # ids per sequence up to which a window is hashed whole (decode); past it, its ends


def _ends(flat: np.ndarray, off: np.ndarray, n: int) -> np.ndarray:
    """``flat`` itself when it holds at most ``_WINDOW`` ids per sequence, else the last id of
    every sequence's run (an empty run reads its neighbour's: still the same on every replica)."""
    if len(flat) <= _WINDOW * n + _WINDOW:
        return flat
    return flat[off[1:] - 1]


def batch_check(b: SequenceBatch) -> np.ndarray:
    """``[11]`` int64: one crc32 per field of the batch (:data:`CHECK_FIELDS`): the per-sequence
    arrays whole, the block tables by their lengths and last ids (what a step appends to;
    ``SequenceBatch.block_table_ends``, which a decode batch of the state answers from its 2-D
    rows: the flat tables, which its build does not read, are never made for the check), the
    token window and Engram ids whole for a decode step and by their last ids for a prompt
    chunk (the history itself is the periodic replica check's). About 11 crc32 calls over a few
    KB. Example: a replica whose ``seqlen_k`` of one sequence is off by one differs in word 1."""
    crc = _crc
    out = [crc(getattr(b, f)) for f in _CRC_FIELDS]
    n = len(b.seqlen_q)
    lens, last = b.block_table_ends()  # from a decode batch's 2-D rows: its flat tables stay unmade
    out += [crc(lens), crc(last)]
    out.append(crc(_ends(b.tokens, b.token_offsets, n)) if len(b.tokens) else 0)
    out.append(crc(_ends(b.compressed, b.compressed_offsets, n)) if len(b.compressed) else 0)
    out.append(int(b.is_prompt))
    return np.array(out, np.int64)


def check_mismatch(mine: np.ndarray, want: np.ndarray) -> str:
    """The fields where two :func:`batch_check` arrays differ (``"seqlen_k, tokens"``); ``""``
    when equal."""
    if np.array_equal(mine, want):
        return ""
    if len(mine) != len(want):
        return "the batch spec"
    return ", ".join(f for f, a, b in zip(CHECK_FIELDS, mine.tolist(), want.tolist()) if a != b)


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
