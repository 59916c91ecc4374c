"""Collectives of the launch loop's checks on tensors of any device.

NCCL moves CUDA tensors; gloo moves CPU tensors only for ``all_gather``. With ``--device cuda`` on
a gloo group (several ranks sharing one GPU) the checks' tensors live on the GPU, so these helpers
send through the group's device and hand the result back on the caller's device. Every rank of
the group calls them (collectives), e.g. with 2 ranks: ``all_gather(t)`` on both returns
``[t_rank0, t_rank1]`` on each.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather", "all_reduce", "broadcast"]


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the device the default group's backend moves (CPU for gloo), contiguous."""
    if t.is_cuda and "nccl" not in str(dist.get_backend()).lower():
        return t.cpu()
    return t.contiguous()


def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape and dtype on every rank), in rank order, on ``t.device``."""
    w = _wire(t)
    parts = [torch.empty_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, w)
    return [p.to(t.device) for p in parts]


def all_reduce(t: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """``t`` reduced over the ranks (returned on ``t.device``; ``t`` itself is not modified)."""
    w = _wire(t).clone()
    dist.all_reduce(w, op=op)
    return w.to(t.device)


def broadcast(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``t`` on every rank (returned on ``t.device``)."""
    w = _wire(t).clone()
    dist.broadcast(w, src=src)
    return w.to(t.device)
