"""The general gather of a ``BatchState`` step: every case the decode fast path does not cover.

Prompt chunks (with the Engram look-back), decode with look-back or placeholders, and any slot
the state does not vouch for (``cpmeta/state/decode_fast.py`` covers the rest). Every ragged gather is
ONE flat ``np.take`` from a row-major matrix of the state; the batch is marked validated for the
state's config when the state's invariants cover ``SequenceBatch.validate`` (else the builders
validate it and raise the usual ``seqs[i].field`` message).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..config import blocks_needed_array
from .batch import SequenceBatch, prefix
from .store import StateStore


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
    ok = need is None or _valid(st, sk, nb, state, svs, need)
    if n_ph:  # one row at position 0: token 0, blocks_needed(1) zero blocks, state 0
        one = np.ones(n_ph, np.int64)
        tokens = np.concatenate([tokens, np.full(n_ph, PLACEHOLDER_TOKEN, np.int64)])
        off = np.concatenate([off, off[-1] + np.arange(1, n_ph + 1)])
        tables = np.concatenate([tables, np.zeros(n_ph * st.placeholder_blocks, np.int64)])
        bt_off = np.concatenate([bt_off, bt_off[-1] + st.placeholder_blocks * np.arange(1, n_ph + 1)])
        c_off = np.concatenate([c_off, np.full(n_ph, c_off[-1])])
        sq, sk, num_tokens = (np.concatenate([x, one]) for x in (sq, sk, num_tokens))
        state, svs = (np.concatenate([x, 0 * one]) for x in (state, svs))
    batch = SequenceBatch(
        is_prompt=is_prompt, seqlen_q=sq, seqlen_k=sk, state_id=state, swa_valid_start=svs,
        is_placeholder=np.arange(n_real + n_ph) >= n_real, num_tokens=num_tokens,
        block_tables=tables, block_table_offsets=bt_off, tokens=tokens, token_offsets=off,
        compressed=comp, compressed_offsets=c_off, lookback=lb,
    )
    if ok and n_real + n_ph:
        batch._checked = st.cfg
        if not n_ph and need is not None:  # extract_batch reuses it (placeholders would need their own entries)
            batch._need = (st.cfg, need)
            # decode block_tables rows, one gather (equal to `tables`); set only when every
            # table's ids are in [0, _bt_max] and every state id in [0, _state_max] (_fast):
            # the builders' int32 checks then skip those two bounds (SequenceBatch._bt2d)
            if drafts is not None and st._fast[slots].all():
                batch._bt2d = (st.cfg, np.take(st._bt32, slots, axis=0))
    return batch


def _valid(st: StateStore, sk: np.ndarray, nb: np.ndarray, state: np.ndarray, svs: np.ndarray,
           need: np.ndarray) -> bool:
    """What ``SequenceBatch.validate`` checks that this state's own invariants leave open
    (counts of tokens, windows and drafts hold by construction; placeholders are valid).
    True: the batch is marked validated for ``st.cfg`` and the builders skip ``validate``;
    False: they run it and raise its ``seqs[i].field`` message."""
    return bool(int(sk.max()) <= st.cfg.max_model_len and int(state.min()) >= 0 and int(svs.min()) >= 0
                and (nb >= need).all())
