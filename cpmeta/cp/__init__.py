"""Per-rank context parallelism (docs/design.md sections 8, 10, 11, 14).

=========================  =========================================================================
module                     holds
=========================  =========================================================================
``zigzag``                 :func:`prepare_cp_mirror`, :func:`mirror_rows`, :func:`unmirror`: the index plan
``mirror_plan``            its argument checks and the calls of its compiled kernels
``mirror_njit``            the mirror's kernels: count, fill, row gather, YoCo segment expansion
``mirror``                 :func:`prepare_for_mirror_cp`: a rank's share of prompt ``InputMetadata``
``prompt_share``           :func:`prepare_prompt_cp`: that share built for the rank (Engram rows its own)
``yoco_cp``                YoCo compact + CP indices (contrib / boundary)
``yoco_views``             ``md.get_mask_view()`` / ``md.get_consumer_view()``
``slot_mapping``           :func:`compute_slot_mapping` with CP-interleaved KV (CPU path + dispatch)
``slot_mapping_njit``      its compiled CPU kernel (slots and error bits in one pass)
``slot_mapping_metadata``  :func:`compute_slot_mapping_from_metadata`: the slots of an ``InputMetadata``'s rows
``slot_mapping_errors``    the error bits both slot-mapping paths report
``slot_mapping_groups``    :func:`compute_slot_mapping_groups`: several KV-cache groups, one call
``kv_shard``               :func:`cp_local_seqlens`: a rank's share of CP-interleaved KV (decode)
``kv_read_plan``           :func:`cp_kv_read_plan`: which keys a rank holds and where (section 14)
``kv_read_plan_njit``      its compiled kernels (counts + checks, then the keys) and ``cp_local_seqlens``'s
=========================  =========================================================================
"""

from __future__ import annotations

from .kv_read_plan import KVReadPlan, cp_kv_read_plan
from .kv_shard import cp_local_seqlens
from .mirror import prepare_for_mirror_cp
from .prompt_share import prepare_prompt_cp
from .slot_mapping import compute_slot_mapping
from .slot_mapping_metadata import compute_slot_mapping_from_metadata
from .slot_mapping_groups import KVCacheGroup, compute_slot_mapping_groups
from .zigzag import mirror_rows, prepare_cp_mirror, unmirror

__all__ = [
    "prepare_cp_mirror",
    "prepare_for_mirror_cp",
    "prepare_prompt_cp",
    "mirror_rows",
    "unmirror",
    "compute_slot_mapping",
    "compute_slot_mapping_from_metadata",
    "compute_slot_mapping_groups",
    "KVCacheGroup",
    "cp_local_seqlens",
    "cp_kv_read_plan",
    "KVReadPlan",
]
