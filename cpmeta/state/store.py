"""``StateStore``: the preallocated arrays of a :class:`~cpmeta.state.batch_state.BatchState`.

The state room owns these arrays. ``BatchState`` (the deltas and the step API) derives from
this class; the step gathers (:mod:`cpmeta.state.gather`, :mod:`cpmeta.state.decode_fast`) read
them, typed against this class so that no module of the room imports ``BatchState`` back. Other
rooms read a state only through the public names below (read-only numpy views where the array
is shared): the in-place decode staging (``cpmeta.gpu.stage_decode``) is one such reader.

Public, read-only to callers (every array is ``[max_seqs, ...]``, row = slot):

==================  ===========================  =================================================
name                shape / dtype                meaning
==================  ===========================  =================================================
``token_ids``       [max_seqs, max_tokens] i64   confirmed tokens (``num_tokens`` of them)
``num_tokens``      [max_seqs] int64             confirmed tokens per slot
``num_computed``    [max_seqs] int64             prompt tokens prefilled so far
``prompt_len``      [max_seqs] int64             prompt length
``block_table``     [max_seqs, max_blocks] i64   block ids (``num_blocks`` of them)
``num_blocks``      [max_seqs] int64             block ids per slot
``compressed``      [max_seqs, max_compressed]   Engram history ids (``num_compressed``)
``state_id``        [max_seqs] int64             SWA / state slot
``swa_valid_start`` [max_seqs] int64             first valid SWA position
``active``          [max_seqs] bool              a live request holds the slot
``block_rows32``    [max_seqs, max_num_blocks]   int32 copy of each table's first
                    int32, -1 padded             ``cfg.max_num_blocks`` ids: a decode step's
                                                 ``block_tables`` rows in one row gather
``last_tokens32``   [max_seqs] int32             each slot's last confirmed token (exact where
                                                 :meth:`~BatchState.vouch_decode` vouches)
``state_ids32``     [max_seqs] int32             ``state_id`` as int32 (exact where vouched)
``placeholder_blocks``  int                      block ids of a placeholder sequence
==================  ===========================  =================================================

Example: ``st.block_rows32[slot, :st.num_blocks[slot]]`` is the slot's table as int32 (when the
table has at most ``cfg.max_num_blocks`` ids).

Room-internal interface: the step gathers (:mod:`~cpmeta.state.gather`,
:mod:`~cpmeta.state.decode_fast`) read the per-slot flags through these methods, never through
the private arrays behind them (each one vectorized over ``slots``, an int64 array of slots
already checked or bounded as the method says):

==============================  =================================================================
method                          answers
==============================  =================================================================
``decode_limits(slots)``        the largest ``seqlen_k`` each slot may decode to with no per-step
                                check (-1: not vouched) and its confirmed tokens; ``None`` for a
                                slot outside ``[-max_seqs, max_seqs)``: the gathers bounds-check
``has_repeats(slots)``          a slot appears twice (O(n): one scatter and one gather)
``slots_vouched(slots)``        every slot's own checks hold (block ids, state id, valid start,
                                tokens): ``block_rows32`` rows are exact and fit the int32 bounds
``tokens_fit_int32(slots)``     every confirmed token of every slot fits int32
==============================  =================================================================
"""

from __future__ import annotations

from typing import Any, Hashable, Optional

import numpy as np

from ..config import MetadataConfig, blocks_needed, seqlen_k_covered
from .batch import window_lookback

__all__ = ["StateStore"]


def _read_only(a: np.ndarray) -> np.ndarray:
    """A view of ``a`` that cannot be written through (``a`` itself stays writable)."""
    v = a.view()
    v.flags.writeable = False
    return v


def _check_slot_arg(slot: object) -> None:
    if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool):
        raise TypeError(f"slot: expected an int, got {slot!r}")


class StateStore:
    """The arrays of a ``BatchState`` and the per-slot flags its decode fast paths read.

    Capacity: ``max_seqs`` request slots, per request ``max_tokens`` confirmed tokens (default
    ``cfg.max_model_len``), ``max_blocks`` block ids (default ``blocks_needed(max_model_len)``)
    and ``max_compressed`` Engram history ids (default ``max_tokens`` with Engram on, else 0).
    """

    def __init__(self, cfg: MetadataConfig, max_seqs: int, *, max_tokens: Optional[int] = None,
                 max_blocks: Optional[int] = None, max_compressed: Optional[int] = None) -> None:
        if max_seqs < 1:
            raise ValueError(f"max_seqs: expected >= 1, got {max_seqs}")
        self.cfg = cfg
        self.max_seqs = int(max_seqs)
        self.max_tokens = int(max_tokens if max_tokens is not None else cfg.max_model_len)
        self.max_blocks = int(max_blocks if max_blocks is not None else blocks_needed(cfg.max_model_len, cfg))
        if max_compressed is None:
            max_compressed = self.max_tokens if cfg.max_ngram_size > 0 else 0
        self.max_compressed = int(max_compressed)
        self.lookback = window_lookback(cfg)
        n = self.max_seqs
        self.token_ids = np.zeros((n, self.max_tokens), np.int64)
        self.num_tokens = np.zeros(n, np.int64)
        self.num_computed = np.zeros(n, np.int64)
        self.prompt_len = np.zeros(n, np.int64)
        self.block_table = np.zeros((n, self.max_blocks), np.int64)
        self.num_blocks = np.zeros(n, np.int64)
        self.compressed = np.zeros((n, self.max_compressed), np.int64)
        self.num_compressed = np.zeros(n, np.int64)
        self.state_id = np.zeros(n, np.int64)
        self.swa_valid_start = np.zeros(n, np.int64)
        self.active = np.zeros(n, bool)
        self._init_fast_path(cfg, n)
        self._req: list[Any] = [None] * n  # request id of each slot
        self._slot: dict[Hashable, int] = {}
        self._free = list(range(n - 1, -1, -1))  # pop() gives the lowest free slot
        self.placeholder_blocks = blocks_needed(1, cfg)
        # decode_batch_fast makes a batch's flat tables from its 2-D rows on first read: that
        # needs every whole table to fit the max_num_blocks columns of _bt32
        self._lazy_no = self.max_blocks > cfg.max_num_blocks

    def _init_fast_path(self, cfg: MetadataConfig, n: int) -> None:
        """The int32 mirrors and per-slot flags of the decode fast paths, kept by every mutator."""
        # [max_seqs, max_num_blocks] int32 mirror of block_table's first max_num_blocks ids, -1
        # padded: a decode step's block_tables rows (Vouch.block_rows32) in one row gather
        self._bt32 = np.full((n, cfg.max_num_blocks), -1, np.int32)
        # [max_seqs] the slot's own checks hold (every id of its table in [0, _bt_max]: the int32
        # mirror is exact and every compressed slot fits int32; state id in [0, _state_max]: its
        # SWA slots fit int32; swa_valid_start >= 0; every confirmed token fits int32)
        self._bt_max, self._state_max = cfg.max_block_id, cfg.max_state_id
        self._bt_ok = np.zeros(n, bool)
        self._fast = np.zeros(n, bool)
        # [2 * max_seqs] the largest seqlen_k slot s may decode to -- its table's reach capped at
        # max_model_len (_table_cap) -- when it is live, done with its prefill and _fast holds;
        # else -1. The second half is -1: a negative slot wraps into it, so ONE gather (np.take
        # raises past 2 * max_seqs) bounds-checks the slots and vouches for the sequences.
        self._dec_cap = np.full(2 * n, -1, np.int64)
        # [max_seqs] each slot's last confirmed token and whether every confirmed token fits int32
        # (checked once, when it enters; part of _fast). int32, written by array assignment,
        # which wraps an id that does not fit: such a slot has _tok_ok False and is never read
        # as exact; same for _state32 and _fast.
        self._last = np.zeros(n, np.int32)
        self._tok_ok = np.zeros(n, bool)
        self._state32 = np.zeros(n, np.int32)
        # [max_seqs] scratch of has_repeats: entry s holds the index of the last occurrence of
        # slot s in the slots it was given (never read before it is written)
        self._seen = np.zeros(n, np.int64)
        self._arange = _read_only(np.arange(n, dtype=np.int64))
        self.block_rows32 = _read_only(self._bt32)
        self.last_tokens32 = _read_only(self._last)
        self.state_ids32 = _read_only(self._state32)

    def __len__(self) -> int:
        return len(self._slot)

    def slot_of(self, req_id: Hashable) -> int:
        """The slot of a live request (``ValueError`` for an unknown id)."""
        try:
            return self._slot[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r}: not in the batch state") from None

    def request_of(self, slot: int) -> Any:
        """The request id in ``slot`` (``None`` for a free slot)."""
        _check_slot_arg(slot)
        return self._req[slot]

    def _live(self, slot: int) -> Any:
        """The request in the live ``slot`` (an int; a numpy integer counts, a bool does not)."""
        if type(slot) is not int:
            _check_slot_arg(slot)
        if not (0 <= slot < self.max_seqs) or not self.active[slot]:
            raise ValueError(f"slot {slot}: no live request there")
        return self._req[slot]

    def _table_cap(self, nb: Any) -> Any:
        """The largest ``seqlen_k`` a table of ``nb`` blocks covers, capped at ``max_model_len``
        (the inverse of ``blocks_needed``: :func:`~cpmeta.config.seqlen_k_covered`, KV sharding
        included): works on an int or an int64 array of ``nb``. Examples: block 128, ratio 4,
        2 blocks -> 259 (k = 260 needs a third); plain, block 16, KV over 3 ranks, 7 blocks ->
        336 (rank 0 holds 112 of 336 keys, 113 of 337)."""
        return np.minimum(seqlen_k_covered(nb, self.cfg), self.cfg.max_model_len)

    def _fits(self, req_id: Any, what: str, n: int, cap: int, name: str) -> None:
        if n > cap:
            raise ValueError(f"request {req_id!r}: {n} {what} exceed {name}={cap}")

    def _set_fast(self, s: int) -> None:
        st = int(self.state_id[s])
        self._fast[s] = bool(self._bt_ok[s] and self._tok_ok[s]) and 0 <= st <= self._state_max and \
            int(self.swa_valid_start[s]) >= 0
        ok = self._fast[s] and self.active[s] and self.num_computed[s] >= self.prompt_len[s]
        self._dec_cap[s] = int(self._table_cap(int(self.num_blocks[s]))) if ok else -1

    def _set_fast_many(self, slots: np.ndarray) -> None:
        """:meth:`_set_fast` for distinct live ``slots`` at once (a few vectorized passes)."""
        st = self.state_id[slots]
        fast = self._bt_ok[slots] & self._tok_ok[slots] & (st >= 0) & (st <= self._state_max) & (
            self.swa_valid_start[slots] >= 0)
        self._fast[slots] = fast
        ok = fast & self.active[slots] & (self.num_computed[slots] >= self.prompt_len[slots])
        self._dec_cap[slots] = np.where(ok, self._table_cap(self.num_blocks[slots]), -1)

    def _check_slots(self, slots: np.ndarray) -> None:
        """``slots`` (int64) are distinct slots of live requests, else ``ValueError("slots: ...")``."""
        # one unsigned comparison catches negative slots (huge as uint64) and slots >= max_seqs
        if slots.ndim != 1 or (slots.view(np.uint64) >= self.max_seqs).any() or not self.active[slots].all():
            bad = [int(s) for s in slots.reshape(-1) if not (0 <= s < self.max_seqs and self.active[s])]
            raise ValueError(f"slots: expected slots of live requests, got {bad[:4]} without one")
        if self.has_repeats(slots):
            _, first = np.unique(slots, return_index=True)  # error path: the first slot that repeats
            s = int(slots[np.setdiff1d(np.arange(len(slots)), first)[0]])
            raise ValueError(f"slots: request {self._req[s]!r} (slot {s}) appears twice in one step")

    # ---- room-internal interface (cpmeta/state/ only; see the module docstring) --------------
    def decode_limits(self, slots: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """``(cap, num_tokens)``, each ``[len(slots)]`` int64: the largest ``seqlen_k`` each slot
        may decode to without a per-step check -- its table's reach capped at ``max_model_len``
        -- when it is live, done with its prefill and :meth:`slots_vouched` holds for it, else
        -1; and its confirmed tokens. ``None`` for a slot outside ``[-max_seqs, max_seqs)`` (the
        ``num_tokens`` gather raises there; the cap gather, over ``2 * max_seqs`` entries whose
        second half is -1, reads -1 for a negative slot), so the two gathers bounds-check the
        slots AND vouch for them. Example: block 16, plain, a decoding slot with 2 blocks and 20
        tokens -> ``(32, 20)``; slot -1 -> cap -1."""
        try:
            return self._dec_cap.take(slots), self.num_tokens.take(slots)
        except IndexError:
            return None

    def has_repeats(self, slots: np.ndarray) -> bool:
        """Whether a slot appears twice in ``slots`` (int64, each in ``[0, max_seqs)``): write
        index i at ``_seen[slots[i]]`` and read it back; a repeated slot keeps only its last
        index (more slots than ``max_seqs`` repeat one anyway). Example: slots ``[3, 1, 3]`` ->
        ``_seen[3] = 2``, ``_seen[1] = 1``; read back ``[2, 1, 2] != [0, 1, 2]``: True. Four
        numpy calls, O(n) (~2.5 us at 256 on an idle 2-core VM)."""
        n = len(slots)
        if n > self.max_seqs:
            return True
        ar = self._arange[:n]
        self._seen.put(slots, ar)
        return self._seen.take(slots).tobytes() != ar.tobytes()

    def slots_vouched(self, slots: np.ndarray) -> bool:
        """Every slot's own checks hold: each block id in ``[0, cfg.max_block_id]`` (its
        ``block_rows32`` row exact, every KV slot in int32), state id in ``[0,
        cfg.max_state_id]``, ``swa_valid_start >= 0``, every confirmed token in int32."""
        return bool(self._fast[slots].all())

    def tokens_fit_int32(self, slots: np.ndarray) -> bool:
        """Every confirmed token of every slot fits int32 (checked when it entered the state)."""
        return bool(self._tok_ok[slots].all())

    def state_holder(self, state_id: int, but: int = -1) -> Optional[int]:
        """The slot of a live request other than slot ``but`` whose state id is ``state_id``, or
        ``None`` (O(max_seqs), vectorized; requests join and move rarely)."""
        held = np.flatnonzero(self.active & (self.state_id == state_id))
        held = held[held != but]
        return int(held[0]) if len(held) else None
