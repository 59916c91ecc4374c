"""cpmeta: build, broadcast and mirror attention ``InputMetadata`` in a context-parallel group.

Public names resolve lazily from their modules (see ``_EXPORTS``), so importing ``cpmeta`` does
not import the broadcast/transport stack until it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import MetadataConfig
from .constants import INT32_MAX, PAD_SLOT_ID, PLACEHOLDER_QUERY_INDEX
from .metadata import InputMetadata, get_or_create_stacked, get_or_create_tensor
from .sequence import SequenceMetadata

_EXPORTS: dict[str, str] = {
    "prepare_prompt": "cpmeta.prompt",
    "prepare_decode": "cpmeta.decode",
    "compute_attn_info": "cpmeta.attn_info",
    "prepare_cp_mirror": "cpmeta.mirror",
    "prepare_for_mirror_cp": "cpmeta.mirror",
    "unmirror": "cpmeta.mirror",
    "mirror_rows": "cpmeta.mirror",
    "compute_slot_mapping": "cpmeta.slot_mapping",
    "MetadataBroadcaster": "cpmeta.broadcast",
    "prepare_decode_inplace": "cpmeta.decode_inplace",
}

__all__ = [
    "MetadataConfig",
    "SequenceMetadata",
    "InputMetadata",
    "get_or_create_tensor",
    "get_or_create_stacked",
    "PAD_SLOT_ID",
    "PLACEHOLDER_QUERY_INDEX",
    "INT32_MAX",
    *_EXPORTS,
]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'cpmeta' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
