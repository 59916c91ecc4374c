"""Prompt load plans ``[num_segments, 4]`` int32 (DESIGN section 4), vectorized over sequences.

A segment is ``[src_block, src_begin, src_end, dst_offset]``: copy rows ``src_begin..src_end`` of
block / ring ``src_block`` to ``dst_offset`` of a contiguous buffer; ``src_block = -1`` zero-fills
``src_end - src_begin`` rows. The number of segments per sequence is computed first; segments are
then emitted with ``np.repeat`` (paged plan) or a fixed ``[n_seq, 3, 4]`` candidate array and a
boolean emit mask (SWA plan, at most 3 segments per sequence) -- never a Python loop over segments.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..buffers import alloc
from .batch_arrays import BatchArrays
from .int_ops import cdiv
from ..config import MetadataConfig
from ..constants import NO_SOURCE_BLOCK

__all__ = ["swa_load_segments", "paged_load_segments"]

SEGMENT_WIDTH = 4  # [src_block, src_begin, src_end, dst_offset]


def swa_load_segments(
    b: BatchArrays, cfg: MetadataConfig, out: Optional[dict[str, torch.Tensor]]
) -> torch.Tensor:
    """``load_segments_swa``: copy each sequence's last ``W`` history keys from its SWA ring.

    History of sequence s is positions ``[q_start - W, q_start)`` -> buffer rows ``s*W ..``;
    ``pad = clamp(swa_valid_start - (q_start - W), 0, W)`` leading rows are zero-filled; the ring
    range ``[q_start - W + pad, q_start)`` (length <= W <= S, so at most one wrap) reads slots
    ``a % S ..``, split at slot S. Worked example: W = S = 8, state 2, q_start = 11,
    swa_valid_start 0, s = 1: history 3..10, pad 0, a = 3, ring slots 3..8 then 0..2 ->
    ``[2, 3, 8, 8]`` and ``[2, 0, 3, 13]``. With q_start = 5 instead: pad = 3 ->
    ``[-1, 0, 3, 8]`` then ``[2, 0, 5, 11]``.
    """
    W, S, n = cfg.window_size, cfg.swa_block_size, b.n_seq
    hist_begin = b.q_start - W
    pad = np.clip(b.swa_valid_start - hist_begin, 0, W)
    a = hist_begin + pad  # first valid position (>= 0)
    length = b.q_start - a
    a_mod = a % S
    first = np.minimum(length, S - a_mod)
    second = length - first
    dst = np.arange(n, dtype=np.int64) * W
    cand = np.empty((n, 3, SEGMENT_WIDTH), np.int64)
    cand[:, 0, 0], cand[:, 0, 1], cand[:, 0, 2], cand[:, 0, 3] = NO_SOURCE_BLOCK, 0, pad, dst
    cand[:, 1, 0], cand[:, 1, 1], cand[:, 1, 2], cand[:, 1, 3] = b.state_id, a_mod, a_mod + first, dst + pad
    cand[:, 2, 0], cand[:, 2, 1], cand[:, 2, 2] = b.state_id, 0, second
    cand[:, 2, 3] = dst + pad + first
    emit = np.stack([pad > 0, first > 0, second > 0], axis=1)
    segs = cand[emit]
    t, arr = alloc(out, "load_segments_swa", (len(segs), SEGMENT_WIDTH), torch.int32)
    arr[:] = segs
    return t


def paged_load_segments(
    b: BatchArrays, cfg: MetadataConfig, n: int, dst_base: np.ndarray,
    out: Optional[dict[str, torch.Tensor]],
) -> torch.Tensor:
    """``load_segments_ca[n]``: load the ``m = seqlen_k // n`` compressed tokens of each sequence.

    ``[0, m)`` is split at block boundaries (a block holds ``b_c = block_size // n`` compressed
    tokens): segment k is ``[block_table[k], 0, min(b_c, m - k*b_c), dst_base[s] + k*b_c]``;
    ``m == 0`` emits one zero row ``[-1, 0, 1, dst_base[s]]``. ``dst_base`` [n_seq] int64 is
    ``cu_compressed_seqlens_k[n][:-1]``. Worked example: b_c = 32, m = 70, table ``[9, 4, 6]``,
    dst_base 5 -> ``[9, 0, 32, 5]``, ``[4, 0, 32, 37]``, ``[6, 0, 6, 69]``.
    """
    bc = cfg.block_size // n
    m = b.seqlen_k // n
    nseg = np.maximum(cdiv(m, bc), 1)
    cu = np.zeros(b.n_seq + 1, np.int64)
    np.cumsum(nseg, out=cu[1:])
    seq = np.repeat(np.arange(b.n_seq), nseg)
    k = np.arange(int(cu[-1]), dtype=np.int64) - cu[seq]
    m_s = m[seq]
    empty = m_s == 0
    t, arr = alloc(out, f"load_segments_ca.{n}", (len(seq), SEGMENT_WIDTH), torch.int32)
    bt_flat, bt_start = b.bt_flat, b.bt_start
    # prompt only: extract_batch leaves the flat tables None only for prepare_decode (flat_tables=False)
    assert bt_flat is not None and bt_start is not None
    # an empty sequence has k = 0 and reads bt_flat[bt_start], always in bounds (trailing 0)
    arr[:, 0] = np.where(empty, NO_SOURCE_BLOCK, bt_flat[bt_start[seq] + k])
    arr[:, 1] = 0
    arr[:, 2] = np.where(empty, 1, np.minimum(bc, m_s - k * bc))
    arr[:, 3] = dst_base[seq] + k * bc
    return t
