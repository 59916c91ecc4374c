"""The general gather of a ``BatchState`` step: every case the decode fast path does not cover.

Prompt chunks (with the Engram look-back), decode with look-back or placeholders, and any slot
the state does not vouch for (``cpmeta/state/decode_fast.py`` covers the rest). Every ragged gather is
ONE flat ``np.take`` from a row-major matrix of the state; the batch is vouched for the state's
config (:func:`~cpmeta.state.vouched.vouched_batch`) when the state's invariants cover
``SequenceBatch.validate`` (else the builders validate it and raise the usual ``seqs[i].field``
message).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..config import blocks_needed_array
from .batch import SequenceBatch, prefix
from .store import StateStore
from .vouched import vouched_batch


__all__ = ["gather_batch", "PLACEHOLDER_TOKEN"]

#: A placeholder sequence (``num_placeholders``): one row at position 0, token 0, state 0, block 0.
PLACEHOLDER_TOKEN = 0


def gather_batch(st: StateStore, is_prompt: bool, slots: np.ndarray, sq: np.ndarray, sk: np.ndarray,
                 drafts: Optional[np.ndarray], n_ph: int) -> SequenceBatch:
    """Gather the step's arrays; placeholders are appended after the requests.

    Every ragged gather is ONE flat ``np.take`` from a row-major matrix, index
    ``slot * row_length + column``. Example: ``max_tokens = 8``, slots ``[2, 0]``, windows
    ``[5, 7)`` and ``[0, 1)`` -> flat indices ``[21, 22, 0]``. A decode without look-back reads
    one confirmed token per sequence (``token_ids[slot, q_start]``) and places the drafts
    after it, with no per-token index at all.
    """
    n_real = len(slots)
    q_start = sk - sq
    lb = st.lookback
    if drafts is not None and lb == 0:  # decode window: the last confirmed token, then the drafts
        last = np.take(st.token_ids, slots * st.max_tokens + q_start)
        if len(drafts) == 0:
            tokens, off = last, np.arange(n_real + 1, dtype=np.int64)
        else:
            off = prefix(sq)
            tokens = np.empty(int(off[-1]), np.int64)
            is_draft = np.ones(len(tokens), bool)
            is_draft[off[:-1]] = False
            tokens[off[:-1]] = last
            tokens[is_draft] = drafts
        lo = q_start
    else:
        lo = np.maximum(q_start - lb, 0) if lb else q_start
        win = sk - lo
        off = prefix(win)
        idx = np.repeat(slots * st.max_tokens + lo - off[:-1], win)
        idx += np.arange(int(off[-1]))
        if drafts is None or len(drafts) == 0:
            tokens = np.take(st.token_ids, idx)
        else:  # window index >= q_start + 1 - lo: a draft (clip: its slot may pass max_tokens)
            tokens = np.take(st.token_ids, idx, mode="clip")
            tokens[np.repeat(q_start + 1 - lo + off[:-1], win) <= np.arange(int(off[-1]))] = drafts
    nb = st.num_blocks[slots]
    bt_off = prefix(nb)
    tables = np.take(st.block_table, np.repeat(slots * st.max_blocks - bt_off[:-1], nb)
                     + np.arange(int(bt_off[-1])))
    if st.max_compressed:
        cl = np.maximum(np.minimum(st.num_compressed[slots], sk) - lo, 0)
        c_off = prefix(cl)
        comp = np.take(st.compressed, np.repeat(slots * st.max_compressed + lo - c_off[:-1], cl)
                       + np.arange(int(c_off[-1])))
    else:
        comp, c_off = np.zeros(0, np.int64), np.zeros(n_real + 1, np.int64)
    state, svs, num_tokens = st.state_id[slots], st.swa_valid_start[slots], st.num_tokens[slots]
    need = blocks_needed_array(sk, st.cfg) if n_real else None
    ok = need is None or _valid(st, slots, sk, nb, state, svs, need)
    if n_ph:  # one row at position 0: token 0, blocks_needed(1) zero blocks, state 0
        one = np.ones(n_ph, np.int64)
        tokens = np.concatenate([tokens, np.full(n_ph, PLACEHOLDER_TOKEN, np.int64)])
        off = np.concatenate([off, off[-1] + np.arange(1, n_ph + 1)])
        tables = np.concatenate([tables, np.zeros(n_ph * st.placeholder_blocks, np.int64)])
        bt_off = np.concatenate([bt_off, bt_off[-1] + st.placeholder_blocks * np.arange(1, n_ph + 1)])
        c_off = np.concatenate([c_off, np.full(n_ph, c_off[-1])])
        sq, sk, num_tokens = (np.concatenate([x, one]) for x in (sq, sk, num_tokens))
        state, svs = (np.concatenate([x, 0 * one]) for x in (state, svs))
    fields = dict(
        is_prompt=is_prompt, seqlen_q=sq, seqlen_k=sk, state_id=state, swa_valid_start=svs,
        is_placeholder=np.arange(n_real + n_ph) >= n_real, num_tokens=num_tokens,
        block_tables=tables, block_table_offsets=bt_off, tokens=tokens, token_offsets=off,
        compressed=comp, compressed_offsets=c_off, lookback=lb,
    )
    if not (ok and n_real + n_ph):  # the builders validate it and raise the seqs[i].field message
        return SequenceBatch(**fields)
    if n_ph or need is None:  # placeholders would need their own blocks_needed entries
        return vouched_batch(st.cfg, **fields)
    # decode block_tables rows, one gather (equal to `tables`), when every table's ids are in
    # [0, max_block_id] and every state id in [0, max_state_id] (slots_vouched): the builders'
    # int32 checks then skip those two bounds (Vouch.block_rows32)
    rows = np.take(st.block_rows32, slots, axis=0) if drafts is not None and st.slots_vouched(slots) else None
    return vouched_batch(st.cfg, blocks_needed=need, block_rows32=rows, **fields)


def _valid(st: StateStore, slots: np.ndarray, sk: np.ndarray, nb: np.ndarray, state: np.ndarray,
           svs: np.ndarray, need: np.ndarray) -> bool:
    """What ``SequenceBatch.validate`` checks that this state's own invariants leave open
    (counts of tokens, windows and drafts hold by construction, token ids are ``>= 0`` and drafts
    in ``[0, 2**31 - 1]`` (refused on entry), state ids are distinct under the state cache
    (``add_request`` / ``set_state_id``) and slots distinct (``_check_slots``); placeholders are
    valid). True: the batch is vouched for ``st.cfg`` and the builders skip ``validate``; False:
    they run it and raise its ``seqs[i].field`` message."""
    cfg = st.cfg
    return bool(int(sk.max()) <= cfg.max_model_len and int(state.min()) >= 0 and int(svs.min()) >= 0
                and (not cfg.has_swa or int(state.max()) <= cfg.max_state_id)
                and (nb >= need).all() and st.tokens_fit_int32(slots))
