"""Slot mapping: logical token position -> physical KV-cache slot, with CP-interleaved KV.

DESIGN section 11. Request ``q`` owns token rows ``[query_start_loc[q], query_start_loc[q+1])``;
every row gets the slot its key/value is written to, or ``pad_id`` when this rank writes nothing
(a token another CP rank owns, a negative circular position, the tail up to ``max_num_tokens``).

Three layouts:

* plain: ``slot = block_table[q, pos // block_size] * block_size + pos % block_size``.
* CP interleave (``cp_world_size > 1``): the KV of one physical block of ``kvb`` tokens on each of
  the ``W`` ranks forms one *virtual block* of ``vbs = kvb * W`` positions; inside it, runs of
  ``cp_interleave`` positions go to the ranks round-robin. A rank packs its runs into consecutive
  local offsets, so its local KV is dense (see :func:`locate`).
* circular: one ring block (block index 0), ``offset = pos % block_size``; ``pos < 0`` is padding.

CPU tensors take a vectorized torch path; CUDA tensors take ONE Triton kernel
(:mod:`cpmeta.gpu.slot_mapping_triton`) unless ``backend="torch"``. Both give identical results.

Validation cost: argument checks are host-only. Checks that need tensor *data* (the
``query_start_loc`` layout, negative positions, block indices inside the row, int32 slots) are
evaluated on the tensors' device next to the computation; no index is ever read out of bounds
even on bad input. By default one 4-byte device-to-host read per call (a stream sync, not a
per-token one) turns a failed check into the ``ValueError``; pass ``error_out`` to record the
failure bits on the device instead (no sync, CUDA-graph capturable) and check them later with
:func:`describe_slot_mapping_error`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..constants import INT32_MAX, PAD_SLOT_ID
from .slot_mapping_errors import SlotMappingError, describe_slot_mapping_error
from .slot_mapping_params import SlotMappingParams

__all__ = [
    "compute_slot_mapping",
    "locate",
    "make_params",
    "check_tensor_args",
    "torch_slot_mapping",
    "use_triton",
    "raise_first_error",
    "int_arg",
    "SlotMappingError",
    "describe_slot_mapping_error",
    "SlotMappingParams",
    "BACKENDS",
]

#: Accepted ``backend`` values: ``auto`` = Triton for CUDA tensors (torch if Triton is missing).
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")

INT32_MIN: int = -(2**31)
_INDEX_DTYPES = (torch.int32, torch.int64)


def int_arg(name: str, value: object, lo: int, hi: int = INT32_MAX) -> int:
    """``value`` as an int in ``[lo, hi]`` (``TypeError`` / ``ValueError`` naming ``name``).
    Example: ``int_arg("block_size", 0, 1)`` -> ``ValueError("block_size: expected 1 <= ...")``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected {lo} <= {name} <= {hi}, got {value}")
    return value


def make_params(
    block_size: int, max_num_tokens: int, kv_cache_block_size: Optional[int], cp_world_size: int,
    cp_rank: int, cp_interleave: int, pad_id: int, circular: bool,
) -> SlotMappingParams:
    """Check the scalar arguments (DESIGN section 11) and bundle them; errors name the argument."""
    bs = int_arg("block_size", block_size, 1)
    mnt = int_arg("max_num_tokens", max_num_tokens, 0)
    kvb = bs if kv_cache_block_size is None else int_arg("kv_cache_block_size", kv_cache_block_size, 1)
    world = int_arg("cp_world_size", cp_world_size, 1)
    if not isinstance(cp_rank, int) or isinstance(cp_rank, bool):
        raise TypeError(f"cp_rank: expected an int, got {type(cp_rank).__name__}")
    if not 0 <= cp_rank < world:
        raise ValueError(f"cp_rank: expected 0 <= cp_rank < cp_world_size ({world}), got {cp_rank}")
    inter = int_arg("cp_interleave", cp_interleave, 1)
    pad = int_arg("pad_id", pad_id, INT32_MIN)
    if not isinstance(circular, bool):
        raise TypeError(f"circular: expected a bool, got {type(circular).__name__}")
    if circular and world > 1:
        raise ValueError(f"circular: a circular KV cache cannot be used with CP (cp_world_size={world})")
    if world > 1:
        if kvb % bs:
            raise ValueError(f"kv_cache_block_size: expected a multiple of block_size ({bs}), got {kvb}")
        if kvb % inter:
            raise ValueError(
                f"cp_interleave: expected a divisor of kv_cache_block_size ({kvb}), got {inter} "
                "(otherwise two positions would share a slot)"
            )
        if kvb * world > INT32_MAX:
            raise ValueError(f"kv_cache_block_size: kvb * cp_world_size = {kvb * world} overflows int32")
    return SlotMappingParams(bs, mnt, kvb, kvb // bs, world, cp_rank, inter, pad, circular)


def locate(pos: torch.Tensor, prm: SlotMappingParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block index, in-block offset and ownership of each position (vectorized).

    ``pos``: [n] int64. Returns ``(bi, off, is_local)``: [n] int64, [n] int64, [n] bool. Values
    are meaningful where ``pos >= 0`` and ``is_local``. CP formula, ``vbs = kvb * W``::

        vbi = pos // vbs; vbo = pos % vbs
        is_local = (vbo // I) % W == rank
        local = (vbo // (W * I)) * I + vbo % I
        bi = vbi * (kvb // block_size) + local // block_size;  off = local % block_size

    Worked example (the seed's): W=2, I=128, block_size=kvb=128, so vbs=256. pos=300: vbi=1,
    vbo=44, (44 // 128) % 2 = 0 -> rank 0; local = 0*128 + 44 = 44; bi = 1*1 + 0 = 1, off=44:
    rank 0's 172nd local slot (positions 0..127 -> 0..127, 256..383 -> 128..255). With I=1,
    block_size=kvb=16: pos=37: vbo=5, 5 % 2 = 1 -> rank 1; local = 2; bi = 1, off = 2 -> local
    index 18 = 37 // 2.
    """
    if prm.circular:
        return torch.zeros_like(pos), pos % prm.block_size, torch.ones_like(pos, dtype=torch.bool)
    if not prm.use_cp:
        return pos // prm.block_size, pos % prm.block_size, torch.ones_like(pos, dtype=torch.bool)
    world, inter = prm.cp_world_size, prm.cp_interleave
    vbs = prm.kv_block_size * world
    vbi, vbo = pos // vbs, pos % vbs
    is_local = (vbo // inter) % world == prm.cp_rank
    local = (vbo // (world * inter)) * inter + vbo % inter
    bi = vbi * prm.blocks_per_kv_block + local // prm.block_size
    return bi, local % prm.block_size, is_local


def check_tensor_args(
    qsl: Any, positions: Any, block_table: Any, prm: SlotMappingParams, out: Any, error_out: Any,
) -> None:
    """Host-only checks of the tensor arguments (types, shapes, devices); no data is read."""
    for name, t, ndim in (("query_start_loc", qsl, 1), ("positions", positions, 1),
                          ("block_table", block_table, 2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name}: expected dtype int32 or int64, got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    device = positions.device
    for name, t in (("query_start_loc", qsl), ("block_table", block_table)):
        if t.device != device:
            raise ValueError(f"{name}: expected the device of positions ({device}), got {t.device}")
    if qsl.shape[0] < 1:
        raise ValueError("query_start_loc: expected [num_reqs + 1] entries, got an empty tensor")
    n_tok, num_reqs = positions.shape[0], qsl.shape[0] - 1
    if n_tok > prm.max_num_tokens:
        raise ValueError(f"max_num_tokens: expected >= num_tokens = len(positions) ({n_tok}), "
                         f"got {prm.max_num_tokens}")
    if block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table: expected at least num_reqs = {num_reqs} rows, "
                         f"got {block_table.shape[0]}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.int32:
            raise TypeError(f"out: expected an int32 tensor, got {getattr(out, 'dtype', type(out))}")
        if tuple(out.shape) != (prm.max_num_tokens,) or not out.is_contiguous() or out.device != device:
            raise ValueError(f"out: expected a contiguous [{prm.max_num_tokens}] tensor on {device}, "
                             f"got shape {tuple(out.shape)} on {out.device}")
    if error_out is not None:
        if not isinstance(error_out, torch.Tensor) or error_out.dtype != torch.int32:
            raise TypeError("error_out: expected a [1] int32 tensor")
        if tuple(error_out.shape) != (1,) or error_out.device != device:
            raise ValueError(f"error_out: expected shape (1,) on {device}, got "
                             f"{tuple(error_out.shape)} on {error_out.device}")


def raise_first_error(
    qsl: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor, prm: SlotMappingParams,
) -> None:
    """Raise a ``ValueError`` naming the argument, request and token of the first data error.

    CPU tensors (the device paths copy their inputs here only after a check failed). Order:
    ``query_start_loc`` layout, ``positions`` count, negative positions, block index, int32 slot.
    """
    q, n_tok = qsl.to(torch.int64), positions.shape[0]
    if int(q[0]) != 0:
        raise ValueError(f"query_start_loc[0]: expected 0, got {int(q[0])}")
    dec = (q[1:] < q[:-1]).nonzero()
    if dec.numel():
        i = int(dec[0, 0])
        raise ValueError(f"query_start_loc: expected non-decreasing values, got query_start_loc[{i}]"
                         f"={int(q[i])} > query_start_loc[{i + 1}]={int(q[i + 1])}")
    if int(q[-1]) != n_tok:
        raise ValueError(f"positions: expected num_tokens = query_start_loc[-1] = {int(q[-1])} "
                         f"entries, got {n_tok}")
    pos = positions.to(torch.int64)
    req = torch.searchsorted(q[1:].contiguous(), torch.arange(n_tok), right=True)
    if not prm.circular and bool((pos < 0).any()):
        t = int((pos < 0).nonzero()[0, 0])
        raise ValueError(f"positions[{t}]: expected >= 0 (request {int(req[t])}; negative positions "
                         f"need circular=True), got {int(pos[t])}")
    bi, off, is_local = locate(pos, prm)
    want = is_local & (pos >= 0)
    cols = block_table.shape[1]
    if bool((want & (bi >= cols)).any()):
        t = int((want & (bi >= cols)).nonzero()[0, 0])
        raise ValueError(f"block_table: request {int(req[t])} token {t} (position {int(pos[t])}) "
                         f"needs block index {int(bi[t])}, but its row has {cols} entries")
    rows = want.nonzero()[:, 0]
    bn = block_table[req[rows], bi[rows]].to(torch.int64)
    slot = bn * prm.block_size + off[rows]
    bad = ((slot > INT32_MAX) | (slot < INT32_MIN)).nonzero()
    if bad.numel():
        k = int(bad[0, 0])
        t = int(rows[k])
        raise ValueError(f"block_table: request {int(req[t])} token {t}: slot {int(bn[k])} * "
                         f"{prm.block_size} + {int(off[t])} = {int(slot[k])} does not fit in int32")


def torch_slot_mapping(
    qsl: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor, prm: SlotMappingParams,
    out: torch.Tensor,
) -> torch.Tensor:
    """Vectorized torch path (any device): fill ``out`` and return the [] int32 error word.

    Bad input never indexes out of bounds: rows that fail a check read block-table entry
    (0, 0) only when it exists, and are reported through the error word.
    """
    n_tok, num_reqs = positions.shape[0], qsl.shape[0] - 1
    bt_rows, bt_cols = block_table.shape
    q = qsl.to(torch.int64)
    pos = positions.to(torch.int64)
    tok = torch.arange(n_tok, device=pos.device, dtype=torch.int64)
    req = torch.searchsorted(q[1:].contiguous(), tok, right=True)  # [n_tok], request of each row
    bi, off, is_local = locate(pos, prm)
    want = is_local & (pos >= 0) & (req < min(num_reqs, bt_rows))
    read = want & (bi < bt_cols)
    if bt_rows > 0 and bt_cols > 0:
        bn = block_table[torch.where(read, req, 0), torch.where(read, bi, 0)].to(torch.int64)
    else:
        bn = torch.zeros_like(pos)
    slot = bn * prm.block_size + off
    out[n_tok:].fill_(prm.pad_id)
    out[:n_tok].copy_(torch.where(read, slot, prm.pad_id))

    E = SlotMappingError
    flags = [
        (q[0] != 0, E.QUERY_START),
        ((q[1:] < q[:-1]).any(), E.QUERY_ORDER),
        (q[-1] != n_tok, E.NUM_TOKENS),
        ((want & ~read).any(), E.BLOCK_INDEX),
        ((read & ((slot > INT32_MAX) | (slot < INT32_MIN))).any(), E.SLOT_OVERFLOW),
    ]
    if not prm.circular:
        flags.append(((pos < 0).any(), E.NEGATIVE_POSITION))
    err = torch.zeros((), dtype=torch.int32, device=pos.device)
    for cond, bit in flags:
        err = err | cond.to(torch.int32) * int(bit)
    return err


def use_triton(device: torch.device, backend: str) -> bool:
    if backend == "torch":
        return False
    if device.type != "cuda":
        if backend == "triton":
            raise ValueError(f"backend: 'triton' needs CUDA tensors, got tensors on {device}")
        return False
    from ..gpu import slot_mapping_triton as tri

    if tri.triton_available():
        return True
    if backend == "triton":
        raise ValueError("backend: 'triton' requested but triton cannot be imported")
    tri.warn_fallback_once()
    return False


def compute_slot_mapping(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    *,
    max_num_tokens: int,
    kv_cache_block_size: Optional[int] = None,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    pad_id: int = PAD_SLOT_ID,
    circular: bool = False,
    out: Optional[torch.Tensor] = None,
    error_out: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Physical KV slot of every token row, padded to ``max_num_tokens`` (DESIGN section 11).

    Args:
        query_start_loc: [num_reqs+1] int32/int64, exclusive prefix sums of tokens per request
            (``query_start_loc[0] == 0``, non-decreasing).
        positions: [num_tokens] int64 (int32 accepted), absolute position of each token row;
            ``num_tokens == query_start_loc[-1]``.
        block_table: [max_reqs >= num_reqs, max_blocks] int32 (int64 accepted), physical block ids.
        block_size: tokens per (logical) block.
        max_num_tokens: output length (>= num_tokens); rows past num_tokens hold ``pad_id``.
        kv_cache_block_size: physical KV block ``kvb`` (CP only; default ``block_size``).
        cp_world_size, cp_rank, cp_interleave: CP group size, this rank, interleave run length.
        pad_id: value of rows this rank does not write.
        circular: ring KV (block index 0, ``pos % block_size``; ``pos < 0`` -> ``pad_id``).
        out: optional [max_num_tokens] int32 contiguous destination on the inputs' device.
        error_out: optional [1] int32 tensor on the inputs' device: data checks OR
            :class:`SlotMappingError` bits into it instead of raising (no host sync).
        backend: ``"auto"`` (Triton for CUDA tensors), ``"torch"`` or ``"triton"``.

    Returns:
        [max_num_tokens] int32 slot mapping on the inputs' device (``out`` when given).

    Example (plain, block_size=4): query_start_loc=[0, 2, 3], positions=[5, 6, 0],
    block_table=[[7, 3], [9, 9]], max_num_tokens=5 -> [3*4+1, 3*4+2, 9*4+0, -1, -1]
    = [13, 14, 36, -1, -1].

    Raises:
        TypeError / ValueError naming the argument (and the request / token for data errors).
    """
    prm = make_params(block_size, max_num_tokens, kv_cache_block_size, cp_world_size, cp_rank,
                      cp_interleave, pad_id, circular)
    check_tensor_args(query_start_loc, positions, block_table, prm, out, error_out)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    device = positions.device
    if out is None:
        out = torch.empty(prm.max_num_tokens, dtype=torch.int32, device=device)
    qsl, pos = query_start_loc.contiguous(), positions.contiguous()
    if use_triton(device, backend):
        from ..gpu import slot_mapping_triton as tri

        err = error_out if error_out is not None else torch.zeros(1, dtype=torch.int32, device=device)
        tri.launch_slot_mapping_kernel(qsl, pos, block_table, out, err, prm)
    else:
        err_word = torch_slot_mapping(qsl, pos, block_table, prm, out)
        if error_out is not None:
            error_out.bitwise_or_(err_word)
            return out
        err = err_word
    if error_out is None and int(err.reshape(-1)[0].item()) != 0:  # the one host sync per call
        raise_first_error(qsl.cpu(), pos.cpu(), block_table.cpu(), prm)
        raise ValueError(describe_slot_mapping_error(err))  # unreachable unless the paths disagree
    return out
