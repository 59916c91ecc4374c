"""Engram look-back ids ``ngram_token_ids`` [total_q, max_ngram_size] (DESIGN section 4), vectorized.

For query row at absolute position ``pos`` and column ``c`` the look-back position is ``t = pos - c``:
pad if ``t < 0`` or any token at positions ``t..pos`` is the image sentinel; else
``compressed_token_ids[t]`` if ``t < len(compressed_token_ids)``, else ``ngram_lookup[token_at(t)]``
(identity without a table). ``token_at`` reads ``token_ids`` then (decode) ``draft_tokens``.

Method: per sequence, the positions any row can look at form one window ``[lo, seqlen_k)`` with
``lo = max(0, q_start - (N - 1))``: exactly the token window of the ``SequenceBatch`` layout, so
its flat ``tokens`` array IS the flat array of raw tokens ``R`` (decode windows end with the
drafts), and its ``compressed`` ids fill the first positions of each window in the values ``V``
(compressed id or looked-up id). A running maximum of "index
of the last image token" over ``R`` answers "is there an image token in ``t..pos``" for every
(row, column) with one comparison, so no loop over rows or columns remains.
"""

from __future__ import annotations

import numpy as np
import torch

from ..buffers import AllocOut, alloc
from .batch_arrays import BatchArrays
from ..config import MetadataConfig
from ..constants import INT32_MAX

__all__ = ["fill_ngram_token_ids", "ngram_rows"]


def _window_values(b: BatchArrays, cfg: MetadataConfig, R: np.ndarray, wcu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Value of every window position and whether it is readable ([total] int64, [total] bool).

    Position ``t`` of sequence ``s`` takes ``compressed_token_ids[t]`` when ``t < Lc``: those are
    exactly the first ``comp_len[s]`` entries of the window (the batch stores them as
    ``comp_flat``), so a boolean-mask assignment of ``comp_flat`` fills them in order.
    Example: ``lo = 2``, ``seqlen_k = 6``, ``compressed = [9, 9, 5, 6]`` -> ``comp_flat`` holds
    ``[5, 6]`` and window positions 2, 3, 4, 5 take ``5, 6, lookup[R[4]], lookup[R[5]]``.
    """
    total = len(R)
    V = R.copy()
    ok = np.ones(total, bool)
    n_c = len(b.comp_flat)
    use_c = None
    if n_c:
        comp_len = b.comp_len
        assert comp_len is not None  # extract_batch sets it whenever max_ngram_size > 0 (our caller's guard)
        w_seq = np.repeat(np.arange(b.n_seq), wcu[1:] - wcu[:-1])
        use_c = (np.arange(total) - wcu[w_seq]) < comp_len[w_seq]
    table = cfg.ngram_lookup
    if table is not None:
        tab = table.detach().cpu().to(torch.int64).numpy()
        need = ~use_c if use_c is not None else slice(None)
        raw = R[need]
        in_range = (raw >= 0) & (raw < len(tab))
        ok[need] = in_range
        V[need] = tab[np.where(in_range, raw, 0)] if len(tab) else 0
    if use_c is not None:
        V[use_c] = b.comp_flat
    return V, ok


def fill_ngram_token_ids(
    b: BatchArrays, cfg: MetadataConfig, out: AllocOut
) -> torch.Tensor:
    """Build ``ngram_token_ids`` [total_q, max_ngram_size] int32 (see the module docstring).

    Worked example: N = 3, one prompt sequence, tokens ``[5, 7, IMG, 8]``, no table, no
    compressed ids, q_start = 0. Row pos 3 looks at t = 3, 2, 1: t = 3 gives 8; t = 2 and t = 1
    see the image token at 2 inside ``t..pos`` -> pad. Row pos 1: t = 1 -> 7, t = 0 -> 5,
    t = -1 -> pad.
    """
    N = cfg.max_ngram_size
    lo, wcu, R = b.tok_lo, b.tok_off, b.tok_flat  # windows [lo, seqlen_k), the batch's token layout
    total = len(R)
    V, ok = _window_values(b, cfg, R, wcu)
    pos = b.row_pos
    fpos = wcu[b.row_seq] + pos - lo[b.row_seq]  # flat window index of each row's own position
    cols = np.arange(N, dtype=np.int64)
    F = fpos[:, None] - cols
    pad = (pos[:, None] - cols) < 0
    if cfg.image_token_id is not None:
        last = np.where(R == cfg.image_token_id, np.arange(total, dtype=np.int64), -1)
        np.maximum.accumulate(last, out=last)
        pad |= F <= last[fpos][:, None]
    Fc = np.maximum(F, 0)
    if not ok[Fc][~pad].all():
        raise ValueError("ngram_lookup: a token id read by ngram_token_ids is outside the table")
    res = np.where(pad, cfg.ngram_pad_token, V[Fc])
    if res.size and (res.max() > INT32_MAX or res.min() < -INT32_MAX - 1):
        raise ValueError("ngram_token_ids: an id does not fit in int32")
    t, a = alloc(out, "ngram_token_ids", (b.total_q, N), torch.int32)
    a[:] = res
    return t


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
