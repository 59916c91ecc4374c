"""The ``SequenceBatch`` of a step gathered by :func:`~cpmeta.state.state_njit.gather_step`.

The kernel returns ONE int64 buffer per step (the batch's own memory: later changes to the state
never reach it) and the placeholder flags; every array of the batch is a view of that buffer.
A batch the kernel vouched for (everything ``SequenceBatch.validate`` checks holds, by the
state's invariants and the kernel's per-step checks) is marked validated for the state's config
(``Vouch(cfg)``): the builders skip ``validate``. Any other batch is returned unchecked, and the
builders raise the usual ``seqs[i].field`` message.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .batch import SequenceBatch, Vouch

__all__ = ["batch_of"]


def batch_of(buf: np.ndarray, ph: np.ndarray, vouch: Optional[Vouch], is_prompt: bool, lookback: int) -> SequenceBatch:
    """The batch over ``buf``'s layout: ``[0, n)`` seqlen_q, then seqlen_k, state_id,
    swa_valid_start, num_tokens (``n`` each), block-table, token and compressed offsets (``n +
    1`` each), then the ``T`` tokens, ``B`` block ids and the compressed ids. Example: n = 1,
    one decode token, one block -> ``buf = [1, 5, 0, 0, 5, 0, 1, 0, 1, 0, 0, t, b]``
    (offsets ``[0, 1]``, ``[0, 1]``, ``[0, 0]``). ``vouch``: the state's ``Vouch(cfg)`` when the
    kernel vouched for the batch (one immutable tuple per state), else ``None``."""
    n = len(ph)
    h = 8 * n + 3
    t = h + int(buf[7 * n + 1])  # tokens end: token_offsets[n]
    b = t + int(buf[6 * n])  # block ids end: block_table_offsets[n]
    batch = SequenceBatch(
        is_prompt, buf[:n], buf[n:2 * n], buf[2 * n:3 * n], buf[3 * n:4 * n], ph, buf[4 * n:5 * n],
        buf[t:b], buf[5 * n:6 * n + 1], buf[h:t], buf[6 * n + 1:7 * n + 2], buf[b:], buf[7 * n + 2:h], lookback)
    batch._vouch = vouch
    return batch
