"""``BatchState``: persistent per-request state in preallocated numpy arrays (DESIGN section 13).

A request is added once; each step only applies deltas and asks for the step's
:class:`~cpmeta.state.batch.SequenceBatch`. No step does work proportional to a sequence's
length: the token history stays here, a step gathers only its token windows (prompt: the chunk
plus the Engram look-back; decode: look-back + the last confirmed token + drafts) and block tables.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Sequence

import numpy as np

from ..constants import INT32_MAX
from .batch import SequenceBatch, prefix
from .checks import as_int_array, bad_id, check_int_arg, ids_in_int32
from .decode_fast import VouchedStep, decode_batch_fast, is_draft_count, vouch_decode_step
from .gather import gather_batch
from .store import StateStore

__all__ = ["BatchState"]


def _ragged_index(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(offsets [n+1], seq [total], k [total])``: entry i of the flat layout is element ``k[i]``
    of sequence ``seq[i]``. Example: lengths ``[2, 1]`` -> offsets ``[0, 2, 3]``, seq
    ``[0, 0, 1]``, k ``[0, 1, 0]``."""
    off = prefix(lengths)
    seq = np.repeat(np.arange(len(lengths)), lengths)
    return off, seq, np.arange(int(off[-1])) - off[:-1][seq]


def _check_placeholders(n: object) -> None:
    """``num_placeholders``: an int >= 0 (numpy integers count, bools do not)."""
    if type(n) is not int or n < 0:
        check_int_arg("num_placeholders", n, lo=0)


class BatchState(StateStore):
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

    Slots are small ints (``add_request``'s return value, ``slot_of(req_id)``); the batch methods
    take arrays of them so a step needs no per-request Python.
    """

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req_id: Hashable, prompt_token_ids: Sequence[int], block_table: Sequence[int],
                    state_id: int, *, compressed_token_ids: Sequence[int] = (), swa_valid_start: int = 0,
                    num_computed: int = 0) -> int:
        """Add a request (once); returns its slot. ``num_computed``: prompt tokens already in the
        KV cache (e.g. a prefix-cache hit). Ints may be numpy integers (never bools); token ids
        must be ``>= 0``; with the sliding-window state cache (``cfg.has_swa``) no other live
        request may hold ``state_id`` (both would write the same ``slot_mapping_store_swa``
        slots; without the cache state ids are read by no field and may repeat). Nothing
        changes when a check fails or a limit is exceeded."""
        if req_id in self._slot:
            raise ValueError(f"request {req_id!r}: already in the batch state (slot {self._slot[req_id]})")
        if not self._free:
            raise ValueError(f"request {req_id!r}: all max_seqs={self.max_seqs} slots are in use")
        check_int_arg("state_id", state_id, req_id)
        check_int_arg("swa_valid_start", swa_valid_start, req_id)
        check_int_arg("num_computed", num_computed, req_id)
        toks = as_int_array("prompt_token_ids", prompt_token_ids, req_id)
        bt = as_int_array("block_table", block_table, req_id)
        comp = as_int_array("compressed_token_ids", compressed_token_ids, req_id)
        self._fits(req_id, "tokens", len(toks), self.max_tokens, "max_tokens")
        self._fits(req_id, "block ids", len(bt), self.max_blocks, "max_blocks")
        self._fits(req_id, "compressed ids", len(comp), self.max_compressed, "max_compressed")
        if len(toks) == 0:
            raise ValueError(f"request {req_id!r}: expected a non-empty prompt")
        if not 0 <= num_computed <= len(toks):
            raise ValueError(f"request {req_id!r}: num_computed {num_computed} outside [0, {len(toks)}]")
        tok_ok = ids_in_int32(toks)
        if not tok_ok:
            bad_id("prompt_token_ids", toks, None, req_id, negative_only=True)
        self._check_state_free(req_id, state_id, -1)
        s = self._free.pop()
        self._slot[req_id], self._req[s], self.active[s] = s, req_id, True
        self.token_ids[s, :len(toks)] = toks
        self.num_tokens[s] = self.prompt_len[s] = len(toks)
        self._last[s:s + 1] = toks[-1:]
        self._tok_ok[s] = tok_ok
        self.num_computed[s] = num_computed
        self.block_table[s, :len(bt)] = bt
        self.num_blocks[s] = len(bt)
        self._bt32[s] = -1
        self._bt32[s, :len(bt)] = bt[:self._bt32.shape[1]]
        self._bt_ok[s] = len(bt) == 0 or (int(bt.min()) >= 0 and int(bt.max()) <= self._bt_max)
        self.compressed[s, :len(comp)] = comp
        self.num_compressed[s] = len(comp)
        self.state_id[s], self.swa_valid_start[s] = state_id, swa_valid_start
        self._state32[s:s + 1] = self.state_id[s:s + 1]
        self._set_fast(s)  # after state_id / swa_valid_start: it reads them
        return s

    def _check_state_free(self, req_id: Hashable, state_id: int, slot: int) -> None:
        """With the sliding-window state cache, ``ValueError`` when a live request other than the
        one in ``slot`` holds ``state_id`` (move it to a free id first to swap two)."""
        if not self.cfg.has_swa:
            return
        other = self.state_holder(state_id, slot)
        if other is not None:
            raise ValueError(
                f"request {req_id!r}: state_id {state_id} is held by request {self._req[other]!r} (slot "
                f"{other}); two live requests would write the same slot_mapping_store_swa slots")

    def free_slots(self) -> list[int]:
        """The free slots in the order ``add_request`` hands them out, LAST first (a copy):
        ``add_request`` takes ``free_slots()[-1]``, ``finish`` puts its slot at the end.
        Example: a new state of 3 -> ``[2, 1, 0]``; after one add and ``finish(0)`` -> ``[2, 1, 0]``."""
        return list(self._free)

    def finish(self, slot: int) -> None:
        """Remove the request in ``slot``; the slot is reused by a later ``add_request``."""
        req = self._live(slot)
        del self._slot[req]
        self._req[slot], self.active[slot] = None, False
        self._dec_cap[slot] = -1
        self.num_tokens[slot] = self.num_blocks[slot] = self.num_compressed[slot] = 0
        self._free.append(slot)

    # ---- per-step deltas --------------------------------------------------------------------
    def append_tokens(self, slot: int, tokens: Sequence[int]) -> None:
        """Confirmed tokens (sampled / accepted drafts + bonus) of one request; ids ``>= 0``."""
        req = self._live(slot)
        t = as_int_array("tokens", tokens, req)
        fits = ids_in_int32(t)
        if not fits:
            bad_id("tokens", t, None, req, negative_only=True)
        self._append(req, slot, t, self.token_ids, self.num_tokens, "tokens", self.max_tokens, "max_tokens")
        if len(t):
            self._last[slot:slot + 1] = t[-1:]
            if not fits:
                self._tokens_past_int32(slot)

    def append_tokens_batch(self, slots: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        """Vectorized :meth:`append_tokens`: request ``slots[i]`` gets the next ``counts[i]`` ids
        of the flat ``tokens`` (ids ``>= 0``; slots distinct). Example: slots ``[4, 0]``, counts
        ``[2, 1]``, tokens ``[8, 9, 5]`` -> slot 4 gets ``[8, 9]``, slot 0 gets ``[5]``. Checks
        before any write: live distinct slots (one scatter + gather), counts, capacity, ids
        (one reduction)."""
        slots, counts = as_int_array("slots", slots), as_int_array("counts", counts)
        tokens = as_int_array("tokens", tokens)
        self._check_slots(slots)
        if counts.shape != slots.shape or (counts < 0).any() or counts.sum() != len(tokens):
            raise ValueError(f"counts: expected {len(slots)} counts >= 0 summing to {len(tokens)} tokens")
        new = self.num_tokens[slots] + counts
        over = np.flatnonzero(new > self.max_tokens)
        if over.size:
            i = int(over[0])
            self._fits(self._req[int(slots[i])], "tokens", int(new[i]), self.max_tokens, "max_tokens")
        fits = ids_in_int32(tokens)
        if not fits:
            bad_id("tokens", tokens, counts, [self._req[s] for s in slots.tolist()], negative_only=True)
        _, seq, k = _ragged_index(counts)
        self.token_ids[slots[seq], self.num_tokens[slots][seq] + k] = tokens
        self.num_tokens[slots] = new
        self._last[slots] = self.token_ids[slots, new - 1]
        if not fits:
            for s in np.unique(slots[seq][tokens > INT32_MAX]).tolist():
                self._tokens_past_int32(s)

    def _tokens_past_int32(self, slot: int) -> None:
        """A confirmed token of ``slot`` does not fit int32: the decode fast paths no longer vouch
        for it (the builders then raise their ``input_ids`` message if it is read)."""
        self._tok_ok[slot] = False
        self._set_fast(slot)

    def append_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        """Block ids newly allocated to the request, appended to its table."""
        req = self._live(slot)
        b = as_int_array("blocks", blocks, req)
        n0 = self._append(req, slot, b, self.block_table, self.num_blocks, "block ids", self.max_blocks,
                          "max_blocks")
        if len(b) and (int(b.min()) < 0 or int(b.max()) > self._bt_max):
            self._bt_ok[slot] = False
        self._set_fast(slot)
        mnb = self._bt32.shape[1]
        if n0 < mnb:
            self._bt32[slot, n0:n0 + len(b)] = b[:mnb - n0]

    def append_blocks_batch(self, slots: np.ndarray, blocks: np.ndarray, counts: np.ndarray) -> None:
        """Vectorized :meth:`append_blocks`: request ``slots[i]`` gets the next ``counts[i]`` ids
        of the flat ``blocks`` (slots distinct). Example: slots ``[4, 0]``, counts ``[2, 0]``,
        blocks ``[17, 3]`` -> slot 4's table grows by ``[17, 3]``, slot 0's is unchanged. Every
        check before any write, as :meth:`append_tokens_batch`."""
        slots, blocks, counts = self._ragged_args(slots, blocks, counts, self.num_blocks,
                                                  self.max_blocks, "block ids", "max_blocks")
        _, seq, k = _ragged_index(counts)
        rows, pos = slots[seq], self.num_blocks[slots][seq] + k
        self.block_table[rows, pos] = blocks
        mirror = pos < self._bt32.shape[1]
        self._bt32[rows[mirror], pos[mirror]] = blocks[mirror]
        if len(blocks) and (int(blocks.min()) < 0 or int(blocks.max()) > self._bt_max):
            self._bt_ok[rows[(blocks < 0) | (blocks > self._bt_max)]] = False
        self.num_blocks[slots] += counts
        self._set_fast_many(slots)

    def append_compressed_batch(self, slots: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> None:
        """Vectorized :meth:`append_compressed` (as :meth:`append_blocks_batch`)."""
        slots, ids, counts = self._ragged_args(slots, ids, counts, self.num_compressed,
                                               self.max_compressed, "compressed ids", "max_compressed")
        _, seq, k = _ragged_index(counts)
        self.compressed[slots[seq], self.num_compressed[slots][seq] + k] = ids
        self.num_compressed[slots] += counts

    def _ragged_args(self, slots: Any, values: Any, counts: Any, have: np.ndarray, cap: int,
                     what: str, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The checked int64 ``(slots, values, counts)`` of a vectorized append: live distinct
        slots, counts >= 0 adding up to the values, every row within ``cap`` (ValueError naming
        the request and the limit; nothing written)."""
        slots, counts = as_int_array("slots", slots), as_int_array("counts", counts)
        values = as_int_array(what, values)
        self._check_slots(slots)
        if counts.shape != slots.shape or (counts < 0).any() or counts.sum() != len(values):
            raise ValueError(f"counts: expected {len(slots)} counts >= 0 summing to {len(values)} {what}")
        over = np.flatnonzero(have[slots] + counts > cap)
        if over.size:
            i = int(over[0])
            self._fits(self._req[int(slots[i])], what, int(have[slots[i]] + counts[i]), cap, name)
        return slots, values, counts

    def append_compressed(self, slot: int, ids: Sequence[int]) -> None:
        """Engram history ids (``compressed_token_ids``) appended for the request."""
        req = self._live(slot)
        self._append(req, slot, as_int_array("compressed ids", ids, req), self.compressed, self.num_compressed,
                     "compressed ids", self.max_compressed, "max_compressed")

    def _append(self, req: Hashable, slot: int, a: np.ndarray, rows: np.ndarray, counts: np.ndarray, what: str,
                cap: int, name: str) -> int:
        """Append the int64 ids ``a`` to the live ``slot``'s row of ``rows`` after its
        ``counts[slot]`` entries (``ValueError`` past ``cap`` before anything changes); returns
        the old count. Example: count 3, ids ``[8, 9]`` -> ``rows[slot, 3:5] = [8, 9]``, count
        5, returns 3."""
        n0 = int(counts[slot])
        self._fits(req, what, n0 + len(a), cap, name)
        rows[slot, n0:n0 + len(a)] = a
        counts[slot] = n0 + len(a)
        return n0

    def set_state_id(self, slot: int, state_id: int) -> None:
        """The request's SWA / state slot moved. With the sliding-window state cache no other live
        request may hold ``state_id`` (``ValueError``, nothing changes): to swap two requests'
        ids, move one to a free id first."""
        req = self._live(slot)
        check_int_arg("state_id", state_id, req)
        self._check_state_free(req, state_id, slot)
        self.state_id[slot] = state_id
        self._state32[slot:slot + 1] = self.state_id[slot:slot + 1]
        self._set_fast(slot)

    def set_swa_valid_start(self, slot: int, swa_valid_start: int) -> None:
        req = self._live(slot)
        check_int_arg("swa_valid_start", swa_valid_start, req)
        self.swa_valid_start[slot] = swa_valid_start
        self._set_fast(slot)

    # ---- the step's batch -------------------------------------------------------------------
    def prompt_batch(self, slots: np.ndarray, chunk_lens: np.ndarray, *, num_placeholders: int = 0,
                     advance: bool = True) -> SequenceBatch:
        """A prompt ``SequenceBatch``: request ``slots[i]`` prefills its next ``chunk_lens[i]``
        tokens (``q_start = num_computed``). ``advance``: count them as computed (default).
        Example: a 10-token prompt, chunks ``[4]`` then ``[6]`` -> seqlen (q, k) = (4, 4), (6, 10)."""
        _check_placeholders(num_placeholders)
        slots, q = as_int_array("slots", slots), as_int_array("chunk_lens", chunk_lens)
        self._check_slots(slots)
        if q.shape != slots.shape or (q < 1).any():
            raise ValueError(f"chunk_lens: expected {len(slots)} chunk lengths >= 1, got {q.tolist()[:8]}")
        q_start = self.num_computed[slots]
        k = q_start + q
        over = np.flatnonzero(k > self.num_tokens[slots])
        if over.size:
            i = int(over[0])
            raise ValueError(f"request {self._req[int(slots[i])]!r}: chunk of {int(q[i])} tokens from "
                             f"{int(q_start[i])} passes its {int(self.num_tokens[slots[i]])} tokens")
        batch = self._batch(True, slots, q, k, None, num_placeholders)
        if advance:
            self.num_computed[slots] = k
            cap = self._table_cap(self.num_blocks[slots])
            self._dec_cap[slots] = np.where(self._fast[slots] & (k >= self.prompt_len[slots]), cap, -1)
        return batch

    def decode_batch(self, slots: np.ndarray, draft_tokens: Optional[np.ndarray] = None,
                     num_drafts: Optional[np.ndarray | int] = None, *, num_placeholders: int = 0) -> SequenceBatch:
        """A decode ``SequenceBatch``: request ``slots[i]`` decodes its last confirmed token plus
        ``num_drafts[i]`` MTP drafts (the next ids of the flat ``draft_tokens``), so
        ``seqlen_q = 1 + num_drafts`` and ``seqlen_k = num_tokens + num_drafts``. ``num_drafts``
        may be ONE int, the count of every request (the common MTP step: ``decode_batch(slots,
        drafts, 2)`` with ``2 * len(slots)`` drafts). Draft ids must be in ``[0, 2**31 - 1]``
        (``ValueError`` naming the request); slots distinct."""
        _check_placeholders(num_placeholders)
        if not (num_placeholders or self.lookback or self.max_compressed or self._lazy_no):
            batch = decode_batch_fast(self, slots, draft_tokens, num_drafts)
            if batch is not None:
                return batch
        slots, drafts, nd = self._decode_args(slots, draft_tokens, num_drafts)
        k = self.num_tokens[slots] + nd
        return self._batch(False, slots, 1 + nd, k, drafts, num_placeholders)

    def vouch_decode(self, slots: np.ndarray, draft_tokens: Optional[np.ndarray] = None,
                     num_drafts: Optional[np.ndarray | int] = None) -> Optional[VouchedStep]:
        """The decode step ``decode_batch(slots, draft_tokens, num_drafts)`` when the state vouches
        for it without a per-step check (every slot live and given once, done with its prefill,
        its ids and the drafts in ``[0, 2**31 - 1]``, ``seqlen_k`` within its table's reach and
        ``max_model_len``; draft counts adding up), else ``None`` (``decode_batch`` then raises
        the precise error). For writers that lay
        out a decode step themselves from :attr:`block_rows32`, :attr:`last_tokens32` and
        :attr:`state_ids32` (``cpmeta.gpu.stage_decode``). Example: slots ``[0, 1]`` holding 5
        and 9 tokens, ``num_drafts=2`` with 4 drafts -> ``sk = [7, 11]``, ``k_hi = 2``."""
        return vouch_decode_step(self, slots, draft_tokens, num_drafts)

    def _decode_args(self, slots: np.ndarray, draft_tokens: Optional[np.ndarray],
                     num_drafts: Optional[np.ndarray | int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``decode_batch``'s argument checks (live slots, draft counts, prefill done); returns
        ``(slots, drafts, num_drafts)`` as int64 arrays; draft ids outside ``[0, 2**31 - 1]``
        are a ``ValueError`` naming the request they belong to."""
        slots = as_int_array("slots", slots)
        self._check_slots(slots)
        drafts = np.zeros(0, np.int64) if draft_tokens is None else as_int_array("draft_tokens", draft_tokens)
        if num_drafts is None:
            if len(drafts):
                raise ValueError(f"num_drafts: expected {len(slots)} counts >= 0 summing to {len(drafts)} drafts")
            nd = np.zeros(len(slots), np.int64)
        else:
            nd = np.full(len(slots), int(num_drafts), np.int64) if is_draft_count(num_drafts) \
                else np.asarray(num_drafts)
            if nd.shape != slots.shape or nd.dtype.kind not in "iu" or (nd < 0).any() \
                    or int(nd.sum()) != len(drafts):
                raise ValueError(f"num_drafts: expected {len(slots)} counts >= 0 (or one count for all) "
                                 f"summing to {len(drafts)} drafts")
            nd = nd.astype(np.int64, copy=False)
        if not ids_in_int32(drafts):
            bad_id("draft_tokens", drafts, nd, [self._req[s] for s in slots.tolist()], negative_only=False)
        in_prefill = self.num_computed[slots] < self.prompt_len[slots]
        if in_prefill.any():
            s = int(slots[np.argmax(in_prefill)])
            raise ValueError(f"request {self._req[s]!r}: still in prefill ({int(self.num_computed[s])} of "
                             f"{int(self.prompt_len[s])} prompt tokens computed)")
        return slots, drafts, nd

    def _batch(self, is_prompt: bool, slots: np.ndarray, sq: np.ndarray, sk: np.ndarray,
               drafts: Optional[np.ndarray], n_ph: int) -> SequenceBatch:
        """The general gather of a step's ``SequenceBatch``: :func:`cpmeta.state.gather.gather_batch`."""
        return gather_batch(self, is_prompt, slots, sq, sk, drafts, n_ph)
