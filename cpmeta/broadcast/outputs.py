"""Where received bytes land: a frame's tensor region into a CPU buffer, received tensors into
the caller's ``out=`` buffers (``MetadataBroadcaster.broadcast(md, out=...)``, docs/design.md section 7).
"""

from __future__ import annotations

import ctypes
import operator
from typing import Any

import torch

from cpmeta.transport.coalesce import tensor_memoryview

from .plan import Plan

__all__ = ["all_cpu", "copy_out_of_frame", "copy_to_out", "check_out", "copy_views"]

_IS_CPU = operator.attrgetter("is_cpu")


def all_cpu(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor is a CPU tensor: one C-level pass over ``is_cpu`` (``t.device.type``
    builds a device object per tensor: ~6x the cost at 20 tensors, on every step of a CUDA rank)."""
    return all(map(_IS_CPU, tensors))


def copy_out_of_frame(dst: torch.Tensor, view: memoryview, at: int, n: int) -> None:
    """Copy ``view[at:at + n]`` (bounds already checked) into the CPU uint8 tensor ``dst``: one
    ``memmove`` from the view's address (a writable view: the ring slot, the private frame
    buffer), else through a memoryview of ``dst``. The address export ends before return."""
    try:
        c = ctypes.c_char.from_buffer(view, at)
    except TypeError:  # read-only bytes
        tensor_memoryview(dst)[:] = view[at:at + n]
        return
    try:
        ctypes.memmove(dst.data_ptr(), ctypes.addressof(c), n)
    finally:
        del c


def copy_views(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for all i, non-blocking: ONE ``_foreach_copy_`` when every
    source is on its destination's device, else one copy each (CPU tensors bound for CUDA)."""
    if all(d.device == s.device for d, s in zip(dsts, srcs)):
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
        return
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)


def _buffer(out: Any, name: str, sub: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``out``'s buffer at path (``name``, ``sub``) once it can hold a ``shape`` ``dtype`` tensor
    (same dtype and ndim, same trailing dims, a first dim at least as large)."""
    buf = getattr(out, name)
    if sub is not None:
        buf = buf.get(sub) if isinstance(buf, dict) else None
    path = name if sub is None else f"{name}.{sub}"
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"out: no buffer at {path} for a received {tuple(shape)} {dtype}")
    if (buf.dtype != dtype or buf.dim() != len(shape) or tuple(buf.shape[1:]) != tuple(shape[1:])
            or (shape and buf.shape[0] < shape[0])):
        raise ValueError(f"out: {path}: buffer {tuple(buf.shape)} {buf.dtype} cannot hold "
                         f"{tuple(shape)} {dtype}")
    return buf


def check_out(out: Any, plan: Plan, dims: Any) -> None:
    """The driver, before its frame leaves: every tensor of the step fits ``out``'s buffers
    (the ``ValueError`` :func:`copy_to_out` would raise after the publish)."""
    for ts, (dtype, shape) in zip(plan.targets, plan.specs(dims)):
        for name, sub in ts:
            _buffer(out, name, sub, dtype, shape)


def copy_to_out(out: Any, plan: Plan, got: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Write each received tensor into ``out``'s buffer at every path it has; return, per
    tensor, the view at each path (same addresses as ``out``'s buffers).

    Worked example: ``out.positions`` is an int32 [256] buffer, the step's ``positions`` is
    int32 [64]: it is copied into ``out.positions[:64]`` and that view is the result's
    ``positions``. Two paths of one received tensor keep their own buffers (one copy each,
    one copy in all when ``out`` holds the same buffer object at both).
    """
    res = []
    for ts, t in zip(plan.targets, got):
        views: list[torch.Tensor] = []
        done: dict[int, torch.Tensor] = {}
        for name, sub in ts:
            buf = _buffer(out, name, sub, t.dtype, tuple(t.shape))
            if id(buf) not in done:
                dst = buf[:t.shape[0]] if t.dim() else buf
                dst.copy_(t, non_blocking=True)
                done[id(buf)] = dst
            views.append(done[id(buf)])
        res.append(views)
    return res
