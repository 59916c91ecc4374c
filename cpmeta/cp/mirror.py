"""``prepare_for_mirror_cp``: rank ``cp_rank``'s zigzag share of prompt ``InputMetadata`` (docs/design.md section 8).

The index plan comes from :mod:`cpmeta.cp.zigzag` (worked example there); this module applies it to
the metadata: query-aligned fields are gathered by ``mirror_cp_index`` (pad rows 0), fields that
describe whole sequences stay in the full layout, ``ks``/``ke`` are recomputed per mirror row, and
YoCo compact metadata also gets its CP indices (:mod:`cpmeta.cp.yoco_cp`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..fields import mirror_gathered_derived
from ..metadata import FIELDS, InputMetadata
from .mirror_plan import check_cp, check_sizes, host_cu, mirror_from_host, mirror_plan
from .zigzag import NO_SPARSE_RATIOS_FALLBACK, RowGather

__all__ = ["prepare_for_mirror_cp"]

logger = logging.getLogger(__name__)

#: Expanded per-row prompt fields (docs/design.md section 5) that ``prepare_for_mirror_cp`` gathers if already
#: computed, with the value their pad rows get (from the field table: ``kv_ca_index`` -1,
#: ``kv_ca_index_len`` 0, ``kv_swa_full_index`` -1).
_DERIVED_ROW_FILLS = mirror_gathered_derived(FIELDS)


def prepare_for_mirror_cp(md: InputMetadata, cp_rank: int, cp_size: int) -> InputMetadata:
    """A NEW ``InputMetadata`` holding rank ``cp_rank``'s zigzag share of prompt metadata ``md``.

    ``md`` is left untouched; fields the docs/design.md section 8 table does not name are the same objects.
    Gathered by ``mirror_cp_index`` ([cp_mirror_len] rows, pad rows 0 / False):
    ``positions`` (the original goes to ``positions_cp``, same object), ``ngram_token_ids``,
    ``gate_force_random_cp`` (``gate_force_random`` itself is kept), ``valid_token_mask``
    (the full mask gathered; ``mirror_cp_index != -1`` when ``md`` has none). ``ks``/``ke``
    come from :func:`prepare_cp_mirror` with the sparse ratios = keys of ``md.ks`` (an empty or
    missing ``ks`` runs ratio ``(1,)`` and drops the result). Added: ``mirror_cp_index``,
    ``mirror_cp_reverse_index``, ``cp_mirror_len``, ``cp_rank``, ``cp_size``. Expanded indices
    already computed on ``md`` (``kv_ca_index``, ``kv_ca_index_len``, ``kv_swa_full_index``)
    are gathered too (pad rows -1 / 0), matching what ``compute_attn_info`` does on a mirrored
    object. Example: ``sq=10, p=2`` -> rank 1 holds rows ``3..8`` with ``positions`` ``3..8``.
    """
    _check_prompt_md(md, cp_rank, cp_size)
    assert md.positions is not None  # _check_prompt_md refused anything but a tensor
    total_q = int(md.positions.shape[0])
    ratios = tuple(int(r) for r in md.ks) if md.ks else NO_SPARSE_RATIOS_FALLBACK
    cu_q = host_cu("md.cu_seqlens_q", md.cu_seqlens_q)  # the only device-to-host copies
    cu_k = host_cu("md.cu_seqlens_k", md.cu_seqlens_k)
    length = mirror_plan(cu_q, cu_k, ratios, cp_size, ("md.cu_seqlens_q", "md.cu_seqlens_k"))
    check_sizes(cu_q, total_q, length, length, cp_size)
    index, reverse, ks_all, ke_all, valid = mirror_from_host(
        cu_q, cu_k, md.positions.device, cp_size, cp_rank, ratios, total_q, length
    )
    changes = _gathered_fields(md, RowGather(index), valid)
    changes.update(
        positions_cp=md.positions,
        mirror_cp_index=index,
        mirror_cp_reverse_index=reverse,
        cp_mirror_len=length,
        cp_rank=cp_rank,
        cp_size=cp_size,
    )
    if md.ks:  # else the (1,) fallback ran and its ks/ke are dropped
        changes["ks"] = {k: ks_all[str(int(k))] for k in md.ks}
        changes["ke"] = {k: ke_all[str(int(k))] for k in md.ks}
    logger.debug("mirrored %d rows to %d on cp rank %d/%d", total_q, length, cp_rank, cp_size)
    mirrored = md.replace(**changes)
    if md.yoco_consumer_cu_seqlens_q is not None:  # YoCo compact + CP fields (docs/design.md section 10)
        from .yoco_cp import mirror_yoco

        mirrored = mirror_yoco(md, mirrored, cp_rank, cp_size)
    return mirrored


def _check_prompt_md(md: InputMetadata, cp_rank: int, cp_size: int) -> None:
    check_cp(cp_size, cp_rank)
    if not isinstance(md, InputMetadata):
        raise TypeError(f"md: expected an InputMetadata, got {type(md).__name__}")
    if md.is_prompt is not True:
        raise ValueError(f"md.is_prompt: the CP mirror applies to prompt metadata only, got {md.is_prompt!r}")
    if md.mirror_cp_index is not None:
        raise ValueError(f"md.mirror_cp_index: metadata is already mirrored (cp_rank={md.cp_rank})")
    for name in ("cu_seqlens_q", "cu_seqlens_k", "positions"):
        if not isinstance(getattr(md, name), torch.Tensor):
            raise ValueError(f"md.{name}: expected a tensor, got {getattr(md, name)!r}")


def _gathered_fields(md: InputMetadata, gather: RowGather, valid: torch.Tensor) -> dict[str, Any]:
    """The row fields of ``md`` gathered into the mirror layout (pad rows 0 / False / -1); one
    compiled gather per field on the CPU. ``valid``: ``mirror_cp_index != -1``."""
    assert md.positions is not None  # the caller ran _check_prompt_md
    total_q = int(md.positions.shape[0])

    def rows(name: str, t: torch.Tensor, fill: Any) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != total_q:  # (the gather named only mirror_index)
            raise ValueError(f"md.{name}: expected {total_q} rows (one per query row, as md.positions), got "
                             f"shape {tuple(t.shape)}")
        return gather(t, fill)

    out: dict[str, Any] = {"positions": gather(md.positions, 0)}
    if md.valid_token_mask is not None:
        out["valid_token_mask"] = rows("valid_token_mask", md.valid_token_mask, False)
    else:
        out["valid_token_mask"] = valid
    if md.ngram_token_ids is not None:
        out["ngram_token_ids"] = rows("ngram_token_ids", md.ngram_token_ids, 0)
    if md.gate_force_random is not None:
        out["gate_force_random_cp"] = rows("gate_force_random", md.gate_force_random, False)
    for name, fill in _DERIVED_ROW_FILLS.items():  # expanded before the mirror: same as after
        value = getattr(md, name)
        if isinstance(value, dict):
            out[name] = {k: rows(f"{name}[{k!r}]", v, fill) for k, v in value.items()}
        elif isinstance(value, torch.Tensor):
            out[name] = rows(name, value, fill)
    return out
