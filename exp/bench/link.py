"""Link benchmark: what the data-plane links cost against the bare transports under them.

Stages exchange activations and gradients of 64 KiB to several MiB per micro-batch, so a
link that loses throughput to its framing, credits or thread hops slows every pipeline
step. Between two processes on loopback (this one sends, a spawned peer receives or
echoes) it measures, for 64 KiB, 1 MiB and 4 MiB frames:

- ``tcp``: a raw TCP socket, ``sendall``/``recv_into`` into a preallocated buffer: the limit;
- ``zmq``: ``ZmqLink`` (DEALER sockets, zero-copy multipart), as a P2P boundary uses it;
- ``nats``: a bare nats-py publish/subscribe loop chunked like RelayLink (512 KiB chunks),
  with at most 4 frames unacknowledged so a fast sender cannot overrun the subscriber;
- ``relay``: ``RelayLink`` (chunks, sequence numbers, credits, a thread for its loop).

Throughput streams frames one way and waits for the peer's acknowledgement of the last;
latency is half the round trip of one frame echoed back (p50 and p99). Every transport runs
in each round, rounds interleave, and the figures are medians over rounds. Targets (printed,
never failing the run): ZmqLink >= 0.90 of raw TCP at 4 MiB, RelayLink >= 0.80 of bare
nats-py. The last line is one JSON object with every figure, the ratios of every round
(``round_ratios``) and the load averages at the start and the end (``load_avg``): on a
machine shared with other work the ratios move by +-0.2 from round to round.

    python exp/bench/link.py            # the full run (about two minutes)
    python exp/bench/link.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO, emit, load_avg, median, percentile, verdict  # puts the repo on sys.path

from silentswarm.agent.pipe.relay import RelayLink
from silentswarm.agent.pipe.zmq import ZmqLink
from silentswarm.natsd import start_nats_server
from silentswarm.procs import free_port

KINDS = ["tcp", "zmq", "nats", "relay"]
SIZES = {"64KiB": 64 * 1024, "1MiB": 1024 * 1024, "4MiB": 4 * 1024 * 1024}
HEAD = struct.Struct(">BQ")  # mode, payload bytes
SINK, ACK, ECHO, QUIT = 0, 1, 2, 3
CHUNK = 512 * 1024  # RelayLink's default chunk
NATS_WINDOW = 4  # bare nats: frames in flight before the sender waits for an ack (RelayLink: 4)
FWD, BWD = "bench.fwd", "bench.bwd"


# --- synchronous channels: raw TCP, ZmqLink, RelayLink ----------------------------------------


class TcpChannel:
    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.head = bytearray(HEAD.size)
        self.buf = bytearray(max(SIZES.values()))

    def _fill(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("peer closed")
            got += n

    def send(self, mode: int, payload: memoryview) -> None:
        self.sock.sendall(HEAD.pack(mode, len(payload)))
        if len(payload):
            self.sock.sendall(payload)

    def recv(self) -> tuple[int, memoryview]:
        self._fill(memoryview(self.head))
        mode, size = HEAD.unpack(self.head)
        view = memoryview(self.buf)[:size]
        self._fill(view)
        return mode, view

    def close(self) -> None:
        self.sock.close()


class LinkChannel:
    """ZmqLink or RelayLink: a message is ``[header, payload]``."""

    def __init__(self, link: ZmqLink | RelayLink) -> None:
        self.link = link

    def send(self, mode: int, payload: memoryview) -> None:
        self.link.send([HEAD.pack(mode, len(payload)), payload], timeout_s=60)

    def recv(self) -> tuple[int, memoryview]:
        head, payload = self.link.recv(60)
        return HEAD.unpack(bytes(head))[0], memoryview(payload)

    def close(self) -> None:
        self.link.close()


# Both ends share a boundary token, as a leader's plan gives them: every message is tagged
# and checked, so this measures the relay as jobs run it.
RELAY_TOKEN = bytes(range(32))


def relay(url: str, outbound: bool) -> RelayLink:
    send, recv = (FWD, BWD) if outbound else (BWD, FWD)
    return RelayLink(
        name=f"bench-{send}", nats=url, send_subject=send, recv_subject=recv, token=RELAY_TOKEN
    )


def measure_sync(ch, size: int, frames: int, pings: int) -> dict[str, float]:
    payload = memoryview(np.ones(size, dtype=np.uint8))
    for _ in range(3):  # warm-up: connections, buffers
        ch.send(ECHO, payload)
        ch.recv()
    started = time.perf_counter()
    for i in range(frames):
        ch.send(ACK if i == frames - 1 else SINK, payload)
    ch.recv()
    elapsed = time.perf_counter() - started
    rtts = []
    for _ in range(pings):
        t = time.perf_counter()
        ch.send(ECHO, payload)
        ch.recv()
        rtts.append(time.perf_counter() - t)
    return summarize(size * frames / elapsed, rtts)


def summarize(bytes_per_s: float, rtts: list[float]) -> dict[str, float]:
    return {
        "gb_per_s": bytes_per_s / 1e9,
        "p50_ms": 1e3 * percentile(rtts, 0.5) / 2,
        "p99_ms": 1e3 * percentile(rtts, 0.99) / 2,
    }


def serve_sync(ch) -> None:
    """The peer: swallow SINK frames, acknowledge ACK frames, echo ECHO frames."""
    empty = memoryview(b"")
    while True:
        mode, payload = ch.recv()
        if mode == QUIT:
            return
        if mode == ACK:
            ch.send(ACK, empty)
        elif mode == ECHO:
            ch.send(ECHO, payload)


# --- bare nats-py -------------------------------------------------------------------------


class NatsChannel:
    """Frames chunked like RelayLink over two subjects, reassembled in the callback."""

    def __init__(self, nc, send_subject: str) -> None:
        self.nc = nc
        self.subject = send_subject
        self.frames: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        self.parts: list[bytes] = []

    async def on_message(self, msg) -> None:
        data = msg.data
        last = data[0]
        self.parts.append(data[1:])
        if last:
            blob = b"".join(self.parts)
            self.parts = []
            mode, _ = HEAD.unpack_from(blob, 0)
            self.frames.put_nowait((mode, blob[HEAD.size :]))

    async def send(self, mode: int, payload: memoryview | bytes) -> None:
        blob = memoryview(HEAD.pack(mode, len(payload)) + bytes(payload))
        count = max(1, -(-len(blob) // CHUNK))
        for i in range(count):
            flag = b"\x01" if i == count - 1 else b"\x00"
            await self.nc.publish(self.subject, flag + bytes(blob[i * CHUNK : (i + 1) * CHUNK]))

    async def recv(self, timeout_s: float | None = 60) -> tuple[int, bytes]:
        return await asyncio.wait_for(self.frames.get(), timeout_s)


async def nats_channel(url: str, outbound: bool) -> NatsChannel:
    import nats

    send, recv = (FWD, BWD) if outbound else (BWD, FWD)
    nc = await nats.connect(servers=[url])
    ch = NatsChannel(nc, send)
    await nc.subscribe(recv, cb=ch.on_message)
    await nc.flush()
    return ch


async def measure_nats(ch: NatsChannel, size: int, frames: int, pings: int) -> dict[str, float]:
    payload = np.ones(size, dtype=np.uint8).tobytes()
    for _ in range(3):
        await ch.send(ECHO, payload)
        await ch.recv()
    started = time.perf_counter()
    for i in range(frames):
        if i >= NATS_WINDOW:
            await ch.recv()  # the ack of frame i - NATS_WINDOW
        await ch.send(ACK, payload)
    for _ in range(min(frames, NATS_WINDOW)):
        await ch.recv()
    elapsed = time.perf_counter() - started
    rtts = []
    for _ in range(pings):
        t = time.perf_counter()
        await ch.send(ECHO, payload)
        await ch.recv()
        rtts.append(time.perf_counter() - t)
    return summarize(size * frames / elapsed, rtts)


async def serve_nats(url: str) -> None:
    ch = await nats_channel(url, outbound=False)
    while True:
        mode, payload = await ch.recv(timeout_s=None)  # as long as the parent takes
        if mode == QUIT:
            await ch.nc.drain()
            return
        if mode == ACK:
            await ch.send(ACK, b"")
        elif mode == ECHO:
            await ch.send(ECHO, payload)


# --- the peer process ---------------------------------------------------------------------


def peer_main(kind: str, endpoint: str) -> None:
    if kind == "nats":
        asyncio.run(serve_nats(endpoint))
        return
    if kind == "tcp":
        ch: Any = TcpChannel(socket.create_connection(("127.0.0.1", int(endpoint))))
    elif kind == "zmq":
        ch = LinkChannel(ZmqLink(name="bench-peer", connect=endpoint))
    else:
        ch = LinkChannel(relay(endpoint, outbound=False))
    ch.send(ACK, memoryview(b""))  # ready
    serve_sync(ch)
    ch.close()


def spawn_peer(kind: str, endpoint: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--peer", kind, endpoint], env=env
    )


# --- the measuring side -------------------------------------------------------------------


def run_kind(kind: str, url: str, sizes: dict[str, int], total: int, pings: int) -> dict:
    """Spawn a peer for ``kind`` and measure every size; {size label: figures}."""
    if kind == "nats":
        return asyncio.run(run_nats(url, sizes, total, pings))
    listener, ch = None, None
    if kind == "tcp":
        listener = socket.create_server(("127.0.0.1", 0))
        endpoint = str(listener.getsockname()[1])
    elif kind == "zmq":
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        ch: Any = LinkChannel(ZmqLink(name="bench", bind=endpoint))
    else:
        endpoint = url
        ch = LinkChannel(relay(url, outbound=True))
    peer = spawn_peer(kind, endpoint)
    try:
        if listener is not None:
            listener.settimeout(60)
            ch = TcpChannel(listener.accept()[0])
        ch.recv()  # the peer is ready
        out = {
            label: measure_sync(ch, size, frames_for(size, total), pings)
            for label, size in sizes.items()
        }
        ch.send(QUIT, memoryview(b""))
        peer.wait(30)
        return out
    finally:
        if ch is not None:
            ch.close()
        if listener is not None:
            listener.close()
        if peer.poll() is None:
            peer.kill()
            peer.wait()


async def run_nats(url: str, sizes: dict[str, int], total: int, pings: int) -> dict:
    ch = await nats_channel(url, outbound=True)
    peer = spawn_peer("nats", url)
    try:
        while True:  # the peer is ready once it answers an echo
            await ch.send(ECHO, b"")
            try:
                await ch.recv(0.5)
                break
            except TimeoutError:
                if peer.poll() is not None:
                    raise RuntimeError("nats peer died") from None
        await asyncio.sleep(0.3)  # answers to the probes sent before the peer subscribed
        while not ch.frames.empty():
            ch.frames.get_nowait()
        out = {
            label: await measure_nats(ch, size, frames_for(size, total), pings)
            for label, size in sizes.items()
        }
        await ch.send(QUIT, b"")
        await ch.nc.drain()
        await asyncio.get_running_loop().run_in_executor(None, peer.wait, 30)
        return out
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


def frames_for(size: int, total: int) -> int:
    return max(8, total // size)


def collect(rounds: list[dict], kinds: list[str], sizes: dict[str, int]) -> dict:
    """Medians over rounds: {kind: {size: {gb_per_s, p50_ms, p99_ms}}}."""
    return {
        kind: {
            label: {
                key: median([r[kind][label][key] for r in rounds])
                for key in ("gb_per_s", "p50_ms", "p99_ms")
            }
            for label in sizes
        }
        for kind in kinds
    }


def paired_ratio(rounds: list[dict], a: str, b: str, label: str) -> float:
    """Median over rounds of a/b throughput, each pair measured in the same round."""
    return median(round_ratios(rounds, a, b, label))


def round_ratios(rounds: list[dict], a: str, b: str, label: str) -> list[float]:
    """a/b throughput in each round, in round order (what :func:`paired_ratio` takes the
    median of)."""
    return [r[a][label]["gb_per_s"] / r[b][label]["gb_per_s"] for r in rounds]


def report(figures: dict, sizes: dict[str, int]) -> None:
    print(f"  {'transport':8s} {'frame':>6s} {'GB/s':>7s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for kind, rows in figures.items():
        for label in sizes:
            row = rows[label]
            print(
                f"  {kind:8s} {label:>6s} {row['gb_per_s']:7.2f} "
                f"{row['p50_ms']:8.3f} {row['p99_ms']:8.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 5, quick 1)")
    parser.add_argument("--peer", nargs=2, metavar=("KIND", "ENDPOINT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        peer_main(*args.peer)
        return
    repeats = args.repeats or (1 if args.quick else 5)
    total = (16 if args.quick else 256) * 1024 * 1024  # bytes streamed per throughput run
    pings = 10 if args.quick else 100
    load_start = load_avg()
    work = Path(tempfile.mkdtemp(prefix="swarm-bench-link-"))
    server = start_nats_server(
        host="127.0.0.1",
        port=0,
        store_dir=work / "store",
        log_path=work / "nats.log",
        tie_to_parent=True,
    )
    print(f"nats-server {server.url}; {repeats} round(s), {total >> 20} MiB per run", flush=True)
    rounds: list[dict] = []
    try:
        for r in range(repeats):
            order = KINDS if r % 2 == 0 else KINDS[::-1]  # interleave against drift
            rounds.append({kind: run_kind(kind, server.url, SIZES, total, pings) for kind in order})
            line = ", ".join(f"{k} {rounds[-1][k]['4MiB']['gb_per_s']:.2f}" for k in KINDS)
            print(f"  round {r + 1}: 4 MiB GB/s: {line}", flush=True)
    finally:
        server.stop()
    load_end = load_avg()
    figures = collect(rounds, KINDS, SIZES)
    report(figures, SIZES)
    zmq_tcp = paired_ratio(rounds, "zmq", "tcp", "4MiB")
    relay_nats = {label: paired_ratio(rounds, "relay", "nats", label) for label in SIZES}
    relay_nats_4m = relay_nats["4MiB"]
    ratios = {
        "zmq_vs_tcp": {label: paired_ratio(rounds, "zmq", "tcp", label) for label in SIZES},
        "relay_vs_nats": relay_nats,
    }
    per_round = {
        "zmq_vs_tcp": {label: round_ratios(rounds, "zmq", "tcp", label) for label in SIZES},
        "relay_vs_nats": {label: round_ratios(rounds, "relay", "nats", label) for label in SIZES},
    }
    for name, row in ratios.items():
        print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        for label, values in per_round[name].items():
            print(f"    {label} per round: " + " ".join(f"{v:.2f}" for v in values), flush=True)
    print(
        f"  load average (1, 5, 15 min) on {os.cpu_count()} cores: start "
        + " ".join(f"{v:.2f}" for v in load_start)
        + ", end "
        + " ".join(f"{v:.2f}" for v in load_end),
        flush=True,
    )
    zmq_met = verdict("ZmqLink / raw TCP at 4 MiB", zmq_tcp, ">= 0.90", zmq_tcp >= 0.90)
    relay_met = verdict(
        "RelayLink / bare nats-py at 4 MiB", relay_nats_4m, ">= 0.80", relay_nats_4m >= 0.80
    )
    emit(
        {
            "bench": "link",
            "quick": args.quick,
            "rounds": repeats,
            "bytes_per_run": total,
            "transports": figures,
            "ratios": ratios,
            "zmq_vs_tcp_4mib": zmq_tcp,
            "relay_vs_nats_4mib": relay_nats_4m,
            "targets": {
                "zmq_vs_tcp_4mib_ge_0.90": zmq_met,
                "relay_vs_nats_4mib_ge_0.80": relay_met,
            },
            # Additive keys: the ratios round by round, and how busy the machine was, so a
            # run on a loaded machine is recognisable as one.
            "round_ratios": per_round,
            "cpu_count": os.cpu_count(),
            "load_avg": {"start": load_start, "end": load_end},
        }
    )


if __name__ == "__main__":
    main()
