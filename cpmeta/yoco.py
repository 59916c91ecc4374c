"""YoCo prefill truncation: two views of one prompt metadata (DESIGN section 10).

Consumer layers see only the last ``k = cfg.yoco_keep_tokens`` tokens of the whole prompt, yet each
kept row must compute exactly what it would compute without truncation. Per sequence ``s``::

    data_len = len(token_ids)            # the WHOLE prompt (not just what is cached)
    rect_lo  = max(0, data_len - k)      # first position consumer layers keep
    chunk    = [q_start, q_start + q_len),  q_start = seqlen_k - seqlen_q,  q_len = seqlen_q

One visibility rule serves both modes (:func:`swa_visibility_pivots`): row ``j`` at ``pos =
q_start + j`` sees SWA keys from ``abs_lo = clamp(max(pos - W + 1, rect_lo, swa_valid_start), 0,
pos + 1)`` to ``pos``, written as the section-4 pivots ``(P0, P1, P2, P3)``.

- ``mask`` mode keeps every row and only narrows visibility: ``yoco_mask_swa_index_pivots``;
  :func:`get_mask_view` swaps them in.
- ``compact`` mode drops the rows before the rectangle (keeping at least the last row of each
  chunk): ``clip_prefix = clamp(data_len - k - q_start, 0, q_len - 1)``, kept local rows
  ``[clip_prefix, q_len)``. The ``yoco_consumer_*`` fields hold the kept rows;
  :func:`get_consumer_view` swaps them in.

Worked example (``W = 4``, ``k = 6``, one sequence with a 10-token prompt, this chunk ``q_start = 2,
q_len = 6``, so rows at positions 2..7; ``rect_lo = 4``)::

    pos               2  3  4  5  6  7
    clip_prefix = clamp(10 - 6 - 2, 0, 5) = 2   -> kept rows j = 2..5 (positions 4..7)
    abs_lo (mask)     3  4  4  4  4  4    (max(pos - 3, 4) clamped to pos + 1 for pos 2, 3)
    visible keys      -  -  4  4..5  4..6  4..7

Compact + CP (compact FIRST, then mirror; :func:`mirror_yoco` in ``_yoco_cp.py``, called by
``prepare_for_mirror_cp``): the consumer rows are zigzag-mirrored on their own compact layout
(``prepare_cp_mirror(yoco_consumer_cu_seqlens_q, ORIGINAL cu_seqlens_k, ...)``), and
``yoco_cp_contrib_index`` / ``yoco_cp_boundary_index`` move the kept rows from the full-mirror
layout to the compact-mirror layout with one all-gather::

    all_gather(full_mirror_rows[yoco_cp_contrib_index])[yoco_cp_boundary_index] == compact_rows

Views are shallow copies (``md.replace``): replaced fields are swapped in, derived fields cleared,
every other field is the SAME object; nothing is ever written through a view.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from operator import attrgetter
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from .config import MetadataConfig
from .constants import PAD_SLOT_ID, PLACEHOLDER_QUERY_INDEX
from .metadata import InputMetadata, get_or_create_tensor
from .mirror import NO_SPARSE_RATIOS_FALLBACK, mirror_rows, prepare_cp_mirror
from .sequence import SequenceMetadata
from ._yoco_cp import mirror_yoco  # compact + CP indices (called by prepare_for_mirror_cp)

__all__ = [
    "swa_visibility_pivots",
    "build_yoco_fields",
    "get_mask_view",
    "get_consumer_view",
    "mirror_yoco",
    "yoco_clip_prefix",
    "YOCO_MASK_FIELDS",
    "YOCO_COMPACT_FIELDS",
    "YOCO_CP_FIELDS",
    "CONSUMER_CLEARED_FIELDS",
]

logger = logging.getLogger(__name__)

#: Field filled by ``prepare_prompt`` in mask mode.
YOCO_MASK_FIELDS: tuple[str, ...] = ("yoco_mask_swa_index_pivots",)

#: Fields filled by ``prepare_prompt`` in compact mode.
YOCO_COMPACT_FIELDS: tuple[str, ...] = (
    "yoco_consumer_cu_seqlens_q",
    "yoco_consumer_total_q",
    "yoco_consumer_query_indices",
    "yoco_consumer_positions",
    "yoco_consumer_slot_mapping_store_swa",
    "yoco_consumer_ks",
    "yoco_consumer_ke",
    "yoco_consumer_kv_ca_index_offset_len",
    "yoco_consumer_kv_swa_full_index_pivots",
)

#: Fields added by ``prepare_for_mirror_cp`` (through :func:`mirror_yoco`) on compact metadata.
YOCO_CP_FIELDS: tuple[str, ...] = (
    "yoco_consumer_cp_mirror_len",
    "yoco_consumer_cp_contrib_pad_len",
    "yoco_cp_contrib_index",
    "yoco_cp_boundary_index",
)

#: Derived fields a consumer view resets so ``compute_attn_info`` re-expands them on its rows.
CONSUMER_CLEARED_FIELDS: tuple[str, ...] = ("kv_ca_index", "kv_ca_index_len", "klen", "kv_swa_full_index")

#: Pivot columns (P0, P1, P2, P3) of one row.
_NUM_PIVOTS: int = 4

_I32 = torch.int32
_I64 = torch.int64
_TOKENS = attrgetter("token_ids")
_VALID_START = attrgetter("swa_valid_start")

#: numpy array (CPU builder) or torch tensor (any device).
Arr = Union[np.ndarray, torch.Tensor]
#: A prompt ``InputMetadata`` or the dict of its constructor arguments.
Fields = Union[InputMetadata, Mapping[str, Any]]


# ---- the ONE visibility rule --------------------------------------------------------------------


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
        out = (torch.empty((pos.shape[0], _NUM_PIVOTS), dtype=_I32, device=pos.device) if xp is torch
               else np.empty((pos.shape[0], _NUM_PIVOTS), np.int32))
    out[:, 0] = sec1_start + start_slot
    out[:, 1] = window - start_slot
    out[:, 2] = sec2_start + k_lo
    out[:, 3] = local - k_lo + 1
    return out


# ---- build (called by prepare_prompt) ----------------------------------------------------------


def yoco_clip_prefix(data_len: Arr, q_start: Arr, q_len: Arr, keep: int) -> Arr:
    """Rows cut from the front of each chunk: ``clamp(data_len - k - q_start, 0, q_len - 1)``.

    Per-sequence int64 arrays ``[n_seq]`` (numpy or torch) in, same kind out. At least one row
    (the chunk's last) is always kept. Example ``k = 6``: prompt 10, chunk ``[2, 8)`` -> 2 rows
    cut; prompt 10, chunk ``[0, 3)`` (entirely before ``rect_lo = 4``) -> 2 (only row 2 kept);
    prompt 5 (``k`` larger than the prompt) -> 0.
    """
    xp: Any = torch if isinstance(q_len, torch.Tensor) else np
    return xp.minimum((data_len - keep - q_start).clip(min=0), q_len - 1)


def _alloc(out: Optional[dict[str, torch.Tensor]], name: str, shape: tuple[int, ...],
           dtype: torch.dtype = _I32) -> tuple[torch.Tensor, np.ndarray]:
    """``get_or_create_tensor`` plus its numpy view (same CPU memory)."""
    t = get_or_create_tensor(out, name, shape, dtype)
    return t, t.numpy()


def _get(md: Fields, name: str) -> Any:
    return md[name] if isinstance(md, Mapping) else getattr(md, name)


def _seq_arrays(md: Fields, seqs: Sequence[SequenceMetadata], keep: int) -> dict[str, Any]:
    """Per-sequence int64 numpy arrays the YoCo fields need (one pass over ``seqs``)."""
    n_seq = len(seqs)
    cu_q = _get(md, "cu_seqlens_q").numpy().astype(np.int64)
    cu_k = _get(md, "cu_seqlens_k").numpy().astype(np.int64)
    if cu_q.shape[0] != n_seq + 1:
        raise ValueError(f"seqs: expected {cu_q.shape[0] - 1} sequences like md.cu_seqlens_q, got {n_seq}")
    q_len = np.diff(cu_q)
    q_start = np.diff(cu_k) - q_len
    data_len = np.fromiter(map(len, map(_TOKENS, seqs)), np.int64, n_seq)
    short = np.flatnonzero(data_len < q_start + q_len)
    if short.size:
        i = int(short[0])
        raise ValueError(
            f"seqs[{i}].token_ids: YoCo needs the whole prompt (at least seqlen_k = "
            f"{int(q_start[i] + q_len[i])} tokens), got {int(data_len[i])}"
        )
    valid_start = np.fromiter(map(_VALID_START, seqs), np.int64, n_seq)
    rect_lo = np.maximum(data_len - keep, 0)
    return dict(
        n_seq=n_seq, cu_q=cu_q, q_len=q_len, q_start=q_start, rect_lo=rect_lo,
        lower=np.maximum(rect_lo, valid_start),
        clip=yoco_clip_prefix(data_len, q_start, q_len, keep),
    )


def _pivots_for_rows(a: dict[str, Any], row_seq: np.ndarray, local: np.ndarray, window: int,
                     out: np.ndarray) -> None:
    """YoCo pivots of the rows ``(row_seq, local)`` (int64 ``[rows]`` each) into ``out``."""
    q_start = a["q_start"][row_seq]
    swa_visibility_pivots(
        q_start + local, local, q_start, a["lower"][row_seq],
        row_seq * window, a["n_seq"] * window + a["cu_q"][row_seq], window, out=out,
    )


def build_yoco_fields(
    md: Fields,
    seqs: Sequence[SequenceMetadata],
    cfg: MetadataConfig,
    *,
    out: Optional[dict[str, torch.Tensor]] = None,
) -> dict[str, Any]:
    """The section-10 fields of ``cfg.yoco_mode`` for prompt metadata built from ``seqs``.

    ``md``: the prompt ``InputMetadata`` -- or the dict of its constructor arguments -- with the
    section-4 CPU fields (``cu_seqlens_q/k``, ``positions``, ``slot_mapping_store_swa``, ``ks``,
    ``ke``, ``kv_ca_index_offset_len``). Returns ``{field: value}`` to merge in (``{}`` when
    ``cfg.yoco_keep_tokens`` is None). Compact per-row fields are the full fields gathered at the
    kept rows, so they can never disagree with the full builder. Tensors are allocated through
    ``get_or_create_tensor(out, "<field>[.<key>]", ...)`` (reused when ``out`` holds them).

    mask: ``yoco_mask_swa_index_pivots`` int32 ``[total_q, 4]``.
    compact: ``yoco_consumer_cu_seqlens_q`` int32 ``[n_seq+1]``, ``yoco_consumer_total_q`` int,
    and int32 ``[total_q_c]`` (``[total_q_c, 2]``/``[total_q_c, 4]``) ``query_indices`` (full
    row), ``positions``, ``slot_mapping_store_swa`` (-1 before ``rect_lo``), ``ks``/``ke``,
    ``kv_ca_index_offset_len``, ``kv_swa_full_index_pivots``.

    Example (``k = 2``; prompts of 3 and 5 tokens, full chunks): ``rect_lo = (1, 3)``,
    ``clip_prefix = (1, 3)``, ``yoco_consumer_cu_seqlens_q = [0, 2, 4]``,
    ``yoco_consumer_query_indices = [1, 2, 6, 7]``, ``yoco_consumer_positions = [1, 2, 3, 4]``.
    """
    keep = cfg.yoco_keep_tokens
    if keep is None:
        return {}
    if _get(md, "is_prompt") is not True:
        raise ValueError("md.is_prompt: YoCo fields apply to prompt metadata only")
    a = _seq_arrays(md, seqs, keep)
    if cfg.yoco_mode == "mask":
        total_q = int(a["cu_q"][-1])
        row_seq = np.repeat(np.arange(a["n_seq"]), a["q_len"])
        local = np.arange(total_q) - a["cu_q"][row_seq]
        t, piv = _alloc(out, "yoco_mask_swa_index_pivots", (total_q, _NUM_PIVOTS))
        _pivots_for_rows(a, row_seq, local, cfg.window_size, piv)
        return {"yoco_mask_swa_index_pivots": t}
    return _build_compact(md, a, cfg.window_size, out)


def _gather_rows(md: Fields, name: str, rows: np.ndarray,
                 out: Optional[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{k: md.<name>[k][rows]}`` into ``yoco_consumer_<name>.<k>`` tensors."""
    d = _get(md, name)
    if d is None:
        raise ValueError(f"md.{name}: expected a dict of tensors (prompt metadata), got None")
    res = {}
    for k, v in d.items():
        res[k], a = _alloc(out, f"yoco_consumer_{name}.{k}", (rows.shape[0], *v.shape[1:]), v.dtype)
        np.take(v.numpy(), rows, axis=0, out=a)
    return res


def _build_compact(md: Fields, a: dict[str, Any], window: int,
                   out: Optional[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Compact-mode fields (see :func:`build_yoco_fields`)."""
    n_seq, clip = a["n_seq"], a["clip"]
    keep_len = a["q_len"] - clip
    cu_t, cu_c = _alloc(out, "yoco_consumer_cu_seqlens_q", (n_seq + 1,))
    cu_c[0] = 0
    np.cumsum(keep_len, out=cu_c[1:])
    total_c = int(keep_len.sum())
    row_seq = np.repeat(np.arange(n_seq), keep_len)
    local = np.arange(total_c) - (cu_c[:-1] - clip)[row_seq]  # j in [clip, q_len)
    full_row = a["cu_q"][row_seq] + local
    qi_t, qi = _alloc(out, "yoco_consumer_query_indices", (total_c,))
    qi[:] = full_row
    pos_t, pos = _alloc(out, "yoco_consumer_positions", (total_c,))
    pos[:] = a["q_start"][row_seq] + local
    slot_t, slot = _alloc(out, "yoco_consumer_slot_mapping_store_swa", (total_c,))
    np.take(_get(md, "slot_mapping_store_swa").numpy(), full_row, out=slot)
    slot[pos < a["rect_lo"][row_seq]] = PAD_SLOT_ID
    piv_t, piv = _alloc(out, "yoco_consumer_kv_swa_full_index_pivots", (total_c, _NUM_PIVOTS))
    _pivots_for_rows(a, row_seq, local, window, piv)
    logger.debug("yoco compact: consumer layers keep %d of %d rows", total_c, int(a["cu_q"][-1]))
    return {
        "yoco_consumer_cu_seqlens_q": cu_t,
        "yoco_consumer_total_q": total_c,
        "yoco_consumer_query_indices": qi_t,
        "yoco_consumer_positions": pos_t,
        "yoco_consumer_slot_mapping_store_swa": slot_t,
        "yoco_consumer_ks": _gather_rows(md, "ks", full_row, out),
        "yoco_consumer_ke": _gather_rows(md, "ke", full_row, out),
        "yoco_consumer_kv_ca_index_offset_len": _gather_rows(md, "kv_ca_index_offset_len", full_row, out),
        "yoco_consumer_kv_swa_full_index_pivots": piv_t,
    }


# ---- views ------------------------------------------------------------------------------------


def get_mask_view(md: InputMetadata) -> InputMetadata:
    """Mask-mode view: ``kv_swa_full_index_pivots`` = ``yoco_mask_swa_index_pivots``.

    A shallow copy (``md`` untouched): ``kv_swa_full_index`` is ``None`` so ``compute_attn_info``
    re-expands it from the mask pivots; every other field is the same object. Works on CP-mirrored
    metadata too (the pivots stay in the full layout and the expansion is gathered by
    ``mirror_cp_index``, as for the untruncated pivots).
    """
    _check_md(md)
    if md.yoco_mask_swa_index_pivots is None:
        raise ValueError(
            "yoco_mask_swa_index_pivots: not built; prepare_prompt fills it only with "
            "yoco_keep_tokens set and yoco_mode='mask'"
        )
    return md.replace(kv_swa_full_index_pivots=md.yoco_mask_swa_index_pivots, kv_swa_full_index=None)


def get_consumer_view(md: InputMetadata) -> InputMetadata:
    """Compact-mode view: the consumer layers' rows (``total_q_c`` of them).

    A shallow copy (``md`` untouched) where ``positions``, ``cu_seqlens_q``, ``total_q``,
    ``query_indices`` (now the FULL-layout row of each kept row, int32 ``[total_q_c]``),
    ``slot_mapping_store_swa``, ``ks``, ``ke``, ``kv_ca_index_offset_len`` and
    ``kv_swa_full_index_pivots`` are the ``yoco_consumer_*`` versions, ``max_seqlen_q`` is the
    longest kept chunk, and ``kv_ca_index``, ``kv_ca_index_len``, ``klen``, ``kv_swa_full_index``
    are ``None``. All other fields (``input_ids``, ``valid_token_mask``, ...) are the same objects,
    in the full row layout; consumer layers gather them through ``query_indices``.

    On CP-mirrored metadata (``mirror_cp_index`` set) the view is mirrored on the compact layout:
    ``prepare_cp_mirror(yoco_consumer_cu_seqlens_q, cu_seqlens_k, ...)`` with the ORIGINAL
    ``cu_seqlens_k`` (so ``seqlen_k - keep_len = q_start + clip_prefix`` is each kept chunk's first
    absolute position) gives ``mirror_cp_index``, ``mirror_cp_reverse_index``, ``ks``, ``ke``;
    ``cp_mirror_len = yoco_consumer_cp_mirror_len``; ``positions`` = the consumer positions
    gathered (pad rows 0) and ``positions_cp`` = the compact consumer positions;
    ``valid_token_mask`` = not a pad row and not a placeholder.
    Example: one sequence, prompt 10, ``k = 6``, full chunk, ``p = 2``: kept rows 4..9 (6 rows,
    ``ps = 2``); rank 0 holds compact rows ``[0, 1, -1, -1]`` -> positions ``[4, 5, 0, 0]``.
    """
    _check_md(md)
    if md.yoco_consumer_cu_seqlens_q is None:
        raise ValueError(
            "yoco_consumer_cu_seqlens_q: not built; prepare_prompt fills the consumer fields only "
            "with yoco_keep_tokens set and yoco_mode='compact'"
        )
    cu_c = md.yoco_consumer_cu_seqlens_q
    changes: dict[str, Any] = dict(
        positions=md.yoco_consumer_positions,
        cu_seqlens_q=cu_c,
        total_q=md.yoco_consumer_total_q,
        max_seqlen_q=int((cu_c[1:] - cu_c[:-1]).max()),
        query_indices=md.yoco_consumer_query_indices,
        slot_mapping_store_swa=md.yoco_consumer_slot_mapping_store_swa,
        ks=md.yoco_consumer_ks,
        ke=md.yoco_consumer_ke,
        kv_ca_index_offset_len=md.yoco_consumer_kv_ca_index_offset_len,
        kv_swa_full_index_pivots=md.yoco_consumer_kv_swa_full_index_pivots,
        **{name: None for name in CONSUMER_CLEARED_FIELDS},
    )
    if md.mirror_cp_index is not None:
        changes.update(_mirrored_consumer_fields(md))
    return md.replace(**changes)


def _check_md(md: object) -> None:
    if not isinstance(md, InputMetadata):
        raise TypeError(f"md: expected an InputMetadata, got {type(md).__name__}")


def _sparse_ratios(md: InputMetadata) -> tuple[int, ...]:
    """Ratios for ``prepare_cp_mirror``: keys of ``yoco_consumer_ks``, or the ``(1,)`` fallback."""
    return tuple(int(r) for r in md.yoco_consumer_ks) if md.yoco_consumer_ks else NO_SPARSE_RATIOS_FALLBACK


def _mirrored_consumer_fields(md: InputMetadata) -> dict[str, Any]:
    """The compact-layout mirror of a consumer view (see :func:`get_consumer_view`)."""
    if md.yoco_consumer_cp_mirror_len is None:
        raise ValueError(
            f"yoco_consumer_cp_mirror_len: mirrored metadata (cp_rank={md.cp_rank}) lacks the YoCo "
            "CP fields; run prepare_for_mirror_cp on the compact metadata (compact first, then CP)"
        )
    cidx, crev, ks_all, ke_all = prepare_cp_mirror(
        md.yoco_consumer_cu_seqlens_q, md.cu_seqlens_k, md.cp_size, md.cp_rank, _sparse_ratios(md),
        md.yoco_consumer_total_q, md.yoco_consumer_cp_mirror_len,
    )
    dev = md.yoco_consumer_positions.device
    cidx, crev = cidx.to(dev), crev.to(dev)
    valid = cidx >= 0
    if md.query_indices is not None:  # full layout: PLACEHOLDER_QUERY_INDEX marks placeholders
        full_row = md.yoco_consumer_query_indices.to(_I64)[cidx.clamp(min=0).to(_I64)]
        valid &= md.query_indices.to(dev)[full_row] != PLACEHOLDER_QUERY_INDEX
    changes: dict[str, Any] = dict(
        mirror_cp_index=cidx,
        mirror_cp_reverse_index=crev,
        cp_mirror_len=md.yoco_consumer_cp_mirror_len,
        positions=mirror_rows(md.yoco_consumer_positions, cidx, 0),
        positions_cp=md.yoco_consumer_positions,
        valid_token_mask=valid,
    )
    if md.yoco_consumer_ks:
        changes["ks"] = {k: ks_all[k].to(dev) for k in md.yoco_consumer_ks}
        changes["ke"] = {k: ke_all[k].to(dev) for k in md.yoco_consumer_ks}
    return changes
