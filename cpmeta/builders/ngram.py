"""Engram look-back ids of chosen query rows (docs/design.md section 4, ``ngram_token_ids``), vectorized.

What a CP rank reads for its own prompt rows (``cpmeta.cp.prompt_share``); the builders fill the
whole field in their kernels (:func:`cpmeta.builders.common_njit.fill_ngram_rows`, the same rule).
For query row at absolute position ``pos`` and column ``c`` the look-back position is ``t = pos - c``:
pad if ``t < 0`` or any token at positions ``t..pos`` is the image sentinel; else
``compressed_token_ids[t]`` if ``t < len(compressed_token_ids)``, else ``ngram_lookup[token_at(t)]``
(identity without a table). ``token_at`` reads ``token_ids`` then (decode) ``draft_tokens``.

Method: per sequence, the positions any row can look at form one window ``[lo, seqlen_k)`` with
``lo = max(0, q_start - (N - 1))``: exactly the token window of the ``SequenceBatch`` layout, so
its flat ``tokens`` array IS the flat array of raw tokens ``R``. A running maximum of "index of
the last image token" over ``R`` answers "is there an image token in ``t..pos``" for every (row,
column) with one comparison, so no loop over rows or columns remains.
"""

from __future__ import annotations

import numpy as np
import torch

from .batch_arrays import BatchArrays
from ..config import MetadataConfig
from ..constants import INT32_MAX

__all__ = ["ngram_rows"]


def ngram_rows(b: BatchArrays, cfg: MetadataConfig, rows: np.ndarray) -> np.ndarray:
    """``ngram_token_ids`` of the query rows ``rows`` only ([len(rows), max_ngram_size] int64;
    a row ``-1``, a CP pad row, is all 0): what one CP rank reads, without the other ranks'
    rows. Same rule and errors as :func:`fill_ngram_token_ids`, but every value is looked up at
    the window positions these rows read (``N`` per row) instead of over whole windows.
    Example: N = 2, one prompt sequence of tokens ``[5, 7, 9]`` (no table), rows ``[2, -1]`` ->
    ``[[9, 7], [0, 0]]``.
    """
    N = cfg.max_ngram_size
    lo, wcu, R = b.tok_lo, b.tok_off, b.tok_flat
    valid = rows >= 0
    r = rows[valid]
    seq, pos = b.row_seq[r], b.row_pos[r]
    fpos = wcu[seq] + pos - lo[seq]  # flat window index of each row's own position
    cols = np.arange(N, dtype=np.int64)
    F = fpos[:, None] - cols
    pad = (pos[:, None] - cols) < 0
    if cfg.image_token_id is not None:
        last = np.where(R == cfg.image_token_id, np.arange(len(R), dtype=np.int64), -1)
        np.maximum.accumulate(last, out=last)
        pad |= F <= last[fpos][:, None]
    Fc = np.maximum(F, 0)
    vals = R[Fc]
    ok = np.ones(Fc.shape, bool)
    use_c = None
    comp_len = b.comp_len
    if len(b.comp_flat):
        assert comp_len is not None  # extract_batch sets it whenever max_ngram_size > 0
        k = Fc - wcu[seq][:, None]  # index inside the sequence's window
        use_c = k < comp_len[seq][:, None]
    table = cfg.ngram_lookup
    if table is not None:
        tab = table.detach().cpu().to(torch.int64).numpy()
        ok = (vals >= 0) & (vals < len(tab))
        vals = tab[np.where(ok, vals, 0)] if len(tab) else np.zeros_like(vals)
    if use_c is not None and comp_len is not None:
        ccu = np.zeros(b.n_seq + 1, np.int64)
        np.cumsum(comp_len, out=ccu[1:])
        at = np.where(use_c, ccu[seq][:, None] + k, 0)
        vals = np.where(use_c, b.comp_flat[np.minimum(at, len(b.comp_flat) - 1)], vals)
        ok |= use_c
    if not ok[~pad].all():
        raise ValueError("ngram_lookup: a token id read by ngram_token_ids is outside the table")
    res = np.zeros((len(rows), N), np.int64)
    res[valid] = np.where(pad, cfg.ngram_pad_token, vals)
    if res.size and (res.max() > INT32_MAX or res.min() < -INT32_MAX - 1):
        raise ValueError("ngram_token_ids: an id does not fit in int32")
    return res
