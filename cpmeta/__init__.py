"""cpmeta: build, broadcast and mirror attention ``InputMetadata`` in a context-parallel group.

The package reads like one engine step (DESIGN sections 1-2)::

    cpmeta/             config (and the block rule), SequenceMetadata lists, InputMetadata and its
                        container operations, its field table (fields: every field's dtype, shape
                        rule, feature, step kinds; the layouts are generated from it), the out=
                        protocol (buffers: OutputBuffers, OutputArenas), bounded caches (cache)
    cpmeta/state/       array-level input: SequenceBatch (one step) and BatchState (the engine's
                        requests, deltas per step)
    cpmeta/builders/    scheduler input -> InputMetadata on the host (prepare_prompt, prepare_decode,
                        compute_attn_info)
    cpmeta/broadcast/   MetadataBroadcaster (any dataclass), broadcast_tensor_dict: driver -> every
                        rank of the CP group, on the one frame codec
    cpmeta/replicate/   ReplicatedBatchState: every rank keeps the BatchState, the driver sends
                        the step (the scheduler's ops) on the same codec
    cpmeta/cp/          per-rank context parallelism: zigzag mirror, YoCo views, slot mapping
    cpmeta/gpu/         device-side builders: in-place decode (StagingLayout, DecodeStaging,
                        stage_decode), Triton kernels

The container, config and sequence types import eagerly; the stages import on first use (module
``__getattr__`` below), so ``import cpmeta`` does not pull in torch.distributed or Triton. The
``TYPE_CHECKING`` block gives type checkers the same names with their real types.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .buffers import OutputArenas, OutputBuffers, get_or_create_stacked, get_or_create_tensor
from .config import MetadataConfig, blocks_needed
from .constants import PAD_SLOT_ID, PLACEHOLDER_QUERY_INDEX
from .metadata import InputMetadata
from .sequence import SequenceMetadata
from .state import BatchState, SequenceBatch

if TYPE_CHECKING:
    from .broadcast import MetadataBroadcaster, broadcast_tensor_dict, close_tensor_dict_channels
    from .broadcast.policy import PersistentPolicy
    from .lifetime import StaleResultError
    from .replicate import ReplicatedBatchState
    from .builders import compute_attn_info, prepare_decode, prepare_prompt
    from .cp import (
        compute_slot_mapping,
        compute_slot_mapping_from_metadata,
        compute_slot_mapping_groups,
        cp_kv_read_plan,
        cp_local_seqlens,
        KVCacheGroup,
        KVReadPlan,
        mirror_rows,
        prepare_cp_mirror,
        prepare_for_mirror_cp,
        prepare_prompt_cp,
        unmirror,
    )
    from .diff import metadata_diff
    from .gpu import (
        DecodeStaging,
        StagedDecodeBroadcaster,
        capture_decode_graph,
        launch_decode_inplace,
        prepare_decode_inplace,
        stage_decode,
        staging_capacity,
    )

#: Public name -> the module that defines it (imported on first attribute access).
_LAZY: dict[str, str] = {
    "prepare_prompt": "cpmeta.builders.prompt",
    "prepare_decode": "cpmeta.builders.decode",
    "compute_attn_info": "cpmeta.builders.attn_info",
    "prepare_cp_mirror": "cpmeta.cp.zigzag",
    "prepare_for_mirror_cp": "cpmeta.cp.mirror",
    "prepare_prompt_cp": "cpmeta.cp.prompt_share",
    "PersistentPolicy": "cpmeta.broadcast.policy",
    "StaleResultError": "cpmeta.lifetime",
    "unmirror": "cpmeta.cp.zigzag",
    "mirror_rows": "cpmeta.cp.zigzag",
    "compute_slot_mapping": "cpmeta.cp.slot_mapping",
    "compute_slot_mapping_from_metadata": "cpmeta.cp.slot_mapping_metadata",
    "compute_slot_mapping_groups": "cpmeta.cp.slot_mapping_groups",
    "KVCacheGroup": "cpmeta.cp.slot_mapping_groups",
    "cp_local_seqlens": "cpmeta.cp.kv_shard",
    "cp_kv_read_plan": "cpmeta.cp.kv_read_plan",
    "KVReadPlan": "cpmeta.cp.kv_read_plan",
    "MetadataBroadcaster": "cpmeta.broadcast.broadcaster",
    "broadcast_tensor_dict": "cpmeta.broadcast.tensor_dict",
    "close_tensor_dict_channels": "cpmeta.broadcast.tensor_dict",
    "ReplicatedBatchState": "cpmeta.replicate.replicated",
    "prepare_decode_inplace": "cpmeta.gpu.decode_inplace",
    "launch_decode_inplace": "cpmeta.gpu.decode_inplace",
    "capture_decode_graph": "cpmeta.gpu.decode_inplace",
    "DecodeStaging": "cpmeta.gpu.decode_staging",
    "staging_capacity": "cpmeta.gpu.staging_layout",
    "stage_decode": "cpmeta.gpu.decode_staging",
    "StagedDecodeBroadcaster": "cpmeta.gpu.decode_cp",
    "metadata_diff": "cpmeta.diff",
}

__all__ = [
    "MetadataConfig",
    "SequenceMetadata",
    "InputMetadata",
    "get_or_create_tensor",
    "get_or_create_stacked",
    "OutputArenas",
    "OutputBuffers",
    "PAD_SLOT_ID",
    "PLACEHOLDER_QUERY_INDEX",
    "prepare_prompt",
    "prepare_decode",
    "compute_attn_info",
    "SequenceBatch",
    "BatchState",
    "prepare_cp_mirror",
    "prepare_for_mirror_cp",
    "prepare_prompt_cp",
    "PersistentPolicy",
    "StaleResultError",
    "unmirror",
    "mirror_rows",
    "compute_slot_mapping",
    "compute_slot_mapping_from_metadata",
    "compute_slot_mapping_groups",
    "KVCacheGroup",
    "cp_local_seqlens",
    "cp_kv_read_plan",
    "KVReadPlan",
    "blocks_needed",
    "MetadataBroadcaster",
    "broadcast_tensor_dict",
    "close_tensor_dict_channels",
    "ReplicatedBatchState",
    "prepare_decode_inplace",
    "launch_decode_inplace",
    "capture_decode_graph",
    "DecodeStaging",
    "staging_capacity",
    "stage_decode",
    "StagedDecodeBroadcaster",
    "metadata_diff",
]
assert set(__all__) >= set(_LAZY), "every lazy name is exported"


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'cpmeta' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
