"""What every link module shares: a message's parts and the errors a link raises."""

from __future__ import annotations

Parts = list[bytes | memoryview]


class LinkError(Exception):
    """The link cannot deliver: the message names the boundary and the peer."""


class PeerTimeoutError(LinkError):
    pass


class RelayGapError(LinkError):
    pass


class HandshakeError(LinkError):
    """The two ends cannot work together (for example their training data differ)."""
