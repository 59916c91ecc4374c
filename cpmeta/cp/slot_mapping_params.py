"""``SlotMappingParams``: the validated scalar arguments of ``compute_slot_mapping`` (docs/design.md section 11).

A type both the CPU path (:mod:`cpmeta.cp.slot_mapping`, which builds and validates it) and the
Triton launchers (:mod:`cpmeta.gpu.slot_mapping_triton`, which read it) need; it lives here, in
the lower room, so that neither of the two imports the other back.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SlotMappingParams"]


@dataclass(frozen=True, slots=True)
class SlotMappingParams:
    """Validated scalar arguments of :func:`compute_slot_mapping` (host-side, no tensors)."""

    block_size: int
    max_num_tokens: int
    kv_block_size: int  # kvb: physical KV block (block_size when not given)
    blocks_per_kv_block: int  # kvb // block_size
    cp_world_size: int
    cp_rank: int
    cp_interleave: int
    pad_id: int
    circular: bool

    @property
    def use_cp(self) -> bool:
        return self.cp_world_size > 1
