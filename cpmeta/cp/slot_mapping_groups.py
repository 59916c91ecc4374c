"""Several KV-cache groups in ONE slot-mapping call (docs/design.md section 11: the fused-groups kernel of the slot-mapping design).

A hybrid model keeps one KV cache per *group* of layers: e.g. full attention with 16-token
blocks and a sliding-window group with 64-token blocks, each with its own block table. Every
group maps the SAME token rows (``query_start_loc``, ``positions``) through its own table::

    slot[g, t] = compute_slot_mapping(qsl, positions, groups[g].block_table, groups[g].block_size,
                                      kv_cache_block_size=groups[g].kv_cache_block_size,
                                      circular=groups[g].circular, <shared CP args>)[t]

:func:`compute_slot_mapping_groups` returns all of them as one ``[n_groups, max_num_tokens]``
int32 tensor: on CPU one compiled call per group (:func:`cpmeta.cp.slot_mapping_njit.slot_fill`)
and one error check for the whole call; on CUDA ONE Triton launch with grid ``(num_reqs + 1, n_groups)``
(:mod:`cpmeta.gpu.slot_mapping_groups_triton`). The CP arguments (world size, rank, interleave)
are shared: they describe the rank, not the cache.

Worked example: positions ``[0, 17, 40]`` of one request, group 0 ``block_size=16`` table
``[[5, 6, 7]]`` -> slots ``5*16+0, 6*16+1, 7*16+8 = [80, 97, 120]``; group 1 ``block_size=64``
table ``[[2]]`` -> ``[128, 145, 168]``; the result is ``[[80, 97, 120], [128, 145, 168]]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..constants import PAD_SLOT_ID
from ..jit import error_slot
from .slot_mapping import (
    BACKENDS,
    SlotMappingParams,
    check_tensor_args,
    host_slot_mapping,
    use_triton,
    make_params,
    raise_slot_error,
)
from .slot_mapping_errors import describe_slot_mapping_error

__all__ = ["KVCacheGroup", "compute_slot_mapping_groups"]


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One KV-cache group: its block table and block geometry (tokens, not bytes)."""

    block_table: torch.Tensor  # [max_reqs >= num_reqs, max_blocks] int32 (int64 accepted)
    block_size: int  # tokens per logical block of this group
    kv_cache_block_size: Optional[int] = None  # tokens per physical KV block (default block_size)
    circular: bool = False  # a ring of one block (e.g. a sliding-window tail); not under CP


def _group_params(
    qsl: torch.Tensor, positions: torch.Tensor, groups: Sequence[KVCacheGroup], max_num_tokens: int,
    cp_world_size: int, cp_rank: int, cp_interleave: int, pad_id: int,
) -> list[SlotMappingParams]:
    """Validate every group like :func:`compute_slot_mapping` would; errors name ``groups[g]``."""
    if isinstance(groups, KVCacheGroup) or not isinstance(groups, Sequence) or not groups:
        raise TypeError(f"groups: expected a non-empty sequence of KVCacheGroup, got {type(groups).__name__}")
    params = []
    for g, grp in enumerate(groups):
        if not isinstance(grp, KVCacheGroup):
            raise TypeError(f"groups[{g}]: expected a KVCacheGroup, got {type(grp).__name__}")
        try:
            prm = make_params(grp.block_size, max_num_tokens, grp.kv_cache_block_size, cp_world_size,
                              cp_rank, cp_interleave, pad_id, grp.circular)
            check_tensor_args(qsl, positions, grp.block_table, prm, None, None)
        except (TypeError, ValueError) as e:
            raise type(e)(f"groups[{g}]: {e}") from None
        params.append(prm)
    return params


def _check_out(out: Optional[torch.Tensor], shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.int32, device=device)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int32:
        raise TypeError(f"out: expected an int32 tensor, got {getattr(out, 'dtype', type(out))}")
    if tuple(out.shape) != shape or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out: expected a contiguous {list(shape)} tensor on {device}, "
                         f"got shape {tuple(out.shape)} on {out.device}")
    return out


def compute_slot_mapping_groups(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    groups: Sequence[KVCacheGroup],
    *,
    max_num_tokens: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    pad_id: int = PAD_SLOT_ID,
    out: Optional[torch.Tensor] = None,
    error_out: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Slot mapping of every KV-cache group at once: ``[n_groups, max_num_tokens]`` int32.

    Row ``g`` equals :func:`cpmeta.compute_slot_mapping` with ``groups[g]``'s block table,
    block size, KV block size and circular flag and the shared arguments (same validation,
    same error texts prefixed with ``groups[g]:``). ``query_start_loc`` [num_reqs+1] and
    ``positions`` [num_tokens] as there. ``out`` (optional): a contiguous
    ``[n_groups, max_num_tokens]`` int32 buffer filled in place. ``error_out`` (optional, [1]
    int32): failure bits are ORed in instead of raising (no host sync). ``backend``: ``auto``
    (one Triton launch for CUDA tensors), ``torch`` or ``triton``.
    """
    params = _group_params(query_start_loc, positions, groups, max_num_tokens, cp_world_size,
                           cp_rank, cp_interleave, pad_id)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    device = positions.device
    out = _check_out(out, (len(groups), max_num_tokens), device)
    qsl, pos = query_start_loc.contiguous(), positions.contiguous()
    if use_triton(device, backend):
        from ..gpu import slot_mapping_groups_triton as tri

        err = error_out if error_out is not None else torch.zeros(1, dtype=torch.int32, device=device)
        tri.launch_slot_mapping_groups_kernel(qsl, pos, [g.block_table for g in groups], out, err, params)
    else:
        bits, wheres = 0, []
        for g, prm in enumerate(params):
            wheres.append(error_slot())
            bits |= host_slot_mapping(qsl, pos, groups[g].block_table, prm, out[g], wheres[g])
        if error_out is not None:
            error_out.bitwise_or_(bits)
        elif bits:
            _raise_group_error(wheres, qsl, pos, groups, params)
        return out
    if error_out is None and int(err.reshape(-1)[0].item()) != 0:  # the one host sync per call
        wheres = [error_slot() for _ in params]
        for g, prm in enumerate(params):
            host_slot_mapping(qsl, pos, groups[g].block_table, prm,
                              torch.empty(max_num_tokens, dtype=torch.int32), wheres[g])
        _raise_group_error(wheres, qsl, pos, groups, params)
        raise ValueError(describe_slot_mapping_error(err))  # unreachable unless the paths disagree
    return out


def _raise_group_error(wheres: list, qsl: torch.Tensor, pos: torch.Tensor, groups: Sequence[KVCacheGroup],
                       params: list[SlotMappingParams]) -> None:
    """The ``ValueError`` of the first group whose kernel call reported a failure, prefixed
    ``groups[g]:`` (returns when none did)."""
    for g, prm in enumerate(params):
        if wheres[g][0]:
            try:
                raise_slot_error(wheres[g], qsl.cpu(), pos.cpu(), groups[g].block_table.cpu(), prm)
            except ValueError as e:
                raise ValueError(f"groups[{g}]: {e}") from None
