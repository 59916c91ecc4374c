"""``decode_batch_fast``: ``BatchState.decode_batch`` for the common engine step, in ~15 numpy calls.

The common decode step -- no placeholders, no Engram look-back, every scheduled request live,
done with its prefill and vouched for by the state's per-slot flags -- needs none of the general
path's per-step checks: the state keeps, per slot, the largest ``seqlen_k`` its table and
``max_model_len`` allow when the slot is live, done with its prefill and its block ids (``[0,
cfg.max_block_id]``), state id (``[0, cfg.max_state_id]``), ``swa_valid_start >= 0`` and
confirmed tokens (int32) are in range, else -1 (``StateStore.decode_limits``) -- so one gather and
one comparison validate the batch, one reduction the drafts (``[0, 2**31 - 1]``) and one scatter
+ gather that no slot repeats (``StateStore.has_repeats``). Distinct slots are distinct state ids
(``add_request`` / ``set_state_id`` keep live requests' ids distinct under the state cache).
Anything else returns ``None`` and ``decode_batch`` takes the general path (same batch, same
errors).

The batch's flat ``block_tables`` / ``block_table_offsets`` are made from its 2-D rows on FIRST
READ (:class:`~cpmeta.state.vouched.StateDecodeBatch`, built by
:func:`~cpmeta.state.vouched.vouched_decode_batch`): ``prepare_decode`` copies the 2-D rows and
never reads them, ``prepare_decode_inplace`` and user code read them as usual. The rows are a
snapshot taken in the step (``block_rows32[slots]``), so later changes to the state never change
a batch already made.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from ..cache import BoundedCache

from .batch import prefix
from .checks import ids_in_int32
from .store import StateStore
from .vouched import StateDecodeBatch, vouched_decode_batch


__all__ = ["decode_batch_fast", "is_draft_count", "vouch_decode_step", "VouchedStep"]

#: ``n -> read-only arrays`` shared by every fast batch of n sequences (a batch is immutable).
_CONST: BoundedCache[int, tuple[np.ndarray, ...]] = BoundedCache(64)


def _consts(n: int) -> tuple[np.ndarray, ...]:
    """``(ones(n), zeros(n, bool), arange(n + 1), zeros(n + 1), empty)`` int64 / bool, read-only:
    ``seqlen_q`` without drafts, ``is_placeholder``, one-token ``token_offsets``, empty
    ``compressed_offsets`` and ``compressed``."""
    hit = _CONST.get(n)
    if hit is None:
        hit = _CONST.put(n, (np.ones(n, np.int64), np.zeros(n, bool), np.arange(n + 1, dtype=np.int64),
                             np.zeros(n + 1, np.int64), np.zeros(0, np.int64)))
        for a in hit:
            a.flags.writeable = False
    return hit


#: ``(n, k) -> bytes`` of ``np.full(n, k, np.int64)``: the counts of a step where every request has k drafts.
_UNIFORM: BoundedCache[tuple[int, int], bytes] = BoundedCache(64)


def _uniform_counts(n: int, k: int) -> bytes:
    """The bytes of ``n`` int64 draft counts all equal to ``k`` (cached): a count array equals
    them iff every request has ``k`` drafts. Example: ``(2, 1)`` -> the 16 bytes of ``[1, 1]``."""
    hit = _UNIFORM.get((n, k))
    if hit is None:
        hit = _UNIFORM.put((n, k), np.full(n, k, np.int64).tobytes())
    return hit


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
    ``slots`` that the state vouches for (``decode_limits``: two gathers, which also bounds-check them),
    draft counts that add up, draft ids that fit int32, ``seqlen_k`` within each slot's cap. Any
    failure -> ``None`` (the caller's general path raises the precise error)."""
    slots = np.asarray(slots)
    if slots.dtype != np.int64 or slots.ndim != 1 or len(slots) == 0:
        return None
    got = st.decode_limits(slots)  # None for a slot outside [-max_seqs, max_seqs), -1 for a negative one
    if got is None:
        return None
    cap, nt = got
    count = is_draft_count(num_drafts)
    if draft_tokens is None or len(draft_tokens) == 0:
        if num_drafts is not None:
            if count:
                if num_drafts:
                    return None
            else:
                nd0 = np.asarray(num_drafts)
                if nd0.shape != slots.shape or nd0.dtype.kind not in "iu" or np.count_nonzero(nd0):
                    return None
        step = VouchedStep(slots, nt, nt, None, None, 0, True)
    else:
        if num_drafts is None:
            return None
        drafts = np.asarray(draft_tokens)
        if drafts.dtype != np.int32:  # int32 ids stay int32; anything else as int64 (both checked below)
            if drafts.dtype.kind not in "iu":
                return None  # floats, bools: the general path refuses them by name
            drafts = np.asarray(drafts, np.int64)
        if drafts.ndim != 1:
            return None
        if count:  # one count for every request (the common MTP step)
            nd, k_lo = None, int(num_drafts)
            k_hi, uniform = k_lo, True
        else:
            nd = np.asarray(num_drafts)
            if nd.shape != slots.shape or nd.dtype.kind not in "iu":
                return None  # the general path refuses float / bool counts by name
            nd = nd.astype(np.int64, copy=False)
            # every request with the same number of drafts (the common MTP step): one memcmp
            k_lo = k_hi = int(nd[0])
            uniform = nd.tobytes() == _uniform_counts(len(nd), k_hi)
            if not uniform:
                k_lo, k_hi = int(nd.min()), int(nd.max())
        if k_lo < 0 or (k_lo * len(slots) if nd is None or uniform else int(nd.sum())) != len(drafts):
            return None
        if not ids_in_int32(drafts):  # ONE reduction; a negative or too large id: the general path names it
            return None
        step = VouchedStep(slots, nt, nt + (k_hi if uniform else nd), drafts, nd, k_hi, uniform)
    # not vouched for (-1), a table too short for seqlen_k, or past max_model_len; a slot twice
    # (two rows would write the same KV and SWA slots)
    if np.count_nonzero(step.sk > cap) or st.has_repeats(slots):
        return None
    return step


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
    last = st.last_tokens32.take(slots).astype(np.int64)  # every confirmed token fits int32 (vouched)
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
    return vouched_decode_batch(
        st.cfg, seqlen_q=sq, seqlen_k=sk, num_tokens=nt, state_id=st.state_id[slots],
        swa_valid_start=st.swa_valid_start[slots], is_placeholder=no_ph, tokens=tokens, token_offsets=tok_off,
        compressed=empty, compressed_offsets=zeros1, block_rows32=np.take(st.block_rows32, slots, axis=0),
        num_blocks=st.num_blocks[slots])
