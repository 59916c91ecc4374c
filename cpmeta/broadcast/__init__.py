"""``MetadataBroadcaster``: every rank of a CP group gets the driver's ``InputMetadata`` (DESIGN 7).

==================  ==============================================================================
module              holds
==================  ==============================================================================
``broadcaster``     :class:`MetadataBroadcaster`: collect by path, send one frame (+ one collective
                    for large CUDA payloads), rebuild by path; ``begin_step``, ``out=``, ``group_src=``
``wire``            the one frame format: header (version, schema fingerprint, flags, crc32),
                    cached layout ids, values, shapes, packed tensors; strict parsing of untrusted
                    frames (a malformed one is a ``RuntimeError`` naming the rank)
==================  ==============================================================================

The transport (codec, shared-memory ring, object and tensor channels) is the ``transport``
package; this package knows ``InputMetadata`` and its paths.
"""

from __future__ import annotations

from .broadcaster import MESSAGE_VERSION, SCHEMA_FINGERPRINT, MetadataBroadcaster

__all__ = ["MetadataBroadcaster", "SCHEMA_FINGERPRINT", "MESSAGE_VERSION"]
