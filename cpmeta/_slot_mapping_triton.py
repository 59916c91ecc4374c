"""The CUDA path of :func:`cpmeta.compute_slot_mapping`: ONE Triton kernel, plus its error word.

Triton is imported lazily (first CUDA call), so this module also loads on CPU-only machines;
the error bits and their texts live here because the kernel writes them.

Grid ``(num_reqs + 1,)``::

    program q < num_reqs : rows [query_start_loc[q], query_start_loc[q+1]) in tiles of TILE rows
    program num_reqs     : pads rows [query_start_loc[-1], max_num_tokens) with pad_id, and checks
                           query_start_loc[0] == 0 and query_start_loc[-1] == len(positions)

Bounded block-table window: a tile of ``TILE`` consecutive positions reads at most
``cdiv(TILE, block_size) + 1`` consecutive block indices (also under CP: the local tokens of
consecutive positions have consecutive rank-local offsets). Each tile loads only
``WINDOW = next_pow2(cdiv(TILE, block_size) + 1)`` entries of its row, starting at the smallest
block index the tile reads, and gathers from registers (``tl.gather``). Example: TILE=1024,
block_size=128: cdiv = 8, + 1 = 9 -> WINDOW = 16 entries, whatever the row length. Tokens whose
block index falls outside the window (positions that jump within a request) load their entry
directly, so arbitrary positions stay exact.

Every read is masked: rows past ``len(positions)`` or ``max_num_tokens``, block indices past the
row, non-local and padded tokens read nothing. Failed checks OR :class:`SlotMappingError` bits
into a 1-element int32 error word with ``atomic_or`` only on failing lanes (no atomics on
valid input).
"""

from __future__ import annotations

import enum
import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .slot_mapping import SlotMappingParams

__all__ = [
    "SlotMappingError",
    "describe_slot_mapping_error",
    "triton_available",
    "window_size",
    "launch_slot_mapping_kernel",
    "DEFAULT_TILE",
    "NUM_WARPS",
]

logger = logging.getLogger(__name__)

#: Token rows per tile (one loop iteration of a request's program).
DEFAULT_TILE: int = 1024
#: Warps per program: 128 threads, 8 rows each at TILE=1024.
NUM_WARPS: int = 4
_INT32_MAX: int = 2**31 - 1
_INT32_MIN: int = -(2**31)


class SlotMappingError(enum.IntFlag):
    """Bits of the device-side error word (``error_out``); each names the argument at fault."""

    QUERY_START = 1  # query_start_loc[0] != 0
    QUERY_ORDER = 2  # query_start_loc decreases somewhere
    NUM_TOKENS = 4  # query_start_loc[-1] != len(positions)
    NEGATIVE_POSITION = 8  # positions < 0 without circular=True
    BLOCK_INDEX = 16  # a token that is read needs a block index past its block_table row
    SLOT_OVERFLOW = 32  # block id * block_size + offset does not fit in int32


_ERROR_TEXT: dict[SlotMappingError, str] = {
    SlotMappingError.QUERY_START: "query_start_loc[0]: expected 0",
    SlotMappingError.QUERY_ORDER: "query_start_loc: expected non-decreasing values",
    SlotMappingError.NUM_TOKENS: "positions: expected num_tokens = query_start_loc[-1] entries",
    SlotMappingError.NEGATIVE_POSITION: "positions: expected >= 0 (negative only with circular=True)",
    SlotMappingError.BLOCK_INDEX: "block_table: a token reads a block index outside its row",
    SlotMappingError.SLOT_OVERFLOW: "block_table: a slot (block id * block_size + offset) overflows int32",
}


def describe_slot_mapping_error(bits: "int | torch.Tensor") -> Optional[str]:
    """Text for an error word written through ``error_out``; ``None`` when it is 0.

    ``bits`` is an int or a 1-element tensor (reading a CUDA tensor syncs its stream). Example:
    ``describe_slot_mapping_error(SlotMappingError.QUERY_START | SlotMappingError.BLOCK_INDEX)``
    -> ``"query_start_loc[0]: expected 0; block_table: a token reads ..."``.
    """
    value = int(bits.reshape(-1)[0].item()) if isinstance(bits, torch.Tensor) else int(bits)
    if value == 0:
        return None
    parts = [text for flag, text in _ERROR_TEXT.items() if value & flag]
    unknown = value & ~sum(int(f) for f in _ERROR_TEXT)
    if unknown:
        parts.append(f"unknown error bits {unknown:#x}")
    return "; ".join(parts)


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works here (checked once)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def warn_fallback_once() -> None:
    """Log once that CUDA tensors take the torch path because Triton is missing."""
    logger.warning("compute_slot_mapping: triton is not importable; CUDA tensors use the torch path")


def window_size(tile: int, block_size: int) -> int:
    """Block-table entries one tile loads: ``next_pow2(cdiv(tile, block_size) + 1)``.

    Examples: (1024, 128) -> next_pow2(9) = 16; (1024, 16) -> next_pow2(65) = 128;
    (1024, 1) -> next_pow2(1025) = 2048; (1024, 4096) -> next_pow2(2) = 2.
    """
    need = -(-tile // block_size) + 1
    return 1 << (need - 1).bit_length()


@functools.cache
def _kernel() -> Callable[..., Any]:
    """Build (once) the jitted kernel; importing triton here keeps CPU-only imports light."""
    import triton
    import triton.language as tl

    @triton.jit
    def _slot_mapping_kernel(
        qsl_ptr, pos_ptr, bt_ptr, out_ptr, err_ptr,
        num_positions, max_num_tokens, bt_row_stride, bt_col_stride, bt_cols,
        block_size, virtual_block_size, blocks_per_kv_block,
        cp_world_size, cp_rank, cp_interleave, pad_id,
        USE_CP: tl.constexpr, IS_CIRCULAR: tl.constexpr, TILE: tl.constexpr, WINDOW: tl.constexpr,
        SLOT_MIN: tl.constexpr, SLOT_MAX: tl.constexpr,
        ERR_QUERY_START: tl.constexpr, ERR_QUERY_ORDER: tl.constexpr, ERR_NUM_TOKENS: tl.constexpr,
        ERR_NEGATIVE: tl.constexpr, ERR_BLOCK_INDEX: tl.constexpr, ERR_OVERFLOW: tl.constexpr,
    ):
        req = tl.program_id(0)
        num_reqs = tl.num_programs(0) - 1
        lanes = tl.arange(0, TILE)
        if req == num_reqs:
            # ---- tail program: checks on query_start_loc, then rows [num_tokens, max) = pad.
            num_tokens = tl.load(qsl_ptr + num_reqs)
            first = tl.load(qsl_ptr)
            bad_first = first != 0
            tl.atomic_or(err_ptr, tl.where(bad_first, ERR_QUERY_START, 0), mask=bad_first)
            bad_total = num_tokens != num_positions
            tl.atomic_or(err_ptr, tl.where(bad_total, ERR_NUM_TOKENS, 0), mask=bad_total)
            pad_start = tl.minimum(tl.maximum(num_tokens, 0), max_num_tokens)
            pad_vals = tl.zeros([TILE], dtype=tl.int32) + pad_id
            for t0 in range(pad_start, max_num_tokens, TILE):
                idx = t0 + lanes
                tl.store(out_ptr + idx, pad_vals, mask=idx < max_num_tokens)
        else:
            start = tl.load(qsl_ptr + req)
            end = tl.load(qsl_ptr + req + 1)
            bad_order = end < start
            tl.atomic_or(err_ptr, tl.where(bad_order, ERR_QUERY_ORDER, 0), mask=bad_order)
            lo = tl.maximum(start, 0)
            hi = tl.minimum(tl.minimum(end, num_positions), max_num_tokens)
            row_ptr = bt_ptr + req.to(tl.int64) * bt_row_stride
            for t0 in range(lo, hi, TILE):
                idx = t0 + lanes
                m = idx < hi
                pos = tl.load(pos_ptr + idx, mask=m, other=0).to(tl.int64)
                # ---- logical position -> (block index, offset, owned by this rank)
                if IS_CIRCULAR:  # negative positions are padding, not errors
                    bi = tl.zeros([TILE], dtype=tl.int64)
                    off = pos % block_size
                    want = m & (pos >= 0)
                    err = tl.zeros([TILE], dtype=tl.int32)
                elif USE_CP:
                    vbi = pos // virtual_block_size
                    vbo = pos % virtual_block_size
                    is_local = (vbo // cp_interleave) % cp_world_size == cp_rank
                    local = (vbo // (cp_world_size * cp_interleave)) * cp_interleave + vbo % cp_interleave
                    bi = vbi * blocks_per_kv_block + local // block_size
                    off = local % block_size
                    want = m & (pos >= 0) & is_local
                    err = tl.where(m & (pos < 0), ERR_NEGATIVE, 0)
                else:
                    bi = pos // block_size
                    off = pos % block_size
                    want = m & (pos >= 0)
                    err = tl.where(m & (pos < 0), ERR_NEGATIVE, 0)
                err = err | tl.where(want & (bi >= bt_cols), ERR_BLOCK_INDEX, 0)
                read = want & (bi < bt_cols)
                # ---- bounded window of the block-table row, gathered in registers
                base = tl.min(tl.where(read, bi, bt_cols), axis=0)
                wcols = base + tl.arange(0, WINDOW)
                win = tl.load(row_ptr + wcols * bt_col_stride, mask=wcols < bt_cols, other=0)
                rel = bi - base
                near = read & (rel < WINDOW)
                bn_near = tl.gather(win, tl.where(near, rel, 0).to(tl.int32), 0)
                far = read & (rel >= WINDOW)
                bn_far = tl.load(row_ptr + bi * bt_col_stride, mask=far, other=0)
                bn = tl.where(near, bn_near, bn_far).to(tl.int64)
                slot = bn * block_size + off
                err = err | tl.where(read & ((slot > SLOT_MAX) | (slot < SLOT_MIN)), ERR_OVERFLOW, 0)
                res = tl.where(read, slot, pad_id).to(tl.int32)
                tl.store(out_ptr + idx, res, mask=m)
                tl.atomic_or(err_ptr + lanes * 0, err, mask=err != 0)

    return _slot_mapping_kernel


def launch_slot_mapping_kernel(
    qsl: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor,
    err: torch.Tensor, prm: "SlotMappingParams", *, tile: int = DEFAULT_TILE,
) -> None:
    """Launch the kernel on validated arguments (no host sync; errors OR into ``err``).

    ``qsl`` [num_reqs+1] and ``positions`` [num_tokens] contiguous int32/int64; ``block_table``
    [rows, cols] int32/int64, any strides; ``out`` [max_num_tokens] int32; ``err`` [1] int32.
    ``tile`` must be a power of two (``tl.arange``).
    """
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile: expected a power of two, got {tile}")
    E = SlotMappingError
    grid = (qsl.shape[0],)  # num_reqs request programs + 1 tail program
    _kernel()[grid](
        qsl, positions, block_table, out, err,
        positions.shape[0], prm.max_num_tokens, block_table.stride(0), block_table.stride(1),
        block_table.shape[1], prm.block_size, prm.kv_block_size * prm.cp_world_size,
        prm.blocks_per_kv_block,
        prm.cp_world_size, prm.cp_rank, prm.cp_interleave, prm.pad_id,
        USE_CP=prm.use_cp, IS_CIRCULAR=prm.circular, TILE=tile,
        WINDOW=window_size(tile, prm.block_size), SLOT_MIN=_INT32_MIN, SLOT_MAX=_INT32_MAX,
        ERR_QUERY_START=int(E.QUERY_START), ERR_QUERY_ORDER=int(E.QUERY_ORDER),
        ERR_NUM_TOKENS=int(E.NUM_TOKENS), ERR_NEGATIVE=int(E.NEGATIVE_POSITION),
        ERR_BLOCK_INDEX=int(E.BLOCK_INDEX), ERR_OVERFLOW=int(E.SLOT_OVERFLOW),
        num_warps=NUM_WARPS,
    )
