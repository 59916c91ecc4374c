"""The zigzag CP mirror's compiled kernels (docs/design.md sections 8 and 17): count, fill, gather.

One call per stage over preallocated host arrays (:mod:`cpmeta.cp.mirror_plan` is the wrapper):

- :func:`mirror_count` -- checks ``cu_seqlens_q`` / ``cu_seqlens_k`` and returns ``cp_mirror_len
  = 2 * sum_s cdiv(sq_s, 2p)`` (the size the fill needs);
- :func:`mirror_fill` -- rank ``cp_rank``'s ``mirror_cp_index``, the shared
  ``mirror_cp_reverse_index`` and one ``ks``/``ke`` row per sparse ratio;
- :func:`gather_rows` -- a query-aligned field gathered by the mirror index (pad rows a fill);
- :func:`expand_segments` -- YoCo's CP indices (:mod:`cpmeta.cp.yoco_cp`): runs of
  ``start + slope * i`` from its per-sequence segment plan.

Worked example (one sequence ``sq = 10, seqlen_k = 14``, ``p = 2``, ratio 4; ``ps = cdiv(10, 4)
= 3``): rank 0 holds blocks 0 and 3 -> index ``[0, 1, 2, 9, -1, -1]``, positions ``4, 5, 6, 13``
-> ``ke = [1, 1, 1, 3, 0, 0]``; rank 1 holds blocks 1 and 2 -> ``[3, 4, 5, 6, 7, 8]``,
``ke = [2, 2, 2, 2, 3, 3]``; ``ks`` all 0 (one sequence: base 0). Reverse (both ranks):
``[0, 1, 2, 6, 7, 8, 9, 10, 11, 3]`` (row 9 sits at rank 0's mirror row 3).

A kernel never raises: it returns an ``E_*`` code and fills ``err = [code, index, value, limit]``.
"""

from __future__ import annotations

import numpy as np

from ..constants import INT32_MAX
from ..jit import OK, kernel, warmer

__all__ = ["mirror_count", "mirror_fill", "gather_rows", "expand_segments", "E_Q_START", "E_Q_NEGATIVE", "E_Q_OVERFLOW",
           "E_K_START", "E_K_NEGATIVE", "E_K_OVERFLOW", "E_SHAPE", "E_Q_GT_K"]

E_Q_START = 1  #: cu_seqlens_q is empty or does not start at 0
E_Q_NEGATIVE = 2  #: cu_seqlens_q: sequence ``err[1]`` has a negative length
E_Q_OVERFLOW = 3  #: cu_seqlens_q: total ``err[2]`` overflows int32
E_K_START = 4  #: the same three for cu_seqlens_k
E_K_NEGATIVE = 5
E_K_OVERFLOW = 6
E_SHAPE = 7  #: cu_seqlens_k has another length than cu_seqlens_q
E_Q_GT_K = 8  #: sequence ``err[1]`` has seqlen_q ``err[2]`` > seqlen_k ``err[3]``


@kernel
def _check_cu(cu: np.ndarray, code0: int, err: np.ndarray) -> int:
    """Exclusive prefix sums starting at 0, non-decreasing, total within int32; else
    ``code0 + 0 / 1 / 2`` (start, negative length of ``err[1]``, overflow of ``err[2]``)."""
    if cu.shape[0] < 1 or cu[0] != 0:
        err[0] = code0
        return code0
    for s in range(cu.shape[0] - 1):
        if cu[s + 1] < cu[s]:
            err[0], err[1] = code0 + 1, s
            return code0 + 1
    if cu[cu.shape[0] - 1] > INT32_MAX:
        err[0], err[2] = code0 + 2, cu[cu.shape[0] - 1]
        return code0 + 2
    return OK


@kernel
def mirror_count(cu_q: np.ndarray, cu_k: np.ndarray, cp_size: int, err: np.ndarray) -> int:
    """Check both prefix sums (q first, then k, then the shapes, then ``sq <= sk``) and return
    ``cp_mirror_len`` (>= 0), or ``-code`` with ``err`` filled. The ``sq > sk`` check is the last
    one, so its wrapper can check the ratios before it (the order the messages had).
    Example: ``cu_q = [0, 1, 6, 19]``, ``cp_size = 3`` -> chunks 1, 1, 3 -> ``2 * 5 = 10``."""
    code = _check_cu(cu_q, E_Q_START, err)
    if code != OK:
        return -code
    code = _check_cu(cu_k, E_K_START, err)
    if code != OK:
        return -code
    if cu_q.shape[0] != cu_k.shape[0]:
        err[0] = E_SHAPE
        return -E_SHAPE
    two_p = 2 * cp_size
    length = 0
    for s in range(cu_q.shape[0] - 1):
        sq = cu_q[s + 1] - cu_q[s]
        sk = cu_k[s + 1] - cu_k[s]
        if sq > sk:
            err[0], err[1], err[2], err[3] = E_Q_GT_K, s, sq, sk
            return -E_Q_GT_K
        length += 2 * ((sq + two_p - 1) // two_p)
    return length


@kernel
def mirror_fill(cu_q: np.ndarray, cu_k: np.ndarray, cp_size: int, cp_rank: int, ratios: np.ndarray,
                index: np.ndarray, reverse: np.ndarray, ks: np.ndarray, ke: np.ndarray,
                valid: np.ndarray) -> int:
    """Fill rank ``cp_rank``'s rows (arguments checked by :func:`mirror_count`).

    Sequence ``s`` (``sq`` rows, ``ps = cdiv(sq, 2p)``, first mirror row ``M_s``): chunk ``j``
    (0: block ``b = rank``, 1: block ``2p-1-rank``), row ``m < ps`` is local row ``b*ps + m``;
    real when ``< sq``: ``index = cu_q[s] + local``, ``pos = sk - sq + local``, per ratio ``r``
    ``ks = base_r``, ``ke = base_r + (pos + 1) // r`` with ``base_r = sum_{s'<s} max(1, sk'//r)``;
    else ``index = -1``, ``ks = ke = 0``, ``valid = False``. Reverse: block ``b`` of ``s`` sits on
    rank ``min(b, 2p-1-b)`` at ``rank * L + M_s + (b >= p) * ps``. Outputs: ``index``/``valid``
    [L], ``reverse`` [total_q], ``ks``/``ke`` [n_ratio, L], int32 (valid bool)."""
    two_p = 2 * cp_size
    length = index.shape[0]
    m_seq = 0
    for s in range(cu_q.shape[0] - 1):  # index, valid, reverse
        q0 = cu_q[s]
        sq = cu_q[s + 1] - q0
        ps = (sq + two_p - 1) // two_p
        for j in range(2):
            b = cp_rank if j == 0 else two_p - 1 - cp_rank
            row0 = m_seq + j * ps
            real = min(max(sq - b * ps, 0), ps)
            first = q0 + b * ps
            ix = index[row0:row0 + ps]  # slices indexed from 0: no negative-index test, loops vectorize
            va = valid[row0:row0 + ps]
            for m in range(real):
                ix[m] = first + m
                va[m] = True
            for m in range(real, ps):
                ix[m] = -1
                va[m] = False
        for b in range(two_p):
            start = b * ps
            stop = min(start + ps, sq)
            at = min(b, two_p - 1 - b) * length + m_seq + (ps if b >= cp_size else 0)
            rv = reverse[q0 + start:q0 + max(stop, start)]
            for m in range(stop - start):
                rv[m] = at + m
        m_seq += 2 * ps
    for i in range(ratios.shape[0]):  # ks, ke: one pass per ratio
        r = ratios[i]
        ks_i, ke_i = ks[i], ke[i]
        base = 0
        m_seq = 0
        for s in range(cu_q.shape[0] - 1):
            sq = cu_q[s + 1] - cu_q[s]
            sk = cu_k[s + 1] - cu_k[s]
            ps = (sq + two_p - 1) // two_p
            for j in range(2):
                b = cp_rank if j == 0 else two_p - 1 - cp_rank
                row0 = m_seq + j * ps
                real = min(max(sq - b * ps, 0), ps)
                # ke = base + (pos + 1) // r along pos = sk - sq + b*ps + m: one division per chunk
                nxt = sk - sq + b * ps + 1
                v, rem = base + nxt // r, nxt % r
                kss = ks_i[row0:row0 + ps]
                kes = ke_i[row0:row0 + ps]
                for m in range(real):
                    kss[m] = base
                    kes[m] = v
                    rem += 1
                    if rem == r:
                        rem = 0
                        v += 1
                for m in range(real, ps):
                    kss[m] = 0
                    kes[m] = 0
            base += max(1, sk // r)
            m_seq += 2 * ps
    return OK


@kernel
def gather_rows(full: np.ndarray, index: np.ndarray, pad: np.ndarray, out: np.ndarray) -> int:
    """``out[m] = full[index[m]]`` (a row of any width), ``pad[0]`` in every element where
    ``index[m] < 0``; the arrays are same-size integer views (``uint8``/``int16``/``int32``/
    ``int64``) of the field, ``[rows, width]``. Returns 0, or ``m + 1`` for the first entry
    reading past ``full``'s rows (nothing written). Example: ``full = [[10], [11], [12], [13]]``,
    ``index = [3, -1, 0]``, ``pad = [0]`` -> ``[[13], [0], [10]]``."""
    rows = full.shape[0]
    for m in range(index.shape[0]):
        if index[m] >= rows:
            return m + 1
    width = out.shape[1]
    fill = pad[0]
    if width == 1:
        src, dst = full[:, 0], out[:, 0]
        for m in range(index.shape[0]):
            g = index[m]
            dst[m] = fill if g < 0 else src[g]
        return OK
    for m in range(index.shape[0]):
        g = index[m]
        if g < 0:
            for c in range(width):
                out[m, c] = fill
        else:
            for c in range(width):
                out[m, c] = full[g, c]
    return OK


@kernel
def expand_segments(length: np.ndarray, start: np.ndarray, slope: np.ndarray, out: np.ndarray) -> int:
    """Segment ``g`` writes ``start[g] + slope[g] * i`` for ``i < length[g]`` after the previous
    segments; ``out`` holds ``sum(length)`` entries (else, or for a negative length, returns 1
    and writes nothing). Example: ``(2, 7, 1), (1, -1, 0), (3, 0, 1)`` -> ``[7, 8, -1, 0, 1, 2]``."""
    k = 0
    for g in range(length.shape[0]):
        if length[g] < 0:
            return 1
        k += length[g]
    if k != out.shape[0]:
        return 1
    k = 0
    for g in range(length.shape[0]):
        v, step = start[g], slope[g]
        for _ in range(length[g]):
            out[k] = v
            v += step
            k += 1
    return OK


@warmer
def _warm() -> None:
    """Each kernel once on the worked example (``sq = 10, sk = 14, p = 2``, ratio 4), gathers in
    the four element sizes."""
    i64 = np.int64
    cu_q, cu_k, err = np.array([0, 10], i64), np.array([0, 14], i64), np.zeros(4, i64)
    length = mirror_count(cu_q, cu_k, 2, err)
    index, valid = np.empty(length, np.int32), np.empty(length, np.bool_)
    ks, ke = np.empty((1, length), np.int32), np.empty((1, length), np.int32)
    mirror_fill(cu_q, cu_k, 2, 0, np.array([4], i64), index, np.empty(10, np.int32), ks, ke, valid)
    expand_segments(np.array([2, 1, 3], i64), np.array([7, -1, 0], i64), np.array([1, 0, 1], i64),
                    np.empty(6, np.int32))
    for dt in (np.uint8, np.int16, np.int32, np.int64):
        gather_rows(np.zeros((10, 1), dt), index, np.zeros(1, dt), np.empty((length, 1), dt))
