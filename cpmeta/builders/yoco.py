"""YoCo prefill truncation: the fields of its two views of one prompt metadata (DESIGN section 10).

Consumer layers see only the last ``k = cfg.yoco_keep_tokens`` tokens of the whole prompt, yet each
kept row must compute exactly what it would compute without truncation. Per sequence ``s``::

    data_len = len(token_ids)            # the WHOLE prompt (not just what is cached)
    rect_lo  = max(0, data_len - k)      # first position consumer layers keep
    chunk    = [q_start, q_start + q_len),  q_start = seqlen_k - seqlen_q,  q_len = seqlen_q

One visibility rule serves both modes (:func:`~cpmeta.builders.swa_pivots.swa_visibility_pivots`): row ``j`` at ``pos =
q_start + j`` sees SWA keys from ``abs_lo = clamp(max(pos - W + 1, rect_lo, swa_valid_start), 0,
pos + 1)`` to ``pos``, written as the section-4 pivots ``(P0, P1, P2, P3)``.

- ``mask`` mode keeps every row and only narrows visibility: ``yoco_mask_swa_index_pivots``;
  :func:`~cpmeta.cp.yoco_views.get_mask_view` swaps them in.
- ``compact`` mode drops the rows before the rectangle (keeping at least the last row of each
  chunk): ``clip_prefix = clamp(data_len - k - q_start, 0, q_len - 1)``, kept local rows
  ``[clip_prefix, q_len)``. The ``yoco_consumer_*`` fields hold the kept rows;
  :func:`~cpmeta.cp.yoco_views.get_consumer_view` swaps them in.

Worked example (``W = 4``, ``k = 6``, one sequence with a 10-token prompt, this chunk ``q_start = 2,
q_len = 6``, so rows at positions 2..7; ``rect_lo = 4``)::

    pos               2  3  4  5  6  7
    clip_prefix = clamp(10 - 6 - 2, 0, 5) = 2   -> kept rows j = 2..5 (positions 4..7)
    abs_lo (mask)     3  4  4  4  4  4    (max(pos - 3, 4) clamped to pos + 1 for pos 2, 3)
    visible keys      -  -  4  4..5  4..6  4..7

Compact + CP (compact FIRST, then mirror; :func:`~cpmeta.cp.yoco_cp.mirror_yoco`, called by
``prepare_for_mirror_cp``): the consumer rows are zigzag-mirrored on their own compact layout
(``prepare_cp_mirror(yoco_consumer_cu_seqlens_q, ORIGINAL cu_seqlens_k, ...)``), and
``yoco_cp_contrib_index`` / ``yoco_cp_boundary_index`` move the kept rows from the full-mirror
layout to the compact-mirror layout with one all-gather::

    all_gather(full_mirror_rows[yoco_cp_contrib_index])[yoco_cp_boundary_index] == compact_rows

Views are shallow copies (``md.replace``): replaced fields are swapped in, derived fields cleared,
every other field is the SAME object; nothing is ever written through a view.

This module builds the fields (called by ``prepare_prompt``); the views live in
:mod:`cpmeta.cp.yoco_views`, the CP indices in :mod:`cpmeta.cp.yoco_cp`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np
import torch

from ..config import MetadataConfig
from ..constants import PAD_SLOT_ID
from ..fields import MIRROR, YOCO_COMPACT, YOCO_MASK, fields_with
from ..metadata import FIELDS
from ..sequence import SequenceMetadata
from ..buffers import alloc
from .batch_arrays import BatchArrays
from ..state.batch import SequenceBatch
from .swa_pivots import NUM_PIVOTS, Arr, swa_visibility_pivots

#: What YoCo reads its per-sequence prompt lengths from.
YocoInput = Union[Sequence[SequenceMetadata], SequenceBatch, BatchArrays]

if TYPE_CHECKING:
    from ..metadata import InputMetadata

    #: A prompt ``InputMetadata`` or the dict of its constructor arguments.
    Fields = Union[InputMetadata, Mapping[str, Any]]

__all__ = [
    "build_yoco_fields",
    "yoco_clip_prefix",
    "YOCO_MASK_FIELDS",
    "YOCO_COMPACT_FIELDS",
    "YOCO_CP_FIELDS",
]

logger = logging.getLogger(__name__)

#: Field filled by ``prepare_prompt`` in mask mode (from the field table: ``yoco_mask_swa_index_pivots``).
YOCO_MASK_FIELDS: tuple[str, ...] = fields_with(FIELDS, YOCO_MASK)

#: Fields filled by ``prepare_prompt`` in compact mode (from the field table: the nine
#: ``yoco_consumer_*`` fields of DESIGN 10, ``yoco_consumer_cu_seqlens_q`` ... ``_kv_swa_full_index_pivots``).
YOCO_COMPACT_FIELDS: tuple[str, ...] = fields_with(FIELDS, YOCO_COMPACT)

#: Fields added by ``prepare_for_mirror_cp`` (through :func:`mirror_yoco`) on compact metadata
#: (from the field table: ``yoco_consumer_cp_mirror_len``, ``yoco_consumer_cp_contrib_pad_len``,
#: ``yoco_cp_contrib_index``, ``yoco_cp_boundary_index``).
YOCO_CP_FIELDS: tuple[str, ...] = fields_with(FIELDS, YOCO_COMPACT, MIRROR)

_I32 = torch.int32
_TOKENS = attrgetter("token_ids")
_VALID_START = attrgetter("swa_valid_start")


def yoco_clip_prefix(data_len: Arr, q_start: Arr, q_len: Arr, keep: int) -> Arr:
    """Rows cut from the front of each chunk: ``clamp(data_len - k - q_start, 0, q_len - 1)``.

    Per-sequence int64 arrays ``[n_seq]`` (numpy or torch) in, same kind out. At least one row
    (the chunk's last) is always kept. Example ``k = 6``: prompt 10, chunk ``[2, 8)`` -> 2 rows
    cut; prompt 10, chunk ``[0, 3)`` (entirely before ``rect_lo = 4``) -> 2 (only row 2 kept);
    prompt 5 (``k`` larger than the prompt) -> 0.
    """
    xp: Any = torch if isinstance(q_len, torch.Tensor) else np
    return xp.minimum((data_len - keep - q_start).clip(min=0), q_len - 1)


def _get(md: Fields, name: str) -> Any:
    """Field ``name`` of metadata or of its constructor kwargs (a field not built is ``None``)."""
    return md.get(name) if isinstance(md, Mapping) else getattr(md, name)


def _seq_inputs(seqs: YocoInput) -> tuple[np.ndarray, np.ndarray]:
    """``(data_len, swa_valid_start)`` ([n_seq] int64 each): ``len(token_ids)`` is the whole prompt.

    Read from the arrays of a ``SequenceBatch`` (``num_tokens``) or ``BatchArrays``
    (``data_len``); a list of ``SequenceMetadata`` is read once."""
    if isinstance(seqs, BatchArrays):
        return seqs.data_len, seqs.swa_valid_start
    if isinstance(seqs, SequenceBatch):
        return seqs.num_tokens, seqs.swa_valid_start
    n_seq = len(seqs)
    return (np.fromiter(map(len, map(_TOKENS, seqs)), np.int64, n_seq),
            np.fromiter(map(_VALID_START, seqs), np.int64, n_seq))


def _seq_arrays(md: Fields, seqs: YocoInput, keep: int) -> dict[str, Any]:
    """Per-sequence int64 numpy arrays the YoCo fields need (no loop over sequences)."""
    data_len, valid_start = _seq_inputs(seqs)
    n_seq = len(data_len)
    cu_q = _get(md, "cu_seqlens_q").numpy().astype(np.int64)
    cu_k = _get(md, "cu_seqlens_k").numpy().astype(np.int64)
    if cu_q.shape[0] != n_seq + 1:
        raise ValueError(f"seqs: expected {cu_q.shape[0] - 1} sequences like md.cu_seqlens_q, got {n_seq}")
    q_len = np.diff(cu_q)
    q_start = np.diff(cu_k) - q_len
    short = np.flatnonzero(data_len < q_start + q_len)
    if short.size:
        i = int(short[0])
        raise ValueError(
            f"seqs[{i}].token_ids: YoCo needs the whole prompt (at least seqlen_k = "
            f"{int(q_start[i] + q_len[i])} tokens), got {int(data_len[i])}"
        )
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
    seqs: YocoInput,
    cfg: MetadataConfig,
    *,
    out: Optional[dict[str, torch.Tensor]] = None,
) -> dict[str, Any]:
    """The section-10 fields of ``cfg.yoco_mode`` for prompt metadata built from ``seqs``.

    Needs the sliding-window state cache (the config refuses YoCo without one); without
    compressed KV the ``yoco_consumer_ks`` / ``ke`` / ``kv_ca_index_offset_len`` are ``None``.

    ``seqs``: the batch ``md`` was built from -- a list of ``SequenceMetadata``, a
    ``SequenceBatch`` or the builders' ``BatchArrays``; YoCo reads only its per-sequence
    ``len(token_ids)`` (``num_tokens``, the whole prompt) and ``swa_valid_start``.

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
        t, piv = alloc(out, "yoco_mask_swa_index_pivots", (total_q, NUM_PIVOTS), _I32)
        _pivots_for_rows(a, row_seq, local, cfg.window_size, piv)
        return {"yoco_mask_swa_index_pivots": t}
    return _build_compact(md, a, cfg.window_size, out)


def _gather_rows(md: Fields, name: str, rows: np.ndarray,
                 out: Optional[dict[str, torch.Tensor]]) -> Optional[dict[str, torch.Tensor]]:
    """``{k: md.<name>[k][rows]}`` into ``yoco_consumer_<name>.<k>`` tensors; ``None`` when the
    field is (a config without compressed KV: the consumer view has no such field either)."""
    d = _get(md, name)
    if d is None:
        return None
    res = {}
    for k, v in d.items():
        res[k], a = alloc(out, f"yoco_consumer_{name}.{k}", (rows.shape[0], *v.shape[1:]), v.dtype)
        np.take(v.numpy(), rows, axis=0, out=a)
    return res


def _build_compact(md: Fields, a: dict[str, Any], window: int,
                   out: Optional[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Compact-mode fields (see :func:`build_yoco_fields`)."""
    n_seq, clip = a["n_seq"], a["clip"]
    keep_len = a["q_len"] - clip
    cu_t, cu_c = alloc(out, "yoco_consumer_cu_seqlens_q", (n_seq + 1,), _I32)
    cu_c[0] = 0
    np.cumsum(keep_len, out=cu_c[1:])
    total_c = int(keep_len.sum())
    row_seq = np.repeat(np.arange(n_seq), keep_len)
    local = np.arange(total_c) - (cu_c[:-1] - clip)[row_seq]  # j in [clip, q_len)
    full_row = a["cu_q"][row_seq] + local
    qi_t, qi = alloc(out, "yoco_consumer_query_indices", (total_c,), _I32)
    qi[:] = full_row
    pos_t, pos = alloc(out, "yoco_consumer_positions", (total_c,), _I32)
    pos[:] = a["q_start"][row_seq] + local
    slot_t, slot = alloc(out, "yoco_consumer_slot_mapping_store_swa", (total_c,), _I32)
    np.take(_get(md, "slot_mapping_store_swa").numpy(), full_row, out=slot)
    slot[pos < a["rect_lo"][row_seq]] = PAD_SLOT_ID
    piv_t, piv = alloc(out, "yoco_consumer_kv_swa_full_index_pivots", (total_c, NUM_PIVOTS), _I32)
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
