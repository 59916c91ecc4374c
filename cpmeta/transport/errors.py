"""Exception types shared by the transport package (``CodecError`` lives in ``codec``)."""

from __future__ import annotations

__all__ = ["PeerError", "RingClosedError"]


class PeerError(ConnectionError):
    """A peer process of a ring/channel died or closed its end; the message names its rank."""


class RingClosedError(PeerError):
    """The writer closed the ring while a reader waited for a message."""
