"""``BatchState``: persistent per-request state in preallocated numpy arrays (DESIGN section 13).

A request is added once; each step only applies deltas and asks for the step's
:class:`~cpmeta.state.batch.SequenceBatch`. No step does work proportional to a sequence's
length: the token history stays here, a step gathers only its token windows (prompt: the chunk
plus the Engram look-back; decode: look-back + the last confirmed token + drafts) and block tables.
A step's appends and its gather are one compiled call each (:mod:`cpmeta.state.state_njit`);
this module checks the argument types, calls the kernel and turns its error code into the
named ``ValueError``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from .batch import SequenceBatch, Vouch
from .checks import as_int_array, bad_id, check_bool, check_int_arg, check_placeholders, ids_in_int32, \
    is_draft_count
from .requests import RequestBook
from .state_njit import (
    E_CHUNK, E_CHUNK_PASSES, E_DRAFT_ID, E_NEGATIVE_ID, E_NUM_DRAFTS, E_PREFILL, E_REPEAT, E_SLOT, K_BLOCKS,
    K_COMPRESSED, K_TOKENS, append_rows, gather_step, vouch_step,
)

__all__ = ["BatchState", "VouchedStep"]

_EMPTY = np.zeros(0, np.int64)  # no ids (writable like every kernel argument: one array type)


def _kernel_ints(a: np.ndarray) -> np.ndarray:
    """An int array as int64 (wrapping, as ``astype`` does), contiguous and writable: the one
    array type of the kernels' arguments (a copy only when ``a`` is not such an array)."""
    a = a.astype(np.int64, copy=False)
    return a if a.flags.c_contiguous and a.flags.writeable else a.copy()


class VouchedStep(NamedTuple):
    """A decode step the state vouches for (:meth:`BatchState.vouch_decode`): int64 ``slots``,
    each slot's confirmed tokens ``nt`` and ``seqlen_k`` ``sk``, the ``drafts`` (int32 or int64)
    and per-slot counts ``nd`` (``None`` without drafts or with one count for all), the largest
    count ``k_hi`` and whether every slot has it."""

    slots: np.ndarray
    nt: np.ndarray
    sk: np.ndarray
    drafts: Optional[np.ndarray]
    nd: Optional[np.ndarray]
    k_hi: int
    uniform: bool


class BatchState(RequestBook):
    """Requests of a running engine as preallocated arrays; each step's ``SequenceBatch`` from them.

    Capacity: ``max_seqs`` request slots (a finished request's slot is reused), per request
    ``max_tokens`` confirmed tokens (default ``cfg.max_model_len``), ``max_blocks`` block ids
    (default ``blocks_needed(max_model_len)``) and ``max_compressed`` Engram history ids (default
    ``max_tokens`` with Engram on, else 0). Exceeding any is a ``ValueError`` naming the request
    and the limit, raised before anything changes: the state stays usable.

    Per-step loop (the engine's scheduler output drives the deltas)::

        st = BatchState(cfg, max_seqs=256)
        a = st.add_request("a", prompt_ids, block_table=[7, 3], state_id=0)   # once per request
        md = prepare_prompt(st.prompt_batch([a], [512]), cfg)      # chunked prefill: 512 tokens
        st.append_tokens(a, [first_token])                         # after the last chunk
        while running:
            slots = np.array([a, ...])                              # this step's requests
            batch = st.decode_batch(slots, drafts, num_drafts)      # MTP drafts, flat + counts
            md = prepare_decode(batch, cfg)                         # or prepare_decode_inplace
            st.append_tokens_batch(slots, accepted, num_accepted)   # accepted drafts + bonus
            st.append_blocks(a, [new_block])                        # when a table grows
            st.finish(a)                                            # slot is free again

    A step's new requests in one call: ``st.add_requests_batch(ids, prompts, prompt_lens, tables,
    table_lens, state_ids)`` (flat ids + counts, like the append batches); its finished ones:
    ``st.finish_batch(slots)``.

    Slots are small ints (``add_request``'s return value, ``slot_of(req_id)``); the batch methods
    take arrays of them so a step needs no per-request Python.
    """

    # ---- per-step deltas: one append_rows call each -----------------------------------------
    def append_tokens(self, slot: int, tokens: Sequence[int]) -> None:
        """Confirmed tokens (sampled / accepted drafts + bonus) of one request; ids ``>= 0``."""
        req = self._live(slot)
        t = as_int_array("tokens", tokens, req)
        if self._append_one(K_TOKENS, slot, t, self.token_ids, self.num_tokens):
            bad_id("tokens", t, req)  # the ids first, then the capacity
            self._fits(req, "tokens", int(self.num_tokens[slot]) + len(t), self.max_tokens, "max_tokens")

    def append_tokens_batch(self, slots: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        """Vectorized :meth:`append_tokens`: request ``slots[i]`` gets the next ``counts[i]`` ids
        of the flat ``tokens`` (ids ``>= 0``; slots distinct). Example: slots ``[4, 0]``, counts
        ``[2, 1]``, tokens ``[8, 9, 5]`` -> slot 4 gets ``[8, 9]``, slot 0 gets ``[5]``. Every
        check (live distinct slots, counts, capacity, ids) before any write."""
        slots, counts = as_int_array("slots", slots), as_int_array("counts", counts)
        tokens = as_int_array("tokens", tokens)
        code = append_rows(K_TOKENS, slots, tokens, counts, self.token_ids, self.num_tokens, self.active,
                           self._seen, self._first_bad, self._p, self._err)
        if code == E_NEGATIVE_ID:
            _, i, v, at = self._err.tolist()
            raise ValueError(f"request {self._req[int(slots[i])]!r}: tokens: expected ids >= 0, got {v} at index {at}")
        if code:
            self._raise_append(code, slots, len(tokens), "tokens", "max_tokens")

    def append_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        """Block ids newly allocated to the request, appended to its table."""
        req = self._live(slot)
        b = as_int_array("blocks", blocks, req)
        if self._append_one(K_BLOCKS, slot, b, self.block_table, self.num_blocks):
            self._fits(req, "block ids", int(self.num_blocks[slot]) + len(b), self.max_blocks, "max_blocks")

    def append_blocks_batch(self, slots: np.ndarray, blocks: np.ndarray, counts: np.ndarray) -> None:
        """Vectorized :meth:`append_blocks`: request ``slots[i]`` gets the next ``counts[i]`` ids
        of the flat ``blocks`` (slots distinct). Example: slots ``[4, 0]``, counts ``[2, 0]``,
        blocks ``[17, 3]`` -> slot 4's table grows by ``[17, 3]``, slot 0's is unchanged. Every
        check before any write, as :meth:`append_tokens_batch`."""
        self._append_batch(K_BLOCKS, slots, blocks, counts, self.block_table, self.num_blocks, "block ids",
                           "max_blocks")

    def append_compressed(self, slot: int, ids: Sequence[int]) -> None:
        """Engram history ids (``compressed_token_ids``) appended for the request."""
        req = self._live(slot)
        c = as_int_array("compressed ids", ids, req)
        if self._append_one(K_COMPRESSED, slot, c, self.compressed, self.num_compressed):
            self._fits(req, "compressed ids", int(self.num_compressed[slot]) + len(c), self.max_compressed,
                       "max_compressed")

    def append_compressed_batch(self, slots: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> None:
        """Vectorized :meth:`append_compressed` (as :meth:`append_blocks_batch`)."""
        self._append_batch(K_COMPRESSED, slots, ids, counts, self.compressed, self.num_compressed,
                           "compressed ids", "max_compressed")

    def _append_one(self, kind: int, slot: int, values: np.ndarray, rows: np.ndarray, have: np.ndarray) -> int:
        """:func:`append_rows` for the live ``slot`` alone; its error code (the caller names it)."""
        self._one[0], self._one_count[0] = slot, len(values)
        return append_rows(kind, self._one, values, self._one_count, rows, have, self.active, self._seen,
                           self._first_bad, self._p, self._err)

    def _append_batch(self, kind: int, slots: Any, values: Any, counts: Any, rows: np.ndarray, have: np.ndarray,
                      what: str, name: str) -> None:
        slots, counts = as_int_array("slots", slots), as_int_array("counts", counts)
        values = as_int_array(what, values)
        code = append_rows(kind, slots, values, counts, rows, have, self.active, self._seen, self._first_bad,
                           self._p, self._err)
        if code:
            self._raise_append(code, slots, len(values), what, name)

    def set_state_id(self, slot: int, state_id: int) -> None:
        """The request's SWA / state slot moved. With the sliding-window state cache no other live
        request may hold ``state_id`` (``ValueError``, nothing changes): to swap two requests'
        ids, move one to a free id first."""
        req = self._live(slot)
        check_int_arg("state_id", state_id, req)
        self._check_state_free(req, state_id, slot)
        self.state_id[slot] = state_id

    def set_swa_valid_start(self, slot: int, swa_valid_start: int) -> None:
        req = self._live(slot)
        check_int_arg("swa_valid_start", swa_valid_start, req)
        self.swa_valid_start[slot] = swa_valid_start

    # ---- the step's batch: one gather_step call ---------------------------------------------
    def prompt_batch(self, slots: np.ndarray, chunk_lens: np.ndarray, *, num_placeholders: int = 0,
                     advance: bool = True) -> SequenceBatch:
        """A prompt ``SequenceBatch``: request ``slots[i]`` prefills its next ``chunk_lens[i]``
        tokens (``q_start = num_computed``). ``advance``: count them as computed (default).
        ``num_placeholders`` rows (seqlen 1, at most ``MAX_PLACEHOLDERS`` = 65,536) follow, as
        in :meth:`decode_batch`. Example: a 10-token prompt, chunks ``[4]`` then ``[6]`` ->
        seqlen (q, k) = (4, 4), (6, 10)."""
        check_placeholders(num_placeholders)
        check_bool("advance", advance)
        slots, q = as_int_array("slots", slots), as_int_array("chunk_lens", chunk_lens)
        return self._gather(True, slots, q, -1, _EMPTY, num_placeholders, bool(advance))

    def decode_batch(self, slots: np.ndarray, draft_tokens: Optional[np.ndarray] = None,
                     num_drafts: Optional[np.ndarray | int] = None, *, num_placeholders: int = 0) -> SequenceBatch:
        """A decode ``SequenceBatch``: request ``slots[i]`` decodes its last confirmed token plus
        ``num_drafts[i]`` MTP drafts (the next ids of the flat ``draft_tokens``), so
        ``seqlen_q = 1 + num_drafts`` and ``seqlen_k = num_tokens + num_drafts``. ``num_drafts``
        may be ONE int, the count of every request (the common MTP step: ``decode_batch(slots,
        drafts, 2)`` with ``2 * len(slots)`` drafts). Draft ids must be in ``[0, 2**31 - 1]``
        (``ValueError`` naming the request); slots distinct."""
        check_placeholders(num_placeholders)
        slots = as_int_array("slots", slots)
        try:
            drafts = _EMPTY if draft_tokens is None else as_int_array("draft_tokens", draft_tokens)
        except (TypeError, ValueError):
            self._raise_slots(slots)  # the slots' error comes first
            raise
        k_all, q = self._draft_counts(slots, drafts, num_drafts)
        return self._gather(False, slots, q, k_all, drafts, num_placeholders, False)

    def _draft_counts(self, slots: np.ndarray, drafts: np.ndarray, num_drafts: Any) -> tuple[int, np.ndarray]:
        """``(k_all, q)`` of :func:`gather_step`: one count for all (``q`` unread) or per slot
        (``k_all = -1``); a count of the wrong kind is named here (after the slots' checks)."""
        if num_drafts is None:
            if not len(drafts):
                return 0, _EMPTY
            self._raise_slots(slots)
            raise ValueError(f"num_drafts: expected {len(slots)} counts >= 0 summing to {len(drafts)} drafts")
        if is_draft_count(num_drafts):
            if num_drafts >= 0:
                return int(num_drafts), _EMPTY
        else:
            nd = np.asarray(num_drafts)
            if nd.shape == slots.shape and nd.dtype.kind in "iu":
                return -1, _kernel_ints(nd)
        self._raise_slots(slots)
        raise ValueError(f"num_drafts: expected {len(slots)} counts >= 0 (or one count for all) "
                         f"summing to {len(drafts)} drafts")

    def _gather(self, is_prompt: bool, slots: np.ndarray, q: np.ndarray, k_all: int, drafts: np.ndarray,
                n_ph: int, advance: bool) -> SequenceBatch:
        buf, ph, vouched = gather_step(is_prompt, slots, q, k_all, drafts, n_ph, advance, self._meta, self.active,
                                       self.token_ids, self.block_table, self.compressed, self._p, self._seen,
                                       self._err)
        if len(buf):  # (a batch of no rows still has its offsets; a refused step: no buffer)
            return _batch_of(buf, ph, self._vouch if vouched else None, is_prompt, self.lookback)
        code, i, v, lim = self._err.tolist()
        if code in (E_SLOT, E_REPEAT):
            self._raise_slots(slots)
        if code == E_CHUNK:
            raise ValueError(f"chunk_lens: expected {len(slots)} chunk lengths >= 1, got {q.tolist()[:8]}")
        if code == E_NUM_DRAFTS:
            raise ValueError(f"num_drafts: expected {len(slots)} counts >= 0 (or one count for all) "
                             f"summing to {len(drafts)} drafts")
        req = self._req[int(slots[i])]
        if code == E_CHUNK_PASSES:
            raise ValueError(f"request {req!r}: chunk of {v} tokens from {lim} passes its "
                             f"{int(self.num_tokens[slots[i]])} tokens")
        if code == E_DRAFT_ID:
            raise ValueError(f"request {req!r}: draft_tokens: expected ids in [0, 2**31 - 1], got {v} at index {lim}")
        assert code == E_PREFILL, code
        raise ValueError(f"request {req!r}: still in prefill ({v} of {lim} prompt tokens computed)")

    def gathered(self, buf: np.ndarray, ph: np.ndarray, vouched: bool, is_prompt: bool) -> SequenceBatch:
        """The ``SequenceBatch`` of a :func:`~cpmeta.state.state_njit.gather_step` result that a
        compiled caller got on this state (``cpmeta.replicate.replay_njit``)."""
        return _batch_of(buf, ph, self._vouch if vouched else None, is_prompt, self.lookback)

    def vouch_decode(self, slots: np.ndarray, draft_tokens: Optional[np.ndarray] = None,
                     num_drafts: Optional[np.ndarray | int] = None) -> Optional[VouchedStep]:
        """The decode step ``decode_batch(slots, draft_tokens, num_drafts)`` when the in-place GPU
        staging may lay it out straight from the state's arrays, their ids cast to int32
        (``cpmeta.gpu.stage_decode``): int64 slots, every one live and given
        once, done with its prefill, its state id, valid start, last token and the needed block
        ids in range (:func:`~cpmeta.state.state_njit.vouch_step`), draft counts adding up and
        draft ids in ``[0, 2**31 - 1]``; else ``None`` (``decode_batch`` then raises the precise
        error). Example: slots ``[0, 1]`` holding 5 and 9 tokens, ``num_drafts=2`` with 4 drafts
        -> ``sk = [7, 11]``, ``k_hi = 2``."""
        slots = np.asarray(slots)
        if slots.dtype != np.int64 or slots.ndim != 1 or len(slots) == 0:
            return None
        count = is_draft_count(num_drafts)
        nd: Optional[np.ndarray] = None
        if draft_tokens is None or len(draft_tokens) == 0:
            if num_drafts is not None and (num_drafts if count else not _zero_counts(num_drafts, slots)):
                return None
            drafts, k_all, k_hi, uniform = None, 0, 0, True
        else:
            drafts = np.asarray(draft_tokens)
            if num_drafts is None or drafts.ndim != 1 or drafts.dtype.kind not in "iu":
                return None  # floats, bools: decode_batch refuses them by name
            if drafts.dtype != np.int32:  # int32 ids stay int32; anything else as int64
                drafts = np.asarray(drafts, np.int64)
            if count:  # one count for every request (the common MTP step)
                k_all = k_lo = k_hi = int(num_drafts)
                uniform, total = True, k_all * len(slots)
            else:
                nd = np.asarray(num_drafts)
                if nd.shape != slots.shape or nd.dtype.kind not in "iu":
                    return None
                nd = _kernel_ints(nd)
                k_lo, k_hi = int(nd.min()), int(nd.max())
                uniform, total = k_lo == k_hi, int(nd.sum())
                k_all = k_hi if uniform else -1
            if k_lo < 0 or total != len(drafts) or not ids_in_int32(drafts):
                return None
        nt, sk = np.empty(len(slots), np.int64), np.empty(len(slots), np.int64)
        q = _EMPTY if k_all >= 0 or nd is None else nd
        if not vouch_step(slots, q, k_all, self._meta, self.active, self.token_ids, self.block_table, self._p,
                          self._seen, self._err, nt, sk):
            return None
        return VouchedStep(slots, nt, sk, drafts, nd, k_hi, uniform)


def _batch_of(buf: np.ndarray, ph: np.ndarray, vouch: Optional[Vouch], is_prompt: bool, lookback: int) -> SequenceBatch:
    """The ``SequenceBatch`` over the buffer :func:`gather_step` returned (the batch's own
    memory: later changes to the state never reach it), every array a view of it: ``[0, n)``
    seqlen_q, then seqlen_k, state_id, swa_valid_start, num_tokens (``n`` each), block-table,
    token and compressed offsets (``n + 1`` each), then the ``T`` tokens, ``B`` block ids and
    the compressed ids (compiled code reads it with ``state_njit.gathered_parts``). Example: n =
    1, one decode token, one block -> ``buf = [1, 5, 0, 0, 5, 0, 1, 0, 1, 0, 0, t, b]`` (offsets
    ``[0, 1]``, ``[0, 1]``, ``[0, 0]``). ``vouch``: the
    state's ``Vouch(cfg)`` when the kernel vouched for the batch, else ``None``: the builders
    then validate it and name the field."""
    n = len(ph)
    h = 8 * n + 3
    t = h + int(buf[7 * n + 1])  # tokens end: token_offsets[n]
    b = t + int(buf[6 * n])  # block ids end: block_table_offsets[n]
    batch = SequenceBatch(
        is_prompt, buf[:n], buf[n:2 * n], buf[2 * n:3 * n], buf[3 * n:4 * n], ph, buf[4 * n:5 * n],
        buf[t:b], buf[5 * n:6 * n + 1], buf[h:t], buf[6 * n + 1:7 * n + 2], buf[b:], buf[7 * n + 2:h], lookback)
    batch._vouch = vouch
    return batch


def _zero_counts(num_drafts: Any, slots: np.ndarray) -> bool:
    """Per-slot draft counts (ints, one per slot) that are all 0."""
    nd = np.asarray(num_drafts)
    return nd.shape == slots.shape and nd.dtype.kind in "iu" and not np.count_nonzero(nd)
