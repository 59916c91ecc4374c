"""Checks that make a diverged replica impossible to miss, at a few microseconds a step.

- per step, :func:`batch_check`: one 64-bit digest per sequence and part of the step's
  ``SequenceBatch`` -- everything its build reads: lengths, state ids, valid starts, placeholder
  flags, confirmed-token counts, the whole token window (a prompt chunk's every id), the whole
  block table and the Engram window (:mod:`cpmeta.replicate.digest_njit`, one kernel call per batch). The driver's
  digests ride in the step frame; every follower compares its own batch's before ``sync()``
  returns, so a replica whose batch -- what the metadata is built from -- differs is refused at
  the step it happens, naming the first differing request and part (:func:`first_difference`).
- every ``check_every`` steps, :func:`slot_digests`: one digest per slot of every count the
  state keeps and, for the slots of one BAND (band ``k`` of ``N_BANDS``: slots ``[k R, (k + 1)
  R)``, ``R = cdiv(max_seqs, N_BANDS)``), of its whole rows of every per-request array -- token
  history, block table, Engram ids -- so every byte of the replica is compared once every
  ``N_BANDS`` checks, what no step has read yet included; :func:`replica_digest` folds them into
  the one int the ranks all-gather. On a mismatch the per-slot digests name the first differing
  request. Whole rows are hashed, stale ids of finished requests too: replicas that applied the
  same calls hold the same bytes there as well. ONE kernel pass over the band, no copy: the
  driver keeps the per-slot digests of its step's spec, not the rows.

Neither is a signature: they catch accidental divergence (a lost or reordered op, a stray write
into a replica), not an adversary, who could also write the frames. Example: a band of 32 slots
of ``token_ids`` [256, 4096] int64 is 1 MiB: ~0.1 ms.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..state import BatchState, SequenceBatch
from ..state.state_njit import M_FIRST_BAD
from .digest_njit import PARTS, fold, replica_slot_digests, seq_digests

__all__ = ["batch_check", "first_difference", "where_differs", "replica_digest", "slot_digests", "digest_call",
           "slots_differ", "N_BANDS", "PARTS"]

N_BANDS = 8  # row bands of slot_digests (every slot's rows are digested once every N_BANDS checks)
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


def _band(st: BatchState, band: int) -> slice:
    r = -(-st.max_seqs // N_BANDS)
    k = band % N_BANDS
    return slice(k * r, min((k + 1) * r, st.max_seqs))


#: the ``BatchState.kernel_arrays`` meta rows a slot's digest covers: its counts (tokens,
#: computed, prompt, blocks, compressed, state id, valid start), the rows before M_FIRST_BAD
_N_COUNTS = M_FIRST_BAD


def slot_digests(st: BatchState, band: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """``[max_seqs]`` int64 (into ``out`` when given): one digest per slot of its counts and, in
    row band ``band``, its whole rows (see the module docstring)."""
    meta, active, token_ids, block_table, compressed = st.kernel_arrays()[:5]
    sl = _band(st, band)
    out = np.empty(st.max_seqs, _I64) if out is None else out
    replica_slot_digests(out, meta, _N_COUNTS, active, token_ids, block_table, compressed, sl.start, sl.stop)
    return out


def replica_digest(per_slot: np.ndarray) -> int:
    """The one int of a replica's :func:`slot_digests` that the ranks compare."""
    return int(fold(per_slot))


def digest_call(st: BatchState, band: int) -> tuple[np.ndarray, Callable[[], int]]:
    """:func:`slot_digests` to be made by a helper thread (the kernel releases the GIL): the
    per-slot array and the call that fills it and returns its :func:`replica_digest`. The
    caller leaves ``st`` unchanged until that call has returned."""
    out = np.empty(st.max_seqs, _I64)
    return out, lambda: replica_digest(slot_digests(st, band, out))


def slots_differ(per_slot: np.ndarray, group: Any, src: int, st: BatchState) -> str:
    """Collective over ``group`` (every rank, after the replica digests differed): every rank's
    :func:`slot_digests` gathered, and where each rank's first differs from the driver's (global
    rank ``src``), in words: ``"rank 2 first differs at slot 3 (request 'b' here)"``."""
    ranks = dist.get_process_group_ranks(group)
    rows = [torch.zeros(len(per_slot), dtype=torch.int64) for _ in ranks]
    dist.all_gather(rows, torch.from_numpy(per_slot), group=group)
    ref = rows[ranks.index(src)].numpy()
    bad = [(r, int(np.flatnonzero(t.numpy() != ref)[0])) for r, t in zip(ranks, rows)
           if not np.array_equal(t.numpy(), ref)]
    return "; ".join(f"rank {r} first differs at slot {s} (request {st.request_of(s)!r} here)" for r, s in bad)
