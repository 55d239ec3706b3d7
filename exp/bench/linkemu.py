"""A link emulator: slow, distant paths between processes on this machine.

This kernel has no ``netem`` (``tc qdisc add ... netem`` fails), so a path is built from what
does work: a network namespace (the path's **far side**) joined to the root namespace by a
veth pair, a ``tbf`` rate limit on each end of the pair (the kernel shapes each direction,
and TCP's own congestion control meets a real bottleneck), and a small user-space TCP relay
that holds every chunk it forwards for the one-way delay (plus optional jitter) of its
direction. Nothing leaves the machine: the veth pair and its two addresses exist only
between the root namespace and the namespace created here, and both go when the path does.

Directions: **forward** is near (root namespace) to far (the namespace), **backward** the
other way. A process runs on the far side with :attr:`FarSide.prefix` in front of its
command line. A connection crosses the path through a relay: :meth:`FarSide.relay` starts
one on either side, listening there and forwarding to a target on the other side, and
returns the address to connect to.

What the relay changes from a real path of the same rate and delay: it splits the TCP
connection in two (the congestion window of each half grows at the half's own, short round
trip, not at the path's), and delays under about 0.1 ms are below what its sleeps resolve.
Both are documented in docs/performance.md beside the figures.

    python exp/bench/linkemu.py probe --profile wan100   # measure a path, print JSON
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

CHUNK = 256 * 1024
QUEUE_CAP = 64 * 1024 * 1024  # bytes a relay holds per direction before it stops reading
GSO_ABOVE_BIT_S = 200e6  # shaped directions slower than this send packets one by one


class EmulatorUnavailable(RuntimeError):
    """This machine cannot build a shaped path (not root, or no ``ip``/``tc``)."""


@dataclass(frozen=True)
class Direction:
    """One direction of a path: its rate (None: not limited) and its one-way delay."""

    rate_bit_s: float | None = None
    delay_s: float = 0.0
    jitter_s: float = 0.0


@dataclass(frozen=True)
class Profile:
    name: str
    forward: Direction = field(default_factory=Direction)
    backward: Direction = field(default_factory=Direction)

    @property
    def shaped(self) -> bool:
        """Whether the profile needs a path at all (``loopback`` does not)."""
        return any(
            d.rate_bit_s is not None or d.delay_s > 0 or d.jitter_s > 0
            for d in (self.forward, self.backward)
        )


def symmetric(name: str, rate_bit_s: float | None, delay_s: float, jitter_s: float = 0.0):
    d = Direction(rate_bit_s, delay_s, jitter_s)
    return Profile(name, d, d)


PROFILES: dict[str, Profile] = {
    "loopback": Profile("loopback"),
    "lan": symmetric("lan", 1e9, 0.25e-3),
    "wan100": symmetric("wan100", 100e6, 25e-3),
    "wan20": symmetric("wan20", 20e6, 50e-3),
}


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown link profile {name!r}; known: {', '.join(PROFILES)}") from None


def packet_by_packet(rate_bit_s: float) -> bool:
    """Whether a direction of this rate sends packets one by one (no GSO on its device).

    With GSO a sender hands the device 64 KiB segments, and a ``tbf`` lets each through whole
    when its tokens are there: the far end then receives 64 KiB clumps, one every 26 ms at
    20 Mbit/s or 262 ms at 2 Mbit/s, which no real path of that rate does (and which a
    bandwidth probe sees as speed). Above :data:`GSO_ABOVE_BIT_S` a segment takes under 2.6 ms
    and the packets' cost would count more than the clumps.
    """
    return rate_bit_s < GSO_ABOVE_BIT_S


def tbf_args(rate_bit_s: float) -> list[str]:
    """``tc qdisc ... tbf`` arguments for ``rate_bit_s``.

    The bucket holds 4 ms at the rate but at least what the device may hand it at once (a
    packet larger than the bucket could never leave): 8 KiB when the direction sends packets
    one by one, one 64 KiB GSO segment otherwise. The queue holds 100 ms at the rate but at
    least 256 KiB, so a burst queues instead of being dropped at once.
    """
    rate_bytes = rate_bit_s / 8
    floor = 8 * 1024 if packet_by_packet(rate_bit_s) else 64 * 1024
    burst = max(floor, int(rate_bytes * 0.004))
    limit = max(256 * 1024, int(rate_bytes * 0.1))
    return ["tbf", "rate", f"{int(rate_bit_s)}bit", "burst", str(burst), "limit", str(limit)]


def shaping_commands(dev: str, rate_bit_s: float) -> list[list[str]]:
    """The commands that shape the traffic leaving ``dev`` to ``rate_bit_s``: packets one by
    one when :func:`packet_by_packet` says so, then the ``tbf``."""
    commands = []
    if packet_by_packet(rate_bit_s):
        commands.append(["ip", "link", "set", "dev", dev, "gso_max_segs", "1"])
    commands.append(["tc", "qdisc", "add", "dev", dev, "root", *tbf_args(rate_bit_s)])
    return commands


def release_at(previous: float, arrival: float, delay_s: float, jitter: float) -> float:
    """When a chunk that arrived at ``arrival`` may leave: after its delay plus ``jitter``
    (a sample in seconds), never before the chunk ahead of it (TCP keeps bytes in order)."""
    return max(previous, arrival + delay_s + jitter)


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode:
        raise EmulatorUnavailable(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def _check_tools() -> None:
    if os.geteuid() != 0:
        raise EmulatorUnavailable("shaped paths need root (network namespaces, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise EmulatorUnavailable(f"shaped paths need `{tool}` (Debian: iproute2)")


def check_available() -> None:
    """Raise :class:`EmulatorUnavailable` with the reason, where a path cannot be built."""
    _check_tools()
    scratch = f"ssw-{os.getpid()}-test"  # root in a container may still not make namespaces
    _run(["ip", "netns", "add", scratch])
    _run(["ip", "netns", "del", scratch])


def unavailable_reason() -> str | None:
    """Why no path can be built here, or None (for a test's skip condition)."""
    try:
        check_available()
    except EmulatorUnavailable as e:
        return str(e)
    return None


def _used_subnets() -> set[int]:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    used = set()
    for word in out.stdout.split():
        if word.startswith("10.213."):
            used.add(int(word.split(".")[2]))
    return used


class FarSide:
    """A network namespace one shaped path away from the root namespace.

    Use as a context manager; everything it made (namespace, veth pair, relays) is gone
    after it, also when the body raised. Names carry this process's pid, so
    :func:`remove_stale` can clear what a killed run left behind.
    """

    def __init__(self, prof: Profile, *, seed: int = 0) -> None:
        self.profile = prof
        self.seed = seed
        tag = secrets.token_hex(2)
        self.namespace = f"ssw-{os.getpid()}-{tag}"
        self._near_dev, self._far_dev = f"ssw{tag}h", f"ssw{tag}f"
        self.near_ip = self.far_ip = ""
        self._relays: list[subprocess.Popen[str]] = []

    @property
    def prefix(self) -> list[str]:
        """Put in front of a command line to run it on the far side."""
        return ["ip", "netns", "exec", self.namespace]

    def __enter__(self) -> FarSide:
        _check_tools()  # a namespace that cannot be made fails below, with ip's reason
        free = sorted(set(range(1, 255)) - _used_subnets())
        if not free:
            raise EmulatorUnavailable("no free 10.213.x.0/30 subnet")
        k = random.Random(self.namespace).choice(free)
        self.near_ip, self.far_ip = f"10.213.{k}.1", f"10.213.{k}.2"
        try:
            ns = self.prefix
            _run(["ip", "netns", "add", self.namespace])
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    self._near_dev,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    self._far_dev,
                    "netns",
                    self.namespace,
                ]
            )
            _run(["ip", "addr", "add", f"{self.near_ip}/30", "dev", self._near_dev])
            _run(["ip", "link", "set", self._near_dev, "up"])
            _run([*ns, "ip", "addr", "add", f"{self.far_ip}/30", "dev", self._far_dev])
            _run([*ns, "ip", "link", "set", self._far_dev, "up"])
            _run([*ns, "ip", "link", "set", "lo", "up"])
            for prefix, dev, direction in (
                ([], self._near_dev, self.profile.forward),
                (ns, self._far_dev, self.profile.backward),
            ):
                if direction.rate_bit_s is not None:
                    for command in shaping_commands(dev, direction.rate_bit_s):
                        _run([*prefix, *command])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in self._relays:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._relays.clear()
        _remove(self.namespace, self._near_dev)

    def relay(self, *, far: bool, target: tuple[str, int]) -> tuple[str, int]:
        """Start a delay relay on the far side (``far``) or the near side, forwarding to
        ``target`` on the other side; the (host, port) to connect to, on the relay's side.

        A relay on the near side listens on 127.0.0.1 and its target is usually
        ``(far_ip, port)``; one on the far side listens on the far side's 127.0.0.1 and
        its target is ``(near_ip, port)``, where the near-side server must listen.
        """
        to_target = self.profile.backward if far else self.profile.forward
        from_target = self.profile.forward if far else self.profile.backward
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "relay",
            "--target",
            f"{target[0]}:{target[1]}",
            "--to-target",
            f"{to_target.delay_s}:{to_target.jitter_s}",
            "--from-target",
            f"{from_target.delay_s}:{from_target.jitter_s}",
            "--seed",
            str(self.seed + len(self._relays)),
        ]
        proc = subprocess.Popen(
            [*self.prefix, *argv] if far else argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._relays.append(proc)
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("listening "):
            raise EmulatorUnavailable(f"the delay relay did not start (exit {proc.poll()})")
        return "127.0.0.1", int(line.split()[1])

    @contextlib.contextmanager
    def connect_to_server(self, serve: str) -> Iterator[socket.socket]:
        """A socket connected, through a near-side relay, to a Python server on the far side
        that accepts one connection ``c`` and runs the code ``serve`` on it (for probes and
        tests of the path itself)."""
        code = (
            "import socket\n"
            f"s=socket.create_server(({self.far_ip!r},0));print(s.getsockname()[1],flush=True)\n"
            f"c,_=s.accept()\n{serve}"
        )
        server = subprocess.Popen(
            [*self.prefix, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True
        )
        try:
            port = int(server.stdout.readline() if server.stdout else "")
            host, entry = self.relay(far=False, target=(self.far_ip, port))
            with socket.create_connection((host, entry), timeout=60) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                yield sock
        finally:
            server.kill()
            server.wait()


def _remove(namespace: str, near_dev: str) -> None:
    """Delete a path: its namespace (with the far end of the veth pair) and the near end."""
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    subprocess.run(["ip", "link", "del", near_dev], capture_output=True)


def remove_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone; their names, returned."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    removed = []
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        ours = len(parts) == 3 and parts[0] == "ssw" and parts[1].isdigit()
        if ours and not Path(f"/proc/{parts[1]}").exists():
            _remove(name, f"ssw{parts[2]}h")
            removed.append(name)
    return removed


# --- the relay process -------------------------------------------------------------------


class _DelayedPipe:
    """One direction of a relayed connection: chunks read from ``src`` leave for ``dst``
    when :func:`release_at` says so. Reading stops while ``QUEUE_CAP`` bytes wait."""

    def __init__(
        self,
        src: socket.socket,
        dst: socket.socket,
        delay_s: float,
        jitter_s: float,
        rng: random.Random,
        on_end,
    ) -> None:
        self.src, self.dst = src, dst
        self.delay_s, self.jitter_s, self.rng = delay_s, jitter_s, rng
        self.on_end = on_end
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.cond = threading.Condition()

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        previous = 0.0
        try:
            while data := self.src.recv(CHUNK):
                jitter = self.rng.uniform(0, self.jitter_s) if self.jitter_s else 0.0
                previous = release_at(previous, time.monotonic(), self.delay_s, jitter)
                with self.cond:
                    while self.queued >= QUEUE_CAP:
                        self.cond.wait()
                    self.queue.append((previous, data))
                    self.queued += len(data)
                    self.cond.notify_all()
        except OSError:
            pass
        with self.cond:
            self.queue.append((previous, b""))  # end of stream
            self.cond.notify_all()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue:
                        self.cond.wait()
                    release, data = self.queue.popleft()
                    self.queued -= len(data)
                    self.cond.notify_all()
                if (wait := release - time.monotonic()) > 0:
                    time.sleep(wait)
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
        except OSError:
            pass
        finally:
            self.on_end()


def _serve(
    target: tuple[str, int],
    to_target: tuple[float, float],
    from_target: tuple[float, float],
    seed: int,
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"listening {listener.getsockname()[1]}", flush=True)
    rng = random.Random(seed)
    while True:
        client, _ = listener.accept()
        try:
            upstream = socket.create_connection(target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            client.close()  # the target is not up yet: the client reconnects
            continue
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ended = []

        def end(client=client, upstream=upstream, ended=ended) -> None:
            ended.append(1)
            if len(ended) == 2:
                client.close()
                upstream.close()

        _DelayedPipe(client, upstream, *to_target, random.Random(rng.random()), end).start()
        _DelayedPipe(upstream, client, *from_target, random.Random(rng.random()), end).start()


def _delay_arg(text: str) -> tuple[float, float]:
    delay, _, jitter = text.partition(":")
    return float(delay), float(jitter or 0.0)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def probe(prof: Profile, megabytes: float = 4.0) -> dict[str, float]:
    """Round trip of a small message and one-way throughput, through a fresh path."""
    serve = (
        "while d:=c.recv(1<<20):\n"
        "  c.sendall(b'k') if d==b'p' else None\n"
        "  if d.endswith(b'E'): c.sendall(b'done')\n"
    )
    with FarSide(prof) as far, far.connect_to_server(serve) as sock:
        rtts = []
        for _ in range(5):
            started = time.perf_counter()
            sock.sendall(b"p")
            sock.recv(1)
            rtts.append(time.perf_counter() - started)
        payload = b"x" * int(megabytes * 2**20 - 1) + b"E"
        started = time.perf_counter()
        sock.sendall(payload)
        while not sock.recv(16).endswith(b"done"):
            pass
        took = time.perf_counter() - started
    rtt = sorted(rtts)[len(rtts) // 2]
    return {
        "profile": prof.name,
        "rtt_ms": 1e3 * rtt,
        # the transfer's time less one round trip (the first byte's way there, "done" back)
        "throughput_mbit_s": len(payload) * 8 / max(took - rtt, 1e-9) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    relay = sub.add_parser("relay", help="(internal) one delay relay")
    relay.add_argument("--target", type=_host_port, required=True)
    relay.add_argument("--to-target", type=_delay_arg, default=(0.0, 0.0))
    relay.add_argument("--from-target", type=_delay_arg, default=(0.0, 0.0))
    relay.add_argument("--seed", type=int, default=0)
    probe_cmd = sub.add_parser("probe", help="measure a fresh path of a profile")
    probe_cmd.add_argument("--profile", default="wan100", choices=list(PROFILES))
    probe_cmd.add_argument("--megabytes", type=float, default=4.0)
    args = parser.parse_args()
    if args.command == "relay":
        _serve(args.target, args.to_target, args.from_target, args.seed)
    else:
        try:
            print(json.dumps(probe(profile(args.profile), args.megabytes)))
        except EmulatorUnavailable as e:
            sys.exit(f"linkemu: {e}")


if __name__ == "__main__":
    main()
