"""``MetadataBroadcaster``: every rank of a CP group gets the driver's ``InputMetadata`` (DESIGN 7).

==================  ==============================================================================
module              holds
==================  ==============================================================================
``broadcaster``     :class:`MetadataBroadcaster`: collect by path, send one frame (+ one collective
                    for large CUDA payloads), rebuild by path; ``begin_step``, ``out=``, ``group_src=``
``walk``            ``collect``: the driver's split of ``InputMetadata`` by path (layout key, tensors,
                    values), cached per tuple of field types
``wire``            the one frame format: header (version, schema fingerprint, flags, crc32s,
                    exact tensor bytes), cached layout ids, values, shapes, packed tensors; the
                    per-layout ``Plan`` (exact sizes, views, assembly)
``schema``          ``InputMetadata`` as a schema: field kinds, ratio keys, value types and bounds;
                    a layout checked once, its values by a check compiled per layout
``integrity``       what a follower proves before reading a frame (limits, checksum policy, meta and
                    frame crc32, the layout block), the driver's ``seal``, the construction-time
                    checksum agreement; a malformed frame is a ``RuntimeError`` naming the rank
``persistent``      ``persistent_outputs=True``: one arena per layout (host, + device on CUDA) and
                    the ``InputMetadata`` built once as its views; a repeated layout lands with one
                    memmove (+ one H2D copy), values set on the cached object
``recollect``       ``CollectMemo``: the persistent driver's ``collect`` when a step reuses the last
                    step's tensor objects (layout key and tensor list reused, values gathered)
``span``            span frames (``FLAG_SPAN``): a persistent driver's one-allocation tensors sent
                    as one span with an offsets table; ``check_span`` proves a new geometry once
``outputs``         where received bytes land: a frame's tensor region into a CPU buffer, received
                    tensors into the caller's ``out=`` buffers
==================  ==============================================================================

The transport (codec, shared-memory ring, object and tensor channels) is the ``transport``
package; this package knows ``InputMetadata`` and its paths.
"""

from __future__ import annotations

from .broadcaster import MESSAGE_VERSION, SCHEMA_FINGERPRINT, MetadataBroadcaster

__all__ = ["MetadataBroadcaster", "SCHEMA_FINGERPRINT", "MESSAGE_VERSION"]
