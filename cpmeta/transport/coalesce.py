"""Coalesced tensor buffers: one uint8 buffer, every tensor at a 16-byte aligned offset.

Worked example: descriptors int32[3] (12 B), bool[5] (5 B), float64[0] (0 B), start 40:
offsets = [48, 64, 80] (each rounded up to a multiple of 16), total = 80.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from .codec import TensorDesc

__all__ = ["ALIGN", "align_up", "plan", "views_of", "copy_into", "tensor_memoryview"]

ALIGN = 16  # byte alignment of every tensor inside a coalesced buffer (>= every itemsize)


def align_up(n: int, align: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``align``: ``align_up(17) == 32``."""
    return -(-n // align) * align


def plan(descs: Sequence[TensorDesc], start: int = 0) -> tuple[list[int], int]:
    """Byte offsets of each tensor and the total buffer size (see the module example)."""
    offsets, off = [], align_up(start)
    for d in descs:
        offsets.append(off)
        off = align_up(off + d.nbytes)
    return offsets, off


def views_of(buf: torch.Tensor, descs: Sequence[TensorDesc], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Views of the 1-D uint8 ``buf`` with each descriptor's dtype and shape (no copy)."""
    out = []
    for d, off in zip(descs, offsets):
        out.append(buf[off:off + d.nbytes].view(d.dtype).view(d.shape))
    return out


def copy_into(buf: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
              non_blocking: bool = False) -> None:
    """Copy each tensor (any strides, any device) into its slot of the uint8 ``buf``."""
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        if n:
            buf[off:off + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=non_blocking)


def tensor_memoryview(t: torch.Tensor) -> memoryview:
    """A byte memoryview of a contiguous CPU tensor's data (no numpy, no copy). The caller
    keeps ``t`` alive while the view is in use."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_memoryview: expected a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
