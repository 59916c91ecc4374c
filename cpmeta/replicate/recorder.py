"""The driver's side of a ``ReplicatedBatchState``: ``BatchState``'s calls, applied and recorded.

Every call is made on the driver's own replica first -- a call the state refuses raises there
and is never recorded -- then recorded into the step's :class:`~cpmeta.replicate.ops.OpLog`
with the values the state now holds. A step's frame ends with its LAST batch spec: calls made
after a spec are recorded into the next step's log (``_next``); a further spec in the same step
(a mixed step: a prompt chunk batch and a decode batch) pulls them back in before itself.
Worked example: ``decode_batch(...)``, ``append_tokens_batch(...)`` (this step's results),
``sync()`` -> the frame holds the decode spec; the appends open the next step's frame.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Hashable, NamedTuple, Optional, Sequence

import numpy as np

from ..state import BatchState, SequenceBatch
from ..state.checks import as_int_array, check_bool, check_int_arg, check_placeholders, int64_flat, is_draft_count
from ..state.requests import add_arguments, check_new_ids, id_list, next_free
from ..state.state_njit import check_slots
from ..state.store import raise_slots
from .ops import BLK, CMP, COLUMNS, NO_LIVE, SID, SPEC_WORDS, SVS, TOK, Columns, OpLog, flat_ints

__all__ = ["Recorder", "StepSpec", "specs_of"]

_SPEC_SLOTS = COLUMNS.index("spec_slots")

_EMPTY = np.zeros(0, np.int64)
#: a batch spec's ``OpLog.batch_spec`` arguments (is_prompt, slots, lens, drafts, placeholders, advance, uniform)
_Logged = tuple[bool, np.ndarray, np.ndarray, np.ndarray, int, bool, int]


class StepSpec(NamedTuple):
    """A batch spec as every rank knows it after ``sync()`` (``rep.specs``): the arguments of
    its ``prompt_batch`` (``chunk_lens``, ``advance``) or ``decode_batch`` (``draft_tokens``,
    ``num_drafts``: one int, an array or None). An in-place decode engine stages from it on
    every rank: ``cpmeta.stage_decode(staging, rep.state, spec.slots, spec.draft_tokens,
    spec.num_drafts, num_placeholders=spec.num_placeholders)``."""

    is_prompt: bool
    slots: np.ndarray
    chunk_lens: Optional[np.ndarray]
    draft_tokens: Optional[np.ndarray]
    num_drafts: Optional[np.ndarray | int]
    num_placeholders: int
    advance: bool


def decode_spec(slots: np.ndarray, lens: np.ndarray, drafts: np.ndarray, uniform: int, n_ph: int) -> StepSpec:
    """The :class:`StepSpec` of a decode spec's columns (``uniform``: the one draft count, -1 =
    per-sequence counts in ``lens``, -2 = none given)."""
    nd: Optional[np.ndarray | int] = uniform if uniform >= 0 else (lens if uniform == -1 else None)
    return StepSpec(False, slots, None, drafts if len(drafts) or nd is not None else None, nd, n_ph, True)


def _ints(name: str, values: Any) -> np.ndarray:
    """A private flat int64 copy of ``values`` (ints only: ``as_int_array`` names anything else;
    with ``defer_apply`` no state has checked them yet)."""
    return np.array(as_int_array(name, values))


class Recorder(ABC):
    """The driver's calls of a ``ReplicatedBatchState`` (see the module docstring)."""

    state: BatchState

    def _init_recorder(self, defer: bool = False, driver: bool = False) -> None:
        n = self.state.max_seqs
        #: defer_apply: calls are only recorded; the driver applies the step after sending it
        #: (``_free_model`` predicts ``add_request``'s slots: the state's hand-out order)
        self._defer = defer
        self._free_model = self.state.free_slots()
        #: defer_apply: the live requests as the recorded calls leave them (id -> slot, each
        #: slot's id or None, and as a mask), for refusing at the call an id already live and a
        #: slot without a live request (appended to, batched, finished, given twice)
        self._owner: list[Any] = [self.state.request_of(s) for s in range(n)]
        self._live_model: dict[Hashable, int] = {r: s for s, r in enumerate(self._owner) if r is not None}
        self._active = np.array([r is not None for r in self._owner], bool)
        self._mark, self._err = np.zeros(n, np.int64), np.zeros(4, np.int64)  # check_slots' scratch
        self._live = (self._active, self._mark, self._err)  # a deferred kernel's live-slot check
        #: a defer_apply driver that may record (cleared at close): its batch appends and specs
        #: of flat int64 arrays go to their kernel with no other Python on the way -- the step's
        #: first calls follow the engine's idle, and each Python layer then costs microseconds
        self._fast = defer and driver
        self._log = OpLog(n)  # this step's calls, up to and with its last batch spec
        self._next = OpLog(n)  # calls made after the last spec: the next step's first ops
        self._batches: list[Optional[SequenceBatch]] = []  # None: deferred (made at sync)
        self._pending: list[StepSpec] = []  # the default driver's specs (defer_apply: made at sync, see _spec_recorded)

    def _on_state(self, call: Callable[..., Any], *args: Any) -> None:
        """The call on the driver's replica now (it validates: a refused call raises before it
        is recorded); with ``defer_apply`` nothing yet (the replica applies the step at sync)."""
        if not self._defer:
            call(*args)

    @abstractmethod
    def _driver(self, what: str) -> None:
        """Refuse ``what`` on a follower or after close (the replicated state's rule)."""

    @property
    def _rec(self) -> OpLog:
        """Where the next call is recorded: after the step's (last) spec, the next step's log."""
        return self._next if self._batches else self._log

    def add_request(self, req_id: Hashable, prompt_token_ids: Sequence[int], block_table: Sequence[int],
                    state_id: int, *, compressed_token_ids: Sequence[int] = (), swa_valid_start: int = 0,
                    num_computed: int = 0) -> int:
        """``BatchState.add_request`` on the driver's replica, recorded for the step (request ids:
        int or str, they travel in the frame)."""
        self._driver("add_request")
        rid = _request_id(req_id)
        if self._defer:  # the state's argument checks now, its checks against the replica at sync
            check_new_ids([rid], self._live_model)
            if not self._free_model:
                raise ValueError(f"request {rid!r}: all max_seqs={self.state.max_seqs} slots are in use")
            for name, v in (("state_id", state_id), ("swa_valid_start", swa_valid_start),
                            ("num_computed", num_computed)):
                check_int_arg(name, v, rid)
            toks, blocks, comp = (as_int_array(name, v, rid) for name, v in (
                ("prompt_token_ids", prompt_token_ids), ("block_table", block_table),
                ("compressed_token_ids", compressed_token_ids)))
            s = self._free_model[-1]
            self._rec.add(s, rid, toks, blocks, comp, int(state_id), int(swa_valid_start), int(num_computed))
            self._live_model[rid], self._owner[s], self._active[s] = s, rid, True
            return self._free_model.pop()  # (a refused call takes no slot)
        st = self.state
        s = st.add_request(rid, prompt_token_ids, block_table, state_id,
                           compressed_token_ids=compressed_token_ids, swa_valid_start=swa_valid_start,
                           num_computed=num_computed)
        self._rec.add(s, rid, st.token_ids[s, :st.num_tokens[s]], st.block_table[s, :st.num_blocks[s]],
                      st.compressed[s, :st.num_compressed[s]], int(st.state_id[s]),
                      int(st.swa_valid_start[s]), int(st.num_computed[s]))
        return s

    def add_requests_batch(self, req_ids: Sequence[Hashable], token_ids: np.ndarray, token_counts: np.ndarray,
                           block_ids: np.ndarray, block_counts: np.ndarray, state_ids: np.ndarray, *,
                           compressed_ids: Optional[np.ndarray] = None,
                           compressed_counts: Optional[np.ndarray] = None,
                           swa_valid_starts: Optional[np.ndarray] = None,
                           num_computed: Optional[np.ndarray] = None) -> np.ndarray:
        """``BatchState.add_requests_batch`` on the driver's replica, recorded as the run of
        ``add_request`` calls it equals, in one recording call (every rank applies the run in
        one call)."""
        self._driver("add_requests_batch")
        rids = [_request_id(r) for r in id_list(req_ids)]
        n = len(rids)
        if self._defer:  # recorded only: the replica's one call checks the values at sync
            check_new_ids(rids, self._live_model)
            if n > len(self._free_model):
                raise ValueError(f"request {rids[len(self._free_model)]!r}: all max_seqs={self.state.max_seqs} "
                                 "slots are in use")
            flat, scal = add_arguments(n, token_ids, token_counts, block_ids, block_counts, state_ids,
                                       compressed_ids, compressed_counts, swa_valid_starts, num_computed)
            free = self._free_model
            slots = np.array(next_free(free, n), np.int64)
            self._rec.add_many(slots, rids, scal, *flat)  # counts checked as the replica's add would
            del free[len(free) - n:]
            for r, s in zip(rids, slots.tolist()):
                self._live_model[r], self._owner[s] = s, r
            self._active[slots] = True
            return slots
        st = self.state
        slots = st.add_requests_batch(rids, token_ids, token_counts, block_ids, block_counts, state_ids,
                                      compressed_ids=compressed_ids, compressed_counts=compressed_counts,
                                      swa_valid_starts=swa_valid_starts, num_computed=num_computed)
        flat, _ = add_arguments(n, token_ids, token_counts, block_ids, block_counts, state_ids,
                                compressed_ids, compressed_counts)  # accepted: no copies
        scal = np.vstack((st.state_id[slots], st.swa_valid_start[slots], st.num_computed[slots]))
        self._rec.add_many(slots, rids, scal, *flat)
        return slots

    def append_tokens(self, slot: int, tokens: Sequence[int]) -> None:
        self._driver("append_tokens")
        self._append_one(TOK, self.state.append_tokens, slot, tokens, "tokens")

    def append_tokens_batch(self, slots: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        self._append_many(TOK, "append_tokens_batch", slots, tokens, counts, "tokens")

    def append_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        self._driver("append_blocks")
        self._append_one(BLK, self.state.append_blocks, slot, blocks, "blocks")

    def append_blocks_batch(self, slots: np.ndarray, blocks: np.ndarray, counts: np.ndarray) -> None:
        """``BatchState.append_blocks_batch``: every request's new block ids in one call."""
        self._append_many(BLK, "append_blocks_batch", slots, blocks, counts, "block ids")

    def append_compressed(self, slot: int, ids: Sequence[int]) -> None:
        self._driver("append_compressed")
        self._append_one(CMP, self.state.append_compressed, slot, ids, "compressed ids")

    def append_compressed_batch(self, slots: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> None:
        self._append_many(CMP, "append_compressed_batch", slots, ids, counts, "compressed ids")

    def _append_one(self, code: int, call: Callable[..., Any], slot: Any, values: Any, what: str) -> None:
        """A one-slot append: made on the replica (it checks), or with ``defer_apply`` its
        arguments checked as the replica's call checks them (its slot against the live model,
        its capacity: the replica's check at sync) -- then recorded."""
        if self._defer:
            s, v = self._slot(slot), as_int_array(what, values)
        else:
            call(slot, values)
            s, v = int(slot), flat_ints(values)
        self._rec.ragged(code, s, len(v), v)

    def _append_many(self, code: int, name: str, slots: Any, values: Any, counts: Any, what: str) -> None:
        """A batch append ``name``, as :meth:`_append_one` (with ``defer_apply``: ints only, live
        distinct slots, the counts ``>= 0`` summing to the values, checked as they are recorded)."""
        live = None
        if self._fast and int64_flat(slots, counts, values):
            live = self._live
        elif self._defer:
            self._driver(name)
            slots, counts, values = as_int_array("slots", slots), as_int_array("counts", counts), \
                as_int_array(what, values)
            live = self._live
        else:
            self._driver(name)
            getattr(self.state, name)(slots, values, counts)
        got = (self._next if self._batches else self._log).ragged(code, slots, counts, values, live)
        if got == -3:
            raise_slots(slots, self._active, self._owner)
        if got:
            raise ValueError(f"counts: expected {len(slots)} counts >= 0 summing to {len(values)} {what}")

    def _live_slots(self, slots: np.ndarray) -> None:
        """With ``defer_apply``: ``slots`` (int64) are distinct slots of the model's live
        requests (``ValueError``, the state's message, naming the first that is not)."""
        if check_slots(slots, self._active, self._mark, self._err):
            raise_slots(slots, self._active, self._owner)

    def _finished(self, slots: np.ndarray) -> None:
        """With ``defer_apply``: the model's requests in ``slots`` leave it (a free slot or one
        given twice: ``ValueError``, nothing changes); their slots are free again in the
        hand-out order."""
        self._live_slots(slots)
        given = slots.tolist()
        for s in given:
            del self._live_model[self._owner[s]]
            self._owner[s] = None
        self._active[slots] = False
        self._free_model += given

    def _slot(self, slot: Any) -> int:
        """A deferred one-slot call's slot: an int (never a float taken as one) holding a live
        request of the model (the state's message otherwise)."""
        if type(slot) is not int:
            check_int_arg("slot", slot)
        if not 0 <= slot < self.state.max_seqs or self._owner[slot] is None:
            raise ValueError(f"slot {slot}: no live request there")
        return int(slot)

    def set_state_id(self, slot: int, state_id: int) -> None:
        self._driver("set_state_id")
        if self._defer:
            check_int_arg("state_id", state_id)
            self._rec.pair(SID, self._slot(slot), int(state_id))
            return
        self.state.set_state_id(slot, state_id)
        self._rec.pair(SID, int(slot), int(self.state.state_id[slot]))

    def set_swa_valid_start(self, slot: int, swa_valid_start: int) -> None:
        self._driver("set_swa_valid_start")
        if self._defer:
            check_int_arg("swa_valid_start", swa_valid_start)
            self._rec.pair(SVS, self._slot(slot), int(swa_valid_start))
            return
        self.state.set_swa_valid_start(slot, swa_valid_start)
        self._rec.pair(SVS, int(slot), int(self.state.swa_valid_start[slot]))

    def finish(self, slot: int) -> None:
        self._driver("finish")
        if self._defer:
            s = self._slot(slot)
            self._finished(np.array((s,), np.int64))
        else:
            self.state.finish(slot)
            s = int(slot)
        self._rec.finish(np.array((s,), np.int64))

    def finish_batch(self, slots: Sequence[int] | np.ndarray) -> None:
        """``BatchState.finish_batch``: a step's finished requests, one recording call."""
        self._driver("finish_batch")
        s = as_int_array("slots", slots)
        if not len(s):
            return
        if self._defer:
            self._finished(s)
        else:
            self.state.finish_batch(s)
        self._rec.finish(s)

    def prompt_batch(self, slots: np.ndarray, chunk_lens: np.ndarray, *, num_placeholders: int = 0,
                     advance: bool = True) -> None:
        """A batch spec of the step: ``BatchState.prompt_batch`` (made on the driver now, on every
        follower when it applies the step); :meth:`sync` returns the batch on every rank."""
        self._driver("prompt_batch")
        check_placeholders(num_placeholders)
        check_bool("advance", advance)
        ints = as_int_array if self._defer else _ints  # (as decode_batch)
        slots_a, lens = ints("slots", slots), ints("chunk_lens", chunk_lens)
        if self._defer and (len(lens) != len(slots_a) or len(lens) and int(lens.min()) < 1):
            self._live_slots(slots_a)  # (its message first)
            raise ValueError(f"chunk_lens: expected {len(slots_a)} chunk lengths >= 1, got {lens.tolist()[:8]}")
        batch = None if self._defer else \
            self.state.prompt_batch(slots_a, lens, num_placeholders=num_placeholders, advance=advance)
        spec = None if self._defer else StepSpec(True, slots_a, lens, None, None, int(num_placeholders), bool(advance))
        self._spec_recorded(batch, spec, (True, slots_a, lens, _EMPTY, num_placeholders, advance, -2))

    def decode_batch(self, slots: np.ndarray, draft_tokens: Optional[np.ndarray] = None,
                     num_drafts: Optional[np.ndarray | int] = None, *, num_placeholders: int = 0) -> None:
        """A batch spec of the step: ``BatchState.decode_batch`` (see :meth:`prompt_batch`)."""
        if not self._fast:
            self._driver("decode_batch")
        check_placeholders(num_placeholders)
        batch = None if self._defer else \
            self.state.decode_batch(slots, draft_tokens, num_drafts, num_placeholders=num_placeholders)
        ints = as_int_array if self._defer else _ints  # defer_apply: the kernel copies them (the spec: at sync)
        slots_a = ints("slots", slots)
        drafts = _EMPTY if draft_tokens is None else ints("draft_tokens", draft_tokens)
        nd = num_drafts
        uniform = -2 if nd is None else int(nd) if is_draft_count(nd) else -1
        lens = ints("num_drafts", nd) if uniform == -1 else _EMPTY
        if self._defer and not _drafts_ok(len(slots_a), nd, lens, len(drafts)):
            self._live_slots(slots_a)  # (its message first)
            raise ValueError(f"num_drafts: expected {len(slots_a)} counts >= 0 (or one count for all) summing to "
                             f"{len(drafts)} drafts")
        self._spec_recorded(batch, None if self._defer else decode_spec(slots_a, lens, drafts, uniform, int(num_placeholders)),
                            (False, slots_a, lens, drafts, num_placeholders, True, uniform))

    def _spec_recorded(self, batch: Optional[SequenceBatch], spec: Optional[StepSpec], logged: _Logged) -> None:
        """A spec was made (``logged``: :meth:`OpLog.batch_spec`'s arguments): the calls since the
        previous spec of this step (if any) belong before it; the batch and spec wait for sync().
        With ``defer_apply`` its slots are checked live and distinct first (the first spec of a
        step in its recording kernel), nothing recorded if not, and ``spec`` is None: made, as
        on a follower, from the step's columns when :attr:`specs` is read."""
        live = NO_LIVE
        if self._defer and self._batches:  # checked before the calls since the last spec join the log
            self._live_slots(logged[1])
        elif self._defer:
            live = self._live
        if self._batches:
            self._log.extend(self._next)
            self._next.clear()
        if self._log.batch_spec(*logged, live=live):
            raise_slots(logged[1], self._active, self._owner)
        self._batches.append(batch)
        if spec is not None:
            self._pending.append(spec)
        if not self._defer:  # (a defer_apply driver digests nothing at the spec)
            self._at_spec()

    @abstractmethod
    def _at_spec(self) -> None:
        """What the replicated state does once a spec is made (its check-step digest)."""


def _drafts_ok(n: int, nd: Any, lens: np.ndarray, n_drafts: int) -> bool:
    """A deferred decode spec's draft counts as ``BatchState.decode_batch`` holds them: one count
    ``>= 0`` for all, or ``n`` counts ``>= 0``, summing to the drafts given (none: no drafts)."""
    if nd is None:
        return n_drafts == 0
    if is_draft_count(nd):
        return nd >= 0 and n * nd == n_drafts
    return len(lens) == n and (not n or int(lens.min()) >= 0) and int(lens.sum()) == n_drafts


def _request_id(req_id: Any) -> Any:
    """A replicated request id: an int64 (a numpy integer counts, a bool does not) or a str --
    what the step frame's value check holds every follower to (the driver's send trusts it)."""
    if type(req_id) is not str and not isinstance(req_id, (int, np.integer)) or isinstance(req_id, bool):
        raise TypeError(f"request {req_id!r}: a replicated request id is an int or a str, got "
                        f"{type(req_id).__name__}")
    if type(req_id) is str:
        return req_id
    rid = int(req_id)
    if not -(1 << 63) <= rid < 1 << 63:
        raise ValueError(f"request {rid}: a replicated request id that is an int fits int64")
    return rid


def specs_of(cols: Columns, spec: list[int]) -> tuple[StepSpec, ...]:
    """A follower's :class:`StepSpec` s of a received step (its spec values and columns), their
    arrays copies (the columns' buffer is the read's, reused two steps later)."""
    out, at = [], [0, 0, 0]
    s_col, l_col, d_col = (cols.col(_SPEC_SLOTS + i) for i in range(3))
    for i in range(0, len(spec) - SPEC_WORDS + 1, SPEC_WORDS):
        is_prompt, n_ph, advance, uniform, ns, nl, nd = spec[i:i + SPEC_WORDS]
        slots = s_col[at[0]:at[0] + ns].copy()
        lens = l_col[at[1]:at[1] + nl].copy()
        drafts = d_col[at[2]:at[2] + nd].copy()
        at = [at[0] + ns, at[1] + nl, at[2] + nd]
        out.append(StepSpec(True, slots, lens, None, None, n_ph, bool(advance)) if is_prompt
                   else decode_spec(slots, lens, drafts, uniform, n_ph))
    return tuple(out)
