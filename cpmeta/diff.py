"""``metadata_diff``: where two ``InputMetadata`` differ (bitwise), for tests, ``launch --verify``
and the benchmarks' self-checks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .config import blocks_needed_tensor

if TYPE_CHECKING:
    from .metadata import InputMetadata

__all__ = ["metadata_diff"]


def metadata_diff(
    a: InputMetadata, b: InputMetadata, *, cfg: Any = None, limit: int = 10
) -> list[str]:
    """Paths where ``a`` and ``b`` differ (bitwise for tensors), at most ``limit`` of them.

    Tensors compare dtype, shape and values exactly (on ``a``'s device); aliasing (the same
    tensor object at two paths) must match too. Decode ``block_tables`` define only the first
    ``blocks_needed(seqlen_k, cfg)`` columns of a row (``cdiv(seqlen_k // m, block_size // m)``,
    ``m = cfg.min_ratio``, of rank 0's share when the KV is sharded); with ``cfg`` given, only
    those columns are compared, so two independent builds compare equal. A field one side lacks
    (``None``: e.g. a feature the config switches off) differs from one the other side holds.
    """
    fa, fb = a.to_flatten_dict(), b.to_flatten_dict()
    out: list[str] = []
    for path in sorted(set(fa) | set(fb)):
        if len(out) >= limit:
            break
        if path not in fa or path not in fb:
            out.append(f"{path}: present on one side only")
            continue
        x, y = fa[path], fb[path]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape:
                out.append(f"{path}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
                continue
            y = y.to(x.device)
            if path == "block_tables" and cfg is not None:
                x, y = _defined_block_columns(a, x, cfg), _defined_block_columns(a, y, cfg)
            if not torch.equal(x, y):
                bad = (x != y).nonzero()
                out.append(f"{path}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}")
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            out.append(f"{path}: tensor on one side, {type(x).__name__}/{type(y).__name__}")
        elif x != y:
            out.append(f"{path}: {x!r} vs {y!r}")
    alias_a, alias_b = _alias_groups(fa), _alias_groups(fb)
    if alias_a != alias_b and len(out) < limit:
        out.append(f"aliasing differs: {sorted(alias_a)} vs {sorted(alias_b)}")
    return out


def _alias_groups(flat: dict[str, Any]) -> set[tuple[str, ...]]:
    groups: dict[int, list[str]] = {}
    for p, v in flat.items():
        if isinstance(v, torch.Tensor):
            groups.setdefault(id(v), []).append(p)
    return {tuple(g) for g in groups.values() if len(g) > 1}


def _defined_block_columns(md: InputMetadata, bt: torch.Tensor, cfg: Any) -> torch.Tensor:
    """``bt`` with every column past its row's defined blocks set to -1 (a copy)."""
    if md.cu_seqlens_k is None or md.cu_seqlens_q is None:
        return bt
    seqlen_k = (md.cu_seqlens_k[1:] - md.cu_seqlens_k[:-1]).to(bt.device, torch.int64)
    seqlen_q = (md.cu_seqlens_q[1:] - md.cu_seqlens_q[:-1]).to(bt.device, torch.int64)
    need = blocks_needed_tensor(seqlen_k, cfg)
    need_rows = torch.repeat_interleave(need, seqlen_q)
    cols = torch.arange(bt.shape[1], device=bt.device)
    return torch.where(cols[None, :] < need_rows[:, None], bt, torch.full_like(bt, -1))
