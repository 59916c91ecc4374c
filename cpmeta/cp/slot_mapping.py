"""Slot mapping: logical token position -> physical KV-cache slot, with CP-interleaved KV.

docs/design.md section 11. Request ``q`` owns token rows ``[query_start_loc[q], query_start_loc[q+1])``;
every row gets the slot its key/value is written to, or ``pad_id`` when this rank writes nothing
(a token another CP rank owns, a negative circular position, the tail up to ``max_num_tokens``).

Three layouts:

* plain: ``slot = block_table[q, pos // block_size] * block_size + pos % block_size``.
* CP interleave (``cp_world_size > 1``): the KV of one physical block of ``kvb`` tokens on each of
  the ``W`` ranks forms one *virtual block* of ``vbs = kvb * W`` positions; inside it, runs of
  ``cp_interleave`` positions go to the ranks round-robin. A rank packs its runs into consecutive
  local offsets, so its local KV is dense (see :func:`locate`).
* circular: one ring block (block index 0), ``offset = pos % block_size``; ``pos < 0`` is padding.

CPU tensors take ONE compiled call (:func:`cpmeta.cp.slot_mapping_njit.slot_fill`); CUDA
tensors take ONE Triton kernel (:mod:`cpmeta.gpu.slot_mapping_triton`) unless
``backend="torch"``, which runs the compiled CPU kernel on host copies and copies the slots
back. Both give identical results.

Validation cost: argument checks are host-only. Checks that need tensor *data* (the
``query_start_loc`` layout, negative positions, block indices inside the row, int32 slots) run
inside the kernel that computes the slots; no index is ever read out of bounds even on bad input.
The kernel returns the failure bits; without ``error_out`` a failure is raised as the
``ValueError`` naming the first bad token (on CUDA: one 4-byte device-to-host read per call, a
stream sync); pass ``error_out`` to record the bits instead (on CUDA no sync, CUDA-graph
capturable) and check them later with :func:`describe_slot_mapping_error`.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ..constants import INT32_MAX, PAD_SLOT_ID
from ..jit import error_slot
from . import slot_mapping_njit as K
from .slot_mapping_errors import SlotMappingError, describe_slot_mapping_error
from .slot_mapping_params import SlotMappingParams

__all__ = [
    "compute_slot_mapping",
    "make_params",
    "check_tensor_args",
    "host_slot_mapping",
    "use_triton",
    "raise_slot_error",
    "int_arg",
    "SlotMappingError",
    "describe_slot_mapping_error",
    "SlotMappingParams",
    "BACKENDS",
]

#: Accepted ``backend`` values: ``auto`` = Triton for CUDA tensors (the compiled CPU kernel if
#: Triton is missing); ``torch`` = the compiled CPU kernel on host copies (the name kept from the
#: torch path it replaced); ``triton`` = Triton or an error.
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
    """Check the scalar arguments (docs/design.md section 11) and bundle them; errors name the argument."""
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


def _locate_one(x: int, prm: SlotMappingParams) -> tuple[int, int]:
    """Block index and offset of one owned position ``x >= 0`` (the error messages' numbers; the
    kernel's formulas, :func:`cpmeta.cp.slot_mapping_njit.slot_fill`). Example (W=2, I=128,
    block_size=kvb=128): 300 -> ``(1, 44)``."""
    if prm.circular:
        return 0, x % prm.block_size
    if not prm.use_cp:
        return x // prm.block_size, x % prm.block_size
    world, inter = prm.cp_world_size, prm.cp_interleave
    vbs = prm.kv_block_size * world
    vbo = x % vbs
    local = (vbo // (world * inter)) * inter + vbo % inter
    return (x // vbs) * prm.blocks_per_kv_block + local // prm.block_size, local % prm.block_size


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


def host_slot_mapping(
    qsl: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor, prm: SlotMappingParams,
    out: torch.Tensor, err: np.ndarray,
) -> int:
    """ONE :func:`~cpmeta.cp.slot_mapping_njit.slot_fill` call on host copies (free for CPU
    tensors of the usual dtypes): fills ``out`` ([max_num_tokens] int32, any device; a device
    ``out`` gets one copy) and ``err``; returns the error bits."""
    q = np.ascontiguousarray(qsl.detach().cpu().numpy(), np.int64)
    pos = np.ascontiguousarray(positions.detach().cpu().numpy(), np.int64)
    table = block_table.detach().cpu().contiguous().numpy()
    host = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=torch.int32)
    bits = int(K.slot_fill(q, pos, table, K.params_array(prm), host.numpy(), err))
    if host is not out:
        out.copy_(host)
    return bits


def raise_slot_error(
    err: np.ndarray, qsl: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
    prm: SlotMappingParams,
) -> None:
    """Raise the ``ValueError`` of the first failed check the kernel reported in ``err =
    [bit, index, request, 0]`` (the argument, request and token named)."""
    bit, t, req = (int(v) for v in err[:3])
    E = SlotMappingError
    if bit == E.QUERY_START:
        raise ValueError(f"query_start_loc[0]: expected 0, got {int(qsl[0])}")
    if bit == E.QUERY_ORDER:
        raise ValueError(f"query_start_loc: expected non-decreasing values, got query_start_loc[{t}]"
                         f"={int(qsl[t])} > query_start_loc[{t + 1}]={int(qsl[t + 1])}")
    if bit == E.NUM_TOKENS:
        raise ValueError(f"positions: expected num_tokens = query_start_loc[-1] = {int(qsl[-1])} "
                         f"entries, got {positions.shape[0]}")
    x = int(positions[t])
    if bit == E.NEGATIVE_POSITION:
        raise ValueError(f"positions[{t}]: expected >= 0 (request {req}; negative positions "
                         f"need circular=True), got {x}")
    bi, off = _locate_one(x, prm)
    if bit == E.BLOCK_INDEX:
        raise ValueError(f"block_table: request {req} token {t} (position {x}) "
                         f"needs block index {bi}, but its row has {block_table.shape[1]} entries")
    bn = int(block_table[req, bi])
    raise ValueError(f"block_table: request {req} token {t}: slot {bn} * {prm.block_size} + {off} = "
                     f"{bn * prm.block_size + off} does not fit in int32")


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
    """Physical KV slot of every token row, padded to ``max_num_tokens`` (docs/design.md section 11).

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
        backend: ``"auto"`` (Triton for CUDA tensors), ``"torch"`` (the compiled CPU kernel, on
            host copies of CUDA tensors) or ``"triton"``.

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
        where = error_slot()
        bits = host_slot_mapping(qsl, pos, block_table, prm, out, where)
        if error_out is not None:
            error_out.bitwise_or_(bits)
        elif bits:
            raise_slot_error(where, qsl.cpu(), pos.cpu(), block_table.cpu(), prm)
        return out
    if error_out is None and int(err.reshape(-1)[0].item()) != 0:  # the one host sync per call
        where = error_slot()
        host_slot_mapping(qsl, pos, block_table, prm, torch.empty(prm.max_num_tokens, dtype=torch.int32), where)
        if where[0]:
            raise_slot_error(where, qsl.cpu(), pos.cpu(), block_table.cpu(), prm)
        raise ValueError(describe_slot_mapping_error(err))  # unreachable unless the paths disagree
    return out
