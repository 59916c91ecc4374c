"""Context-parallel zigzag mirror of prompt metadata (docs/design.md section 8).

Every sequence's ``sq`` query rows of this chunk are cut into ``2p`` chunks of ``ps = cdiv(sq, 2p)``
rows (``p = cp_size``). Rank ``r`` holds chunk ``r`` and chunk ``2p-1-r``: one early and one late
chunk, so the causal attention work is the same on every rank. Chunks are clipped to ``sq`` and
padded with ``-1`` to ``ps`` rows, so every rank holds exactly ``cp_mirror_len = 2 * sum_s ps_s``
rows (sequence-major: sequence 0's two chunks, then sequence 1's, ...).

Worked example (one sequence, ``sq=10``, ``cp_size=2``, so ``ps = cdiv(10, 4) = 3``)::

    chunk          0        1        2        3
    local rows   0 1 2    3 4 5    6 7 8    9 - -
    rank 0 holds chunks 0 and 3:  mirror_cp_index = [0, 1, 2, 9, -1, -1]
    rank 1 holds chunks 1 and 2:  mirror_cp_index = [3, 4, 5, 6, 7, 8]
    rank-major concatenation:     [0, 1, 2, 9, -1, -1, 3, 4, 5, 6, 7, 8]
    mirror_cp_reverse_index     = [0, 1, 2, 6, 7, 8, 9, 10, 11, 3]   (row 9 sits at 3)

Query-aligned fields are gathered by ``mirror_cp_index`` (pad rows 0); fields that describe whole
sequences (``cu_seqlens_*``, the compressed-KV write and load plans, ``input_ids``) stay in the
full layout. ``ks``/``ke`` are recomputed for each mirror row from the ORIGINAL ``cu_seqlens_k``
because compressed-token boundaries depend on absolute positions, not on the mirror order.
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache
from typing import Optional, Sequence, Union

import numpy as np
import torch

from .mirror_njit import gather_rows
from .mirror_plan import (
    MIRROR_PAD_INDEX,
    check_cp,
    check_sizes,
    describe,
    host_cu,
    is_int,
    mirror_from_host,
    mirror_plan,
)

__all__ = [
    "prepare_cp_mirror",
    "unmirror",
    "mirror_rows",
    "cp_mirror_len",
    "RowGather",
    "MIRROR_PAD_INDEX",
    "NO_SPARSE_RATIOS_FALLBACK",
]

logger = logging.getLogger(__name__)

#: Ratios given to :func:`prepare_cp_mirror` when the model has no sparse ratios; the resulting
#: ``ks``/``ke`` are computed (so the kernel has a valid grid) and then dropped.
NO_SPARSE_RATIOS_FALLBACK: tuple[int, ...] = (1,)


def cp_mirror_len(cu_seqlens_q: torch.Tensor, cp_size: int) -> int:
    """Rows every rank holds after the mirror: ``2 * sum_s cdiv(seqlen_q[s], 2 * cp_size)``.

    ``cu_seqlens_q``: [n_seq+1] integer tensor (exclusive prefix sums). Same value on every rank.
    Example: sequences of 1, 5 and 13 rows at ``cp_size=3`` (chunks of 1, 1 and 3 rows):
    ``2 * (1 + 1 + 3) = 10``.
    """
    if not is_int(cp_size) or cp_size < 1:
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size!r}")
    cu_q = host_cu("cu_seqlens_q", cu_seqlens_q)
    return mirror_plan(cu_q, cu_q, NO_SPARSE_RATIOS_FALLBACK, cp_size)


def prepare_cp_mirror(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    ratios: Sequence[int],
    total_q: int,
    cp_mirror_len: int,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Zigzag mirror indices and per-row ``ks``/``ke`` of rank ``cp_rank``.

    Inputs: ``cu_seqlens_q``/``cu_seqlens_k`` [n_seq+1] integer (exclusive prefix sums; ``k`` is
    the ORIGINAL key layout, also when ``q`` is a compacted one), ``ratios`` the sparse ratios (pass
    :data:`NO_SPARSE_RATIOS_FALLBACK` when there are none), ``total_q = cu_seqlens_q[-1]`` and
    ``cp_mirror_len`` (see :func:`cp_mirror_len`); both are checked. One compiled call fills every
    row on the host (:func:`cpmeta.cp.mirror_njit.mirror_fill`, after one tiny copy of
    ``cu_seqlens_*``); on a device the results are copied there.

    Returns, all int32 on that device:

    - ``mirror_cp_index`` [cp_mirror_len]: global row ``cu_seqlens_q[s] + local`` or -1 (pad).
    - ``mirror_cp_reverse_index`` [total_q]: position of each global row in the rank-major
      concatenation of every rank's mirror rows (identical on all ranks).
    - ``ks_all``/``ke_all``: ``{str(r): [cp_mirror_len]}`` with, for a real row at absolute position
      ``pos = (seqlen_k - seqlen_q) + local``, ``ks = base``, ``ke = base + (pos + 1) // r`` where
      ``base = sum_{s' < s} max(1, seqlen_k[s'] // r)``; 0 on pad rows.

    Worked example: one sequence ``sq=10, seqlen_k=14`` (``q_start=4``), ``p=2``, ``r=4``:
    ``ps=3``; rank 0: index ``[0,1,2,9,-1,-1]``, positions ``4,5,6,13``, ``ke = [1,1,1,3,0,0]``;
    rank 1: index ``[3,4,5,6,7,8]``, positions ``7..12``, ``ke = [2,2,2,2,3,3]``; ``ks`` all 0.
    Reverse index (both ranks): ``[0,1,2,6,7,8,9,10,11,3]``.
    """
    check_cp(cp_size, cp_rank)
    cu_q = host_cu("cu_seqlens_q", cu_seqlens_q)
    cu_k = host_cu("cu_seqlens_k", cu_seqlens_k)
    want = mirror_plan(cu_q, cu_k, ratios, cp_size)
    check_sizes(cu_q, total_q, cp_mirror_len, want, cp_size)
    index, reverse, ks, ke, _valid = mirror_from_host(cu_q, cu_k, cu_seqlens_q.device, cp_size, cp_rank,
                                                      ratios, total_q, want)
    return index, reverse, ks, ke


# ---- row helpers -----------------------------------------------------------------------------


def mirror_rows(
    full: torch.Tensor, mirror_index: torch.Tensor, pad_value: Union[int, float, bool] = 0
) -> torch.Tensor:
    """Gather rows of a full-layout tensor by a mirror index, ``pad_value`` where the index is -1.

    ``full``: [total_q, ...] any dtype; ``mirror_index``: [L] integer, entries in ``[-1, total_q)``.
    Returns a NEW tensor [L, ...] of ``full``'s dtype and device (``full`` is never aliased).
    Example: ``full = [10, 11, 12, 13]``, ``mirror_index = [3, -1, 0]`` -> ``[13, 0, 10]``.
    """
    if not isinstance(full, torch.Tensor) or full.dim() < 1:
        raise TypeError(f"full: expected a tensor with a row dimension, got {describe(full)}")
    if not isinstance(mirror_index, torch.Tensor) or mirror_index.dim() != 1 \
            or mirror_index.dtype.is_floating_point:
        raise TypeError(f"mirror_index: expected a 1-D integer tensor, got {describe(mirror_index)}")
    return RowGather(mirror_index.to(full.device))(full, pad_value)


#: the same-size integer dtype a field's elements are copied as, by element size in bytes
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@lru_cache(maxsize=64)
def _pad_word(dtype: torch.dtype, pad_value: Union[int, float, bool]) -> np.ndarray:
    """``pad_value`` in ``dtype``, as one element of its copy word. Example: ``(torch.bool,
    False)`` -> ``uint8 [0]``."""
    return torch.tensor([pad_value], dtype=dtype).view(_WORD[dtype.itemsize]).numpy()


class RowGather:
    """:func:`mirror_rows` for several fields by one index.

    On the CPU each field is ONE :func:`cpmeta.cp.mirror_njit.gather_rows` call over a view of
    its elements as same-size integers (any dtype of 1, 2, 4 or 8 bytes); on a device,
    ``index_select`` and a pad fill. An index past the field's rows is an ``IndexError`` (the
    CPU kernel checks every entry before it reads one)."""

    __slots__ = ("length", "index", "host_index", "_pad")

    def __init__(self, mirror_index: torch.Tensor) -> None:
        self.length = int(mirror_index.shape[0])
        self.index = mirror_index
        self.host_index = None
        self._pad: Optional[torch.Tensor] = None
        if mirror_index.device.type == "cpu":
            self.host_index = np.ascontiguousarray(mirror_index.numpy(), np.int32)

    @property
    def pad(self) -> torch.Tensor:
        """[length] bool: the pad rows (``index == -1``)."""
        if self._pad is None:
            self._pad = self.index < 0
        return self._pad

    def __call__(self, full: torch.Tensor, pad_value: Union[int, float, bool]) -> torch.Tensor:
        out = torch.empty((self.length, *full.shape[1:]), dtype=full.dtype, device=full.device)
        if self.host_index is None or full.device.type != "cpu" or full.dtype.itemsize not in _WORD:
            if full.shape[0] == 0:  # nothing to read: every row is a pad row
                return out.fill_(pad_value)
            got = full.index_select(0, self.index.to(full.device).clamp(min=0).to(torch.int64))
            return got.masked_fill_(self.pad.to(full.device).view(-1, *([1] * (full.dim() - 1))), pad_value)
        word = _WORD[full.dtype.itemsize]
        rows, width = int(full.shape[0]), math.prod(full.shape[1:])
        src = full.contiguous().view(word).numpy().reshape(rows, width)
        dst = out.view(word).numpy().reshape(self.length, width)
        bad = int(gather_rows(src, self.host_index, _pad_word(full.dtype, pad_value), dst))
        if bad:
            raise IndexError(f"mirror_index: entry {bad - 1} reads row {int(self.host_index[bad - 1])} "
                             f"of a tensor of {rows} rows")
        return out


def unmirror(
    rows_from_all_ranks: Union[torch.Tensor, Sequence[torch.Tensor]],
    reverse_index: torch.Tensor,
    *,
    cp_size: Optional[int] = None,
) -> torch.Tensor:
    """Restore the full row order from every rank's mirror rows.

    ``rows_from_all_ranks``: either the list of per-rank tensors ``[cp_mirror_len, ...]`` in rank
    order (what ``all_gather`` fills) or their concatenation ``[cp_size * cp_mirror_len, ...]``;
    ``reverse_index``: [total_q] integer (``mirror_cp_reverse_index``). Returns [total_q, ...].
    Example (sq=10, p=2): ranks hold ``[0,1,2,9,P,P]`` and ``[3,4,5,6,7,8]`` (P = pad);
    the concatenation indexed by ``[0,1,2,6,7,8,9,10,11,3]`` gives ``[0,1,...,9]``.

    Wrong parts are a ``ValueError`` naming expected and got: parts of different shapes, fewer
    rows than ``total_q``, a count other than ``cp_size`` (when given: the list's length, or a
    concatenation not a multiple of it) and, for a ``reverse_index`` on the CPU, a row it reads
    past the end (e.g. one rank's part missing). On CUDA that last check is left out (it would
    cost a device sync); pass ``cp_size`` there.
    """
    parts = None if isinstance(rows_from_all_ranks, torch.Tensor) else _parts(rows_from_all_ranks)
    cat = rows_from_all_ranks if parts is None else torch.cat(parts, 0)
    assert isinstance(cat, torch.Tensor)
    if not isinstance(reverse_index, torch.Tensor) or reverse_index.dim() != 1 \
            or reverse_index.dtype.is_floating_point:
        raise TypeError(f"reverse_index: expected a 1-D integer tensor, got {describe(reverse_index)}")
    _check_part_count(cat, parts, reverse_index, cp_size)
    return cat.index_select(0, reverse_index.to(device=cat.device, dtype=torch.int64))


def _parts(rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    parts = list(rows)
    if not parts or not all(isinstance(t, torch.Tensor) for t in parts):
        raise TypeError("rows_from_all_ranks: expected a tensor or a non-empty list of tensors")
    for i, t in enumerate(parts):
        if t.shape != parts[0].shape or t.dtype != parts[0].dtype:
            raise ValueError(
                f"rows_from_all_ranks[{i}]: expected {tuple(parts[0].shape)} {parts[0].dtype} "
                f"like rank 0, got {tuple(t.shape)} {t.dtype}"
            )
    return parts


def _check_part_count(
    cat: torch.Tensor, parts: Optional[list[torch.Tensor]], reverse: torch.Tensor, cp_size: Optional[int]
) -> None:
    """Example: 2 parts of 6 rows, a reverse index of 10 rows reading rows 0..14 -> "expected at
    least 3 parts of 6 rows (reverse_index reads rows 0..14), got 2 parts (12 rows)"."""
    rows, total_q = int(cat.shape[0]) if cat.dim() else 0, int(reverse.shape[0])
    got = f"{len(parts)} parts ({rows} rows)" if parts is not None else f"{rows} rows"
    if cp_size is not None:
        if not is_int(cp_size) or cp_size < 1:
            raise ValueError(f"cp_size: expected an int >= 1 or None, got {cp_size!r}")
        if (parts is not None and len(parts) != cp_size) or (parts is None and rows % cp_size):
            what = "parts" if parts is not None else "rows: a multiple of cp_size"
            raise ValueError(f"rows_from_all_ranks: expected {cp_size} {what} (cp_size={cp_size}), got {got}")
    if rows < total_q:
        raise ValueError(f"rows_from_all_ranks: expected at least total_q={total_q} rows "
                         f"(reverse_index has {total_q} entries), got {got}")
    if reverse.device.type == "cpu" and total_q:  # on CUDA this would be a device sync
        lo, hi = int(reverse.min()), int(reverse.max())
        if lo < 0 or hi >= rows:
            per = int(parts[0].shape[0]) if parts is not None else 0
            need = f"at least {-(-(hi + 1) // per)} parts of {per} rows" if per else f"at least {hi + 1} rows"
            raise ValueError(f"rows_from_all_ranks: expected {need} (reverse_index reads rows "
                             f"{lo}..{hi}), got {got}")
