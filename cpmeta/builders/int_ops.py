"""Integer helpers of the host builders (docs/design.md sections 3 and 4): the int32 bound check's message
and the one loaded-compressed-length rule (``int``, numpy arrays and torch tensors). Example:
``loaded_compressed_len(np.array([3, 8]), 4) -> [1, 2]``.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

from ..constants import INT32_MAX

__all__ = ["loaded_compressed_len", "check_int32", "IntLike"]

IntLike = TypeVar("IntLike", int, np.ndarray, torch.Tensor)


def loaded_compressed_len(seqlen_k: IntLike, r: int) -> IntLike:
    """Compressed KV rows loaded for a sequence: ``max(1, seqlen_k // r)``.

    The ONE helper behind ``cu_compressed_seqlens_k`` (loaded rows), the ``ks``/``ke`` base and
    the prompt ``kv_ca_index_offset_len`` offset: a sequence shorter than ``r`` still occupies one
    (zero-filled) row, so all three must step by the same amount. Works on ``int``, numpy arrays and
    torch tensors (elementwise). Example: ``seqlen_k = [3, 8, 13]``, ``r = 4`` -> ``[1, 2, 3]``.
    """
    if isinstance(seqlen_k, torch.Tensor):
        return torch.clamp(seqlen_k // r, min=1)
    if isinstance(seqlen_k, np.ndarray):
        return np.maximum(seqlen_k // r, 1)
    return max(1, seqlen_k // r)


def check_int32(what: str, value: int, why: str) -> None:
    """Raise ``ValueError`` if ``value`` (a bound computed BEFORE allocation) exceeds int32.

    ``what`` names the field, ``why`` the config/batch quantities that produce the bound.
    """
    if int(value) > INT32_MAX:
        raise ValueError(
            f"{what}: int32 overflow, {why} = {int(value)} > 2**31 - 1; "
            "reduce the batch, max_model_len or the ids, or raise the compress ratio"
        )
