"""Coalesced tensor buffers: one uint8 buffer, tensors laid by the frame's rule.

The rule (the one every cpmeta frame and builder arena uses, ``cpmeta.buffers.ArenaLayout``):
a run of tensors of one dtype starts at a 16-byte aligned offset, the tensors of a run lie back
to back (each at a multiple of its itemsize, since sizes are); a new run starts where the dtype
changes. Tensors given in dtype runs (as a frame's region orders them) therefore lie exactly
where the frame puts them.

Worked example: descriptors int32[3] (12 B), int32[2] (8 B), bool[5] (5 B), float64[0] (0 B),
start 40: offsets = [48, 60, 80, 96] (the int32 run at 48, back to back; bool at the next 16;
float64 at the next 16), total = 96.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from .codec import TensorDesc

__all__ = ["ALIGN", "align_up", "plan", "views_of", "copy_into", "tensor_memoryview"]

ALIGN = 16  # byte alignment of every dtype run inside a coalesced buffer (>= every itemsize)


def align_up(n: int, align: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``align``: ``align_up(17) == 32``."""
    return -(-n // align) * align


def plan(descs: Sequence[TensorDesc], start: int = 0) -> tuple[list[int], int]:
    """Byte offsets of each tensor and the total buffer size, the end of the last run rounded up
    to :data:`ALIGN` (see the module example)."""
    offsets, off, run = [], start, None
    for d in descs:
        if d.dtype != run:
            off, run = align_up(off), d.dtype
        offsets.append(off)
        off += d.nbytes
    return offsets, align_up(off)


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
