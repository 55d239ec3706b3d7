"""The rings that keep a job's replicas in sync, pure: segments, ports, links and secrets.

A job with replicas keeps every layer in sync among its replicas, and the replicas may split
the layers differently (each replica's split balanced on its own fellows). The union of the
replicas' stage boundaries cuts the layers into **segments**: maximal runs of layers that
every replica holds on one stage. Each segment has one ring, over the stages that hold it
(one per replica, in replica order: each sends to the next, the last to the first); a stage
is a member of one ring per segment it holds, in segment order, and every member runs its
rings in that order (so a round or a hand-over never waits in a cycle). With one split for
every replica each stage holds one segment, its own layers: one ring per stage.

A segment is named by its first layer (the relay subjects of its links, the digests a member
reports): the embedding belongs to the segment of layer 0, the head to the segment of the
last layer, a learned codec's projections to their stage's only segment (such jobs keep one
split, as the boundaries' projections have no counterpart in another split).

**Ports.** A ring link is a ZeroMQ socket the receiving member binds, one per ring: a fellow's
``SWARM_SYNC_ADDRESS`` names one port (``tcp://host:7000``) or a range
(``tcp://host:7000-7003``, four); :func:`sync_ports` lists them. A stage binds port ``j`` of
its fellow for the ``j``-th ring it is in. A ring link to a member with no port left uses
the NATS relay under transport ``auto``; placement keeps ``p2p`` jobs within their fellows'
ports.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from silentswarm.errors import ConfigError
from silentswarm.plan import CurveKeys, Peer, SyncRing

MAX_SYNC_PORTS = 64
_PORTS_RE = re.compile(r"^(?P<base>.+):(?P<first>\d{1,5})(?:-(?P<last>\d{1,5}))?$")

Split = Sequence[tuple[int, int]]  # one replica's stage layer ranges, in stage order


def sync_ports(address: str | None) -> list[str]:
    """The ring ports a fellow's sync address names, each as a ZeroMQ endpoint:
    ``tcp://h:7000`` is ``[tcp://h:7000]``, ``tcp://h:7000-7002`` three; none for None.
    ConfigError for a range that is backwards, past port 65535 or longer than
    :data:`MAX_SYNC_PORTS`."""
    if not address:
        return []
    match = _PORTS_RE.match(address)
    if match is None or match["last"] is None:
        return [address]
    base, first, last = match["base"], int(match["first"]), int(match["last"])
    if not 0 < first <= last <= 65535:
        raise ConfigError(f"sync address {address!r}: the port range must be ascending, 1-65535")
    if last - first + 1 > MAX_SYNC_PORTS:
        raise ConfigError(f"sync address {address!r}: at most {MAX_SYNC_PORTS} ports")
    return [f"{base}:{port}" for port in range(first, last + 1)]


def fellow_ports(address: str | None) -> list[str]:
    """The ring ports a fellow advertised: :func:`sync_ports`, or none for a malformed
    range (a fellow's word: its stages then use the relay, or p2p does not place them)."""
    try:
        return sync_ports(address)
    except ConfigError:
        return []


def segments(splits: Sequence[Split]) -> list[tuple[int, int]]:
    """The segments of the replicas' ``splits``: the layers cut at every boundary of any
    replica. ConfigError unless every split covers the same layers contiguously."""
    if not splits or not all(splits):
        raise ConfigError("need one non-empty split per replica")
    ends = {(split[0][0], split[-1][1]) for split in splits}
    if len(ends) != 1:
        raise ConfigError(f"the replicas' splits cover different layers: {sorted(ends)}")
    for split in splits:
        for (_, end), (start, _) in itertools.pairwise(split):
            if end != start:
                raise ConfigError(f"split {list(split)} is not contiguous")
        if any(start >= end for start, end in split):
            raise ConfigError(f"split {list(split)} has a stage without layers")
    ((first, last),) = ends
    cuts = sorted({first, last, *(start for split in splits for start, _ in split)})
    return list(itertools.pairwise(cuts))


def stage_segments(
    layer_start: int, layer_end: int, all_segments: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The segments a stage of layers ``[layer_start, layer_end)`` holds, in order."""
    return [(a, b) for a, b in all_segments if layer_start <= a and b <= layer_end]


def uniform(splits: Sequence[Split]) -> bool:
    """Whether every replica splits the layers the same way (one ring per stage)."""
    return all(list(split) == list(splits[0]) for split in splits)


def ports_needed(splits: Sequence[Split]) -> list[list[int]]:
    """``[r][s]``: how many rings (ports) stage ``s`` of replica ``r`` is in."""
    segs = segments(splits)
    return [[len(stage_segments(a, b, segs)) for a, b in split] for split in splits]


# --- secrets ------------------------------------------------------------------------------------


def boundary_keys(n_stages: int) -> list[tuple[CurveKeys, CurveKeys]]:
    """Fresh CURVE keys per boundary: (for the upstream end, for the downstream end)."""
    import zmq  # only the leader makes keys

    out = []
    for _ in range(n_stages - 1):
        server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
        client_public, client_secret = (k.decode() for k in zmq.curve_keypair())
        out.append(
            (
                CurveKeys(public=client_public, secret=client_secret, peer_public=server_public),
                CurveKeys(public=server_public, secret=server_secret, peer_public=client_public),
            )
        )
    return out


@dataclass(frozen=True)
class LinkSecrets:
    """The secrets of one link (a pipeline boundary or a ring link): CURVE keys for the
    connecting and the binding end (None under transport tunnel), and the relay token both
    ends tag with (None under p2p)."""

    connecting: CurveKeys | None
    binding: CurveKeys | None
    token: str | None


def link_secrets(count: int, *, curve: bool, relay: bool) -> list[LinkSecrets]:
    """Fresh secrets for ``count`` links."""
    keys = boundary_keys(count + 1) if curve else [(None, None)] * count
    return [
        LinkSecrets(
            connecting=connecting,
            binding=binding,
            token=secrets.token_hex(32) if relay else None,
        )
        for connecting, binding in keys
    ]


# --- the rings ----------------------------------------------------------------------------------


class Placed(Protocol):
    """What a seat is made from: a placed stage (leader) or a stage plan (without one)."""

    stage: int
    fellow_id: str
    layer_start: int
    layer_end: int


@dataclass(frozen=True)
class Seat:
    """A replica's stage as the rings see it: who runs it, its layers, its fellow's ring
    ports (advertised: the addresses its ring predecessors connect to)."""

    replica: int
    stage: int
    fellow_id: str
    layer_start: int
    layer_end: int
    ports: tuple[str, ...] = ()

    @classmethod
    def of(cls, placed: Placed, replica: int, ports: Iterable[str]) -> Seat:
        """The seat of ``placed`` (a placed stage or a stage plan) in pipeline ``replica``."""
        return cls(
            replica=replica,
            stage=placed.stage,
            fellow_id=placed.fellow_id,
            layer_start=placed.layer_start,
            layer_end=placed.layer_end,
            ports=tuple(ports),
        )


def signing_seeds(replicas: Iterable[int]) -> dict[int, str]:
    """A fresh ed25519 key for each of ``replicas`` (its 32-byte seed, hex): what a member of
    a ring of three or more signs its own contributions with."""
    import nacl.signing  # only the leader makes keys

    return {r: nacl.signing.SigningKey.generate().encode().hex() for r in replicas}


def public_key(seed: str) -> str:
    """The ed25519 public key (hex) of a :func:`signing_seeds` seed."""
    import nacl.signing

    return nacl.signing.SigningKey(bytes.fromhex(seed)).verify_key.encode().hex()


def next_member(members: Sequence[int], replica: int) -> int:
    """The member ``replica`` sends to in the ring ``members`` (sorted): the next one, the
    last member's the first (itself in a ring of one)."""
    i = list(members).index(replica)
    return members[(i + 1) % len(members)]


def prev_member(members: Sequence[int], replica: int) -> int:
    """The member ``replica`` hears from in the ring ``members``: the one before it."""
    i = list(members).index(replica)
    return members[(i - 1) % len(members)]


def build_rings(
    pipelines: Mapping[int, Sequence[Seat]], *, curve: bool, relay: bool
) -> dict[tuple[int, int], list[SyncRing]]:
    """Every member stage's rings, by (replica, stage), over the replicas of ``pipelines``
    (each replica's seats in stage order): one ring per segment of their splits, in replica
    order, with fresh secrets for every link. A member binds port ``j`` of its own for its
    ``j``-th ring and its predecessor connects there; past its ports, the link's ``port``
    and address are None (the relay under transport ``auto``). In a ring of three or more
    every member gets a signing key of its own and every member's public key."""
    members = sorted(pipelines)
    splits = [[(s.layer_start, s.layer_end) for s in pipelines[r]] for r in members]
    segs = segments(splits)
    out: dict[tuple[int, int], list[SyncRing]] = {
        (seat.replica, seat.stage): [] for r in members for seat in pipelines[r]
    }

    def holder(replica: int, segment: tuple[int, int]) -> tuple[Seat, int | None]:
        seat = next(s for s in pipelines[replica] if s.layer_start <= segment[0] < s.layer_end)
        j = stage_segments(seat.layer_start, seat.layer_end, segs).index(segment)
        return seat, (j if j < len(seat.ports) else None)

    for segment in segs:
        ring = [holder(r, segment) for r in members]
        n = len(ring)
        links = link_secrets(n, curve=curve, relay=relay) if n > 1 else []
        seeds = signing_seeds(members) if n > 2 else {}
        signers = {r: public_key(seed) for r, seed in seeds.items()}
        for j, (seat, port) in enumerate(ring):
            fields: dict[str, object] = {}
            if n > 1:
                (before, _), (after, after_port) = ring[j - 1], ring[(j + 1) % n]
                up, down = links[j - 1], links[j]
                fields = dict(
                    prev=Peer(fellow_id=before.fellow_id),
                    next=Peer(
                        fellow_id=after.fellow_id,
                        data_address=None if after_port is None else after.ports[after_port],
                    ),
                    curve_up=up.binding,
                    curve_down=down.connecting,
                    relay_up_token=up.token,
                    relay_down_token=down.token,
                    sign_seed=seeds.get(seat.replica),
                    signers=signers,
                )
            out[(seat.replica, seat.stage)].append(
                SyncRing(layer_start=segment[0], layer_end=segment[1], port=port, **fields)
            )
    return out


__all__ = [
    "MAX_SYNC_PORTS",
    "LinkSecrets",
    "Seat",
    "boundary_keys",
    "build_rings",
    "fellow_ports",
    "link_secrets",
    "next_member",
    "ports_needed",
    "prev_member",
    "public_key",
    "segments",
    "signing_seeds",
    "stage_segments",
    "sync_ports",
    "uniform",
]
