"""The ONE SWA visibility rule of prompt rows: pivots ``(P0, P1, P2, P3)`` (DESIGN sections 4, 10).

``prepare_prompt`` uses it for ``kv_swa_full_index_pivots`` (lower bound ``swa_valid_start``) and
the YoCo builder for its narrowed pivots (lower bound ``max(rect_lo, swa_valid_start)``), so the
two can never disagree on what a row sees.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np
import torch

__all__ = ["swa_visibility_pivots", "NUM_PIVOTS"]

#: Pivot columns (P0, P1, P2, P3) of one row.
NUM_PIVOTS: int = 4

#: numpy array (CPU builder) or torch tensor (any device).
Arr = Union[np.ndarray, torch.Tensor]


def swa_visibility_pivots(
    pos: Arr,
    local: Arr,
    q_start: Arr,
    lower: Arr,
    sec1_start: Arr,
    sec2_start: Arr,
    window: int,
    *,
    out: Optional[Arr] = None,
) -> Arr:
    """SWA pivots ``(P0, P1, P2, P3)`` of prompt rows (DESIGN sections 4 and 10).

    Inputs are per-row int64 arrays of one shape ``[rows]``, all numpy or all torch (one
    device): ``pos`` absolute position, ``local`` the row's index ``j`` in its chunk
    (``pos = q_start + j``), ``q_start`` its sequence's first query position, ``lower`` the extra
    lower bound on visible keys (``swa_valid_start``; with YoCo ``max(rect_lo, swa_valid_start)``),
    ``sec1_start = s*W`` and ``sec2_start = n_seq*W + cu_seqlens_q[s]``. Returns ``[rows, 4]``
    (int32 when allocated here; written into ``out`` -- an int32 array/tensor -- when given)::

        abs_lo    = clamp(max(pos - W + 1, lower), 0, pos + 1)     # pos + 1: nothing visible
        sec1_lo   = min(abs_lo, q_start);  start_slot = sec1_lo - (q_start - W)
        P0 = sec1_start + start_slot;      P1 = W - start_slot     # history rows
        k_lo      = max(0, abs_lo - q_start)
        P2 = sec2_start + k_lo;            P3 = j - k_lo + 1       # this chunk's rows

    Worked example: ``W = 4``, sequence 1 of 2 (``sec1_start = 4``), ``q_start = 5``,
    ``cu_seqlens_q[1] = 3`` (``sec2_start = 2*4 + 3 = 11``), row ``j = 1`` (``pos = 6``):
    ``lower = 0``: ``abs_lo = 3``, ``start_slot = 3 - 1 = 2`` -> ``P0 = 6, P1 = 2``
    (history positions 3, 4), ``k_lo = 0`` -> ``P2 = 11, P3 = 2`` (positions 5, 6).
    ``lower = 6`` (the rectangle starts at 6): ``abs_lo = 6``, ``start_slot = 4`` ->
    ``P0 = 8, P1 = 0``; ``k_lo = 1`` -> ``P2 = 12, P3 = 1`` (position 6 only).
    ``lower = 9`` (row before the rectangle): ``abs_lo = 7`` -> ``P1 = 0, P3 = 0``.
    """
    xp: Any = torch if isinstance(pos, torch.Tensor) else np
    abs_lo = xp.minimum(xp.maximum(pos - (window - 1), lower).clip(min=0), pos + 1)
    start_slot = xp.minimum(abs_lo, q_start) - (q_start - window)
    k_lo = (abs_lo - q_start).clip(min=0)
    if out is None:
        out = (torch.empty((pos.shape[0], NUM_PIVOTS), dtype=torch.int32, device=pos.device) if xp is torch
               else np.empty((pos.shape[0], NUM_PIVOTS), np.int32))
    out[:, 0] = sec1_start + start_slot
    out[:, 1] = window - start_slot
    out[:, 2] = sec2_start + k_lo
    out[:, 3] = local - k_lo + 1
    return out
