"""The CUDA path of :func:`cpmeta.compute_slot_mapping`: ONE Triton kernel, plus its error word.

The kernel itself is :func:`cpmeta.gpu.slot_mapping_kernels.slot_mapping_kernel` (with the device
functions it shares with the several-groups kernel); that module imports triton and is imported
on the first launch, so this one also loads on CPU-only machines.

Grid ``(num_reqs + 1,)``::

    program q < num_reqs : rows [query_start_loc[q], query_start_loc[q+1]) in tiles of TILE rows
    program num_reqs     : pads rows [query_start_loc[-1], max_num_tokens) with pad_id, and checks
                           query_start_loc[0] == 0 and query_start_loc[-1] == len(positions)

Tiles: ``TILE`` rows per loop iteration, picked from the average request length
(:func:`choose_tile`), 8 rows per thread. Block size, kvb, CP size and interleave are
``tl.constexpr`` so the index divisions compile to shifts/multiplies (one variant per engine
configuration); ``cp_rank`` and ``pad_id`` stay runtime arguments.

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

import functools
import logging
from typing import TYPE_CHECKING, Optional

import torch

from ..cp.slot_mapping_errors import SlotMappingError

if TYPE_CHECKING:  # pragma: no cover
    from ..cp.slot_mapping_params import SlotMappingParams

__all__ = [
    "triton_available",
    "window_size",
    "launch_slot_mapping_kernel",
    "TILE_TIERS",
    "choose_tile",
]

logger = logging.getLogger(__name__)

#: (tile rows, warps) tiers: the first tier whose tile covers the average request is used, the
#: last one beyond. Every thread handles 8 rows; one long request loops over few large tiles.
TILE_TIERS: tuple[tuple[int, int], ...] = ((256, 1), (1024, 4), (4096, 16))
_INT32_MAX: int = 2**31 - 1
_INT32_MIN: int = -(2**31)


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


def choose_tile(num_tokens: int, num_reqs: int) -> tuple[int, int]:
    """(TILE, num_warps) from the average request length (host-known sizes only, no sync).

    Examples: 8192 tokens / 256 requests = 32 -> (256, 1); 65536 / 64 = 1024 -> (1024, 4);
    65536 / 1 -> (4096, 16), i.e. 16 loop iterations instead of 64 at TILE=1024.
    """
    avg = -(-num_tokens // max(num_reqs, 1))
    for tile, warps in TILE_TIERS:
        if avg <= tile:
            return tile, warps
    return TILE_TIERS[-1]


def launch_slot_mapping_kernel(
    qsl: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor,
    err: torch.Tensor, prm: "SlotMappingParams", *, tile: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> None:
    """Launch the kernel on validated arguments (no host sync; errors OR into ``err``).

    ``qsl`` [num_reqs+1] and ``positions`` [num_tokens] contiguous int32/int64; ``block_table``
    [rows, cols] int32/int64, any strides; ``out`` [max_num_tokens] int32; ``err`` [1] int32.
    ``tile`` (a power of two, for ``tl.arange``) and ``num_warps`` default to :func:`choose_tile`.
    Block size, CP sizes and interleave are compile-time constants (divisions by constants
    become shifts or multiplies): one compiled variant per engine configuration.
    """
    auto_tile, auto_warps = choose_tile(positions.shape[0], qsl.shape[0] - 1)
    tile = auto_tile if tile is None else tile
    num_warps = auto_warps if num_warps is None else num_warps
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile: expected a power of two, got {tile}")
    E = SlotMappingError
    grid = (qsl.shape[0],)  # num_reqs request programs + 1 tail program
    from .slot_mapping_kernels import slot_mapping_kernel  # imports triton: first launch only

    slot_mapping_kernel[grid](
        qsl, positions, block_table, out, err,
        positions.shape[0], prm.max_num_tokens, block_table.stride(0), block_table.stride(1),
        block_table.shape[1], prm.cp_rank, prm.pad_id,
        BLOCK_SIZE=prm.block_size, VIRTUAL_BLOCK_SIZE=prm.kv_block_size * prm.cp_world_size,
        BLOCKS_PER_KV_BLOCK=prm.blocks_per_kv_block, CP_WORLD_SIZE=prm.cp_world_size,
        CP_INTERLEAVE=prm.cp_interleave, USE_CP=prm.use_cp, IS_CIRCULAR=prm.circular, TILE=tile,
        WINDOW=window_size(tile, prm.block_size), SLOT_MIN=_INT32_MIN, SLOT_MAX=_INT32_MAX,
        ERR_QUERY_START=int(E.QUERY_START), ERR_QUERY_ORDER=int(E.QUERY_ORDER),
        ERR_NUM_TOKENS=int(E.NUM_TOKENS), ERR_NEGATIVE=int(E.NEGATIVE_POSITION),
        ERR_BLOCK_INDEX=int(E.BLOCK_INDEX), ERR_OVERFLOW=int(E.SLOT_OVERFLOW),
        num_warps=num_warps,
    )
