"""Output buffers the builders write into: ``get_or_create_tensor`` / ``get_or_create_stacked``.

A builder called with ``out=`` (a dict) reuses the tensors stored there (shape and dtype checked;
with ``allow_prefix`` a larger buffer captured for a CUDA graph is written through its prefix view)
and stores what it had to allocate. Host buffers are pinned when CUDA is available, so the
separate host-to-device step can copy them with ``non_blocking=True``.
"""

from __future__ import annotations

import functools
from typing import Iterable, Optional

import torch

__all__ = ["get_or_create_tensor", "get_or_create_stacked"]


@functools.lru_cache(maxsize=1)
def _pin() -> bool:
    """Allocate pinned host memory when a GPU exists (cached: checked once per process)."""
    return torch.cuda.is_available()


def get_or_create_tensor(
    out: Optional[dict[str, torch.Tensor]],
    name: str,
    shape: tuple[int, ...] | list[int],
    dtype: torch.dtype,
    *,
    allow_prefix: bool = False,
) -> torch.Tensor:
    """Return ``out[name]`` (shape and dtype checked) or allocate a new tensor.

    With ``out`` given and holding ``name``, the stored tensor is returned after checking
    ``shape`` and ``dtype`` (``ValueError`` naming ``name`` on a mismatch). With
    ``allow_prefix=True`` a stored tensor whose first dim is LARGER (a buffer captured for a
    bigger batch) is accepted and its prefix view ``out[name][:shape[0]]`` returned (same
    storage, so a captured CUDA graph sees the writes). Otherwise a tensor is allocated
    (pinned when CUDA is available) and, if ``out`` is a dict, stored under ``name``.
    """
    shape = tuple(int(s) for s in shape)
    if out is not None and name in out:
        t = out[name]
        if t.dtype != dtype:
            raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype} in out")
        if tuple(t.shape) == shape:
            return t
        if (
            allow_prefix
            and t.dim() == len(shape)
            and len(shape) > 0
            and t.shape[0] >= shape[0]
            and tuple(t.shape[1:]) == shape[1:]
        ):
            return t[: shape[0]]
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)} in out")
    t = torch.empty(shape, dtype=dtype, pin_memory=_pin())
    if out is not None:
        out[name] = t
    return t


def get_or_create_stacked(
    out: Optional[dict[str, torch.Tensor]],
    name: str,
    keys: Iterable[str],
    shape: tuple[int, ...] | list[int],
    dtype: torch.dtype,
    *,
    allow_prefix: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One ``[len(keys), *shape]`` tensor and ``{key: row view}`` sharing its storage.

    Example: keys ``("4", "128")``, shape ``(5,)`` gives a ``[2, 5]`` tensor ``t`` and
    ``{"4": t[0], "128": t[1]}``. With ``allow_prefix`` a stored ``[2, Q, ...]`` buffer with
    ``Q >= shape[0]`` yields views ``t[i, :shape[0]]`` (no allocation, same addresses).
    """
    keys = list(keys)
    shape = tuple(int(s) for s in shape)
    full = (len(keys), *shape)
    if out is not None and name in out:
        t = out[name]
        if t.dtype != dtype:
            raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype} in out")
        ok_exact = tuple(t.shape) == full
        ok_prefix = (
            allow_prefix
            and len(shape) > 0
            and t.dim() == len(full)
            and t.shape[0] == len(keys)
            and t.shape[1] >= shape[0]
            and tuple(t.shape[2:]) == shape[1:]
        )
        if not (ok_exact or ok_prefix):
            raise ValueError(f"{name}: expected shape {full}, got {tuple(t.shape)} in out")
        stacked = t
    else:
        stacked = torch.empty(full, dtype=dtype, pin_memory=_pin())
        if out is not None:
            out[name] = stacked
    views = {}
    for i, k in enumerate(keys):
        v = stacked[i]
        if shape and v.shape[0] != shape[0]:
            v = v[: shape[0]]
        views[k] = v
    base = stacked.untyped_storage().data_ptr()
    for k, v in views.items():
        assert v.untyped_storage().data_ptr() == base, f"{name}.{k}: row view lost the shared storage"
    return stacked, views
