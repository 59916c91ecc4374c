"""YoCo views of one prompt metadata (docs/design.md section 10): ``get_mask_view``, ``get_consumer_view``.

Called by the container methods ``md.get_mask_view()`` / ``md.get_consumer_view()``. Views are
shallow copies (``md.replace``): replaced fields are swapped in, derived fields cleared, every
other field is the SAME object; nothing is ever written through a view. On CP-mirrored compact
metadata the consumer view is mirrored on the compact layout (see :func:`get_consumer_view`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol, TypeVar

import torch

from ..cache import IdentityCache
from ..constants import PLACEHOLDER_QUERY_INDEX
from ..fields import consumer_cleared, consumer_swaps, field_table
from .zigzag import NO_SPARSE_RATIOS_FALLBACK, mirror_rows, prepare_cp_mirror

__all__ = ["get_mask_view", "get_consumer_view"]

_I64 = torch.int64
_V = TypeVar("_V", bound="YocoViewFields")


class YocoViewFields(Protocol):
    """The ``InputMetadata`` fields and method the views read (they write none: views are copies).

    Typed structurally so this module never imports the container that calls it (docs/design.md
    section 2); mypy checks ``InputMetadata`` against it where ``md.get_*_view`` passes ``self``.
    """

    query_indices: Optional[torch.Tensor]
    cu_seqlens_k: Optional[torch.Tensor]
    mirror_cp_index: Optional[torch.Tensor]
    cp_rank: Optional[int]
    cp_size: Optional[int]
    yoco_mask_swa_index_pivots: Optional[torch.Tensor]
    yoco_consumer_cu_seqlens_q: Optional[torch.Tensor]
    yoco_consumer_total_q: Optional[int]
    yoco_consumer_query_indices: Optional[torch.Tensor]
    yoco_consumer_positions: Optional[torch.Tensor]
    yoco_consumer_ks: Optional[dict[str, torch.Tensor]]
    yoco_consumer_cp_mirror_len: Optional[int]

    def replace(self: _V, **changes: Any) -> _V: ...


_Rules = tuple[tuple[tuple[str, str], ...], tuple[str, ...]]
_RULES: IdentityCache[type, _Rules] = IdentityCache(4)


def _view_rules(cls: type) -> _Rules:
    """The consumer view's rules from the field table of ``cls`` (read off the dataclass: this
    module never imports the container): ``(field, yoco_consumer_* field)`` swaps
    (``positions`` <- ``yoco_consumer_positions``, ...) and the fields it clears (``klen`` and
    the derived ones, re-expanded on the view's rows). Cached per class."""
    hit = _RULES.get(cls)
    if hit is None:
        table = field_table(cls)
        hit = _RULES.put(cls, (tuple(consumer_swaps(table).items()), consumer_cleared(table)))
    return hit


def get_mask_view(md: _V) -> _V:
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


def get_consumer_view(md: _V) -> _V:
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
    swaps, cleared = _view_rules(type(md))
    changes: dict[str, Any] = {name: getattr(md, consumer) for name, consumer in swaps}
    changes.update({name: None for name in cleared}, max_seqlen_q=int((cu_c[1:] - cu_c[:-1]).max()))
    if md.mirror_cp_index is not None:
        changes.update(_mirrored_consumer_fields(md))
    return md.replace(**changes)


def _check_md(md: object) -> None:
    """Duck check (this module never imports the container: it is called by it)."""
    if not (dataclasses.is_dataclass(md) and hasattr(md, "yoco_consumer_cu_seqlens_q")):
        raise TypeError(f"md: expected an InputMetadata, got {type(md).__name__}")


def _sparse_ratios(md: YocoViewFields) -> tuple[int, ...]:
    """Ratios for ``prepare_cp_mirror``: keys of ``yoco_consumer_ks``, or the ``(1,)`` fallback."""
    return tuple(int(r) for r in md.yoco_consumer_ks) if md.yoco_consumer_ks else NO_SPARSE_RATIOS_FALLBACK


def _mirrored_consumer_fields(md: YocoViewFields) -> dict[str, Any]:
    """The compact-layout mirror of a consumer view (see :func:`get_consumer_view`)."""
    if md.yoco_consumer_cp_mirror_len is None:
        raise ValueError(
            f"yoco_consumer_cp_mirror_len: mirrored metadata (cp_rank={md.cp_rank}) lacks the YoCo "
            "CP fields; run prepare_for_mirror_cp on the compact metadata (compact first, then CP)"
        )
    # set together by prepare_prompt (compact YoCo) and prepare_for_mirror_cp (docs/design.md sections 8, 10)
    assert md.yoco_consumer_cu_seqlens_q is not None and md.yoco_consumer_positions is not None
    assert md.yoco_consumer_total_q is not None and md.yoco_consumer_query_indices is not None
    assert md.cu_seqlens_k is not None and md.cp_size is not None and md.cp_rank is not None
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
