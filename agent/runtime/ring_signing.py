"""Signed ring frames: in a ring of three or more replicas each member forwards the others'
contributions (and the donor's state), so the link it came over proves only who passed a
frame on. Each member signs what it originates with its ring key (ed25519, PyNaCl: the
``nkeys`` extra of nats-py already brings it) and every member checks the origin's signature
before it takes or forwards a frame. The signature is one more message part, 64 bytes, over
a SHA-256 of the frame's parts (each with its length, so no two framings collide); the header
inside names the job, attempt, round and origin, so a signature cannot be replayed elsewhere.
The keys are fresh for every ring the leader makes (a plan's, each ring change's)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import nacl.exceptions
import nacl.signing

from silentswarm.agent.pipe.base import Parts

CONTEXT = b"silentswarm ring frame\0"
SIGNATURE_BYTES = 64


def frame_digest(parts: Sequence[bytes | memoryview]) -> bytes:
    """SHA-256 over every part (bytes, a memoryview, a zmq Frame), each preceded by its
    length."""
    digest = hashlib.sha256()
    for part in parts:
        view = memoryview(part)
        digest.update(view.nbytes.to_bytes(8, "little"))
        digest.update(view)
    return digest.digest()


class RingSigner:
    """One member's view of a ring's keys: its own (None: it signs nothing) and every
    member's public key by replica (empty: the ring signs nothing, a ring of two)."""

    def __init__(self, seed: str | None, signers: Mapping[int, str]) -> None:
        self._own = None if seed is None else nacl.signing.SigningKey(bytes.fromhex(seed))
        self._keys = {r: nacl.signing.VerifyKey(bytes.fromhex(k)) for r, k in signers.items()}

    @property
    def active(self) -> bool:
        """Whether the ring's frames carry signatures."""
        return bool(self._keys)

    def sign(self, parts: Parts) -> Parts:
        """``parts`` with this member's signature as one more part (unchanged when the ring
        signs nothing)."""
        if self._own is None:
            return parts
        signature = self._own.sign(CONTEXT + frame_digest(parts)).signature
        return [*parts, signature]

    def split(self, parts: Parts) -> tuple[Parts, bytes | None] | None:
        """``(frame parts, signature)`` of a received message: the signature None when the
        ring signs nothing; None when it should carry one and does not."""
        if not self.active:
            return parts, None
        if len(parts) < 3 or memoryview(parts[-1]).nbytes != SIGNATURE_BYTES:
            return None
        return parts[:-1], bytes(parts[-1])

    def signed_by(self, origin: int, parts: Parts, signature: bytes) -> bool:
        """Whether replica ``origin`` signed ``parts``."""
        key = self._keys.get(origin)
        if key is None:
            return False
        try:
            key.verify(CONTEXT + frame_digest(parts), signature)
        except (nacl.exceptions.BadSignatureError, ValueError):
            return False
        return True


__all__ = ["SIGNATURE_BYTES", "RingSigner", "frame_digest"]
