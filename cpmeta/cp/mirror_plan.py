"""Index kernel of the zigzag CP mirror: a host plan per chunk, expanded per row on the device.

The plan is O(n_seq * cp_size) numpy work on host copies of ``cu_seqlens_q/k`` (validated here);
the expansion is O(rows): one 2-D repeat of the per-chunk table plus a few elementwise ops, in
numpy on the CPU (``np.repeat`` is single-threaded; torch's CPU ``repeat_interleave`` forks a
parallel region on every call, which costs milliseconds when cores are contended) or in torch on
a device (one host-to-device copy of the plan, no synchronisation). Public entry points live in
:mod:`cpmeta.cp.zigzag` and :mod:`cpmeta.cp.mirror`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..builders.int_ops import loaded_compressed_len
from ..constants import INT32_MAX

__all__ = [
    "MIRROR_PAD_INDEX", "is_int", "check_cp", "describe", "chunk_len", "host_cu", "validate_mirror_args",
    "mirror_from_host",
]

#: ``mirror_cp_index`` value of a pad row (a chunk clipped at the end of its sequence).
MIRROR_PAD_INDEX: int = -1


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_cp(cp_size: object, cp_rank: object) -> None:
    if not is_int(cp_size) or cp_size < 1:  # type: ignore[operator]
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size!r}")
    if not is_int(cp_rank) or not 0 <= cp_rank < cp_size:  # type: ignore[operator]
        raise ValueError(f"cp_rank: expected an int in [0, {cp_size}), got {cp_rank!r}")


def describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return repr(x)


def chunk_len(seqlens_q: np.ndarray, cp_size: int) -> np.ndarray:
    """``ps = cdiv(sq, 2p)`` per sequence, e.g. ``sq=13, p=3 -> 3``; ``sq=1, p=3 -> 1``."""
    return -(-seqlens_q // (2 * cp_size))


def host_cu(name: str, cu: object) -> np.ndarray:
    """Validated int64 host copy of a cu_seqlens tensor (one tiny device-to-host copy on CUDA)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point \
            or cu.dtype == torch.bool:
        raise TypeError(f"{name}: expected a 1-D integer tensor, got {describe(cu)}")
    host = cu.detach().to("cpu", torch.int64).numpy()
    if host.size < 1 or host[0] != 0:
        raise ValueError(f"{name}: expected exclusive prefix sums [n_seq+1] starting at 0, got {host[:4]}")
    lens = np.diff(host)
    if (lens < 0).any():
        raise ValueError(f"{name}: sequence {int(np.flatnonzero(lens < 0)[0])} has a negative length")
    if host[-1] > INT32_MAX:
        raise ValueError(f"{name}: total {int(host[-1])} overflows int32")
    return host


def validate_mirror_args(
    cu_q: np.ndarray, cu_k: np.ndarray, ratios: Sequence[int], total_q: int, mirror_len: int,
    cp_size: int,
) -> None:
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_k: expected the shape of cu_seqlens_q {cu_q.shape}, got {cu_k.shape}")
    if isinstance(ratios, (str, bytes)) or not isinstance(ratios, Sequence) or not ratios:
        raise ValueError(f"ratios: expected a non-empty sequence of positive ints, got {ratios!r}")
    for r in ratios:
        if not is_int(r) or r < 1:
            raise ValueError(f"ratios: expected positive ints, got {r!r} in {tuple(ratios)!r}")
    sq, sk = np.diff(cu_q), np.diff(cu_k)
    bad = np.flatnonzero(sq > sk)
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"cu_seqlens_k: sequence {s} has seqlen_q {int(sq[s])} > seqlen_k {int(sk[s])}")
    if not is_int(total_q) or total_q != int(cu_q[-1]):
        raise ValueError(f"total_q: expected cu_seqlens_q[-1] = {int(cu_q[-1])}, got {total_q!r}")
    want = int(2 * chunk_len(sq, cp_size).sum())
    if not is_int(mirror_len) or mirror_len != want:
        raise ValueError(f"cp_mirror_len: expected 2 * sum(cdiv(seqlen_q, 2 * cp_size)) = {want}, "
                         f"got {mirror_len!r}")
    if cp_size * mirror_len > INT32_MAX:
        raise ValueError(f"cp_mirror_len: cp_size * cp_mirror_len = {cp_size * mirror_len} overflows int32")


def _rank_plan(
    cu_q: np.ndarray, cu_k: np.ndarray, cp_size: int, cp_rank: int, ratios: Sequence[int]
) -> np.ndarray:
    """Per-chunk table [4 + len(ratios), 2*n_seq] of this rank's 2 chunks per sequence.

    Rows: ``repeats`` (= ps), ``off`` (global row = mirror row + off), ``lim`` (real while mirror
    row < lim), ``shift`` (pos = global row + shift), then ``base`` per ratio. For chunk ``c`` of
    sequence ``s`` (block ``b``, first mirror row ``M_c``): ``off = cu_q[s] + b*ps - M_c``,
    ``lim = M_c + clamp(sq - b*ps, 0, ps)``, ``shift = seqlen_k - seqlen_q - cu_q[s]``.
    Example (sq=10, seqlen_k=14, p=2, rank 0): blocks 0 and 3, ps 3, M = 0, 3:
    off = 0, 9-3 = 6; lim = 3, 3+1 = 4; shift = 4 -> rows m=0..5 map to 0,1,2,9 then pad, pad.
    """
    sq, sk = np.diff(cu_q), np.diff(cu_k)
    ps = chunk_len(sq, cp_size)[:, None]  # [n_seq, 1]
    m_seq = (np.cumsum(2 * ps) - 2 * ps[:, 0])[:, None]  # first mirror row of each sequence
    local0 = np.array([cp_rank, 2 * cp_size - 1 - cp_rank])[None, :] * ps  # [n_seq, 2]
    chunk_m = m_seq + np.array([0, 1])[None, :] * ps
    vlen = np.minimum(np.maximum(sq[:, None] - local0, 0), ps)
    rows = [np.broadcast_to(ps, local0.shape), cu_q[:-1, None] + local0 - chunk_m, chunk_m + vlen,
            np.broadcast_to((sk - sq - cu_q[:-1])[:, None], local0.shape)]
    for r in ratios:
        loaded = loaded_compressed_len(sk, r)
        rows.append(np.broadcast_to((np.cumsum(loaded) - loaded)[:, None], local0.shape))
    return np.stack(rows).reshape(len(rows), -1)


def _reverse_plan(cu_q: np.ndarray, cp_size: int, mirror_len: int) -> np.ndarray:
    """Per-(sequence, block) table [2, n_seq*2p]: rows ``vlen`` and ``shift`` (reverse = row + shift).

    Block ``b`` of sequence ``s`` (global rows ``cu_q[s] + b*ps + [0, vlen)``) lives on rank
    ``min(b, 2p-1-b)`` at ``rank*mirror_len + M_s + (b >= p)*ps``. Example (sq=10, p=2, length 6):
    block 3 (row 9) -> rank 0, second chunk: ``0*6 + 0 + 3 = 3``, shift ``3 - 9 = -6``.
    """
    sq = np.diff(cu_q)
    two_p = 2 * cp_size
    ps = chunk_len(sq, cp_size)[:, None]
    m_seq = (np.cumsum(2 * ps) - 2 * ps[:, 0])[:, None]
    b = np.arange(two_p)[None, :]
    vlen = np.minimum(np.maximum(sq[:, None] - b * ps, 0), ps)
    dest = np.minimum(b, two_p - 1 - b) * mirror_len + m_seq + (b >= cp_size) * ps
    return np.stack([vlen, dest - (cu_q[:-1, None] + b * ps)]).reshape(2, -1)


def mirror_from_host(
    cu_q: np.ndarray, cu_k: np.ndarray, device: torch.device, cp_size: int, cp_rank: int,
    ratios: Sequence[int], total_q: int, length: int,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``cpmeta.cp.zigzag.prepare_cp_mirror`` on validated host copies; results on ``device``."""
    rank_plan = _rank_plan(cu_q, cu_k, cp_size, cp_rank, ratios).astype(np.int32)
    rev_plan = _reverse_plan(cu_q, cp_size, length).astype(np.int32)
    if device.type == "cpu":  # numpy: np.repeat is single-threaded (torch's CPU kernel forks per call)
        index, reverse, ks, ke = _expand(_NumpyOps(), rank_plan, rev_plan, ratios, length, total_q)
        return (torch.from_numpy(index), torch.from_numpy(reverse),
                {k: torch.from_numpy(v) for k, v in ks.items()}, {k: torch.from_numpy(v) for k, v in ke.items()})
    plan = torch.from_numpy(np.concatenate([rank_plan.ravel(), rev_plan.ravel()]))
    plan = plan.to(device, non_blocking=True)  # the one host-to-device copy
    rank_t = plan[: rank_plan.size].view(rank_plan.shape)
    rev_t = plan[rank_plan.size:].view(rev_plan.shape)
    return _expand(_TorchOps(device), rank_t, rev_t, ratios, length, total_q)


class _NumpyOps:
    """Array ops of :func:`_expand` on host numpy arrays (int32)."""

    @staticmethod
    def arange(n: int) -> np.ndarray:
        return np.arange(n, dtype=np.int32)

    @staticmethod
    def repeat(values: np.ndarray, repeats: np.ndarray, n: int) -> np.ndarray:
        return np.repeat(values, repeats, axis=-1)

    @staticmethod
    def fill(x: np.ndarray, mask: np.ndarray, value: int) -> np.ndarray:
        x[mask] = value
        return x


class _TorchOps:
    """Array ops of :func:`_expand` on device tensors (int32), no host synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int32, device=self.device)

    @staticmethod
    def repeat(values: torch.Tensor, repeats: torch.Tensor, n: int) -> torch.Tensor:
        return torch.repeat_interleave(values, repeats, dim=-1, output_size=n)

    @staticmethod
    def fill(x: torch.Tensor, mask: torch.Tensor, value: int) -> torch.Tensor:
        return x.masked_fill_(mask, value)


def _expand(ops: Any, rank_plan: Any, rev_plan: Any, ratios: Sequence[int], length: int, total_q: int) -> tuple[Any, ...]:
    """Per-row expansion of the plans (numpy or torch, int32); see :func:`_rank_plan`.

    Mirror row ``m`` of chunk ``c``: ``glob = m + off_c`` (pad if ``m >= lim_c``),
    ``pos = glob + shift_c``, ``ks = base_c``, ``ke = base_c + (pos + 1) // r``; reverse of global
    row ``g`` in block ``b``: ``g + shift_b``.
    """
    cols = ops.repeat(rank_plan[1:], rank_plan[0], length)  # [3 + n_ratio, length], one call
    m = ops.arange(length)
    pad = m >= cols[1]
    glob = m + cols[0]
    pos = glob + cols[2]
    ks_all: dict[str, Any] = {}
    ke_all: dict[str, Any] = {}
    for i, r in enumerate(ratios):
        ks = cols[3 + i]  # a row of the fresh ``cols`` buffer: filled in place below
        ke_all[str(r)] = ops.fill(ks + (pos + 1) // r, pad, 0)
        ks_all[str(r)] = ops.fill(ks, pad, 0)
    reverse = ops.arange(total_q) + ops.repeat(rev_plan[1], rev_plan[0], total_q)
    return ops.fill(glob, pad, MIRROR_PAD_INDEX), reverse, ks_all, ke_all
