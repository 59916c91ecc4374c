"""Context-parallel zigzag mirror of prompt metadata (DESIGN section 8).

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
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from ._batch import loaded_compressed_len
from .constants import INT32_MAX
from .metadata import InputMetadata

__all__ = [
    "prepare_cp_mirror",
    "prepare_for_mirror_cp",
    "unmirror",
    "mirror_rows",
    "cp_mirror_len",
    "MIRROR_PAD_INDEX",
    "NO_SPARSE_RATIOS_FALLBACK",
]

logger = logging.getLogger(__name__)

#: ``mirror_cp_index`` value of a pad row (a chunk clipped at the end of its sequence).
MIRROR_PAD_INDEX: int = -1

#: Ratios given to :func:`prepare_cp_mirror` when the model has no sparse ratios; the resulting
#: ``ks``/``ke`` are computed (so the kernel has a valid grid) and then dropped.
NO_SPARSE_RATIOS_FALLBACK: tuple[int, ...] = (1,)

#: Fill value of gathered index rows (``kv_ca_index``, ``kv_swa_full_index``) on pad rows.
_PAD_INDEX_FILL: int = -1

#: Expanded per-row fields (DESIGN 5) that ``prepare_for_mirror_cp`` gathers if already computed,
#: with the value their pad rows get.
_DERIVED_ROW_FILLS: dict[str, int] = {
    "kv_ca_index": _PAD_INDEX_FILL,
    "kv_ca_index_len": 0,
    "kv_swa_full_index": _PAD_INDEX_FILL,
}


# ---- small helpers ---------------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_cp(cp_size: object, cp_rank: object) -> None:
    if not _is_int(cp_size) or cp_size < 1:  # type: ignore[operator]
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size!r}")
    if not _is_int(cp_rank) or not 0 <= cp_rank < cp_size:  # type: ignore[operator]
        raise ValueError(f"cp_rank: expected an int in [0, {cp_size}), got {cp_rank!r}")


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return repr(x)


def _chunk_len(seqlens_q: np.ndarray, cp_size: int) -> np.ndarray:
    """``ps = cdiv(sq, 2p)`` per sequence, e.g. ``sq=13, p=3 -> 3``; ``sq=1, p=3 -> 1``."""
    return -(-seqlens_q // (2 * cp_size))


def _host_cu(name: str, cu: object) -> np.ndarray:
    """Validated int64 host copy of a cu_seqlens tensor (one tiny device-to-host copy on CUDA)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point \
            or cu.dtype == torch.bool:
        raise TypeError(f"{name}: expected a 1-D integer tensor, got {_describe(cu)}")
    host = cu.detach().to("cpu", torch.int64).numpy()
    if host.size < 1 or host[0] != 0:
        raise ValueError(f"{name}: expected exclusive prefix sums [n_seq+1] starting at 0, got {host[:4]}")
    lens = np.diff(host)
    if (lens < 0).any():
        raise ValueError(f"{name}: sequence {int(np.flatnonzero(lens < 0)[0])} has a negative length")
    if host[-1] > INT32_MAX:
        raise ValueError(f"{name}: total {int(host[-1])} overflows int32")
    return host


def cp_mirror_len(cu_seqlens_q: torch.Tensor, cp_size: int) -> int:
    """Rows every rank holds after the mirror: ``2 * sum_s cdiv(seqlen_q[s], 2 * cp_size)``.

    ``cu_seqlens_q``: [n_seq+1] integer tensor (exclusive prefix sums). Same value on every rank.
    Example: sequences of 1, 5 and 13 rows at ``cp_size=3`` (chunks of 1, 1 and 3 rows):
    ``2 * (1 + 1 + 3) = 10``.
    """
    if not _is_int(cp_size) or cp_size < 1:
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size!r}")
    return int(2 * _chunk_len(np.diff(_host_cu("cu_seqlens_q", cu_seqlens_q)), cp_size).sum())


# ---- the index kernel: host plan (O(n_seq * p)), device expansion (O(rows)) --------------------


def _validate_mirror_args(
    cu_q: np.ndarray, cu_k: np.ndarray, ratios: Sequence[int], total_q: int, mirror_len: int,
    cp_size: int,
) -> None:
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_k: expected the shape of cu_seqlens_q {cu_q.shape}, got {cu_k.shape}")
    if isinstance(ratios, (str, bytes)) or not isinstance(ratios, Sequence) or not ratios:
        raise ValueError(f"ratios: expected a non-empty sequence of positive ints, got {ratios!r}")
    for r in ratios:
        if not _is_int(r) or r < 1:
            raise ValueError(f"ratios: expected positive ints, got {r!r} in {tuple(ratios)!r}")
    sq, sk = np.diff(cu_q), np.diff(cu_k)
    bad = np.flatnonzero(sq > sk)
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"cu_seqlens_k: sequence {s} has seqlen_q {int(sq[s])} > seqlen_k {int(sk[s])}")
    if not _is_int(total_q) or total_q != int(cu_q[-1]):
        raise ValueError(f"total_q: expected cu_seqlens_q[-1] = {int(cu_q[-1])}, got {total_q!r}")
    want = int(2 * _chunk_len(sq, cp_size).sum())
    if not _is_int(mirror_len) or mirror_len != want:
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
    ps = _chunk_len(sq, cp_size)[:, None]  # [n_seq, 1]
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
    ps = _chunk_len(sq, cp_size)[:, None]
    m_seq = (np.cumsum(2 * ps) - 2 * ps[:, 0])[:, None]
    b = np.arange(two_p)[None, :]
    vlen = np.minimum(np.maximum(sq[:, None] - b * ps, 0), ps)
    dest = np.minimum(b, two_p - 1 - b) * mirror_len + m_seq + (b >= cp_size) * ps
    return np.stack([vlen, dest - (cu_q[:-1, None] + b * ps)]).reshape(2, -1)


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
    ``cp_mirror_len`` (see :func:`cp_mirror_len`); both are checked. The per-sequence plan is made
    on the host (one tiny copy of ``cu_seqlens_*``), the per-row expansion runs on their device.

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
    _check_cp(cp_size, cp_rank)
    cu_q = _host_cu("cu_seqlens_q", cu_seqlens_q)
    cu_k = _host_cu("cu_seqlens_k", cu_seqlens_k)
    _validate_mirror_args(cu_q, cu_k, ratios, total_q, cp_mirror_len, cp_size)
    return _mirror_from_host(cu_q, cu_k, cu_seqlens_q.device, cp_size, cp_rank, ratios, total_q, cp_mirror_len)


def _mirror_from_host(
    cu_q: np.ndarray, cu_k: np.ndarray, device: torch.device, cp_size: int, cp_rank: int,
    ratios: Sequence[int], total_q: int, length: int,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """:func:`prepare_cp_mirror` on validated host copies; results on ``device``."""
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
    return _expand(_TorchOps(device), rank_t, rev_t, ratios, length, total_q)  # type: ignore[return-value]


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
        raise TypeError(f"full: expected a tensor with a row dimension, got {_describe(full)}")
    if not isinstance(mirror_index, torch.Tensor) or mirror_index.dim() != 1 \
            or mirror_index.dtype.is_floating_point:
        raise TypeError(f"mirror_index: expected a 1-D integer tensor, got {_describe(mirror_index)}")
    return _RowGather(mirror_index.to(full.device))(full, pad_value)


class _RowGather:
    """:func:`mirror_rows` for several fields by one index (clamped index and pad mask made once)."""

    __slots__ = ("length", "safe", "pad")

    def __init__(self, mirror_index: torch.Tensor) -> None:
        self.length = int(mirror_index.shape[0])
        self.pad = mirror_index < 0
        self.safe = mirror_index.clamp(min=0).to(torch.int64)

    def __call__(self, full: torch.Tensor, pad_value: Union[int, float, bool]) -> torch.Tensor:
        if full.shape[0] == 0:  # nothing to read: every row is a pad row
            return torch.full((self.length, *full.shape[1:]), pad_value, dtype=full.dtype, device=full.device)
        out = full.index_select(0, self.safe)
        return out.masked_fill_(self.pad.view(-1, *([1] * (full.dim() - 1))), pad_value)


def unmirror(
    rows_from_all_ranks: Union[torch.Tensor, Sequence[torch.Tensor]], reverse_index: torch.Tensor
) -> torch.Tensor:
    """Restore the full row order from every rank's mirror rows.

    ``rows_from_all_ranks``: either the list of per-rank tensors ``[cp_mirror_len, ...]`` in rank
    order (what ``all_gather`` fills) or their concatenation ``[cp_size * cp_mirror_len, ...]``;
    ``reverse_index``: [total_q] integer (``mirror_cp_reverse_index``). Returns [total_q, ...].
    Example (sq=10, p=2): ranks hold ``[0,1,2,9,P,P]`` and ``[3,4,5,6,7,8]`` (P = pad);
    the concatenation indexed by ``[0,1,2,6,7,8,9,10,11,3]`` gives ``[0,1,...,9]``.
    """
    if isinstance(rows_from_all_ranks, torch.Tensor):
        cat = rows_from_all_ranks
    else:
        parts = list(rows_from_all_ranks)
        if not parts or not all(isinstance(t, torch.Tensor) for t in parts):
            raise TypeError("rows_from_all_ranks: expected a tensor or a non-empty list of tensors")
        for i, t in enumerate(parts):
            if t.shape != parts[0].shape or t.dtype != parts[0].dtype:
                raise ValueError(
                    f"rows_from_all_ranks[{i}]: expected {tuple(parts[0].shape)} {parts[0].dtype} "
                    f"like rank 0, got {tuple(t.shape)} {t.dtype}"
                )
        cat = torch.cat(parts, 0)
    if not isinstance(reverse_index, torch.Tensor) or reverse_index.dim() != 1 \
            or reverse_index.dtype.is_floating_point:
        raise TypeError(f"reverse_index: expected a 1-D integer tensor, got {_describe(reverse_index)}")
    return cat.index_select(0, reverse_index.to(device=cat.device, dtype=torch.int64))


# ---- the metadata transform ------------------------------------------------------------------


def _gather_dict(
    d: Optional[dict[str, torch.Tensor]], gather: _RowGather, fill: int
) -> Optional[dict[str, torch.Tensor]]:
    if d is None:
        return None
    return {k: gather(v, fill) for k, v in d.items()}


def prepare_for_mirror_cp(md: InputMetadata, cp_rank: int, cp_size: int) -> InputMetadata:
    """A NEW ``InputMetadata`` holding rank ``cp_rank``'s zigzag share of prompt metadata ``md``.

    ``md`` is left untouched; fields the DESIGN 8 table does not name are the same objects.
    Gathered by ``mirror_cp_index`` ([cp_mirror_len] rows, pad rows 0 / False):
    ``positions`` (the original goes to ``positions_cp``, same object), ``ngram_token_ids``,
    ``gate_force_random_cp`` (``gate_force_random`` itself is kept), ``valid_token_mask``
    (the full mask gathered; ``mirror_cp_index != -1`` when ``md`` has none). ``ks``/``ke``
    come from :func:`prepare_cp_mirror` with the sparse ratios = keys of ``md.ks`` (an empty or
    missing ``ks`` runs ratio ``(1,)`` and drops the result). Added: ``mirror_cp_index``,
    ``mirror_cp_reverse_index``, ``cp_mirror_len``, ``cp_rank``, ``cp_size``. Expanded indices
    already computed on ``md`` (``kv_ca_index``, ``kv_ca_index_len``, ``kv_swa_full_index``)
    are gathered too (pad rows -1 / 0), matching what ``compute_attn_info`` does on a mirrored
    object. Example: ``sq=10, p=2`` -> rank 1 holds rows ``3..8`` with ``positions`` ``3..8``.
    """
    _check_cp(cp_size, cp_rank)
    if not isinstance(md, InputMetadata):
        raise TypeError(f"md: expected an InputMetadata, got {type(md).__name__}")
    if md.is_prompt is not True:
        raise ValueError(f"md.is_prompt: the CP mirror applies to prompt metadata only, got {md.is_prompt!r}")
    if md.mirror_cp_index is not None:
        raise ValueError(f"md.mirror_cp_index: metadata is already mirrored (cp_rank={md.cp_rank})")
    for name in ("cu_seqlens_q", "cu_seqlens_k", "positions"):
        if not isinstance(getattr(md, name), torch.Tensor):
            raise ValueError(f"md.{name}: expected a tensor, got {getattr(md, name)!r}")

    total_q = int(md.positions.shape[0])
    has_ks = bool(md.ks)
    ratios = tuple(int(r) for r in md.ks) if has_ks else NO_SPARSE_RATIOS_FALLBACK
    cu_q = _host_cu("md.cu_seqlens_q", md.cu_seqlens_q)  # the only device-to-host copies
    cu_k = _host_cu("md.cu_seqlens_k", md.cu_seqlens_k)
    length = int(2 * _chunk_len(np.diff(cu_q), cp_size).sum())
    _validate_mirror_args(cu_q, cu_k, ratios, total_q, length, cp_size)
    index, reverse, ks_all, ke_all = _mirror_from_host(
        cu_q, cu_k, md.positions.device, cp_size, cp_rank, ratios, total_q, length
    )
    gather = _RowGather(index)
    if md.valid_token_mask is not None:
        valid = gather(md.valid_token_mask, False)
    else:
        valid = index != MIRROR_PAD_INDEX
    changes: dict[str, object] = dict(
        positions=gather(md.positions, 0),
        positions_cp=md.positions,
        valid_token_mask=valid,
        mirror_cp_index=index,
        mirror_cp_reverse_index=reverse,
        cp_mirror_len=length,
        cp_rank=cp_rank,
        cp_size=cp_size,
    )
    if md.ngram_token_ids is not None:
        changes["ngram_token_ids"] = gather(md.ngram_token_ids, 0)
    if md.gate_force_random is not None:
        changes["gate_force_random_cp"] = gather(md.gate_force_random, False)
    if has_ks:
        changes["ks"] = {k: ks_all[k] for k in md.ks}
        changes["ke"] = {k: ke_all[k] for k in md.ks}
    for name, fill in _DERIVED_ROW_FILLS.items():
        value = getattr(md, name)
        if isinstance(value, dict):
            changes[name] = _gather_dict(value, gather, fill)
        elif isinstance(value, torch.Tensor):
            changes[name] = gather(value, fill)
    logger.debug("mirrored %d rows to %d on cp rank %d/%d", total_q, length, cp_rank, cp_size)
    mirrored = md.replace(**changes)
    if md.yoco_consumer_cu_seqlens_q is not None:  # YoCo compact + CP fields (DESIGN 10), cpmeta/yoco.py
        from .yoco import mirror_yoco  # lazy: yoco imports this module

        mirrored = mirror_yoco(md, mirrored, cp_rank, cp_size)
    return mirrored
