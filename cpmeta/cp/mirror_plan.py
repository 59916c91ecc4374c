"""The zigzag CP mirror's wrapper: argument checks and the calls of its compiled kernels.

:func:`mirror_plan` checks the arguments (host-only ones here; the ones that read
``cu_seqlens_*`` in :func:`cpmeta.cp.mirror_njit.mirror_count`, whose code it turns into the
named ``ValueError``) and returns ``cp_mirror_len``; :func:`mirror_from_host` runs
:func:`cpmeta.cp.mirror_njit.mirror_fill` once into arrays it allocates (one host-to-device copy
of all of them when the metadata lives on a device). Public entry points live in
:mod:`cpmeta.cp.zigzag` and :mod:`cpmeta.cp.mirror`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..constants import INT32_MAX
from ..jit import error_slot
from . import mirror_njit as K

__all__ = [
    "MIRROR_PAD_INDEX", "is_int", "check_cp", "describe", "host_cu", "mirror_plan", "check_sizes",
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


def host_cu(name: str, cu: object) -> np.ndarray:
    """int64 host copy of a 1-D integer tensor (one tiny device-to-host copy on CUDA); its data
    is checked by :func:`mirror_plan`."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point \
            or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise TypeError(f"{name}: expected a 1-D integer tensor, got {describe(cu)}")
    return np.ascontiguousarray(cu.detach().to("cpu", torch.int64).numpy())


def _check_ratios(ratios: Sequence[int]) -> None:
    if isinstance(ratios, (str, bytes)) or not isinstance(ratios, Sequence) or not ratios:
        raise ValueError(f"ratios: expected a non-empty sequence of positive ints, got {ratios!r}")
    for r in ratios:
        if not is_int(r) or r < 1:
            raise ValueError(f"ratios: expected positive ints, got {r!r} in {tuple(ratios)!r}")


def mirror_plan(cu_q: np.ndarray, cu_k: np.ndarray, ratios: Sequence[int], cp_size: int,
                names: tuple[str, str] = ("cu_seqlens_q", "cu_seqlens_k")) -> int:
    """Check the prefix sums (named ``names``), the shapes, ``ratios`` and ``seqlen_q <=
    seqlen_k``, in that order; return ``cp_mirror_len`` (one :func:`~mirror_njit.mirror_count` call).
    Example: ``cu_q = [0, 1, 6, 19]`` at ``cp_size = 3`` -> ``10``; ``cu_q = [1, 2]`` ->
    ``ValueError("cu_seqlens_q: expected exclusive prefix sums [n_seq+1] starting at 0, got [1 2]")``."""
    err = error_slot()
    got = int(K.mirror_count(cu_q, cu_k, cp_size, err))
    code = int(err[0])
    if got < 0 and code != K.E_Q_GT_K:
        name, cu = (names[0], cu_q) if code <= K.E_Q_OVERFLOW else (names[1], cu_k)
        if code in (K.E_Q_START, K.E_K_START):
            raise ValueError(f"{name}: expected exclusive prefix sums [n_seq+1] starting at 0, got {cu[:4]}")
        if code in (K.E_Q_NEGATIVE, K.E_K_NEGATIVE):
            raise ValueError(f"{name}: sequence {int(err[1])} has a negative length")
        if code in (K.E_Q_OVERFLOW, K.E_K_OVERFLOW):
            raise ValueError(f"{name}: total {int(err[2])} overflows int32")
        raise ValueError(f"cu_seqlens_k: expected the shape of cu_seqlens_q {cu_q.shape}, got {cu_k.shape}")
    _check_ratios(ratios)
    if got < 0:
        s, sq, sk = (int(v) for v in err[1:])
        raise ValueError(f"cu_seqlens_k: sequence {s} has seqlen_q {sq} > seqlen_k {sk}")
    return got


def check_sizes(cu_q: np.ndarray, total_q: object, mirror_len: object, want: int, cp_size: int) -> None:
    """``total_q == cu_q[-1]``, ``mirror_len == want`` (from :func:`mirror_plan`) and
    ``cp_size * mirror_len`` within int32."""
    if not is_int(total_q) or total_q != int(cu_q[-1]):
        raise ValueError(f"total_q: expected cu_seqlens_q[-1] = {int(cu_q[-1])}, got {total_q!r}")
    if not is_int(mirror_len) or mirror_len != want:
        raise ValueError(f"cp_mirror_len: expected 2 * sum(cdiv(seqlen_q, 2 * cp_size)) = {want}, "
                         f"got {mirror_len!r}")
    if cp_size * want > INT32_MAX:
        raise ValueError(f"cp_mirror_len: cp_size * cp_mirror_len = {cp_size * want} overflows int32")


def mirror_from_host(
    cu_q: np.ndarray, cu_k: np.ndarray, device: torch.device, cp_size: int, cp_rank: int,
    ratios: Sequence[int], total_q: int, length: int,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """``cpmeta.cp.zigzag.prepare_cp_mirror`` on checked host copies: ONE
    :func:`~mirror_njit.mirror_fill` call into fresh int32 arrays (index, reverse, the ks rows,
    the ke rows), each moved to ``device`` in one copy. Returns ``(index, reverse, ks, ke,
    valid)``; ``valid`` [length] bool is ``index != -1``."""
    n_ratio = len(ratios)
    index, reverse = np.empty(length, np.int32), np.empty(total_q, np.int32)
    ks, ke = np.empty((n_ratio, length), np.int32), np.empty((n_ratio, length), np.int32)
    valid = np.empty(length, np.bool_)
    K.mirror_fill(cu_q, cu_k, cp_size, cp_rank, np.array(ratios, np.int64), index, reverse, ks, ke, valid)
    out = [torch.from_numpy(a) for a in (index, reverse, ks, ke, valid)]
    if device.type != "cpu":
        out = [t.to(device, non_blocking=True) for t in out]
    index_t, reverse_t, ks_t, ke_t, valid_t = out
    return (index_t, reverse_t, {str(r): ks_t[i] for i, r in enumerate(ratios)},
            {str(r): ke_t[i] for i, r in enumerate(ratios)}, valid_t)
