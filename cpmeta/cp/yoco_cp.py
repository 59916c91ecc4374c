"""Compact + CP redistribution indices of YoCo (docs/design.md section 10), behind ``yoco.mirror_yoco``.

With YoCo compact mode under context parallelism the producer layers run on the zigzag mirror of
the FULL rows, the consumer layers on the zigzag mirror of the KEPT (compact) rows. One
all-gather moves the kept rows between the two layouts::

    all_gather(full_mirror_rows[yoco_cp_contrib_index])[yoco_cp_boundary_index] == compact_rows

Everything here is planned per sequence on the host (numpy, ``n_seq``-sized arrays) and expanded
into rows as runs of consecutive values, so the cost is ``O(contrib_pad_len + compact mirror
rows)``, independent of the full ``total_q``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .mirror_njit import expand_segments


if TYPE_CHECKING:
    from ..metadata import InputMetadata

__all__ = ["mirror_yoco"]

logger = logging.getLogger(__name__)

_I32 = torch.int32


def _kept_per_block(q_len: np.ndarray, clip: np.ndarray, cp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``ps = cdiv(q_len, 2p)`` [n_seq] and kept rows per zigzag block ``K`` [n_seq, 2p] (int64).

    ``K[s, b] = max(min(ps*(b+1), q_len) - max(ps*b, clip), 0)``. Example ``q_len = 10``,
    ``clip = 5``, ``p = 2``: ``ps = 3``, blocks ``[0,3) [3,6) [6,9) [9,10)`` -> ``K = [0, 1, 3, 1]``.
    """
    two_p = 2 * cp_size
    ps = (q_len + two_p - 1) // two_p
    b = np.arange(two_p)
    lo = np.maximum(ps[:, None] * b, clip[:, None])
    hi = np.minimum(ps[:, None] * (b + 1), q_len[:, None])
    return ps, np.maximum(hi - lo, 0)


def _expand_segments(plan: np.ndarray, total: int, device: torch.device) -> torch.Tensor:
    """Concatenate segments ``start + slope * arange(length)``; ``plan`` [3, n_seg] int64 rows
    ``(length, start, slope)``. Returns int32 ``[total]`` on ``device``: ONE compiled call
    (:func:`cpmeta.cp.mirror_njit.expand_segments`) on the host, copied to a device. Example:
    ``(2, 7, 1), (1, -1, 0), (3, 0, 1)`` -> ``[7, 8, -1, 0, 1, 2]``.
    """
    length, start, slope = (np.ascontiguousarray(row) for row in plan)
    out = np.empty(total, np.int32)
    if expand_segments(length, start, slope, out):
        raise RuntimeError(f"yoco segment plan: lengths {length.tolist()[:8]} do not fill {total} rows")
    return torch.from_numpy(out).to(device)


def _boundary_value(l: np.ndarray, a: dict[str, Any], cp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Boundary entry of kept full-local rows ``l`` [n_seq, 2] and the end of their full block.

    The row lives in block ``blk = l // ps`` on rank ``owner = min(blk, 2p-1-blk)``, which sends
    its kept rows in full-mirror order: earlier sequences (``off``), then its early chunk, then its
    late chunk. Entry = ``owner * pad_len + off[s, owner] + (late ? K[s, owner] : 0) + l -
    max(ps*blk, clip)``; consecutive rows of one block have consecutive entries.
    """
    two_p = 2 * cp_size
    ps = a["ps"][:, None]
    blk = np.minimum(l // ps, two_p - 1)  # clamped: only reached by empty segments
    late = blk >= cp_size
    owner = np.where(late, two_p - 1 - blk, blk)
    value = (owner * a["pad_len"] + np.take_along_axis(a["off"], owner, 1)
             + np.where(late, np.take_along_axis(a["kept"], owner, 1), 0)
             + l - np.maximum(ps * blk, a["clip"][:, None]))
    return value, (blk + 1) * ps


def _cp_plans(cu_q: np.ndarray, cu_c: np.ndarray, cp_rank: int, cp_size: int) -> dict[str, Any]:
    """Host plans of :func:`mirror_yoco`: ``pad_len``, ``mirror_len_c`` and the contrib / boundary
    segment tables ([3, n_seg] rows ``(length, start, slope)``) of rank ``cp_rank``.

    Per-sequence arrays are ``[n_seq, 2]``: column 0 this rank's early chunk (block ``r``),
    column 1 its late chunk (block ``2p-1-r``), in sequence-major order like the mirror rows.
    """
    q_len, keep_len = np.diff(cu_q), np.diff(cu_c)
    clip = q_len - keep_len
    two_p, n_seq = 2 * cp_size, q_len.shape[0]
    ps, kept = _kept_per_block(q_len, clip, cp_size)
    ranks = np.arange(cp_size)
    per_rank_seq = kept[:, ranks] + kept[:, two_p - 1 - ranks]  # [n_seq, p]
    a = dict(ps=ps, kept=kept, clip=clip, pad_len=int(per_rank_seq.sum(0).max()),
             off=np.cumsum(per_rank_seq, 0) - per_rank_seq)
    blocks = np.array([cp_rank, two_p - 1 - cp_rank])  # [2]
    ps2, clip2 = ps[:, None], clip[:, None]
    m_seq = (np.cumsum(2 * ps) - 2 * ps)[:, None]  # first full-mirror row of each sequence
    contrib = np.empty((3, n_seq, 2), np.int64)
    contrib[0] = kept[:, blocks]
    contrib[1] = m_seq + np.arange(2) * ps2 + np.maximum(ps2 * blocks, clip2) - ps2 * blocks
    contrib[2] = 1
    # compact mirror rows: chunk (s, slot) holds compact locals ps_c*b + [0, ps_c), real below keep_len;
    # their full locals l0 + i may cross one full block boundary -> pieces A, B, then pad rows
    ps_c = ((keep_len + two_p - 1) // two_p)[:, None]
    vlen = np.clip(keep_len[:, None] - ps_c * blocks, 0, ps_c)
    l0 = clip2 + ps_c * blocks
    boundary = np.empty((3, n_seq, 2, 3), np.int64)  # (length, start, slope) x (A, B, pad)
    val_a, end_a = _boundary_value(l0, a, cp_size)
    len_a = np.minimum(vlen, np.maximum(end_a - l0, 0))
    boundary[1, :, :, 1], _ = _boundary_value(l0 + len_a, a, cp_size)
    boundary[0, :, :, 0], boundary[0, :, :, 1], boundary[0, :, :, 2] = len_a, vlen - len_a, ps_c - vlen
    boundary[1, :, :, 0], boundary[1, :, :, 2] = val_a, -1
    boundary[2, :, :, :2], boundary[2, :, :, 2] = 1, 0
    return dict(pad_len=a["pad_len"], mirror_len_c=int(2 * ps_c.sum()), contrib=contrib.reshape(3, -1),
                contrib_len=int(per_rank_seq[:, cp_rank].sum()), boundary=boundary.reshape(3, -1))


def mirror_yoco(md_full: InputMetadata, md_mirrored: InputMetadata, cp_rank: int, cp_size: int) -> InputMetadata:
    """Add the compact + CP fields of rank ``cp_rank`` to ``md_mirrored`` (a new object).

    ``md_full`` is the un-mirrored prompt metadata, ``md_mirrored`` its mirrored copy from
    ``prepare_for_mirror_cp``. Without compact YoCo fields ``md_mirrored`` is returned as is (mask
    pivots, like ``kv_swa_full_index_pivots``, stay in the full layout). Otherwise adds, with
    ``p = cp_size``, ``ps = cdiv(q_len, 2p)``, ``clip = q_len - keep_len`` and ``K`` of
    :func:`_kept_per_block`:

    - ``yoco_consumer_cp_mirror_len = 2 * sum_s cdiv(keep_len, 2p)``;
    - ``yoco_consumer_cp_contrib_pad_len = max_r sum_s (K[s, r] + K[s, 2p-1-r])``;
    - ``yoco_cp_contrib_index`` int32 ``[contrib_pad_len]``: positions in this rank's full-mirror
      rows of the kept rows, ascending, -1 padded;
    - ``yoco_cp_boundary_index`` int32 ``[yoco_consumer_cp_mirror_len]``: for each compact-mirror
      row, ``r' * contrib_pad_len + k`` where the row is the ``k``-th contribution of rank ``r'``.

    The plan is per sequence on the host (one tiny copy of the two ``cu_seqlens``); rows are
    expanded as runs of consecutive values, so the cost is ``O(contrib_pad_len + mirror_len_c)``.

    Worked example: one sequence, ``q_len = 10``, ``clip = 5`` (kept rows 5..9), ``p = 2``:
    ``K = [0, 1, 3, 1]``; rank 0 keeps 1 row (9), rank 1 keeps 4 (5, 6, 7, 8) -> pad len 4.
    Full mirror rank 0 ``[0,1,2,9,-,-]`` -> contrib ``[3,-1,-1,-1]``; rank 1 ``[3,4,5,6,7,8]`` ->
    ``[2,3,4,5]``; gathered contributions ``[9,-,-,-,5,6,7,8]``. Compact rows 0..4 = full rows
    5..9, ``ps_c = 2``: rank 0 holds ``[5,6,-,-]`` -> boundary ``[4,5,-1,-1]``; rank 1 holds
    ``[7,8,9,-]`` -> ``[6,7,0,-1]`` (rows 7, 8 in block 2 of rank 1, row 9 in block 3 of rank 0).
    """
    if md_full.yoco_consumer_cu_seqlens_q is None:
        return md_mirrored
    # prepare_for_mirror_cp checked md_full's cu_seqlens_q and set md_mirrored's mirror_cp_index
    assert md_full.cu_seqlens_q is not None and md_mirrored.mirror_cp_index is not None
    dev = md_mirrored.mirror_cp_index.device
    cu_q = md_full.cu_seqlens_q.cpu().numpy().astype(np.int64)
    cu_c = md_full.yoco_consumer_cu_seqlens_q.cpu().numpy().astype(np.int64)
    if cu_c.shape != cu_q.shape or bool((np.diff(cu_c) < 1).any()) or bool((np.diff(cu_c) > np.diff(cu_q)).any()):
        raise ValueError("yoco_consumer_cu_seqlens_q: expected 1 <= keep_len <= seqlen_q for every sequence")
    plans = _cp_plans(cu_q, cu_c, cp_rank, cp_size)
    pad_len = plans["pad_len"]
    contrib = torch.full((pad_len,), -1, dtype=_I32, device=dev)
    contrib[: plans["contrib_len"]] = _expand_segments(plans["contrib"], plans["contrib_len"], dev)
    boundary = _expand_segments(plans["boundary"], plans["mirror_len_c"], dev)
    logger.debug("yoco cp rank %d/%d: %d compact mirror rows, contrib pad %d",
                 cp_rank, cp_size, plans["mirror_len_c"], pad_len)
    return md_mirrored.replace(
        yoco_consumer_cp_mirror_len=plans["mirror_len_c"],
        yoco_consumer_cp_contrib_pad_len=pad_len,
        yoco_cp_contrib_index=contrib,
        yoco_cp_boundary_index=boundary,
    )
