"""A relay sender against its receiver: a frame's send has a deadline of its own (a
receiver that grants one chunk of credit just before each chunk's timeout cannot hold its
sender for hours), and a receiver asking for resends without pause gets each chunk once per
``RESEND_EVERY_S``."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from silentswarm.agent.errors import PeerTimeoutError, SlowReceiverError
from silentswarm.agent.pipe import relay
from silentswarm.agent.pipe.relay import RelayLink
from silentswarm.agent.pipe.relaymsg import Credit
from silentswarm.agent.pipe.wire import Direction, encode_frame
from silentswarm.compression import parse_wire_codec
from tests.helpers import wait_for


def ten_chunks() -> list:
    _, parts = encode_frame(
        np.zeros((10 * 256, 64), np.float32),  # 640 KiB: ten chunks of 64 KiB
        parse_wire_codec("none"),
        job="j",
        attempt=1,
        step=0,
        micro=0,
        direction=Direction.FWD,
        phase="sync",
    )
    return parts


def sender(nats_url: str, subject: str) -> RelayLink:
    """A relay link's sending end, chunks of 64 KiB, two of them without credit."""
    return RelayLink(
        name=f"honest -> {subject}",
        nats=nats_url,
        send_subject=f"{subject}.fwd",
        recv_subject=f"{subject}.bwd",
        chunk_bytes=64 * 1024,
        window=2,
    )


def test_a_receiver_dripping_credit_is_a_timeout_at_the_frames_deadline(nats_server, monkeypatch):
    monkeypatch.setattr(relay, "MIN_SEND_BYTES_PER_S", 1 << 20)  # 640 KiB: 0.6 s beside 1 s
    link = sender(nats_server.url, "dripping")
    stop = threading.Event()

    def drip() -> None:  # one chunk of credit every 0.8 s: under the 1 s per chunk
        granted = 0
        while not stop.wait(0.8):
            granted += 1
            link._on_credit(Credit(serial=granted, granted=granted, acked=0))

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    started = time.monotonic()
    try:
        with pytest.raises(SlowReceiverError, match="under 1024 KiB/s"):
            link.send(ten_chunks(), timeout_s=1.0)
        # before: 8 grants x 0.8 s = 6.4 s and no error; now its deadline, 1.6 s
        assert time.monotonic() - started < 3.0
    finally:
        stop.set()
        dripper.join(5)
        link.close()


def test_a_receiver_that_grants_nothing_is_a_timeout_per_chunk(nats_server):
    link = sender(nats_server.url, "silent")
    try:
        with pytest.raises(PeerTimeoutError, match="granted no credit for 1s") as raised:
            link.send(ten_chunks(), timeout_s=1.0)
        assert not isinstance(raised.value, SlowReceiverError)
    finally:
        link.close()


def test_a_peer_asking_again_and_again_gets_each_chunk_once_per_resend_interval(nats_server):
    """A resend request is a few dozen bytes and each used to send the whole retained window
    again (16 MiB at the defaults), for any number of requests: now a chunk goes again at
    most once per ``RESEND_EVERY_S``, the pace an honest receiver asks at."""
    link = sender(nats_server.url, "asking")
    try:
        link.send([b"one chunk"], timeout_s=5.0)
        wait_for(lambda: link._published == 1, timeout=10, what="the chunk published")
        started = time.monotonic()
        for serial in range(1, 21):
            link._io.call_soon(link._on_credit, Credit(serial, 0, 0, resend=True))
            wait_for(
                lambda serial=serial: link.resent + getattr(link, "resends_held", 0) >= serial,
                timeout=10,
                what=f"request {serial} answered",
            )
        elapsed = time.monotonic() - started
        assert link.resend_requests == 20
        assert link.resent <= 1 + elapsed / relay.RESEND_EVERY_S, (link.resent, elapsed)
    finally:
        link.close()
