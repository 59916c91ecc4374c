"""A follower applies one step frame to its replica: the runs in order, the batch spec in place.

Every run is replayed with the ``BatchState`` call the driver made, or with the kernels that call
runs (appends, finishes, adds and batch specs: one compiled call per spec,
:mod:`cpmeta.replicate.replay_njit`), so the replica goes through exactly the driver's states and the
batch spec yields, bit for bit, the driver's ``SequenceBatch``. A frame whose runs do not add up
to its columns, or whose ``add_request`` lands in another slot than the driver's, is refused
(``ReplicaError``), never half-applied silently: the caller stops the replica (it is diverged).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from ..builders.decode_sink import DecodeSink
from ..metadata import InputMetadata
from ..state import BatchState, SequenceBatch
from ..state.requests import next_free
from .ops import ADD, BLK, CMP, COLUMNS, FIN, SID, SPEC, SPEC_WORDS, SVS, TOK, Columns
from .ops import WIDTHS as _WIDTH  # int64 values per row of each column
from .digest import batch_check
from .replay_njit import S_END, S_SPEC, replay, replay_decode
from .step_read_njit import F_DONE

__all__ = ["apply_step", "warm_replay", "ReplicaError", "Gathered", "batches_of"]


class ReplicaError(RuntimeError):
    """A step this replica cannot apply as the driver did (the replica has diverged)."""


class Gathered(NamedTuple):
    """A batch the replay's call gathered AND built (``apply_step(..., lazy=True)``): its
    ``SequenceBatch`` is made only when read (:func:`batches_of`: ~5 us warm, ~12 after an idle,
    on the way from a follower's frame to its metadata otherwise)."""

    state: BatchState
    buf: np.ndarray
    ph: np.ndarray
    vouched: bool
    is_prompt: bool


def one_or_many(got: list[Any]) -> Any:
    """A step's results as ``ReplicatedBatchState.sync`` returns them: ``None``, one, a tuple."""
    return None if not got else got[0] if len(got) == 1 else tuple(got)


def batches_of(got: list[Any]) -> list[SequenceBatch]:
    """``apply_step``'s batches, each :class:`Gathered` one made now."""
    return [b.state.gathered(b.buf, b.ph, b.vouched, b.is_prompt) if type(b) is Gathered else b for b in got]


#: the columns each run code reads, in order (a ragged run: slots, counts, then its flat ids)
_C = {name: i for i, name in enumerate(COLUMNS)}
_READS = {ADD: (_C["add_meta"],), TOK: (_C["tok_slots"], _C["tok_counts"], _C["tok_flat"]),
          BLK: (_C["blk_slots"], _C["blk_counts"], _C["blk_flat"]),
          CMP: (_C["cmp_slots"], _C["cmp_counts"], _C["cmp_flat"]), SID: (_C["sid_pairs"],),
          SVS: (_C["svs_pairs"],), FIN: (_C["fin_slots"],)}
_UNREAD = ("runs", "batch_digest")  # columns no run reads from
_ADD_TOKENS, _FIN = _C["add_tokens"], _C["fin_slots"]  # add_tokens: then add_blocks, add_comp
assert COLUMNS[_ADD_TOKENS:_ADD_TOKENS + 3] == ("add_tokens", "add_blocks", "add_comp")


def _take(cols: Columns, at: np.ndarray, c: int, k: int) -> Any:
    """The next ``k`` rows of column ``c`` (``ReplicaError`` past its end); ``at[c]``, its
    cursor into the columns' buffer, moves past them."""
    w, a = _WIDTH[c], int(at[c])
    start, stop = cols.starts[c:c + 2].tolist()
    have = (stop - start) // w
    if k < 0 or (a - start) // w + k > have:
        raise ReplicaError(f"step frame: {COLUMNS[c]} holds {have} entries, its runs read {(a - start) // w + k}")
    at[c] = a + k * w
    v = cols.buf[a:a + k * w]
    return v if w == 1 else v.reshape(k, w)


def apply_step(state: BatchState, cols: Columns, req_ids: list[Any], spec: list[int],
               sink: Optional[DecodeSink] = None, lazy: bool = False, fused: Any = None, digest: bool = True
               ) -> tuple[list[Any], np.ndarray, list[Optional[InputMetadata]]]:
    """Apply the step's runs to ``state`` in order; return the specs' batches (in call order),
    their step check (``digest.batch_check(batches)``, written by the replay) and, with a
    ``sink`` (a :class:`~cpmeta.builders.decode_sink.DecodeSink` on ``state``'s config), each decode
    batch's metadata when the replay's call built it too (:func:`~.replay_njit.replay_decode`:
    a vouched batch of the sink's last shape), else ``None`` (the caller builds it); with
    ``lazy`` such a batch comes as a :class:`Gathered` (:func:`batches_of` makes it).

    ``cols``: every column of :data:`cpmeta.replicate.ops.COLUMNS` as the frame carried it
    (:class:`~cpmeta.replicate.ops.Columns`: one int64 buffer);
    ``req_ids`` the added requests' ids in order; ``spec`` the batch specs' values,
    ``SPEC_WORDS`` per spec (``[is_prompt, num_placeholders, advance, uniform drafts, #slots,
    #lens, #drafts]``). Appends, finishes, adds and batch specs go through the compiled replay
    (:func:`~cpmeta.replicate.replay_njit.replay`: a decode or prompt step is one call; adds and
    finishes only when every added id is new, else here); moves and any run it refuses are
    replayed here with the ``BatchState`` call the driver made, which raises the named error of
    a refused run. ``fused``: what the follower's compiled read already applied of this step
    (``step_frame.StepReader.read``: the whole decode step, or up to a run it leaves to this
    replay), else None. ``digest=False``: no step check (an empty one returned; the caller
    makes it later from the batches, :func:`~cpmeta.replicate.digest.batch_check`).
    """
    if fused is not None and fused[0] == F_DONE:  # the read's call replayed and built it
        _, (_, _, _, crow, gbuf, ph, vouched), _, check = fused
        md = sink.result() if sink is not None else None
        return ([Gathered(state, gbuf, ph, vouched, False) if lazy and md is not None
                 else state.gathered(gbuf, ph, vouched, False)], check[:crow], [md])
    if len(spec) % SPEC_WORDS:
        raise ReplicaError(f"step frame: {len(spec)} spec values, not a multiple of {SPEC_WORDS}")
    buf, starts = cols
    runs = cols.col(0)
    at, end = starts[:-1].copy(), starts[1:]
    at[_RUNS], at[_DIGEST] = end[_RUNS], end[_DIGEST]  # no run reads them: read to their end
    first = None  # the replay's first return, when the compiled read made that call
    if fused is not None:  # F_PART: the read's call stopped at a run Python replays (and names)
        _, first, at, check = fused  # its check rows: the first ``rows`` of that buffer (below)
    try:
        words = np.array(spec, np.int64)
        rows = len(spec) // SPEC_WORDS + int(sum(spec[4::SPEC_WORDS]) + sum(spec[1::SPEC_WORDS]))
    except (OverflowError, TypeError, ValueError):
        words, rows = _NO_WORDS, 0  # every spec then replayed below, which names the bad value
    arrays = state.kernel_arrays()
    if first is None:  # rows past _MAX_CHECK_ROWS: batch_check below
        check = np.empty((rows if digest and 0 <= rows <= _MAX_CHECK_ROWS else 0, 4), np.int64)
    else:
        check = check[:rows]
    batches: list[Any] = []
    adds = iter(req_ids)
    # adds and finishes in the kernel too when every added id is new (else Python's calls name it)
    book = bool(req_ids or starts[_FIN + 1] > starts[_FIN]) and state.all_new(req_ids)
    free = state.free_stack() if book else _NO_FREE
    booked = [0, 0]  # fin_slots / add_meta rows whose slots the request maps hold
    r, si, crow, replayed = 0, 0, 0, True
    mds: list[Optional[InputMetadata]] = []
    while True:
        r0 = r
        if first is not None:
            (status, r, si, crow, gbuf, ph, vouched), first = first, None
        elif sink is None:
            status, r, si, crow, gbuf, ph, vouched = replay(r, runs, buf, at, end, words, si, *arrays, check, crow,
                                                            state.lookback, book, *free)
        else:  # aimed at the arena of the coming decode batch's rows and sequences (its spec words)
            n = T = -1
            if len(words) >= si + SPEC_WORDS and words[si] == 0:
                n = int(words[si + 4] + words[si + 1])
                T = n + int(words[si + 6])  # a row per sequence and placeholder, one per draft
            status, r, si, crow, gbuf, ph, vouched = replay_decode(
                r, runs, buf, at, end, words, si, *arrays, check, crow, state.lookback, book, *free,
                *sink.refresh(T, n))
        if book and r > r0:
            _book(state, cols, runs[r0:r].tolist(), booked, adds)
        if status == S_END:
            break
        if status == S_SPEC:
            md = None if sink is None else sink.result()
            prompt = bool(spec[si - SPEC_WORDS])
            batches.append(Gathered(state, gbuf, ph, vouched, prompt) if lazy and md is not None
                           else state.gathered(gbuf, ph, vouched, prompt))
            mds.append(md)
            if r == len(runs):  # the step's last run (a decode step: ONE call); else the next runs
                break
            continue
        code, n = runs[r].tolist()
        replayed = replayed and code != SPEC  # a spec made here: its check made below
        _run(state, cols, at, code, n, adds, spec, batches)
        mds += [None] * (len(batches) - len(mds))
        if book and (code == ADD or code == FIN):  # made by Python's call: the kernel's free list again
            booked[code == ADD] += n
            state.free_stack()
        si = SPEC_WORDS * len(batches)
        r += 1
    if at.tobytes() != end.tobytes():  # a column its runs did not read to its end (the first one named;
        # bytes compared: a ufunc and a reduction cost ~16 us after an idle, this ~8)
        i = int(np.flatnonzero(at != end)[0])
        raise ReplicaError(f"step frame: {COLUMNS[i]} holds {len(cols.col(i))} entries, its runs read "
                           f"{(at[i] - starts[i]) // _WIDTH[i]}")
    if next(adds, None) is not None or len(spec) != SPEC_WORDS * len(batches):
        raise ReplicaError("step frame: more request ids or specs than its runs use")
    if not digest:
        return batches, _NO_CHECK, mds
    return batches, (check if replayed and crow == len(check) else batch_check(batches_of(batches))), mds


def warm_replay(state: BatchState, cols: Columns, sink: Optional[DecodeSink] = None) -> None:
    """Enter, read-only, the compiled replay :func:`apply_step` runs on a step like ``cols``: its
    call with the state's arrays from the end of the runs (nothing applied), the fused one with a
    ``sink`` (:class:`~cpmeta.builders.decode_sink.DecodeSink`) -- a spinning follower's warm after
    a frame too large to read again (``ReplicatedBatchState.warm``)."""
    buf, starts = cols
    runs = cols.col(0)
    args = (len(runs), runs, buf, starts[:-1].copy(), starts[1:], _NO_WORDS, 0, *state.kernel_arrays(), _NO_CHECK, 0,
            state.lookback, False, *_NO_FREE)
    if sink is None:
        replay(*args)
    else:  # (at the runs' end it returns at once: nothing filled)
        replay_decode(*args, *sink.args)


_NO_WORDS = np.zeros(0, np.int64)
_NO_FREE = (np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64))  # a frame without adds / finishes
_NO_CHECK = np.zeros((0, 4), np.int64)
_MAX_CHECK_ROWS = 1 << 20  # spec words claiming more rows: the check is made from the batches, if any
_RUNS, _DIGEST = (COLUMNS.index(c) for c in _UNREAD)  # columns no run reads (set read to their end)


def _book(state: BatchState, cols: Columns, runs: list[list[int]], booked: list[int], adds: Any) -> None:
    """The request maps after the compiled replay finished / added requests in ``runs``
    (``booked``: the fin_slots / add_meta rows already booked; ``adds`` the frame's ids)."""
    done: list[tuple[list[int], Any]] = []
    for code, n in runs:
        if code == FIN:
            done.append((cols.col(_C["fin_slots"])[booked[0]:booked[0] + n].tolist(), None))
            booked[0] += n
        elif code == ADD:
            ids = [next(adds, None) for _ in range(n)]
            if None in ids:  # the rows are written: the replica stops here
                raise ReplicaError("step frame: fewer request ids than its add_request entries")
            done.append((cols.col(_C["add_meta"])[booked[1]:booked[1] + n, 0].tolist(), ids))
            booked[1] += n
    if done:
        state.book_replayed(done)


def _run(state: BatchState, cols: Columns, at: np.ndarray, code: int, n: int, adds: Any,
         spec: list[int], batches: list[SequenceBatch]) -> None:
    """One run replayed with the driver's ``BatchState`` call(s); ``at``: the columns' cursors."""
    if code == TOK or code == BLK or code == CMP:
        c = _READS[code]
        slots, counts = _take(cols, at, c[0], n), _take(cols, at, c[1], n)
        flat = _take(cols, at, c[2], int(counts.sum()))
        (state.append_tokens_batch if code == TOK else state.append_blocks_batch if code == BLK
         else state.append_compressed_batch)(slots, flat, counts)
    elif code == ADD:
        _add(state, cols, at, _take(cols, at, _C["add_meta"], n), [next(adds, None) for _ in range(n)])
    elif code == FIN:
        state.finish_batch(_take(cols, at, _C["fin_slots"], n))
    elif code == SID or code == SVS:
        for slot, v in _take(cols, at, _READS[code][0], n).tolist():
            (state.set_state_id if code == SID else state.set_swa_valid_start)(slot, v)
    elif code == SPEC and n == 1 and len(spec) > SPEC_WORDS * len(batches):
        w = SPEC_WORDS * len(batches)
        batches.append(_spec(state, cols, at, spec[w:w + SPEC_WORDS]))
    else:
        raise ReplicaError(f"step frame: unknown run ({code}, {n})")


def _add(state: BatchState, cols: Columns, at: np.ndarray, meta: np.ndarray, req_ids: list[Any]) -> None:
    """A run of ``add_request`` calls as ONE ``add_requests_batch`` (all or none added; the
    frame's int64 columns as the state's kernel takes them); each request must land in the
    driver's slot."""
    if None in req_ids:
        raise ReplicaError("step frame: fewer request ids than its add_request entries")
    m = np.ascontiguousarray(meta.T)  # rows: slot, state id, valid start, num computed, the 3 counts
    counts = m[4:].tolist()
    if any(v < 0 for row in counts for v in row):
        raise ReplicaError("step frame: an add_request entry with a negative count")
    slot = m[0].tolist()
    here = next_free(state.free_slots(), len(slot))  # too few free: the add's own error below
    if len(here) == len(slot) and here != slot:  # checked before anything is written
        i = next(i for i, (g, s) in enumerate(zip(here, slot)) if g != s)
        raise ReplicaError(f"request {req_ids[i]!r}: added in slot {here[i]} here, slot {slot[i]} on the driver")
    toks = _take(cols, at, _ADD_TOKENS, sum(counts[0]))
    blocks = _take(cols, at, _ADD_TOKENS + 1, sum(counts[1]))
    comp = _take(cols, at, _ADD_TOKENS + 2, sum(counts[2]))
    state.add_converted(req_ids, toks, m[4], blocks, m[5], comp, m[6], m[1:4])


def _spec(state: BatchState, cols: Columns, at: np.ndarray, spec: list[int]) -> SequenceBatch:
    is_prompt, n_ph, advance, uniform, n_slots, n_lens, n_drafts = spec
    slots = _take(cols, at, _C["spec_slots"], n_slots)
    lens = _take(cols, at, _C["spec_lens"], n_lens)
    drafts = _take(cols, at, _C["spec_drafts"], n_drafts)
    if is_prompt:
        return state.prompt_batch(slots, lens, num_placeholders=n_ph, advance=bool(advance))
    nd: Any = uniform if uniform >= 0 else (lens if uniform == -1 else None)
    return state.decode_batch(slots, drafts if len(drafts) or nd is not None else None, nd,
                              num_placeholders=n_ph)
