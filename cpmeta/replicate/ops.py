"""The step's op log: what the driver did to its ``BatchState``, as ONE frame's arrays.

A step's mutating calls (``add_request``, ``append_tokens`` ...) and its batch spec
(``prompt_batch`` / ``decode_batch``) are recorded in call order as RUNS: consecutive calls of
one kind on distinct slots form one run, applied by one vectorized call on the replica (a call
on a slot the current run already holds starts a new run, so two appends to one slot keep their
order). Each kind keeps its entries in flat columns:

==========  =====================================================  ==============================
run code    columns (int64; ragged ones flat with counts)          applied as
==========  =====================================================  ==============================
``ADD``     ``add_meta`` [a, 7] (slot, state id, valid start,      ``add_requests_batch``
            num computed, #tokens, #blocks, #compressed), the
            flat ``add_tokens`` / ``add_blocks`` / ``add_comp``,
            request ids (values)
``TOK``     ``tok_slots``, ``tok_counts``, ``tok_flat``            ``append_tokens_batch``
``BLK``     ``blk_slots``, ``blk_counts``, ``blk_flat``            ``append_blocks_batch``
``CMP``     ``cmp_slots``, ``cmp_counts``, ``cmp_flat``            ``append_compressed_batch``
``SID``     ``sid_pairs`` [s, 2] (slot, state id)                  ``set_state_id`` per entry
``SVS``     ``svs_pairs`` [s, 2] (slot, valid start)               ``set_swa_valid_start``
``FIN``     ``fin_slots``                                          ``finish_batch``
``SPEC``    ``spec_slots``, ``spec_lens`` (chunk lengths or draft   ``prompt_batch`` /
            counts), ``spec_drafts``; ``SPEC_WORDS`` values each    ``decode_batch`` (one or more
                                                                   per step: a mixed step)
==========  =====================================================  ==============================

``runs`` [r, 2] = (code, entries) in call order. Worked example: ``finish(3)``, ``add_request("b",
...)`` (gets slot 3 again), ``append_blocks(3, [9])``, ``append_blocks(5, [4, 2])``,
``decode_batch([3, 5])`` -> runs ``[[FIN, 1], [ADD, 1], [BLK, 2], [SPEC, 1]]``, ``fin_slots
[3]``, ``blk_slots [3, 5]``, ``blk_counts [1, 2]``, ``blk_flat [9, 4, 2]``, ``spec_slots [3, 5]``.
"""

from __future__ import annotations

from typing import Any, Hashable, NamedTuple, Optional

import numpy as np

from ..jit import warmer
from . import ops_njit
from .ops_njit import log_add, log_extend, log_pair, log_ragged, log_slots, log_spec, pack_region

__all__ = ["OpLog", "Columns", "ADD", "TOK", "BLK", "CMP", "SID", "SVS", "FIN", "SPEC", "COLUMNS",
           "RUN_NAMES", "SPEC_WORDS", "WIDTHS", "NO_LIVE", "flat_ints"]

ADD, TOK, BLK, CMP, SID, SVS, FIN, SPEC = range(8)
RUN_NAMES = ("add_request", "append_tokens", "append_blocks", "append_compressed",
             "set_state_id", "set_swa_valid_start", "finish", "batch spec")
#: every array column of a step frame, in frame order (all int64)
COLUMNS: tuple[str, ...] = (
    "runs", "add_meta", "add_tokens", "add_blocks", "add_comp",
    "tok_slots", "tok_counts", "tok_flat", "blk_slots", "blk_counts", "blk_flat",
    "cmp_slots", "cmp_counts", "cmp_flat", "sid_pairs", "svs_pairs", "fin_slots",
    "spec_slots", "spec_lens", "spec_drafts", "batch_digest",
)
#: columns of rank 2 and their second dim
WIDE: dict[str, int] = {"runs": 2, "add_meta": 7, "sid_pairs": 2, "svs_pairs": 2, "batch_digest": 4}
#: values per batch spec in a frame's ``spec`` list (see OpLog.batch_spec)
SPEC_WORDS = 7

(_RUNS, _ADD_META, _ADD_TOKENS, _ADD_BLOCKS, _ADD_COMP, _TOK_SLOTS, _TOK_COUNTS, _TOK_FLAT, _BLK_SLOTS,
 _BLK_COUNTS, _BLK_FLAT, _CMP_SLOTS, _CMP_COUNTS, _CMP_FLAT, _SID, _SVS, _FIN, _SPEC_SLOTS, _SPEC_LENS,
 _SPEC_DRAFTS, _DIGEST) = range(len(COLUMNS))
#: first column (slots; counts and flat ids follow) of each ragged run code
_RAGGED = {TOK: _TOK_SLOTS, BLK: _BLK_SLOTS, CMP: _CMP_SLOTS}
_WIDTH = [WIDE.get(c, 1) for c in COLUMNS]
#: values per row of each column (1, or a wide column's second dim), frame order
WIDTHS = np.array(_WIDTH, np.int64)
_NOTHING = np.zeros(0, np.int64)  # OpLog.layout's output: the sizes alone
#: a recording kernel's live-slot arguments when it checks none
NO_LIVE = (np.zeros(0, np.bool_), _NOTHING, np.zeros(4, np.int64))
assert (ops_njit.SPEC_CODE, ops_njit.RUNS, ops_njit.ADD_META, ops_njit.ADD_TOKENS, ops_njit.SPEC_SLOTS) == (
    SPEC, _RUNS, _ADD_META, _ADD_TOKENS, _SPEC_SLOTS), "ops_njit's constants = this module's"


class Columns(NamedTuple):
    """A step's columns as ONE int64 buffer: column ``i`` at ``buf[starts[i]:starts[i + 1]]``
    (what the compiled replay walks). :meth:`col` is one column's view, :attr:`named` all of
    them by name, :attr:`dims` the frame's flat dims (``[k, w]`` for a wide column)."""

    buf: np.ndarray
    starts: np.ndarray

    @property
    def dims(self) -> tuple[int, ...]:
        sizes = np.diff(self.starts).tolist()
        return tuple(d for k, w in zip(sizes, _WIDTH) for d in ((k,) if w == 1 else (k // w, w)))

    @property
    def nbytes(self) -> int:
        return int(self.buf.nbytes)

    def col(self, i: int) -> np.ndarray:
        """Column ``i`` of :data:`COLUMNS` (a view; ``[k, w]`` for a wide one)."""
        a = self.buf[self.starts[i]:self.starts[i + 1]]
        return a if _WIDTH[i] == 1 else a.reshape(-1, _WIDTH[i])

    @property
    def named(self) -> dict[str, np.ndarray]:
        return {name: self.col(i) for i, name in enumerate(COLUMNS)}


def flat_ints(values: Any) -> np.ndarray:
    """``values`` as a flat int64 array (an int64 numpy array's own view; anything else converted
    once) for the log to copy in. Example: ``[3, 5]`` -> ``array([3, 5])``."""
    a = values if type(values) is np.ndarray and values.dtype == np.int64 else np.asarray(values, np.int64)
    return a if a.ndim == 1 else a.reshape(-1)


def _negative_id(what: str, ids: np.ndarray, counts: np.ndarray, owners: Optional[list[Any]] = None) -> None:
    """Raise the ``ValueError`` naming the first negative id of the flat ``ids`` (``counts[i]``
    of them per owner, ``what`` formatted with owner ``i``): error path only. Example: ids ``[4,
    -1]``, counts ``[1, 1]``, owners ``[3, 5]``, ``"slot {}: tokens"`` -> ``slot 5: tokens:
    expected ids >= 0, got -1 at index 0``."""
    f = int(np.flatnonzero(ids < 0)[0])
    i = int(np.searchsorted(np.cumsum(counts), f, side="right"))
    at = f - int(counts[:i].sum())
    who = what.format(repr(owners[i])) if owners is not None else what
    raise ValueError(f"{who}: expected ids >= 0, got {int(ids[f])} at index {at}")


class OpLog:
    """The driver's record of one step (see the module docstring) in ONE preallocated int64
    buffer, every call one compiled kernel (:mod:`cpmeta.replicate.ops_njit`: the values
    copied in, the run opened or extended; a column that fills up doubles, once);
    :meth:`pack` lays the used columns out as the frame's region (:meth:`layout` its sizes,
    :meth:`pack_into` the same into a caller's buffer), :meth:`columns` hands views of
    them, :meth:`clear` starts the next step (resets counters), :meth:`extend` appends another
    log's calls (those made between two specs of one step)."""

    def __init__(self, max_seqs: int) -> None:
        # run id that last touched each slot: a slot already in the current run starts a new one
        self._seen = np.zeros(max_seqs, np.int64)
        self._st = np.array([0, -1], np.int64)  # [run id, open run's code (-1: none)]
        per = 4 * max_seqs + 64
        self._cap = np.array([per * w for w in _WIDTH[:_DIGEST]], np.int64)  # int64 values per column
        self._off = np.zeros(_DIGEST, np.int64)
        self._flat = np.zeros(0, np.int64)
        self._layout(self._cap)
        self._n = np.zeros(_DIGEST, np.int64)  # int64 values used per column
        self._region = np.zeros(0, np.int64)  # pack's output (the frame's region), grown as needed
        self._dims = np.zeros(sum(2 if w > 1 else 1 for w in _WIDTH), np.int64)
        self._starts = np.zeros(len(COLUMNS) + 1, np.int64)
        self.req_ids: list[Any] = []
        self._words, self._nw = np.zeros(SPEC_WORDS * 8, np.int64), 0  # the specs' words, as log_spec wrote them
        self.clear()

    def _layout(self, cap: np.ndarray) -> None:
        """Columns at ``cap`` values each in a new buffer, the used parts kept."""
        flat, off = np.zeros(int(cap.sum()), np.int64), np.zeros(_DIGEST, np.int64)
        off[1:] = np.cumsum(cap)[:-1]
        if len(self._flat):
            for c in range(_DIGEST):
                k = int(self._n[c])
                flat[off[c]:off[c] + k] = self._flat[self._off[c]:self._off[c] + k]
        self._flat, self._off, self._cap = flat, off, cap

    def _call(self, fn: Any, *args: Any) -> int:
        """One recording kernel; a column it finds full doubles and the call runs again. Returns
        the kernel's refusal (< 0, nothing written) or 0."""
        while True:
            got = fn(self._flat, self._off, self._cap, self._n, *args)
            if got <= 0:
                return int(got)
            cap = self._cap.copy()
            cap[got - 1] = max(2 * cap[got - 1], 64)
            self._layout(cap)

    def clear(self) -> None:
        self._n[:] = 0
        self._st[0] += 1
        self._st[1] = -1
        self._nw = 0
        self.req_ids.clear()

    def extend(self, other: "OpLog") -> None:
        """Append ``other``'s runs and columns after this log's (calls made later)."""
        self._call(log_extend, self._st, other._flat, other._off, other._n)
        self.req_ids += other.req_ids
        self._room(other._nw)
        self._words[self._nw:self._nw + other._nw] = other.words
        self._nw += other._nw

    @property
    def words(self) -> np.ndarray:
        """The batch specs' values, :data:`SPEC_WORDS` per spec in call order, as ``log_spec``
        wrote them (int64; a view, valid until the next spec or :meth:`clear`)."""
        return self._words[:self._nw]

    @property
    def specs(self) -> list[int]:
        """:attr:`words` as a list of ints (a copy)."""
        return self._words[:self._nw].tolist()

    def _room(self, more: int) -> None:
        """:attr:`words` has room for ``more`` values after its own (doubled when it would not)."""
        need = self._nw + more
        if need > len(self._words):
            self._words = np.concatenate([self._words, np.zeros(max(need, len(self._words)), np.int64)])

    # ---- recording (after the driver's own state applied the call) ---------------------------
    def add(self, slot: int, req_id: Hashable, tokens: Any, blocks: Any, comp: Any, state_id: int,
            swa_valid_start: int, num_computed: int) -> None:
        tokens, blocks, comp = flat_ints(tokens), flat_ints(blocks), flat_ints(comp)
        m = np.array((slot, state_id, swa_valid_start, num_computed, len(tokens), len(blocks), len(comp)), np.int64)
        if self._call(log_add, self._seen, self._st, ADD, m[:1], m[1:4].reshape(3, 1), tokens, m[4:5], blocks, m[5:6],
                      comp, m[6:7]):
            _negative_id(f"request {req_id!r}: prompt_token_ids", tokens, m[4:5])
        self.req_ids.append(req_id)

    def add_many(self, slots: np.ndarray, req_ids: list[Hashable], scalars: np.ndarray, tokens: np.ndarray,
                 tc: np.ndarray, blocks: np.ndarray, bc: np.ndarray, comp: np.ndarray, cc: np.ndarray) -> None:
        """:meth:`add` of ``len(slots)`` requests in one call (int64, contiguous): ``scalars`` [3, n]
        (state id, valid start, num computed), request ``i``'s ids the next ``tc[i]`` / ``bc[i]`` /
        ``cc[i]`` of the flat ``tokens`` / ``blocks`` / ``comp``. Counts that are not ``n`` values
        ``>= 0`` summing to their ids: ``ValueError`` naming them, nothing recorded."""
        got = self._call(log_add, self._seen, self._st, ADD, slots, scalars, tokens, tc, blocks, bc, comp, cc)
        if got == -4:
            _negative_id("request {}: prompt_token_ids", tokens, tc, req_ids)
        if got:
            what, ids = (("token", tokens), ("block", blocks), ("compressed", comp))[-1 - got]
            raise ValueError(f"{what}_counts: expected {len(slots)} counts >= 0 summing to {len(ids)} {what}_ids")
        self.req_ids += req_ids

    def ragged(self, code: int, slots: Any, counts: Any, flat: np.ndarray,
               live: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None) -> int:
        """TOK / BLK / CMP entries: ``counts[i]`` values of ``flat`` for ``slots[i]`` (arrays,
        or one slot and its count: a single-slot call). Returns 0, or (nothing recorded) -1 when
        the counts are not one per slot, ``>= 0``, summing to ``len(flat)``, -3 when ``live`` =
        ``(active, mark, err)`` is given (a deferred recorder's live requests and
        ``check_slots``' scratch; the three arrays then flat int64 already) and a slot is not live
        or appears twice; a negative token id is a ``ValueError`` naming its slot."""
        if live is None:
            s, c, v = flat_ints(slots), flat_ints(counts), flat_ints(flat)
            live = NO_LIVE
        else:
            s, c, v = slots, counts, flat
        got = log_ragged(self._flat, self._off, self._cap, self._n, self._seen, self._st, code, _RAGGED[code], s, c,
                         v, code == TOK, *live)  # (one call: the step's first calls come after an idle)
        if got > 0:  # a column full: grown, recorded again
            got = self._call(log_ragged, self._seen, self._st, code, _RAGGED[code], s, c, v, code == TOK, *live)
        if got == -2:
            _negative_id("slot {}: tokens", v, c, s.tolist())
        return got

    def pair(self, code: int, slot: int, value: int) -> None:
        self._call(log_pair, self._seen, self._st, code, _SID if code == SID else _SVS,
                   np.array((slot, value), np.int64))

    def finish(self, slots: np.ndarray) -> None:
        """``FIN`` entries, one per slot (int64)."""
        self._call(log_slots, self._seen, self._st, FIN, _FIN, slots)

    def batch_spec(self, is_prompt: bool, slots: np.ndarray, lens: np.ndarray, drafts: np.ndarray,
                   num_placeholders: int, advance: bool, uniform: int,
                   live: tuple[np.ndarray, np.ndarray, np.ndarray] = NO_LIVE) -> int:
        """A batch spec; its values ``[is_prompt, num_placeholders, advance, uniform drafts,
        #slots, #lens, #drafts]`` (:data:`SPEC_WORDS`) go to :attr:`specs`. Returns 0, or -3
        (nothing recorded) when ``live`` is given (as for :meth:`ragged`) and a slot is not live
        or appears twice."""
        self._room(SPEC_WORDS)
        w, p, a = self._words[self._nw:], int(is_prompt), int(advance)
        got = log_spec(self._flat, self._off, self._cap, self._n, self._st, slots, lens, drafts, *live, w, p,
                       num_placeholders, a, uniform)
        if got > 0:
            got = self._call(log_spec, self._st, slots, lens, drafts, *live, w, p, num_placeholders, a, uniform)
        if got == 0:
            self._nw += SPEC_WORDS
        return got

    # ---- the frame ----------------------------------------------------------------------------
    def pack(self, batch_digest: np.ndarray) -> "Columns":
        """The step frame's region: the used columns and ``batch_digest`` back to back in ONE int64
        buffer of this log (rewritten by the next ``pack``), with the frame's dims."""
        total = self.pack_into(batch_digest, self._region)
        if total < 0:  # the region grows (rarely: it doubles)
            self._region = np.zeros(max(-total, 2 * len(self._region), 256), np.int64)
            total = self.pack_into(batch_digest, self._region)
        return Columns(self._region[:total], self._starts)

    def layout(self, batch_digest: np.ndarray) -> tuple[tuple[int, ...], int]:
        """The frame's dims and its region's int64 values for the log and ``batch_digest`` as they
        stand (nothing copied): what the driver reserves its ring slot with before
        :meth:`pack_into` writes the region straight into it."""
        got = self.pack_into(batch_digest, _NOTHING)
        return tuple(self._dims.tolist()), -got if got < 0 else got

    @property
    def buffers(self) -> tuple[np.ndarray, ...]:
        """``(flat, offsets, used, dims, starts)``: the log's buffers as :func:`~.ops_njit.pack_region`
        takes them (a compiled frame writer's: :mod:`cpmeta.replicate.step_write_njit`)."""
        return self._flat, self._off, self._n, self._dims, self._starts

    def pack_into(self, batch_digest: np.ndarray, out: np.ndarray) -> int:
        """:meth:`pack`'s values into ``out`` (int64); the count written, or ``-need`` (nothing
        written) when ``out`` is shorter than the region."""
        return int(pack_region(self._flat, self._off, self._n, batch_digest, WIDTHS, out, self._dims, self._starts))

    def columns(self, batch_digest: np.ndarray) -> list[np.ndarray]:
        """Every column of :data:`COLUMNS`: views of the used parts (valid until the next
        :meth:`clear`), ``[k, w]`` for the wide ones, then ``batch_digest``."""
        out = []
        for c in range(_DIGEST):
            a = self._flat[self._off[c]:self._off[c] + self._n[c]]
            out.append(a if _WIDTH[c] == 1 else a.reshape(-1, _WIDTH[c]))
        out.append(batch_digest)
        return out


@warmer
def _warm() -> None:
    """Compile / load the log's kernels on a two-slot log: a token run, an add, a finish, a spec,
    an extend and a pack (the follower's ``unpack_region`` is warmed by ``step_frame``)."""
    log, other = OpLog(2), OpLog(2)
    log.ragged(TOK, np.array([0]), np.array([1]), np.array([7]))
    log.add(1, "r", np.array([1, 2]), np.array([0]), np.zeros(0, np.int64), 0, 0, 0)
    log.pair(SID, 1, 3)
    log.finish(np.array([1]))
    log.batch_spec(False, np.array([0]), np.zeros(0, np.int64), np.zeros(0, np.int64), 0, True, -2)
    other.ragged(TOK, np.array([0]), np.array([1]), np.array([8]))
    log.extend(other)
    log.pack(np.zeros((0, 4), np.int64))
