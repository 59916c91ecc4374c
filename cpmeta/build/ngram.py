"""Engram look-back ids ``ngram_token_ids`` [total_q, max_ngram_size] (DESIGN section 4), vectorized.

For query row at absolute position ``pos`` and column ``c`` the look-back position is ``t = pos - c``:
pad if ``t < 0`` or any token at positions ``t..pos`` is the image sentinel; else
``compressed_token_ids[t]`` if ``t < len(compressed_token_ids)``, else ``ngram_lookup[token_at(t)]``
(identity without a table). ``token_at`` reads ``token_ids`` then (decode) ``draft_tokens``.

Method: per sequence, the positions any row can look at form one window ``[lo, seqlen_k)`` with
``lo = max(0, q_start - (N - 1))``. All windows are concatenated into one flat array of raw
tokens ``R`` and one of values ``V`` (compressed id or looked-up id). A running maximum of "index
of the last image token" over ``R`` answers "is there an image token in ``t..pos``" for every
(row, column) with one comparison, so no loop over rows or columns remains.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Optional

import numpy as np
import torch

from .arrays import BatchArrays, alloc, int_array
from ..config import MetadataConfig
from ..constants import INT32_MAX

__all__ = ["fill_ngram_token_ids"]

_TOK = attrgetter("token_ids")
_DRAFT = attrgetter("draft_tokens")
_COMP = attrgetter("compressed_token_ids")


def _raw_windows(b: BatchArrays, lo: list[int], hi: list[int], total: int) -> np.ndarray:
    """Raw token ids of every window ``[lo[s], hi[s])`` back to back ([total] int64).

    Decode: ``token_ids`` covers positions ``0..q_start`` and the drafts ``q_start+1..``, so the
    window is ``token_ids[lo:] + draft_tokens``.
    """
    toks = list(map(_TOK, b.seqs))
    if b.is_prompt:
        parts = [t[a:e] for t, a, e in zip(toks, lo, hi)]
    else:
        drafts = map(_DRAFT, b.seqs)
        parts = [x for t, d, a in zip(toks, drafts, lo) for x in (t[a:], d)]
    return int_array(parts, total)


def _window_values(
    b: BatchArrays, cfg: MetadataConfig, R: np.ndarray, lo: np.ndarray, wcu: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Value of every window position and whether it is readable ([total] int64, [total] bool).

    Position ``t`` of sequence ``s`` takes ``compressed_token_ids[t]`` when ``t < Lc``: those are
    exactly the first ``cl[s] = max(0, min(Lc, seqlen_k) - lo)`` entries of the window, so a
    boolean-mask assignment of the concatenated compressed slices fills them in order.
    Example: ``lo = 2``, ``seqlen_k = 6``, ``compressed = [9, 9, 5, 6]`` -> window positions
    2, 3, 4, 5 take ``5, 6, lookup[R[4]], lookup[R[5]]``.
    """
    n, total = b.n_seq, len(R)
    comps = list(map(_COMP, b.seqs))
    ce = np.minimum(np.array(list(map(len, comps)), np.int64), b.seqlen_k)
    cl = np.maximum(ce - lo, 0)
    w_seq = np.repeat(np.arange(n), wcu[1:] - wcu[:-1])
    use_c = (np.arange(total) - wcu[w_seq]) < cl[w_seq]
    V = R.copy()
    ok = np.ones(total, bool)
    table = cfg.ngram_lookup
    if table is not None:
        tab = table.detach().cpu().to(torch.int64).numpy()
        need = ~use_c
        raw = R[need]
        in_range = (raw >= 0) & (raw < len(tab))
        ok[need] = in_range
        V[need] = tab[np.where(in_range, raw, 0)] if len(tab) else 0
    n_c = int(cl.sum())
    if n_c:
        parts = [c[a:e] for c, a, e in zip(comps, lo.tolist(), ce.tolist())]
        V[use_c] = int_array(parts, n_c)
    return V, ok


def fill_ngram_token_ids(
    b: BatchArrays, cfg: MetadataConfig, out: Optional[dict[str, torch.Tensor]]
) -> torch.Tensor:
    """Build ``ngram_token_ids`` [total_q, max_ngram_size] int32 (see the module docstring).

    Worked example: N = 3, one prompt sequence, tokens ``[5, 7, IMG, 8]``, no table, no
    compressed ids, q_start = 0. Row pos 3 looks at t = 3, 2, 1: t = 3 gives 8; t = 2 and t = 1
    see the image token at 2 inside ``t..pos`` -> pad. Row pos 1: t = 1 -> 7, t = 0 -> 5,
    t = -1 -> pad.
    """
    N = cfg.max_ngram_size
    lo = np.maximum(b.q_start - (N - 1), 0)
    wl = b.seqlen_k - lo
    wcu = np.zeros(b.n_seq + 1, np.int64)
    np.cumsum(wl, out=wcu[1:])
    total = int(wcu[-1])
    R = _raw_windows(b, lo.tolist(), b.seqlen_k.tolist(), total)
    V, ok = _window_values(b, cfg, R, lo, wcu)
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
