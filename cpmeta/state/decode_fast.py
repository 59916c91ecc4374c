"""``decode_batch_fast``: ``BatchState.decode_batch`` for the common engine step, in ~15 numpy calls.

The common decode step -- no placeholders, no Engram look-back, every scheduled request live,
done with its prefill and vouched for by the state's per-slot flags -- needs none of the general
path's per-step checks: ``BatchState`` keeps, per slot, ``_dec_cap``: the largest ``seqlen_k``
its table and ``max_model_len`` allow when the slot is live, done with its prefill and its
block ids (``[0, _bt_max]``), state id (``[0, _state_max]``) and ``swa_valid_start >= 0`` are in
range, else -1 -- so one gather and one comparison validate the batch. Anything else returns ``None`` and ``decode_batch`` takes the general
path (same batch, same errors).

The batch's flat ``block_tables`` / ``block_table_offsets`` are made from its 2-D rows on FIRST
READ (:class:`StateDecodeBatch`): ``prepare_decode`` copies the 2-D rows and never reads them,
``prepare_decode_inplace`` and user code read them as usual. The rows are a snapshot taken in
the step (``_bt32[slots]``), so later changes to the state never change a batch already made.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from .batch import SequenceBatch, prefix
from ..constants import INT32_MAX
from .store import StateStore


__all__ = ["StateDecodeBatch", "decode_batch_fast", "is_draft_count", "vouch_decode_step", "VouchedStep"]

_BT = SequenceBatch.__dict__["block_tables"]  # the dataclass slots behind the two properties
_BT_OFF = SequenceBatch.__dict__["block_table_offsets"]

#: ``n -> read-only arrays`` shared by every fast batch of n sequences (a batch is immutable).
_CONST: dict[int, tuple[np.ndarray, ...]] = {}


def _consts(n: int) -> tuple[np.ndarray, ...]:
    """``(ones(n), zeros(n, bool), arange(n + 1), zeros(n + 1), empty)`` int64 / bool, read-only:
    ``seqlen_q`` without drafts, ``is_placeholder``, one-token ``token_offsets``, empty
    ``compressed_offsets`` and ``compressed``."""
    hit = _CONST.get(n)
    if hit is None:
        if len(_CONST) > 64:
            _CONST.clear()
        hit = _CONST[n] = (np.ones(n, np.int64), np.zeros(n, bool), np.arange(n + 1, dtype=np.int64),
                           np.zeros(n + 1, np.int64), np.zeros(0, np.int64))
        for a in hit:
            a.flags.writeable = False
    return hit


#: ``(n, k) -> bytes`` of ``np.full(n, k, np.int64)``: the counts of a step where every request has k drafts.
_UNIFORM: dict[tuple[int, int], bytes] = {}


def _uniform_counts(n: int, k: int) -> bytes:
    """The bytes of ``n`` int64 draft counts all equal to ``k`` (cached): a count array equals
    them iff every request has ``k`` drafts. Example: ``(2, 1)`` -> the 16 bytes of ``[1, 1]``."""
    hit = _UNIFORM.get((n, k))
    if hit is None:
        if len(_UNIFORM) > 64:
            _UNIFORM.clear()
        hit = _UNIFORM[n, k] = np.full(n, k, np.int64).tobytes()
    return hit


def _made_on_first_read(slot: Any) -> property:
    """A property over the dataclass ``slot`` that runs ``self._tables()`` when it is still unset."""

    def get(self: "StateDecodeBatch") -> np.ndarray:
        try:
            return slot.__get__(self)
        except AttributeError:
            self._tables()
            return slot.__get__(self)

    return property(get, slot.__set__)


class StateDecodeBatch(SequenceBatch):
    """A decode ``SequenceBatch`` whose flat block tables are made from its 2-D rows on first read.

    Equal to the ``SequenceBatch`` the general path builds (``tests/test_batch_state.py`` compares
    every field on random steps). ``_rows`` is ``(bt2d, num_blocks)``: ``[n_seq,
    max_num_blocks]`` int32 rows, -1 padded, and each table's length (``<= max_num_blocks``).
    Example: rows ``[[7, 8, -1], [4, -1, -1]]``, lengths ``[2, 1]`` -> ``block_tables = [7, 8,
    4]``, ``block_table_offsets = [0, 2, 3]``.
    """

    __slots__ = ("_rows",)
    _rows: tuple[np.ndarray, np.ndarray]  # ([n_seq, max_num_blocks] int32 rows, [n_seq] int64 lengths)

    def _tables(self) -> None:
        bt2d, nb = self._rows
        _BT.__set__(self, bt2d[np.arange(bt2d.shape[1]) < nb[:, None]].astype(np.int64))
        _BT_OFF.__set__(self, prefix(nb))

    block_tables = _made_on_first_read(_BT)
    block_table_offsets = _made_on_first_read(_BT_OFF)


def is_draft_count(num_drafts: Any) -> bool:
    """``num_drafts`` given as ONE count for every request of the step (an int, not a bool)
    rather than one count per request."""
    return isinstance(num_drafts, (int, np.integer)) and not isinstance(num_drafts, (bool, np.bool_))


class VouchedStep(NamedTuple):
    """A decode step the state vouches for (:func:`vouch_decode_step`): int64 ``slots``, each
    slot's confirmed tokens ``nt`` and ``seqlen_k`` ``sk``, the ``drafts`` (int32 or int64) and
    per-slot counts ``nd`` (``None`` without drafts or with one count for all), the largest count
    ``k_hi`` and whether every slot has it."""

    slots: np.ndarray
    nt: np.ndarray
    sk: np.ndarray
    drafts: Optional[np.ndarray]
    nd: Optional[np.ndarray]
    k_hi: int
    uniform: bool


def vouch_decode_step(st: StateStore, slots: Any, draft_tokens: Optional[np.ndarray],
                      num_drafts: Optional[np.ndarray | int]) -> Optional[VouchedStep]:
    """The checks of both decode fast paths (``decode_batch_fast``, ``stage_decode``): int64 1-D
    ``slots`` that the state vouches for (``_dec_cap``: one gather, which also bounds-checks them),
    draft counts that add up, draft ids that fit int32, ``seqlen_k`` within each slot's cap. Any
    failure -> ``None`` (the caller's general path raises the precise error)."""
    slots = np.asarray(slots)
    if slots.dtype != np.int64 or slots.ndim != 1 or len(slots) == 0:
        return None
    try:  # a slot outside [-max_seqs, max_seqs) raises here or reads -1: the general path names it
        cap = st._dec_cap.take(slots)
        nt = st.num_tokens.take(slots)
    except IndexError:
        return None
    count = is_draft_count(num_drafts)
    if draft_tokens is None or len(draft_tokens) == 0:
        if num_drafts is not None:
            if count:
                if num_drafts:
                    return None
            else:
                nd0 = np.asarray(num_drafts)
                if nd0.shape != slots.shape or np.count_nonzero(nd0):
                    return None
        step = VouchedStep(slots, nt, nt, None, None, 0, True)
    else:
        if num_drafts is None:
            return None
        drafts = np.asarray(draft_tokens)
        if drafts.dtype != np.int32:  # int32 ids fit by their type; anything else as int64, checked below
            drafts = np.asarray(drafts, np.int64)
        if drafts.ndim != 1:
            return None
        if count:  # one count for every request (the common MTP step)
            nd, k_lo = None, int(num_drafts)
            k_hi, uniform = k_lo, True
        else:
            nd = np.asarray(num_drafts, np.int64)
            if nd.shape != slots.shape:
                return None
            # every request with the same number of drafts (the common MTP step): one memcmp
            k_lo = k_hi = int(nd[0])
            uniform = nd.tobytes() == _uniform_counts(len(nd), k_hi)
            if not uniform:
                k_lo, k_hi = int(nd.min()), int(nd.max())
        if k_lo < 0 or (k_lo * len(slots) if nd is None or uniform else int(nd.sum())) != len(drafts):
            return None
        # ids in [0, 2**31) in ONE reduction: their bitwise or is too (>> 31 is 0 there); any id
        # outside sets bit 31 or above, or the sign; a negative id takes the full check
        if drafts.dtype != np.int32 and np.bitwise_or.reduce(drafts) >> 31 \
                and (int(drafts.max()) > INT32_MAX or int(drafts.min()) < -INT32_MAX - 1):
            return None
        step = VouchedStep(slots, nt, nt + (k_hi if uniform else nd), drafts, nd, k_hi, uniform)
    # not vouched for (-1), a table too short for seqlen_k, or past max_model_len
    return None if np.count_nonzero(step.sk > cap) else step


def decode_batch_fast(st: StateStore, slots: np.ndarray, draft_tokens: Optional[np.ndarray],
                      num_drafts: Optional[np.ndarray | int]) -> Optional[StateDecodeBatch]:
    """``st.decode_batch(slots, draft_tokens, num_drafts)`` when the state vouches for every
    scheduled request (see the module doc), else ``None``. The caller excludes placeholders,
    Engram (look-back / compressed history) and states whose tables can pass max_num_blocks."""
    step = vouch_decode_step(st, slots, draft_tokens, num_drafts)
    if step is None:
        return None
    slots, nt, sk, drafts, nd, k_hi = step.slots, step.nt, step.sk, step.drafts, step.nd, step.k_hi
    n = len(slots)
    ones, no_ph, ar1, zeros1, empty = _consts(n)
    last = st._last.take(slots).astype(np.int64)  # every confirmed token fits int32 (part of _dec_cap)
    if drafts is None:
        sq, tokens, tok_off = ones, last, ar1
    elif step.uniform:  # rows of sequence s: [s * (1 + k), (s + 1) * (1 + k)): last token, drafts
        sq = np.full(n, k_hi + 1, np.int64)
        tok_off = ar1 * (k_hi + 1)
        tokens = np.empty((n, k_hi + 1), np.int64)
        tokens[:, 0] = last
        tokens[:, 1:] = drafts.reshape(n, k_hi)
        tokens = tokens.reshape(-1)
    else:
        assert nd is not None  # counts differ: one per request
        sq = nd + 1
        tok_off = prefix(sq)
        tokens = np.empty(int(tok_off[-1]), np.int64)
        tokens[tok_off[:-1]] = last
        # draft i of sequence s sits at row i + s + 1 (every earlier sequence adds its last token)
        tokens[np.arange(len(drafts)) + np.repeat(ar1[1:], nd)] = drafts
    b = StateDecodeBatch.__new__(StateDecodeBatch)
    b.is_prompt = False
    b.seqlen_q, b.seqlen_k, b.num_tokens = sq, sk, nt
    b.state_id, b.swa_valid_start = st.state_id[slots], st.swa_valid_start[slots]
    b.is_placeholder = no_ph
    b.tokens, b.token_offsets = tokens, tok_off
    b.compressed, b.compressed_offsets = empty, zeros1
    b.lookback = 0
    bt2d = np.take(st._bt32, slots, axis=0)
    b._rows = (bt2d, st.num_blocks[slots])
    b._checked, b._need, b._bt2d, b._ids_ok = st.cfg, None, (st.cfg, bt2d), True
    return b
