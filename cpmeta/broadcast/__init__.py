"""Broadcast from the driver to every rank of a CP group, on ONE frame codec (docs/design.md sections 7, 16).

==================  ==============================================================================
module              holds
==================  ==============================================================================
``broadcaster``     :class:`MetadataBroadcaster`: collect by path, send one frame (+ one collective
                    for large CUDA payloads), rebuild by path; ``begin_step``, ``out=``,
                    ``group_src=``, ``schema=`` (any dataclass, or ``dict``); the driver's half
``follower``        ``FollowerSide``: the broadcaster's follower half (frame's tensor region landed,
                    copied or left to the collective; views, ``out=``, assembly)
``tensor_dict``     :func:`broadcast_tensor_dict`: vLLM's ``broadcast_tensor_dict`` semantics on it
``channel``         ``FrameChannel``: the codec over a ``transport.ObjectChannel`` (what every
                    cpmeta message rides on: broadcast, tensor dicts, replicated steps, staged
                    decode); the construction-time agreement on schema, source and checksum
``wire``            the frame codec: header (version, schema fingerprint, flags, crc32s, exact
                    tensor bytes), layout ids sent once, values, shapes; ``FrameWriter`` /
                    ``FrameReader`` (write, strict parse, the follower's plan cache)
``plan``            ``Plan``: one layout's sizes, proofs, views, packing and assembly
``schema``          ``Schema``: a dataclass as a schema (its fields, fingerprint, layout checks,
                    rebuild); ``INPUT_METADATA``; a mismatch explained across ranks
``field_spec``      ``FieldSpec``: one annotation classified (kind, value and key types), its pinned
                    dtype / ndim and fixed dims; the dict key rules (``check_key``)
``dict_schema``     ``DictSchema``: a tensor dict's tree (one msgpack token list) and its tensors on
                    the frame (``broadcast_tensor_dict``)
``value_check``     the per-frame value checks: one rule per value, made once per layout
``collect``         ``collect`` / ``collect_dict``: the driver's split by path (layout key,
                    tensors, values), cached per tuple of field types
``persistent``      ``persistent_outputs``: the pool of arenas per layout (``depth`` in turn), its
                    budget and LRU eviction, the lifetime of what it hands out
``arena``           ``LayoutArena``: one layout's host (+ device) buffer and the object built once
                    as its views; a repeated layout lands with one memmove; CUDA stream ordering
``metrics``         ``bc.stats()``: per-step rings and counters, ``BroadcastStats``, refusal kinds,
                    the launch table, ``prometheus_collector``
``prometheus``      the ``prometheus_client`` collector (optional extra ``metrics``)
``outputs``         where received bytes land: a frame's tensor region into a CPU buffer, received
                    tensors into the caller's ``out=`` buffers
==================  ==============================================================================

The transport (codec, shared-memory ring, object and tensor channels) is the ``transport``
package; this package knows schemas and paths, never ring slots.
"""

from __future__ import annotations

from .broadcaster import MESSAGE_VERSION, SCHEMA_FINGERPRINT, MetadataBroadcaster
from .metrics import BroadcastStats
from .tensor_dict import broadcast_tensor_dict, close_tensor_dict_channels

__all__ = ["MetadataBroadcaster", "SCHEMA_FINGERPRINT", "MESSAGE_VERSION", "broadcast_tensor_dict",
           "close_tensor_dict_channels", "BroadcastStats"]
