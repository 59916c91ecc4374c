"""A follower applies one step frame to its replica: the runs in order, the batch spec in place.

Every run is replayed with the ``BatchState`` call the driver made, or with the kernels that call
runs (appends and batch specs: one compiled call, :mod:`cpmeta.replicate.replay_njit`), so the replica goes through exactly the driver's states and the
batch spec yields, bit for bit, the driver's ``SequenceBatch``. A frame whose runs do not add up
to its columns, or whose ``add_request`` lands in another slot than the driver's, is refused
(``ReplicaError``), never half-applied silently: the caller stops the replica (it is diverged).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..state import BatchState, SequenceBatch
from .ops import ADD, BLK, CMP, COLUMNS, FIN, SID, SPEC, SPEC_WORDS, SVS, TOK, Columns
from .ops import WIDTHS as _WIDTH  # int64 values per row of each column
from .digest import batch_check
from .replay_njit import S_END, S_SPEC, replay

__all__ = ["apply_step", "warm_replay", "ReplicaError"]


class ReplicaError(RuntimeError):
    """A step this replica cannot apply as the driver did (the replica has diverged)."""


#: the columns each run code reads, in order (a ragged run: slots, counts, then its flat ids)
_READS = {ADD: ("add_meta",), TOK: ("tok_slots", "tok_counts", "tok_flat"),
          BLK: ("blk_slots", "blk_counts", "blk_flat"), CMP: ("cmp_slots", "cmp_counts", "cmp_flat"),
          SID: ("sid_pairs",), SVS: ("svs_pairs",), FIN: ("fin_slots",)}
_UNREAD = ("runs", "batch_digest")  # columns no run reads from


def _take(cols: dict[str, np.ndarray], at: dict[str, int], name: str, k: int) -> Any:
    """The next ``k`` rows of column ``name`` (``ReplicaError`` past its end): an int64 array."""
    a = at[name]
    col = cols[name]
    if k < 0 or a + k > len(col):
        raise ReplicaError(f"step frame: {name} holds {len(col)} entries, its runs read {a + k}")
    at[name] = a + k
    return col[a:a + k]


def apply_step(state: BatchState, cols: Columns, req_ids: list[Any], spec: list[int]
               ) -> tuple[list[SequenceBatch], np.ndarray]:
    """Apply the step's runs to ``state`` in order; return the specs' batches (in call order)
    and their step check (``digest.batch_check(batches)``, written by the replay).

    ``cols``: every column of :data:`cpmeta.replicate.ops.COLUMNS` as the frame carried it
    (:class:`~cpmeta.replicate.ops.Columns`: one int64 buffer);
    ``req_ids`` the added requests' ids in order; ``spec`` the batch specs' values,
    ``SPEC_WORDS`` per spec (``[is_prompt, num_placeholders, advance, uniform drafts, #slots,
    #lens, #drafts]``). Append runs and batch specs go through the compiled replay
    (:func:`~cpmeta.replicate.replay_njit.replay`: a decode step is one call); adds, finishes,
    moves and any run it refuses are replayed here with the ``BatchState`` call the driver made,
    which raises the named error of a refused run.
    """
    if len(spec) % SPEC_WORDS:
        raise ReplicaError(f"step frame: {len(spec)} spec values, not a multiple of {SPEC_WORDS}")
    buf, starts, _ = cols
    runs = cols.col(0)
    at, end = starts[:-1].copy(), starts[1:]
    at[_RUNS], at[_DIGEST] = end[_RUNS], end[_DIGEST]  # no run reads them: read to their end
    try:
        words = np.array(spec, np.int64)
        rows = len(spec) // SPEC_WORDS + int(sum(spec[4::SPEC_WORDS]) + sum(spec[1::SPEC_WORDS]))
    except (OverflowError, TypeError, ValueError):
        words, rows = _NO_WORDS, 0  # every spec then replayed below, which names the bad value
    arrays = state.kernel_arrays()
    check = np.empty((rows if 0 <= rows <= _MAX_CHECK_ROWS else 0, 4), np.int64)  # else: batch_check below
    batches: list[SequenceBatch] = []
    adds = iter(req_ids)
    r, si, crow, replayed = 0, 0, 0, True
    named: Any = None  # the columns by name, made when a run goes through Python
    while True:
        status, r, si, crow, gbuf, ph, vouched = replay(r, runs, buf, at, end, words, si, *arrays, check, crow,
                                                        state.lookback)
        if status == S_END:
            break
        if status == S_SPEC:
            batches.append(state.gathered(gbuf, ph, vouched, bool(spec[si - SPEC_WORDS])))
            if r == len(runs):  # the step's last run (a decode step: ONE call); else the next runs
                break
            continue
        replayed = replayed and not (runs[r, 0] == SPEC)  # a spec made here: its check made below
        pos = dict(zip(COLUMNS, ((at - starts[:-1]) // _WIDTH).tolist()))  # rows of each column
        code, n = runs[r].tolist()
        if named is None:
            named = cols.named
        _run(state, named, pos, code, n, adds, spec, batches)
        at[:] = starts[:-1] + _WIDTH * [pos[c] for c in COLUMNS]
        si = SPEC_WORDS * len(batches)
        r += 1
    if (at != end).any():  # a column its runs did not read to its end: the first one named
        i = int(np.flatnonzero(at != end)[0])
        raise ReplicaError(f"step frame: {COLUMNS[i]} holds {len(cols.col(i))} entries, its runs read "
                           f"{(at[i] - starts[i]) // _WIDTH[i]}")
    if next(adds, None) is not None or len(spec) != SPEC_WORDS * len(batches):
        raise ReplicaError("step frame: more request ids or specs than its runs use")
    return batches, (check if replayed and crow == len(check) else batch_check(batches))


def warm_replay(state: BatchState, cols: Columns, batches: list[SequenceBatch]) -> None:
    """Run, read-only, what :func:`apply_step` runs on a step like ``cols``: the compiled replay's
    call with the state's arrays (from the end of the runs: nothing applied) and the digests of
    the last step's ``batches`` (reading their arrays and the kernel). A follower spinning for
    its next step calls it (``ReplicatedBatchState.warm``) so the step meets warm caches."""
    buf, starts, _ = cols
    runs = cols.col(0)
    replay(len(runs), runs, buf, starts[:-1].copy(), starts[1:], _NO_WORDS, 0, *state.kernel_arrays(),
           _NO_CHECK, 0, state.lookback)
    if batches:
        batch_check(batches)


_NO_WORDS = np.zeros(0, np.int64)
_NO_CHECK = np.zeros((0, 4), np.int64)
_MAX_CHECK_ROWS = 1 << 20  # spec words claiming more rows: the check is made from the batches, if any
_RUNS, _DIGEST = (COLUMNS.index(c) for c in _UNREAD)  # columns no run reads (set read to their end)


def _run(state: BatchState, cols: dict[str, np.ndarray], at: dict[str, int], code: int, n: int, adds: Any,
         spec: list[int], batches: list[SequenceBatch]) -> None:
    """One run replayed with the driver's ``BatchState`` call(s); ``at``: the columns' cursors."""
    if code == TOK or code == BLK or code == CMP:
        names = _READS[code]
        slots, counts = _take(cols, at, names[0], n), _take(cols, at, names[1], n)
        flat = _take(cols, at, names[2], int(counts.sum()))
        (state.append_tokens_batch if code == TOK else state.append_blocks_batch if code == BLK
         else state.append_compressed_batch)(slots, flat, counts)
    elif code == ADD:
        _add(state, cols, at, _take(cols, at, "add_meta", n), [next(adds, None) for _ in range(n)])
    elif code == FIN:
        for slot in _take(cols, at, "fin_slots", n).tolist():
            state.finish(slot)
    elif code == SID or code == SVS:
        for slot, v in _take(cols, at, _READS[code][0], n).tolist():
            (state.set_state_id if code == SID else state.set_swa_valid_start)(slot, v)
    elif code == SPEC and n == 1 and len(spec) > SPEC_WORDS * len(batches):
        w = SPEC_WORDS * len(batches)
        batches.append(_spec(state, cols, at, spec[w:w + SPEC_WORDS]))
    else:
        raise ReplicaError(f"step frame: unknown run ({code}, {n})")


def _add(state: BatchState, cols: dict[str, np.ndarray], at: dict[str, int], meta: np.ndarray,
         req_ids: list[Any]) -> None:
    """A run of ``add_request`` calls as ONE ``add_requests_batch`` (all or none added); each
    request must land in the driver's slot."""
    if None in req_ids:
        raise ReplicaError("step frame: fewer request ids than its add_request entries")
    if (meta[:, 4:] < 0).any():
        raise ReplicaError("step frame: an add_request entry with a negative count")
    slot, state_id, valid_start, num_computed, nt, nb, nc = meta.T
    got = state.add_requests_batch(req_ids, _take(cols, at, "add_tokens", int(nt.sum())), nt,
                                   _take(cols, at, "add_blocks", int(nb.sum())), nb, state_id,
                                   compressed_ids=_take(cols, at, "add_comp", int(nc.sum())), compressed_counts=nc,
                                   swa_valid_starts=valid_start, num_computed=num_computed)
    if (got != slot).any():
        i = int(np.flatnonzero(got != slot)[0])
        raise ReplicaError(f"request {req_ids[i]!r}: added in slot {int(got[i])} here, slot {int(slot[i])} on the driver")


def _spec(state: BatchState, cols: dict[str, np.ndarray], at: dict[str, int], spec: list[int]) -> SequenceBatch:
    is_prompt, n_ph, advance, uniform, n_slots, n_lens, n_drafts = spec
    slots = _take(cols, at, "spec_slots", n_slots)
    lens = _take(cols, at, "spec_lens", n_lens)
    drafts = _take(cols, at, "spec_drafts", n_drafts)
    if is_prompt:
        return state.prompt_batch(slots, lens, num_placeholders=n_ph, advance=bool(advance))
    nd: Any = uniform if uniform >= 0 else (lens if uniform == -1 else None)
    return state.decode_batch(slots, drafts if len(drafts) or nd is not None else None, nd,
                              num_placeholders=n_ph)
