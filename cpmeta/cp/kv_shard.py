"""Reading CP-interleaved KV back: how long is each rank's local shard (docs/design.md section 11).

Under ``cp_interleave = I`` and ``cp_world_size = W`` position ``p``'s key/value lives on rank
``(p // I) % W`` (:func:`cpmeta.compute_slot_mapping` writes it there). A rank packs the
positions it owns into consecutive local offsets, in position order, so the keys a decode row
at position ``pos`` may see on rank ``r`` are exactly local offsets ``0 .. n - 1`` with
``n = cp_local_seqlens(pos + 1, W, r, I)``. Each rank attends over its ``n`` keys, returns a
partial output and its log-sum-exp, and the ranks combine by LSE (vLLM: the DCP local length).
"""

from __future__ import annotations

import numpy as np
import torch

from ..jit import error_slot
from .kv_read_plan_njit import local_seqlens


def _int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value >= hi):
        bound = f"{lo} <= {name}" + (f" < {hi}" if hi is not None else "")
        raise ValueError(f"{name}: expected {bound}, got {value}")
    return value

__all__ = ["cp_local_seqlens"]


def cp_local_seqlens(
    seqlens_k: torch.Tensor, cp_world_size: int, cp_rank: int, cp_interleave: int
) -> torch.Tensor:
    """How many of positions ``0 .. seqlen_k - 1`` rank ``cp_rank`` owns, per sequence.

    Args:
        seqlens_k: [n] int32/int64 key lengths (>= 0), any device.
        cp_world_size: ``W`` ranks of the CP group (>= 1).
        cp_rank: this rank, ``0 <= cp_rank < W``.
        cp_interleave: ``I`` consecutive positions per rank before the next rank (>= 1).

    Returns [n] int32 on ``seqlens_k``'s device. Position ``p`` is owned when
    ``(p // I) % W == cp_rank``; every full cycle of ``W * I`` positions gives each rank ``I``,
    the remainder ``rem`` gives rank r ``clamp(rem - r * I, 0, I)``::

        local = (L // (W * I)) * I + clamp(L % (W * I) - cp_rank * I, 0, I)

    Worked example: W=2, I=128, L=300: one full cycle (256) gives 128 each, rem = 44 ->
    rank 0 owns 128 + 44 = 172 (positions 0..127 and 256..299), rank 1 owns 128 + 0 = 128
    (128..255); 172 + 128 = 300. With I=1, W=3, L=7: 2 cycles -> 2 each, rem 1 -> rank 0: 3,
    ranks 1, 2: 2.

    It counts POSITIONS, not valid rows: a placeholder row or sequence (which writes no KV) still
    gets its count here; mask it yourself (``valid_token_mask``), or use
    :func:`cpmeta.cp_kv_read_plan`, whose ``seqlens`` hold 0 for placeholders.
    """
    if not isinstance(seqlens_k, torch.Tensor) or seqlens_k.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"seqlens_k: expected an int32/int64 tensor, got {getattr(seqlens_k, 'dtype', type(seqlens_k))}")
    if seqlens_k.dim() != 1:
        raise ValueError(f"seqlens_k: expected a 1-D tensor, got shape {tuple(seqlens_k.shape)}")
    _int("cp_world_size", cp_world_size, 1, 1 << 31)  # (2**63 was an OverflowError of the kernel's call)
    _int("cp_rank", cp_rank, 0, cp_world_size)
    _int("cp_interleave", cp_interleave, 1, 1 << 31)
    host = np.ascontiguousarray(seqlens_k.detach().cpu().numpy(), np.int64)
    out = np.empty(host.shape[0], np.int32)
    if local_seqlens(host, cp_world_size, cp_rank, cp_interleave, out, error_slot()):
        raise ValueError("seqlens_k: expected lengths >= 0")
    return torch.from_numpy(out).to(seqlens_k.device)
