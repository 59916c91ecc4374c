"""Device-side builders (DESIGN sections 11, 12).

=============================  ===================================================================
module                         holds
=============================  ===================================================================
``decode_inplace``             :func:`prepare_decode_inplace`, :func:`launch_decode_inplace`, :func:`capture_decode_graph` (CUDA-graph ready)
``decode_buffers``             the device buffers the kernels write (from the field table), ``OutCapacity``
``decode_staging``             ``DecodeStaging`` (the pinned int32 staging buffer, upload, stream order), :func:`stage_decode`
``staging_layout``             ``StagingLayout``: the layout, written from a batch or a state, validated
``staging_njit``               the layout's compiled writers: one call per step from a batch or a state
``staging_header``             the layout's word slots and ``StagedDecode`` (the host scalars)
``decode_cp``                  :class:`StagedDecodeBroadcaster`: one staging broadcast, kernels on every CP rank
``decode_triton``              the two decode metadata kernels (Triton)
``decode_emulate``             the same kernels as vectorized torch (CPU fallback, CI)
``slot_mapping_triton``        the slot-mapping kernel
``slot_mapping_groups_triton`` the fused kernel for several KV-cache groups
=============================  ===================================================================

Importing this package does not import Triton; the kernel modules are imported when first used.
"""

from __future__ import annotations

from .decode_cp import StagedDecodeBroadcaster
from .decode_inplace import capture_decode_graph, launch_decode_inplace, prepare_decode_inplace
from .decode_staging import DecodeStaging, OutCapacity, stage_decode, staging_capacity

__all__ = [
    "prepare_decode_inplace", "launch_decode_inplace", "capture_decode_graph", "DecodeStaging", "OutCapacity",
    "staging_capacity", "stage_decode", "StagedDecodeBroadcaster",
]
