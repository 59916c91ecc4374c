"""cpmeta: build, broadcast and mirror attention ``InputMetadata`` in a context-parallel group.

The front door is ``__all__`` (twelve names, one job each; README "Which one do I use?"). The
package reads like one engine step::

    cpmeta/             config (and the block rule), SequenceMetadata, InputMetadata and its
                        field table (fields), the out= protocol (buffers), the compiled kernels'
                        decorator and warm-up (jit), the multi-rank test helper (testing)
    cpmeta/state/       array-level input: SequenceBatch (one step) and BatchState (the engine's
                        requests, deltas per step)
    cpmeta/builders/    scheduler input -> InputMetadata on the host (prepare, prepare_prompt,
                        prepare_decode, compute_attn_info)
    cpmeta/broadcast/   MetadataBroadcaster (any dataclass), broadcast_tensor_dict
    cpmeta/replicate/   ReplicatedBatchState: every rank keeps the BatchState, the driver sends
                        the step
    cpmeta/cp/          per-rank context parallelism: zigzag mirror, YoCo views, slot mapping,
                        the KV read plan
    cpmeta/gpu/         device-side builders: in-place decode for CUDA graphs, Triton kernels
    cpmeta/transport/   how bytes and tensors move: strict msgpack codec, shared-memory ring,
                        object and tensor channels (knows nothing of InputMetadata)
    cpmeta/launch/      ``python -m cpmeta.launch``: a CP group on this machine, the per-rank loop

The container, config and sequence types import eagerly; the stages import on first use (module
``__getattr__`` below), so ``import cpmeta`` does not pull in torch.distributed or Triton. The
``TYPE_CHECKING`` block gives type checkers the same names with their real types.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .buffers import OutputArenas, get_or_create_stacked, get_or_create_tensor
from .config import MetadataConfig, blocks_needed
from .metadata import InputMetadata
from .sequence import SequenceMetadata
from .state import BatchState, SequenceBatch

if TYPE_CHECKING:
    from .broadcast import MetadataBroadcaster, broadcast_tensor_dict
    from .builders import compute_attn_info, prepare_decode, prepare_prompt
    from .builders.dispatch import prepare
    from .cp import (
        compute_slot_mapping,
        cp_kv_read_plan,
        cp_local_seqlens,
        mirror_rows,
        prepare_cp_mirror,
        prepare_for_mirror_cp,
        unmirror,
    )
    from .gpu import prepare_decode_inplace
    from .replicate import ReplicatedBatchState

#: The front door (``__all__``): one name per job. Which one to use: README "Which one do I use?".
__all__ = [
    "MetadataConfig",          # the model's attention layout (plain paged KV, or a preset)
    "SequenceMetadata",        # one scheduled sequence, as objects
    "SequenceBatch",           # one step's sequences, as arrays
    "BatchState",              # the engine's requests, changed by deltas each step
    "InputMetadata",           # what attention reads: positions, slots, block tables, index plans
    "prepare",                 # build a step's metadata (prompt or decode, as the batch says)
    "OutputArenas",            # caller-owned outputs refilled every step (steady state, CUDA graphs)
    "MetadataBroadcaster",     # the driver builds, every rank receives the same metadata
    "ReplicatedBatchState",    # every rank keeps the batch state, the driver sends only the step
    "broadcast_tensor_dict",   # vLLM's broadcast_tensor_dict, on cpmeta's frame
    "prepare_for_mirror_cp",   # this rank's zigzag share of the query rows
    "cp_kv_read_plan",         # this rank's KV read plan under CP-sharded KV
]

#: Lazily imported name -> its module. The front door above, plus the names the design contract
#: calls as ``cpmeta.<name>`` (docs/design.md); each also lives in its submodule, which is where
#: everything else is (``cpmeta.builders``, ``cpmeta.cp``, ``cpmeta.gpu``, ``cpmeta.broadcast``...).
_LAZY: dict[str, str] = {
    "prepare": "cpmeta.builders.dispatch",
    "MetadataBroadcaster": "cpmeta.broadcast.broadcaster",
    "ReplicatedBatchState": "cpmeta.replicate.replicated",
    "broadcast_tensor_dict": "cpmeta.broadcast.tensor_dict",
    "prepare_for_mirror_cp": "cpmeta.cp.mirror",
    "cp_kv_read_plan": "cpmeta.cp.kv_read_plan",
    # contract names (not in __all__)
    "prepare_prompt": "cpmeta.builders.prompt",
    "prepare_decode": "cpmeta.builders.decode",
    "compute_attn_info": "cpmeta.builders.attn_info",
    "prepare_cp_mirror": "cpmeta.cp.zigzag",
    "mirror_rows": "cpmeta.cp.zigzag",
    "unmirror": "cpmeta.cp.zigzag",
    "compute_slot_mapping": "cpmeta.cp.slot_mapping",
    "cp_local_seqlens": "cpmeta.cp.kv_shard",
    "prepare_decode_inplace": "cpmeta.gpu.decode_inplace",
}
#: Contract names imported eagerly with the container types.
_EAGER_CONTRACT = ("blocks_needed", "get_or_create_tensor", "get_or_create_stacked")
assert len(__all__) <= 12 and set(__all__) <= set(_LAZY) | set(globals())


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'cpmeta' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
