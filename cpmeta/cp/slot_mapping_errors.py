"""Error bits of the slot-mapping kernels and their text (docs/design.md section 11).

The CPU path raises ``ValueError`` directly; the CUDA kernel cannot raise, so it ORs these bits
into an ``error_out`` word that :func:`describe_slot_mapping_error` turns into the same text.
"""

from __future__ import annotations

import enum
from typing import Optional

import torch

__all__ = ["SlotMappingError", "describe_slot_mapping_error"]


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
