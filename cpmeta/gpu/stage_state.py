"""``stage_decode``: the in-place decode's staging buffer written straight from a ``BatchState``.

The fast path of ``BatchState.stage_decode`` (DESIGN 12 and 13): instead of
``staging.stage(state.decode_batch(...), cfg)`` (a ``SequenceBatch``, its extraction, then the
staging fill) it reads the state's arrays directly. It uses the state's private caches (the
int32 block-table mirror, per-slot validity flags, the cached staging header): the two modules are
written together, and ``tests/test_stage_decode.py`` checks that both paths stage the same bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from ..batch import blocks_needed_array
from ..constants import INT32_MAX
from .decode_staging import (
    F_BT_OFFSET, F_CU_K_INCL, F_CU_Q_INCL, F_PLACEHOLDER, F_SEQLEN_K, F_SEQLEN_Q, F_STATE, HEADER_FIXED,
    SEQ_FIELDS, DecodeStaging, StagedDecode,
)

if TYPE_CHECKING:
    from ..batch_state import BatchState

__all__ = ["stage_decode"]


def stage_decode(st: "BatchState", staging: DecodeStaging, slots: np.ndarray,
                 draft_tokens: Optional[np.ndarray] = None, num_drafts: Optional[np.ndarray] = None,
                 *, num_placeholders: int = 0) -> StagedDecode:
    """``staging.stage(st.decode_batch(slots, draft_tokens, num_drafts, num_placeholders=...),
    cfg)`` written STRAIGHT from the state arrays: no ``SequenceBatch``, no ``BatchArrays``.

    Same staging bytes, same errors, same capacity refusal (``staging.out_capacity``; here
    checked before the host buffer is touched), same upload (``DecodeStaging.upload``: ONE
    non-blocking copy, event recorded), same return value; ``launch_decode_inplace`` and
    graph replay read it unchanged. A step is ~15 vectorized numpy calls over ``[n_seq]``
    arrays, the ``[n_seq, max_num_blocks]`` int32 table mirror and the drafts.

    Falls back to the ``decode_batch`` + ``stage`` path (identical result, slower) when the
    fast path cannot vouch for the batch: Engram configs (``max_ngram_size > 0``: the
    look-back windows are staged by ``write_staging``), a batch the state's invariants do not
    validate (``seqlen_k > max_model_len``, negative state id / valid start, too few blocks),
    a table holding a block id outside ``[0, (2**31 - b_c) // b_c]``, any int32 overflow,
    or no real request (placeholders only). Any error is thus the builders' own message.
    Example: ``staged = st.stage_decode(staging, slots, drafts, counts); g.replay()``.
    """
    assert st._header[0] - len(st._header[1]) == HEADER_FIXED, "BatchState caches the staging header"
    cfg = st.cfg
    n_ph = int(num_placeholders)
    slots, drafts, nd = st._decode_args(slots, draft_tokens, num_drafts)
    n_real = len(slots)
    if cfg.max_ngram_size or n_real == 0 or n_ph < 0 or not st._fast[slots].all():
        return st._stage_slow(staging, slots, drafts, nd, n_ph)
    n = n_real + n_ph
    n_d = len(drafts)
    total_q = n + n_d
    nt = st.num_tokens[slots]
    sk = nt + nd if n_d else nt
    need = blocks_needed_array(sk, cfg)
    last = np.take(st.token_ids, slots * st.max_tokens + (nt - 1))
    max_sk, max_need = int(sk.max()), int(need.max())
    total_k = int(sk.sum()) + n_ph
    mnb = st._bt32.shape[1]
    decode_bound = total_q * mnb * (cfg.block_size // min(cfg.dense_compress_ratios)) \
        if cfg.dense_compress_ratios else 0
    # int32 ids: x + 2**31 in [0, 2**32) (one pass instead of min and max)
    bad_ids = ((last + 2**31).view(np.uint64) >= 2**32).any() or \
        (n_d and ((drafts + 2**31).view(np.uint64) >= 2**32).any())
    if (max_sk > cfg.max_model_len or max_need > mnb or total_k > INT32_MAX or decode_bound > INT32_MAX
            or bad_ids or (st.num_blocks[slots] < need).any()):
        return st._stage_slow(staging, slots, drafts, nd, n_ph)
    ph_nb = st._ph_blocks
    total_b_real = int(need.sum())
    total_b = total_b_real + n_ph * ph_nb
    hl, ratios = st._header
    off_ids = hl + SEQ_FIELDS * n
    off_bt = off_ids + total_q
    used = off_bt + total_b
    staged = StagedDecode(n, total_q, total_k, 1 + int(nd.max()) if n_d else 1, max(max_sk, 1 if n_ph else 0),
                          used, max(max_need, ph_nb if n_ph else 0))
    staging.check_capacity(staged)  # before the host buffer is touched
    view = staging.host_view(used)
    view[:HEADER_FIXED] = (n, total_q, total_k, hl, off_ids, off_bt, used, used)
    view[HEADER_FIXED:hl] = ratios
    blk = view[hl:off_ids].reshape(SEQ_FIELDS, n)
    if n_ph:
        blk[:, n_real:] = ((1,), (1,), (0,), (0,), (0,), (1,), (0,))  # cu / bt rows: set below
        blk[F_CU_Q_INCL, n_real:] = np.arange(total_q - n_ph + 1, total_q + 1)
        blk[F_CU_K_INCL, n_real:] = np.arange(total_k - n_ph + 1, total_k + 1)
        blk[F_BT_OFFSET, n_real:] = total_b_real + ph_nb * np.arange(n_ph)
    r = slice(0, n_real)
    if n_d:
        blk[F_SEQLEN_Q, r] = nd
        blk[F_SEQLEN_Q, r] += 1
        np.cumsum(blk[F_SEQLEN_Q, r], out=blk[F_CU_Q_INCL, r])
    else:
        blk[F_SEQLEN_Q, r] = 1
        blk[F_CU_Q_INCL, r] = st._ar[1:n_real + 1]
    blk[F_SEQLEN_K, r] = sk
    np.cumsum(blk[F_SEQLEN_K, r], out=blk[F_CU_K_INCL, r])
    blk[F_STATE, r] = st.state_id[slots]
    blk[F_PLACEHOLDER, r] = 0
    bt_off = blk[F_BT_OFFSET, r]
    bt_off[0] = 0
    np.cumsum(need[:-1], out=bt_off[1:])
    ids = view[off_ids:off_bt]
    if n_d:  # row of draft i of sequence s: i + s + 1 (every earlier sequence adds its last token)
        ids[blk[F_CU_Q_INCL, r] - blk[F_SEQLEN_Q, r]] = last
        ids[np.arange(n_d) + np.repeat(st._ar[1:n_real + 1], nd)] = drafts
    else:
        ids[:n_real] = last
    ids[total_q - n_ph:] = 0
    # flat tables: entry i of sequence s is _bt32[slot, i], one ragged take of the flat mirror
    idx = np.repeat(slots * mnb - bt_off, need)
    idx += st._ar[:total_b_real]
    np.take(st._bt32.reshape(-1), idx, out=view[off_bt:off_bt + total_b_real])
    view[off_bt + total_b_real:used] = 0
    staging.upload(staged)
    return staged
