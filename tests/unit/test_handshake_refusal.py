"""A downstream peer's refusal at the handshake is a stranger's words: any bytes end the
handshake as a HandshakeError that quotes them, cut short, never another exception."""

from __future__ import annotations

import pytest

from silentswarm.agent.errors import HandshakeError
from silentswarm.agent.pipe.handshake import REFUSAL_CHARS, _check_ack, _refusal


@pytest.mark.parametrize(
    ("body", "quoted"),
    [
        (b"!not valid utf-8 \xff\xfe", "not valid utf-8 \ufffd\ufffd"),
        (b"!\x1b[2Jclear", "\x1b[2Jclear"),  # shown escaped by repr
        (b"!" + b"x" * 5000, "x" * (REFUSAL_CHARS - 1)),
    ],
    ids=["invalid utf-8", "a terminal escape", "a flood"],
)
def test_any_refusal_is_a_handshake_error_quoting_it(body, quoted):
    with pytest.raises(HandshakeError) as caught:
        _check_ack("near", body)
    assert caught.value.message == f"near: the downstream peer refused: {quoted!r}"


def test_an_honest_refusal_reads_as_written_and_an_ok_passes():
    with pytest.raises(HandshakeError, match="fingerprints differ"):
        _check_ack("near", _refusal(b"a" * 32, b"b" * 32) or b"")
    _check_ack("near", b"ok")
