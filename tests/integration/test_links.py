"""The data-plane links over real sockets and a real nats-server."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import msgspec
import nats
import numpy as np
import pytest

from silentswarm.agent.errors import FrameError, LinkError, PeerTimeoutError, RelayGapError
from silentswarm.agent.pipe.handshake import ACK, HELLO
from silentswarm.agent.pipe.link import TransportKind, accept_upstream, connect_downstream
from silentswarm.agent.pipe.relay import (
    ACK_DELAY_S,
    REANSWER_EVERY_S,
    LoopThread,
    RelayLink,
    serialize_parts,
)
from silentswarm.agent.pipe.relaymsg import RelayAuth
from silentswarm.agent.pipe.wire import Direction, decode_frame, encode_frame, parse_wire_codec
from silentswarm.agent.pipe.zmq import ZmqLink
from silentswarm.procs import free_port
from tests.helpers import REPO, child_env, wait_for
from tests.integration.nats_client import with_nats

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
TOKEN = bytes(range(32))  # a boundary's relay token, as the leader makes one per START


def frame(
    step: int,
    value: float = 1.0,
    shape=(4, 8, 16),
    codec="none",
    attempt=1,
    micro=0,
    targets: np.ndarray | None = None,
):
    array = np.full(shape, value, dtype=np.float32)
    return encode_frame(
        array,
        parse_wire_codec(codec),
        job="j",
        attempt=attempt,
        step=step,
        micro=micro,
        direction=Direction.FWD,
        targets=targets,
    )[1]


def ids(shape=(4, 8), value: int = 3) -> np.ndarray:
    """A forward frame's target ids (the byte vocabulary's uint8)."""
    return np.full(shape, value, dtype=np.uint8)


def test_zmq_large_frames_arrive_intact_though_the_sender_dropped_its_arrays_at_once(zmq_pair):
    """What ZmqLink sends is the caller's own buffer, kept alive by ZeroMQ until written,
    and what it receives is a view, not a copy."""
    binder, connector = zmq_pair
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
        header, got, _ = decode_frame(parts)
        assert header.step == step
        assert np.array_equal(got, np.arange(nbytes // 4, dtype=np.float32) + step)
        # For the uncompressed codec the decoded array is a view of the received message.
        assert not got.flags.owndata


def test_zmq_link_leaves_socket_buffers_to_the_kernel(zmq_pair):
    """A fixed SO_SNDBUF/SO_RCVBUF would turn Linux's autotuning off (zmq.py says why)."""
    for link in zmq_pair:
        assert link._sock.sndbuf == -1 and link._sock.rcvbuf == -1


def test_zmq_link_carries_frames_both_ways_and_counts_bytes(zmq_pair):
    binder, connector = zmq_pair
    parts = frame(3, 2.5)
    connector.send(parts)
    header, array, _ = decode_frame(binder.recv(5))
    assert header.step == 3 and np.all(array == 2.5)
    binder.send(frame(4, -1.0))
    assert decode_frame(connector.recv(5))[0].step == 4
    wire = sum(memoryview(p).nbytes for p in parts)
    assert connector.bytes_sent >= wire and binder.bytes_received >= wire


def test_zmq_recv_times_out_with_the_link_name():
    link = ZmqLink(name="boundary 7 (a -> b)", bind=f"tcp://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(PeerTimeoutError, match=r"boundary 7 \(a -> b\)"):
            link.recv(0.3)
    finally:
        link.close()


PEER = textwrap.dedent(
    """
    import sys, time
    from silentswarm.agent.pipe.link import connect_downstream, TransportKind
    link = connect_downstream(name="peer", transport=TransportKind.P2P, address=sys.argv[1],
                              relay=None, timeout_s=20)
    link.send([b"from-" + sys.argv[2].encode()])
    reply = link.recv(20)
    print(bytes(reply[0]).decode(), flush=True)
    time.sleep(60)
    """
)


def test_a_killed_peer_is_replaced_on_the_same_boundary(tmp_path):
    """The binder keeps its socket; a new upstream process takes the boundary over."""
    address = f"tcp://127.0.0.1:{free_port()}"
    env = child_env(PYTHONPATH=str(REPO))
    peers = []
    try:
        first = subprocess.Popen(
            [sys.executable, "-c", PEER, address, "one"], env=env, stdout=subprocess.PIPE
        )
        peers.append(first)
        link = accept_upstream(
            name="b0",
            transport=TransportKind.P2P,
            bind=address,
            relay=None,
            timeout_s=30,
            p2p_grace_s=0,
        )
        assert bytes(link.recv(20)[0]) == b"from-one"
        link.send([b"hi-one"])
        assert first.stdout.readline().strip() == b"hi-one"
        os.kill(first.pid, signal.SIGKILL)
        first.wait()

        second = subprocess.Popen(
            [sys.executable, "-c", PEER, address, "two"], env=env, stdout=subprocess.PIPE
        )
        peers.append(second)
        assert bytes(link.recv(30)[0]) == b"from-two", "the replacement's HELLO was answered"
        link.send([b"hi-two"])
        assert second.stdout.readline().strip() == b"hi-two"
        link.close()
    finally:
        for peer in peers:
            peer.kill()
            peer.wait()


def relay_pair(url: str, **kw) -> tuple[RelayLink, RelayLink]:
    a = RelayLink(name="a->b", nats=url, send_subject="t.fwd", recv_subject="t.bwd", **kw)
    b = RelayLink(name="b<-a", nats=url, send_subject="t.bwd", recv_subject="t.fwd", **kw)
    return a, b


def test_a_sender_that_ignores_credit_cannot_queue_frames_without_bound(nats_server):
    """Window 2, at most 1 unread frame: whatever a sender that never waits for credit
    sends, the receiver holds what its grants allowed and drops the rest, counted."""
    a, b = relay_pair(nats_server.url, token=TOKEN, window=2, max_frames=1)
    a._wait_credit = lambda timeout_s, deadline: None  # a peer that ignores the protocol
    try:
        for step in range(40):
            a.send(frame(step, shape=(4, 64)), timeout_s=10)  # one chunk each
        wait_for(
            lambda: b.dropped_by_reason.get("over_credit", 0) >= 1,
            timeout=10,
            what="a chunk past the credit to be dropped",
        )
        assert len(b._frames) <= 3, len(b._frames)  # the window's 2, and 1 granted after
        assert [decode_frame(b.recv(5))[0].step for _ in range(len(b._frames))] == [0, 1, 2]
    finally:
        a.close()
        b.close()


def test_relay_chunks_large_frames_below_max_payload(nats_server):
    a, b = relay_pair(nats_server.url, chunk_bytes=256 * 1024)
    try:
        parts = frame(1, 0.5, shape=(8, 128, 768))  # 3 MiB: 12+ chunks, over max_payload
        a.send(parts, timeout_s=20)
        header, array, _ = decode_frame(b.recv(20))
        assert header.step == 1 and array.shape == (8, 128, 768) and np.all(array == 0.5)
        assert a.bytes_sent >= 3 * 1024 * 1024 and b.bytes_received >= 3 * 1024 * 1024
        b.send(frame(2), timeout_s=10)
        assert decode_frame(a.recv(10))[0].step == 2
    finally:
        a.close()
        b.close()


def test_relay_sender_waits_for_credit_and_fails_loudly_without_it(nats_server):
    """Window 2 chunks, at most 1 unread frame: the third 2-chunk frame must wait."""
    a, b = relay_pair(nats_server.url, chunk_bytes=64 * 1024, window=2, max_frames=1)
    try:
        a.send(frame(1, shape=(60, 512)), timeout_s=10)  # 120 KiB + headers: two 64 KiB chunks
        a.send(frame(2, shape=(60, 512)), timeout_s=10)  # its grants are held back
        with pytest.raises(PeerTimeoutError, match="granted no credit"):
            a.send(frame(3, shape=(60, 512)), timeout_s=1.0)
        # The reader catches up: the held grants flow and the sender goes on.
        assert decode_frame(b.recv(5))[0].step == 1
        assert decode_frame(b.recv(5))[0].step == 2
        done = threading.Event()

        def send() -> None:
            a.send(frame(4, shape=(60, 512)), timeout_s=10)
            done.set()

        thread = threading.Thread(target=send)
        thread.start()
        assert decode_frame(b.recv(15))[0].step == 4
        thread.join(15)
        assert done.is_set()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("token", [None, TOKEN], ids=["untagged", "tagged"])
def test_a_gap_is_asked_for_again_and_fails_the_receive_only_if_it_stays_open(nats_server, token):
    """A chunk of the authentic peer that skips a sequence number, as after a lost message:
    dropped and counted, and the chunk expected is asked for again. Here the sender never
    sent it (it was injected), so nothing comes: the receive times out naming the gap. The
    sender's next chunk closes the gap and the link goes on."""
    a, b = relay_pair(nats_server.url, token=token)
    try:
        a.send(frame(1), timeout_s=5)
        assert decode_frame(b.recv(5))[0].step == 1

        async def inject(nc):
            await nc.publish("t.fwd", RelayAuth(token, "t.fwd").data(99, 0, 1, 2, b"xx"))

        with_nats(nats_server.url, inject)
        with pytest.raises(RelayGapError, match="expected chunk 1, got 99; asked for it 1 time"):
            b.recv(1)
        assert b.dropped_by_reason == {"gap": 1}
        # The request reaches the sender before its next chunk goes (on a loaded machine it
        # can take longer than the receive's second): asked for after that, it would be owed.
        wait_for(lambda: a.resend_requests >= 1, timeout=10, what="the request to reach a")
        assert a.resent == 0, "a resend request for what it has not sent"
        a.send(frame(2), timeout_s=5)
        assert decode_frame(b.recv(5))[0].step == 2
        # b asks again every RESEND_EVERY_S while the gap is open: one asking while chunk 1
        # is on its way has it sent again (b drops the copy), never more.
        assert a.resent <= 1 and a.dropped == 0, (a.resent, a.dropped_by_reason)
    finally:
        a.close()
        b.close()


def kill_nats(control) -> None:
    """SIGKILL the nats-server, as a crash would: whatever it had in flight is lost.
    ``control.start()`` brings it back on the same port and store."""
    process = control.server.process
    process.kill()
    process.wait(timeout=10)
    control.server = None


def outage(control, *links: RelayLink) -> None:
    """Kill the server, wait until every link has noticed, start it again."""
    kill_nats(control)
    wait_for(lambda: not any(link.connected for link in links), timeout=10, what="disconnects")
    control.start()


class Stream:
    """Frames one way through a RelayLink pair while a test does something else: a thread
    sends frames numbered 0, 1, 2... until stopped, then an end marker; another receives."""

    SHAPE = (2, 64, 512)  # 256 KiB + header: 5 chunks of 64 KiB

    def __init__(self, sender: RelayLink, receiver: RelayLink) -> None:
        self.sender, self.receiver = sender, receiver
        self.got: list[tuple[int, bool]] = []  # (step, every value right)
        self.sent = 0
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._guard, args=(self._send,)),
            threading.Thread(target=self._guard, args=(self._recv,)),
        ]
        for thread in self.threads:
            thread.start()

    def _guard(self, fn) -> None:
        try:
            fn()
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def _send(self) -> None:
        while not self.stop.is_set():
            self.sender.send(frame(self.sent, value=self.sent % 4096, shape=self.SHAPE), 30)
            self.sent += 1
        self.sender.send(frame(self.sent, value=-1.0, shape=(1,)), 30)

    def _recv(self) -> None:
        while True:
            header, array, _ = decode_frame(self.receiver.recv(30))
            if array.shape == (1,):
                return
            self.got.append((header.step, bool(np.all(array == header.step % 4096))))

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        assert not any(t.is_alive() for t in self.threads), "the stream did not end"
        assert not self.errors, self.errors
        assert [step for step, _ in self.got] == list(range(self.sent)), "in order, none lost"
        assert all(ok for _, ok in self.got), "every frame intact"


def test_relay_frames_cross_three_nats_kills_intact_and_in_order(nats_server):
    """Frames stream both ways while the nats-server is SIGKILLed and started again on its
    port three times: whatever was on the wire is lost, and the relay asks for it again.
    Every frame arrives, intact and in order, and no send or receive fails."""
    a, b = relay_pair(nats_server.url, token=TOKEN, chunk_bytes=64 * 1024)
    streams = [Stream(a, b), Stream(b, a)]

    def ten_more_frames(what: str) -> None:
        marks = [len(stream.got) + 10 for stream in streams]
        wait_for(
            lambda: all(len(s.got) >= m for s, m in zip(streams, marks, strict=True)),
            timeout=30,
            what=what,
        )

    try:
        for _ in range(3):
            ten_more_frames("frames flowing")
            outage(nats_server, a, b)
        ten_more_frames("frames flowing after the last restart")
        for stream in streams:
            stream.finish()
        assert a.reconnects == b.reconnects == 3
        assert a.send_done(10) and b.wait_done(0)
    finally:
        for stream in streams:
            stream.stop.set()
        a.close()
        b.close()


def lose(link: RelayLink, kind: bytes, which: Callable[[int], bool]) -> list[int]:
    """Make ``link`` lose the messages of ``kind`` it publishes whose count (0, 1, ...)
    ``which`` picks, as a dying server would: they seem sent and never arrive. The counts
    lost are listed."""
    publish, seen, lost = link._publish, [0], []

    async def lossy(payload: bytes) -> bool:
        if payload[:1] == kind:
            seen[0] += 1
            if which(seen[0] - 1):
                lost.append(seen[0] - 1)
                return True
        return await publish(payload)

    link._publish = lossy
    return lost


@pytest.mark.parametrize(
    ("loser", "kind", "which", "window"),
    [
        ("b", b"C", lambda n: n < 2, 2),  # the first grants: the sender waits for credit
        ("a", b"D", lambda n: n == 4, 8),  # the frame's last chunk: no later one shows a gap
        ("a", b"D", lambda n: n in (1, 2), 8),  # chunks in the middle: the next shows the gap
    ],
    ids=["grants", "tail", "middle"],
)
def test_what_is_lost_on_the_way_is_found_and_sent_again(nats_server, loser, kind, which, window):
    """Without any outage to announce it, a lost grant or chunk is found (by the sender's
    probe, or the receiver seeing the gap) and the frame arrives whole."""
    a, b = relay_pair(nats_server.url, token=TOKEN, chunk_bytes=64 * 1024, window=window)
    lost = lose(a if loser == "a" else b, kind, which)
    try:
        a.send(frame(1, value=3.0, shape=(2, 64, 512)), timeout_s=10)  # 5 chunks
        header, array, _ = decode_frame(b.recv(10))
        assert header.step == 1 and np.all(array == 3.0)
        assert lost and (a.resent > 0) == (kind == b"D")
        assert a.send_done(10) and b.wait_done(0)
    finally:
        a.close()
        b.close()


def published(link: RelayLink, kind: bytes) -> list[float]:
    """When ``link`` publishes each message of ``kind`` from now on (monotonic seconds)."""
    publish, times = link._publish, []

    async def counted(payload: bytes) -> bool:
        if payload[:1] == kind:
            times.append(time.monotonic())
        return await publish(payload)

    link._publish = counted
    return times


def test_a_frame_there_is_no_memory_for_fails_that_frame_and_the_link_goes_on(
    nats_server, monkeypatch
):
    """The buffer of a frame is allocated from the size its first chunk claims (bounded by
    the link's limit); where that fails, the frame is a FrameError for the reader and the
    next one comes. It used to escape into nats-py's error callback, the chunk's grant
    with it: the window shrank for good."""
    import silentswarm.agent.pipe.relay as relay_module

    a, b = relay_pair(nats_server.url, token=TOKEN)
    real_empty, failed = relay_module.np.empty, []

    def empty(size, dtype=None):
        if not failed:
            failed.append(size)
            raise MemoryError
        return real_empty(size, dtype=dtype)

    monkeypatch.setattr(relay_module.np, "empty", empty)
    try:
        for step in range(3):
            a.send(frame(step, shape=(16, 64, 256)), timeout_s=5)  # 1 MiB: chunks to assemble
        with pytest.raises(FrameError, match="no memory for a frame"):
            b.recv(5)
        assert [decode_frame(b.recv(5))[0].step for _ in range(2)] == [1, 2]
        assert a.send_done(10) and b.wait_done(0)
    finally:
        monkeypatch.undo()
        a.close()
        b.close()


class SlowToRead(RelayLink):
    """A relay end whose handling of each message takes 20 ms, so messages wait in nats-py."""

    async def _on_message(self, msg) -> None:
        await asyncio.sleep(0.02)
        await super()._on_message(msg)


def test_messages_waiting_for_a_relay_end_are_bounded_by_its_window(nats_server):
    """nats-py holds up to 128 MiB a subscription by default: strangers publishing on a
    link's subject faster than it reads could fill that. A link holds four windows of
    chunks and 1 MiB; what is shed beyond is counted (`slow_consumer`), and an honest
    peer's chunks lost so are asked for again."""
    link = SlowToRead(
        name="slow", nats=nats_server.url, send_subject="s.bwd", recv_subject="s.fwd",
        chunk_bytes=64 * 1024, window=2,
    )  # fmt: skip
    try:

        async def flood(nc):
            for _ in range(100):  # 6.4 MiB of junk, far over 4 x 2 x 64 KiB + 1 MiB
                await nc.publish("s.fwd", b"Z" * (64 * 1024))
            await nc.flush()

        with_nats(nats_server.url, flood)
        wait_for(lambda: link.dropped >= 100, timeout=30, what="every message dropped or shed")
        assert link.dropped_by_reason.get("slow_consumer", 0) > 0, link.dropped_by_reason
    finally:
        link.close()


def test_a_peer_repeating_done_is_answered_at_most_once_per_interval(nats_server):
    """Each DONE used to be answered at once: a peer repeating it had this end publish as
    fast as it did. An honest sender says it every DONE_EVERY_S, so answering at most every
    REANSWER_EVERY_S still confirms it; the rest are dropped as stale."""
    a, b = relay_pair(nats_server.url, token=TOKEN)
    answers = published(b, b"F")
    try:
        started = time.monotonic()

        async def flood(nc):
            auth = RelayAuth(TOKEN, "t.fwd")
            for _ in range(300):
                await nc.publish("t.fwd", auth.message(b"E"))
            await nc.flush()

        with_nats(nats_server.url, flood)
        wait_for(lambda: b.dropped + len(answers) >= 300, timeout=10, what="every DONE handled")
        elapsed = time.monotonic() - started
        assert b.wait_done(0) and 1 <= len(answers) <= 1 + elapsed / REANSWER_EVERY_S
        assert b.dropped_by_reason == {"stale": 300 - len(answers)}
    finally:
        a.close()
        b.close()


def test_small_frames_share_their_acknowledgements(nats_server):
    """Eighteen one-chunk frames: the receiver acknowledges every window / 4 chunks (at 8
    and 16) and the last two within ACK_DELAY_S, not once per frame, so the sender's end
    waits no longer than that."""
    a, b = relay_pair(nats_server.url, token=TOKEN, window=32)
    credits = published(b, b"C")
    try:
        for step in range(18):
            a.send(frame(step, shape=(16, 256)), timeout_s=10)  # 16 KiB: one chunk each
            assert decode_frame(b.recv(10))[0].step == step
        last = time.monotonic()
        assert a.send_done(10) and b.wait_done(0)
        assert len(credits) == 3, credits
        assert credits[-1] - last < ACK_DELAY_S + 0.5
    finally:
        a.close()
        b.close()


def test_done_and_a_late_hello_are_answered_across_a_nats_kill(nats_server):
    """DONE said while NATS is down is said again until the peer confirms it; a HELLO that
    comes after the handshake (its ACK was lost) is answered again."""
    a, b = relay_pair(nats_server.url, token=TOKEN)
    try:
        b.send_control(b"A", b"ok")  # b answered a HELLO: it is the binder
        kill_nats(nats_server)
        wait_for(lambda: not a.connected and not b.connected, timeout=10, what="disconnects")
        confirmed: list[bool] = []
        thread = threading.Thread(target=lambda: confirmed.append(b.send_done(30)))
        thread.start()
        nats_server.start()
        assert a.wait_done(30), "DONE arrived"
        thread.join(30)
        assert confirmed == [True], "and was confirmed"
        a.send_control(b"H", b"fingerprint")
        assert a.recv_control(10) == b"Aok", "a late HELLO is answered with the same ACK"
    finally:
        a.close()
        b.close()


def test_a_frame_larger_than_the_limit_is_refused_at_both_ends(nats_server):
    """The sender refuses a frame over ``max_frame_bytes``; a receiver never allocates for
    one: an authentic first chunk that claims a terabyte fails that receive, not the link."""
    a, b = relay_pair(nats_server.url, token=TOKEN, max_frame_bytes=1 << 20)
    try:
        with pytest.raises(LinkError, match="over the relay's limit"):
            a.send(frame(1, shape=(512, 1024)), timeout_s=5)  # 2 MiB

        async def inject(nc):
            auth = RelayAuth(TOKEN, "t.fwd")
            await nc.publish("t.fwd", auth.data(0, 0, 2, 1 << 40, b"x" * 1000))
            await nc.publish("t.fwd", auth.data(1, 1, 2, 1 << 40, b"x" * 1000))

            blob = serialize_parts(frame(3))
            await nc.publish("t.fwd", auth.data(2, 0, 1, len(blob), blob))

        with_nats(nats_server.url, inject)
        with pytest.raises(FrameError, match="over the limit of 1048576"):
            b.recv(5)
        assert decode_frame(b.recv(5))[0].step == 3, "the next frame is taken"
    finally:
        a.close()
        b.close()


class Intruder:
    """A third NATS client on the relay's subjects: it records what the pair sends (its own
    messages are not echoed back to it) and publishes what a test gives it."""

    def __init__(self, url: str, subjects: list[str]) -> None:
        self.seen: dict[str, list[bytes]] = {s: [] for s in subjects}
        self._io = LoopThread("intruder")
        self._nc = self._run(self._connect(url, subjects))

    def _run(self, coro):
        return self._io.run(coro, 10)

    async def _connect(self, url: str, subjects: list[str]):
        nc = await nats.connect(url, no_echo=True, max_reconnect_attempts=1)
        for subject in subjects:

            async def record(msg, subject=subject) -> None:
                self.seen[subject].append(msg.data)

            await nc.subscribe(subject, cb=record)
        await nc.flush()
        return nc

    def publish(self, subject: str, payloads: list[bytes]) -> None:
        """Publish and flush: the server has them all before this returns."""

        async def go() -> None:
            for payload in payloads:
                await self._nc.publish(subject, payload)
            await self._nc.flush()

        self._run(go())

    def close(self) -> None:
        self._run(self._nc.drain())
        self._io.stop()


def junk(subject: str, seq: int, other: str, rng: random.Random) -> list[bytes]:
    """What an intruder without the token can publish on ``subject``, whose receiver expects
    chunk ``seq`` next; ``other`` is the opposite direction's subject."""
    forged = serialize_parts(frame(666, value=-1.0, shape=(4, 8)))
    wrong = RelayAuth(os.urandom(32), subject)
    return [
        b"Zjunk",
        b"",
        b"D\x00\x01",  # truncated
        bytes(rng.getrandbits(8) for _ in range(300)),
        RelayAuth(None, subject).data(seq, 0, 1, len(forged), forged),  # the next, untagged
        wrong.data(seq, 0, 1, len(forged), forged),  # the next chunk, another token's tag
        wrong.credit(10**9, 10**9, 10**9),  # a grant of unlimited credit
        wrong.credit(10**9, 0, 0, resend=True),  # a resend request from the start
        wrong.probe(10**9, 10**9),  # a probe claiming chunks never sent
        wrong.message(b"E"),  # "done"
        wrong.message(b"F"),  # "done seen"
        wrong.message(b"A", b"!refused"),
        RelayAuth(TOKEN, other).data(seq, 0, 1, len(forged), forged),  # the other subject's
    ]


def test_relay_drops_junk_and_forgeries_and_counts_them(nats_server):
    """While a tagged pair exchanges frames both ways, an intruder publishes junk, forged
    chunks at the very sequence number expected next, forged grants and forged control
    messages on both subjects, then replays everything the pair sent. Every frame arrives
    intact and in order, no send fails, and each piece of junk is counted once."""
    rng = random.Random(17)
    a, b = relay_pair(nats_server.url, token=TOKEN, chunk_bytes=64 * 1024, window=4)
    intruder = Intruder(nats_server.url, ["t.fwd", "t.bwd"])
    shape = (2, 64, 256)  # 128 KiB + header: 3 chunks of 64 KiB
    rounds, per_frame = 6, 3
    try:
        for step in range(rounds):
            intruder.publish("t.fwd", junk("t.fwd", step * per_frame, "t.bwd", rng))
            intruder.publish("t.bwd", junk("t.bwd", step * per_frame, "t.fwd", rng))
            a.send(frame(step, value=step, shape=shape), timeout_s=10)
            b.send(frame(step, value=-step, shape=shape), timeout_s=10)
            header, array, _ = decode_frame(b.recv(10))
            assert (header.step, array.shape) == (step, shape) and np.all(array == step)
            header, array, _ = decode_frame(a.recv(10))
            assert (header.step, array.shape) == (step, shape) and np.all(array == -step)
        per_link = rounds * len(junk("t.fwd", 0, "t.bwd", rng))
        wait_for(lambda: (a.dropped, b.dropped) == (per_link, per_link), timeout=10, what="drops")
        assert not a.wait_done(0) and not b.wait_done(0), "a forged DONE ended nothing"
        for counts in (a.dropped_by_reason, b.dropped_by_reason):
            assert counts.keys() <= {"unknown_kind", "truncated", "bad_tag"}
            assert counts["unknown_kind"] >= 2 * rounds and counts["truncated"] >= rounds
            assert counts["bad_tag"] >= 9 * rounds

        # Replays of the authentic chunks and grants are stale: dropped, not a gap.
        sent = rounds * per_frame * 2  # on each subject: one end's chunks and its grants
        wait_for(
            lambda: [len(seen) for seen in intruder.seen.values()] == [sent, sent],
            timeout=10,
            what="the intruder to see every chunk and grant",
        )
        replayed = {subject: list(seen) for subject, seen in intruder.seen.items()}
        for subject, messages in replayed.items():
            intruder.publish(subject, messages)
        a.send(frame(rounds, value=7.0, shape=shape), timeout_s=10)
        header, array, _ = decode_frame(b.recv(10))
        assert header.step == rounds and np.all(array == 7.0)
        wait_for(
            lambda: (
                (a.dropped, b.dropped)
                == (per_link + len(replayed["t.bwd"]), per_link + len(replayed["t.fwd"]))
            ),
            timeout=10,
            what="replays counted",
        )
        assert a.dropped_by_reason["stale"] == len(replayed["t.bwd"])
        assert b.dropped_by_reason["stale"] == len(replayed["t.fwd"])
        b.send_done()
        assert a.wait_done(10)
    finally:
        intruder.close()
        a.close()
        b.close()


def test_an_untagged_relay_drops_malformed_messages(nats_server):
    """Without a token (no leader) anything tagged or not is taken, as before; but junk that
    is no relay message at all is dropped and counted, not fatal."""
    a, b = relay_pair(nats_server.url)
    try:

        async def inject(nc):
            for payload in (b"Zjunk", b"", b"D\x00\x01", b"C" + bytes(16) + b"\x01"):
                await nc.publish("t.fwd", payload)

        with_nats(nats_server.url, inject)
        a.send(frame(3), timeout_s=5)
        assert decode_frame(b.recv(5))[0].step == 3
        wait_for(lambda: b.dropped == 4, timeout=5, what="drops")
        assert b.dropped_by_reason == {"unknown_kind": 2, "truncated": 2}
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("token", [None, TOKEN], ids=["untagged", "tagged"])
def test_tunnel_handshake_over_the_relay(nats_server, token):
    def relay(send: str, recv: str):
        return RelayLink(
            name=f"{send}", nats=nats_server.url, send_subject=send, recv_subject=recv, token=token
        )

    down_end, up_end = relay("h.bwd", "h.fwd"), relay("h.fwd", "h.bwd")
    if token is not None:
        # A forged refusal waiting for the connector, a forged HELLO for the binder: dropped.
        wrong = os.urandom(32)

        async def forge(nc):
            await nc.publish("h.bwd", RelayAuth(wrong, "h.bwd").message(b"A", b"!go away"))
            await nc.publish("h.fwd", RelayAuth(wrong, "h.fwd").message(b"H", b"other data"))

        with_nats(nats_server.url, forge)
        wait_for(lambda: up_end.dropped == down_end.dropped == 1, timeout=5, what="forgeries")
    result = {}

    def downstream() -> None:
        result["down"] = accept_upstream(
            name="down",
            transport=TransportKind.TUNNEL,
            bind=None,
            relay=lambda: down_end,
            timeout_s=20,
            p2p_grace_s=0,
        )

    thread = threading.Thread(target=downstream)
    thread.start()
    up = connect_downstream(
        name="up",
        transport=TransportKind.TUNNEL,
        address=None,
        relay=lambda: up_end,
        timeout_s=20,
    )
    thread.join(20)
    down = result["down"]
    try:
        assert up.transport == down.transport == "relay"
        up.send(frame(5))
        assert decode_frame(down.recv(5))[0].step == 5
    finally:
        up.close()
        down.close()


def test_control_messages_never_reach_the_caller(zmq_pair):
    binder, connector = zmq_pair
    connector.send([HELLO, b""])
    connector.send(frame(9))
    assert decode_frame(binder.recv(5))[0].step == 9
    assert bytes(connector.recv_any(5)[0]) == ACK, "a late HELLO is answered again"


def test_boundary_rejects_corrupt_and_drops_stale_frames(zmq_pair):
    from silentswarm.agent.runtime.stage import Boundary

    binder, connector = zmq_pair
    boundary = Boundary(
        binder, 0, "boundary 0 (x -> y)", "j", 2, parse_wire_codec("none"), 5.0, vocab_size=256
    )
    connector.send(frame(1, attempt=1, targets=ids()))  # an older attempt: dropped
    connector.send(frame(1, attempt=2, value=7.0, targets=ids()))
    got = boundary.recv(step=1, micro=0, direction=Direction.FWD)
    assert np.all(got.array == 7.0) and np.all(got.targets == 3) and boundary.dropped == 1

    connector.send(frame(2, attempt=2))  # a forward frame must bring its targets
    with pytest.raises(FrameError, match=r"boundary 0 \(x -> y\).*carries no targets"):
        boundary.recv(step=2, micro=0, direction=Direction.FWD)

    parts = frame(2, attempt=2, targets=ids())
    connector.send([parts[0], bytes(parts[1])[:-4]])  # truncated payload
    with pytest.raises(FrameError, match=r"boundary 0 \(x -> y\)"):
        boundary.recv(step=2, micro=0, direction=Direction.FWD)

    connector.send(frame(5, attempt=2, micro=1, targets=ids()))  # out of order
    with pytest.raises(FrameError, match="expected frame"):
        boundary.recv(step=3, micro=0, direction=Direction.FWD)

    def with_header(parts, **changes):
        header = msgspec.msgpack.decode(bytes(parts[0]))
        return [msgspec.msgpack.encode({**header, **changes}), *parts[1:]]

    for changes in ({"dtype": "float64"}, {"shape": [4, 8, 32]}):  # wrong dtype, wrong shape
        connector.send(with_header(frame(6, attempt=2, targets=ids()), **changes))
        with pytest.raises(FrameError, match=r"boundary 0 \(x -> y\)"):
            boundary.recv(step=6, micro=0, direction=Direction.FWD)


def test_a_frame_of_the_wrong_shape_or_not_finite_is_refused_by_name(zmq_pair):
    from silentswarm.agent.runtime.stage import Boundary

    binder, connector = zmq_pair
    boundary = Boundary(binder, 0, "b0", "j", 2, parse_wire_codec("none"), 5.0)
    connector.send(frame(1, attempt=2, shape=(4, 8, 16), targets=ids()))
    assert boundary.recv(step=1, micro=0, direction=Direction.FWD, shape=(None, 8, 16))
    connector.send(frame(2, attempt=2, shape=(4, 9, 16), targets=ids((4, 9))))
    with pytest.raises(
        FrameError, match=r"b0: frame .* is shaped \[4, 9, 16\], expected \['any', 8, 16\]"
    ):
        boundary.recv(step=2, micro=0, direction=Direction.FWD, shape=(None, 8, 16))
    connector.send(frame(3, attempt=2, shape=(2, 8, 16), targets=ids((2, 8))))
    with pytest.raises(FrameError, match="is shaped"):  # a gradient's shape is exact
        boundary.recv(step=3, micro=0, direction=Direction.FWD, shape=(4, 8, 16))
    for step, value in enumerate((np.nan, np.inf, -np.inf), start=4):
        connector.send(frame(step, value, attempt=2, targets=ids()))
        with pytest.raises(FrameError, match="not finite"):
            boundary.recv(step=step, micro=0, direction=Direction.FWD)


def test_stale_frames_do_not_hold_off_the_peer_timeout(zmq_pair):
    """Frames of an older attempt are dropped, but each does not start the wait again: a
    peer that sends one now and then still times out at the boundary's timeout."""
    from silentswarm.agent.runtime.stage import Boundary

    binder, connector = zmq_pair
    boundary = Boundary(binder, 0, "b0", "j", 2, parse_wire_codec("none"), 1.5)
    stop = threading.Event()

    def stale_now_and_then() -> None:
        while not stop.wait(0.3):
            connector.send(frame(1, attempt=1, targets=ids()))

    sender = threading.Thread(target=stale_now_and_then, daemon=True)
    sender.start()
    started = time.monotonic()
    try:
        with pytest.raises(PeerTimeoutError):
            boundary.recv(step=1, micro=0, direction=Direction.FWD)
    finally:
        stop.set()
        sender.join(5)
    assert time.monotonic() - started < 5.0 and boundary.dropped >= 2


FLOOD = """
import sys, time, zmq
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    sock.send_multipart([bytes.fromhex(sys.argv[3]), b""])
"""


@pytest.mark.parametrize("wait", ["recv", "wait_done"])
def test_a_peer_sending_control_messages_without_end_does_not_hold_a_wait(wait):
    """Control messages are answered or noted, never handed on, and each used to go round
    the wait again: a peer faster than the Python that reads, sending them without pause,
    held a receive (a ring round, a boundary) or the end-of-run wait for as long as it kept
    on, here 10 s against a timeout of 1."""
    address = f"tcp://127.0.0.1:{free_port()}"
    binder = ZmqLink(name="b", bind=address)
    # Two, so that together they outpace the reader on two cores.
    flood = [sys.executable, "-c", FLOOD, address, "10", ACK.hex()]
    flooders = [subprocess.Popen(flood) for _ in range(2)]
    try:
        assert binder.recv_any(10.0) is not None, "the flood never started"
        started = time.monotonic()
        if wait == "recv":
            with pytest.raises(PeerTimeoutError):
                binder.recv(1.0)
        else:
            assert binder.wait_done(1.0) is False
        assert time.monotonic() - started < 4.0
    finally:
        # The link first: libzmq 4.3.5 aborts the process when a peer whose messages fill
        # the receive queue disconnects just before a heartbeat (docs/operations/security.md).
        binder.close()
        for flooder in flooders:
            flooder.kill()
            flooder.wait(10)


@pytest.mark.parametrize("max_queued", [3, None])
def test_a_peer_that_reads_nothing_queues_at_most_max_queued_messages(max_queued):
    """A peer that accepts the connection but never reads: ZeroMQ would queue a thousand
    messages (each holding its frame's memory); ``max_queued`` makes the send time out."""
    import socket

    with socket.create_server(("127.0.0.1", free_port())) as server:
        address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        link = ZmqLink(name="to-a-mute-peer", connect=address, max_queued=max_queued)
        try:
            sent = 0
            for _ in range(20):
                try:
                    link.send([b"x" * (1 << 20)], timeout_s=0.2)
                except PeerTimeoutError:
                    break
                sent += 1
        finally:
            link.close()
    assert sent <= 4 if max_queued else sent == 20


def test_boundaries_carry_targets_downstream_and_count_their_bytes(zmq_pair):
    """Targets are a frame part like any other: both ends' byte counts include them; an id
    outside the receiver's vocabulary is refused; gradients go back without any."""
    from silentswarm.agent.pipe.wire import frame_nbytes, token_ids
    from silentswarm.agent.runtime.stage import Boundary

    binder, connector = zmq_pair
    codec = parse_wire_codec("fixed_int8")
    down = Boundary(connector, 0, "down", "j", 1, codec, 5.0, vocab_size=300)
    up = Boundary(binder, 0, "up", "j", 1, codec, 5.0, vocab_size=300)
    x = np.random.default_rng(0).standard_normal((4, 8, 16)).astype(np.float32)
    targets = token_ids(np.arange(32).reshape(4, 8) * 9, 300)  # up to 279: uint16
    down.send(x, step=0, micro=0, direction=Direction.FWD, targets=targets)
    got = up.recv(step=0, micro=0, direction=Direction.FWD)
    np.testing.assert_array_equal(got.targets, targets)
    assert got.targets.dtype == np.uint16
    _, parts = encode_frame(
        x, codec, job="j", attempt=1, step=0, micro=0, direction=Direction.FWD, targets=targets
    )
    assert len(parts) == 4 and memoryview(parts[-1]).nbytes == 4 * 8 * 2
    assert down.bytes_sent == up.bytes_received == frame_nbytes(parts)

    up.send(x, step=0, micro=0, direction=Direction.BWD)  # gradients: no targets
    assert down.recv(step=0, micro=0, direction=Direction.BWD).targets is None

    wide = np.full((4, 8), 299, dtype=np.uint16)
    wide[3, 7] = 300
    down.send(x, step=0, micro=1, direction=Direction.FWD, targets=wide)
    with pytest.raises(FrameError, match=r"up: target id 300 is outside the vocabulary of 300"):
        up.recv(step=0, micro=1, direction=Direction.FWD)


@pytest.mark.parametrize("kind", ["p2p", "relay"])
def test_frames_queued_before_close_are_delivered_and_done_confirmed(kind, nats_server):
    """An upstream that sends its last frames and closes at once must lose none of them."""
    if kind == "p2p":
        address = f"tcp://127.0.0.1:{free_port()}"
        receiver = ZmqLink(name="down", bind=address)
        sender = ZmqLink(name="up", connect=address)
    else:
        sender, receiver = relay_pair(nats_server.url)
    try:

        def upstream() -> None:
            for step in range(16):
                sender.send(frame(step, shape=(8, 128, 256)), timeout_s=30)  # 1 MiB each
            sender.send_done()
            sender.close()

        thread = threading.Thread(target=upstream)
        thread.start()
        got = [decode_frame(receiver.recv(30))[0].step for _ in range(16)]
        thread.join(30)
        assert got == list(range(16))
        assert receiver.wait_done(10)
    finally:
        receiver.close()


def test_a_bound_end_without_a_peer_fails_its_send_instead_of_hanging():
    link = ZmqLink(name="boundary 3 (u -> d)", bind=f"tcp://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(PeerTimeoutError, match=r"boundary 3 \(u -> d\): no peer took"):
            link.send(frame(1), timeout_s=0.5)
    finally:
        link.close()


def test_curve_lets_only_the_placed_neighbour_connect():
    import threading

    import zmq

    from silentswarm.agent.errors import PeerTimeoutError
    from silentswarm.agent.pipe.link import TransportKind
    from silentswarm.agent.pipe.link import accept_upstream as accept
    from silentswarm.agent.pipe.link import connect_downstream as connect
    from silentswarm.agent.pipe.zmq import CurveKeys
    from silentswarm.procs import free_port

    def keys():
        return [k.decode() for k in zmq.curve_keypair()]

    (s_pub, s_sec), (c_pub, c_sec), (x_pub, x_sec) = keys(), keys(), keys()
    address = f"tcp://127.0.0.1:{free_port()}"
    accepted: dict[str, object] = {}

    def binder():
        try:
            accepted["link"] = accept(
                name="b0", transport=TransportKind.P2P, bind=address, relay=None,
                timeout_s=15, p2p_grace_s=0,
                curve=CurveKeys(public=s_pub, secret=s_sec, peer_public=c_pub),
            )  # fmt: skip
        except Exception as exc:  # reported below
            accepted["error"] = exc

    thread = threading.Thread(target=binder)
    thread.start()
    try:
        # A peer with keys of its own (it knows the server's public key) gets no answer.
        with pytest.raises(PeerTimeoutError):
            connect(
                name="intruder", transport=TransportKind.P2P, address=address, relay=None,
                timeout_s=2, curve=CurveKeys(public=x_pub, secret=x_sec, peer_public=s_pub),
            )  # fmt: skip
        link = connect(
            name="b0", transport=TransportKind.P2P, address=address, relay=None, timeout_s=10,
            curve=CurveKeys(public=c_pub, secret=c_sec, peer_public=s_pub),
        )  # fmt: skip
        thread.join(timeout=15)
        assert "error" not in accepted, accepted.get("error")
        link.send([b"frame", b"payload"])
        received = accepted["link"].recv_any(5)
        assert [bytes(p) for p in received] == [b"frame", b"payload"]
        link.close()
    finally:
        thread.join(timeout=20)
        if "link" in accepted:
            accepted["link"].close()


def test_a_peer_that_sends_past_the_message_limit_is_cut_off_before_it_is_read():
    """ZeroMQ drops the connection of a peer whose message part is over
    ``max_message_bytes`` (the stages set it from the largest frame they expect): the
    receiver never holds it, and the peer's messages within the limit get through once it
    has reconnected."""
    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = ZmqLink(name="down", bind=address, max_message_bytes=1 << 20)
    sender = ZmqLink(name="up", connect=address)
    try:
        sender.send([b"x" * (2 << 20)], timeout_s=5)
        assert receiver.recv_any(1.0) is None, "the oversized message was read"

        def small_arrives() -> bool:
            sender.send([b"small"], timeout_s=5)
            got = receiver.recv_any(0.5)
            return got is not None and bytes(got[0]) == b"small"

        wait_for(small_arrives, timeout=20, what="a message within the limit after the cut")
    finally:
        sender.close()
        receiver.close()


def test_a_stages_links_allow_its_largest_frames():
    """Every part of the largest frame a boundary carries (a validation batch, float32, with
    its targets) fits its limit with room to spare, and so does a ring's state frame."""
    from silentswarm.agent.pipe.wire import Direction, encode_frame, parse_wire_codec
    from silentswarm.agent.runtime.replicas import pack_state
    from silentswarm.agent.runtime.stage import boundary_message_bytes, ring_message_bytes
    from silentswarm.plan import ModelConfig, TrainConfig, single_process_plan

    model = ModelConfig(n_layers=2, d_model=256, seq_len=128)
    plan = single_process_plan(
        job_id="j", model=model, train=TrainConfig(batch_size=16, micro_batches=1)
    )
    batch = np.zeros((16, 128, 256), np.float32)
    _, parts = encode_frame(
        batch,
        parse_wire_codec("none"),
        job="j",
        attempt=1,
        step=0,
        micro=0,
        direction=Direction.FWD,
        phase="eval",
        targets=np.zeros((16, 128), np.uint8),
        eval_batches=1,
    )
    largest = max(memoryview(p).nbytes for p in parts)
    assert largest == batch.nbytes and boundary_message_bytes(plan) >= 4 * largest
    n_params = 250_000
    state = pack_state([np.zeros(n_params, np.float32)] * 5)  # weights, m, v, anchor, momentum
    assert ring_message_bytes(n_params) >= state.nbytes
