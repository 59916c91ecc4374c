"""``MetadataBroadcaster``: every rank of a CP group gets the driver's ``InputMetadata`` (DESIGN 7).

The transport (codec, shared-memory ring, object and tensor channels) is the ``transport``
package; this package knows ``InputMetadata`` and its paths.
"""

from __future__ import annotations

from .broadcaster import MESSAGE_VERSION, SCHEMA_FINGERPRINT, MetadataBroadcaster

__all__ = ["MetadataBroadcaster", "SCHEMA_FINGERPRINT", "MESSAGE_VERSION"]
