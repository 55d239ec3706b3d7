"""ZmqLink's zero-copy path over a real loopback socket: what it sends is the caller's own
buffer, kept alive by ZeroMQ until written, and what it receives is a view, not a copy."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from silentswarm.agent.pipe.wire import Direction, decode_frame, encode_frame, parse_wire_codec
from silentswarm.agent.pipe.zmq import ZmqLink
from silentswarm.procs import free_port

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


@pytest.fixture
def pair():
    address = f"tcp://127.0.0.1:{free_port()}"
    binder = ZmqLink(name="b", bind=address)
    connector = ZmqLink(name="c", connect=address)
    try:
        yield binder, connector
    finally:
        binder.close()
        connector.close()


def test_large_frames_arrive_intact_though_the_sender_dropped_its_arrays_at_once(pair):
    binder, connector = pair
    sizes = (16 * 1024, 64 * 1024, MIB, 4 * MIB)  # both sides of pyzmq's copy threshold
    for step, nbytes in enumerate(sizes):
        array = np.arange(nbytes // 4, dtype=np.float32) + step
        _, parts = encode_frame(
            array,
            parse_wire_codec("none"),
            job="j",
            attempt=1,
            step=step,
            micro=0,
            direction=Direction.FWD,
        )
        connector.send(parts)
        del array, parts  # only ZeroMQ holds the payload now
    gc.collect()
    for step, nbytes in enumerate(sizes):
        parts = binder.recv(10)
        assert all(isinstance(p, memoryview) for p in parts)
        header, got = decode_frame(parts)
        assert header.step == step
        assert np.array_equal(got, np.arange(nbytes // 4, dtype=np.float32) + step)
        # For the uncompressed codec the decoded array is a view of the received message.
        assert not got.flags.owndata


def test_the_link_leaves_socket_buffers_to_the_kernel(pair):
    """A fixed SO_SNDBUF/SO_RCVBUF would turn Linux's autotuning off (zmq.py says why)."""
    for link in pair:
        assert link._sock.sndbuf == -1 and link._sock.rcvbuf == -1
