"""FellowRegistry: what the leader knows of each fellow.

Pure state: no I/O, and both clocks are injected, so every rule is unit-tested. The leader
mirrors the status each fellow reports about itself and owns one transition of its own:
a fellow whose heartbeat is stale goes ``offline``. Staleness counts from the later of the
fellow's last heartbeat and the leader's own (re)connection to NATS, and is never judged
while the leader is disconnected, so a leader restart or a NATS blip cannot mark the swarm
offline.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from silentswarm.errors import ErrorCode
from silentswarm.leader.balance import LinkBook, smoothed
from silentswarm.leader.hostview import HostFellow, merge_host
from silentswarm.lifecycle import FellowEvent, can_go_offline, next_status
from silentswarm.protocol import (
    DeregisterRequest,
    FellowIdentity,
    FellowStatus,
    HardwareSnapshot,
    Heartbeat,
    LinkProbeReport,
    RegisterReply,
    RegisterRequest,
)
from silentswarm.text import loggable
from silentswarm.types.fleet import FellowRecord, NodeView, ReleasedFellow, Transition
from silentswarm.types.links import MeasuredLink

__all__ = ["FellowRecord", "FellowRegistry", "NodeView", "Transition"]

T = TypeVar("T")

log = logging.getLogger(__name__)
HISTORY_LEN = 50
# Measured links kept per fellow (its stages' downstream peers, the most recent): a bound
# on what one fellow's record holds, well above the peers a fellow meets in its jobs.
LINKS_KEPT = 32
# Release markers kept at most, the oldest dropped first: bounded like the revocations in
# the NATS account (about 2,000 released fellows fill its JWT), with room to spare.
RELEASED_KEPT = 10_000


@dataclass
class _Entry:
    record: FellowRecord
    last_seen: float  # leader's monotonic clock
    # The instance said goodbye: its heartbeats still in flight must not revive it.
    deregistered: bool = False
    # The latest link probe report its heartbeats carried (silentswarm.leader.linkprobes).
    link_probe: LinkProbeReport | None = None


class FellowRegistry:
    def __init__(
        self,
        *,
        heartbeat_interval_s: float,
        offline_after_s: float,
        leader_version: str,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        purge_pending: Callable[[str], bool] = lambda _: False,
        instance_key: bytes | None = None,
    ) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.offline_after_s = offline_after_s
        self.leader_version = leader_version
        self._clock = clock
        self._wall = wall
        # Set by the leader: a released agent with a pending purge must wait for it, not exit.
        self.purge_pending = purge_pending
        # Makes each instance's deregister secret (an HMAC: nothing stored, and the same
        # after a leader restart when the key is the same).
        self._instance_key = instance_key or os.urandom(32)
        self._entries: dict[str, _Entry] = {}
        self._connected_since: float | None = None
        self.dropped: Counter[str] = Counter()
        # Fellow id -> the agent instance an operator released: its heartbeats are ignored.
        # Stored (``take_released_dirty``), so a restarted leader does not take it back.
        self._released: dict[str, ReleasedFellow] = {}
        self.released_dirty: set[str] = set()
        # Released instances heard from (heartbeats) since ``take_released_heard``: agents
        # that missed their STOP (offline when released), which the leader tells again.
        self._released_heard: set[str] = set()
        # Fellow ids whose record changed (or was removed) since the store last wrote them.
        self.dirty: set[str] = set()
        # (upstream, downstream) -> their latest measured link: an index of the records'
        # ``links``, which placement reads on every tick.
        self._links = LinkBook()

    # --- the leader's own NATS connection ---------------------------------------------------

    def bus_connected(self) -> None:
        """The leader (re)connected to NATS: every fellow gets a fresh offline window."""
        self._connected_since = self._clock()

    def bus_disconnected(self) -> None:
        self._connected_since = None

    @property
    def bus_is_connected(self) -> bool:
        return self._connected_since is not None

    # --- messages from fellows -------------------------------------------------------------

    def register(self, req: RegisterRequest) -> RegisterReply:
        fid = req.fellow.fellow_id
        if self._is_released(fid, req.fellow.instance_id):
            if self.purge_pending(fid):
                return self._reject(
                    ErrorCode.PURGE_PENDING, f"fellow {fid!r} was released; a purge is on its way"
                )
            return self._reject(ErrorCode.RELEASED, f"fellow {fid!r} was released by an operator")
        self._forget_release(fid)
        self.dirty.add(fid)
        entry = self._entries.get(fid)
        if entry is None:
            self._entries[fid] = self._new_entry(req.fellow, req.hardware, req.status, "registered")
            log.info("fellow %s registered (host %s)", fid, loggable(req.fellow.hostname, 100))
            return self._registered(req.fellow, "registered")
        record = entry.record
        if record.instance_id != req.fellow.instance_id and not self._is_gone(entry):
            age = self._clock() - entry.last_seen
            return self._reject(
                ErrorCode.FELLOW_ID_IN_USE,
                f"fellow id {fid!r} is held by a live agent (pid {record.pid} on "
                f"{record.hostname}, heard {age:.1f}s ago); choose another --name, or wait "
                f"{self.offline_after_s:.0f}s for it to go offline",
            )
        self._revive_if_offline(entry, "registered again")
        entry.deregistered = False
        self._refresh(entry, req.fellow, req.hardware)
        entry.record.registrations += 1
        entry.record.last_registered_at = self._wall()
        self._set_status(entry, req.status, "registered again")
        log.info(
            "fellow %s registered again (instance %s)", fid, loggable(req.fellow.instance_id, 80)
        )
        return self._registered(req.fellow, "registered again")

    def instance_secret(self, fellow_id: str, instance_id: str) -> str:
        message = f"instance:{fellow_id}:{instance_id}".encode()
        return hmac.new(self._instance_key, message, hashlib.sha256).hexdigest()[:32]

    def _registered(self, fellow: FellowIdentity, message: str) -> RegisterReply:
        reply = self._accept(message)
        reply.instance_secret = self.instance_secret(fellow.fellow_id, fellow.instance_id)
        return reply

    def deregister(self, req: DeregisterRequest) -> RegisterReply:
        entry = self._entries.get(req.fellow_id)
        if entry is None:
            return self._reject(ErrorCode.NOT_FOUND, f"fellow {req.fellow_id!r} is not registered")
        if entry.record.instance_id != req.instance_id:
            return self._reject(
                ErrorCode.INSTANCE_MISMATCH,
                f"fellow {req.fellow_id!r} is held by another agent instance",
            )
        expected = self.instance_secret(req.fellow_id, req.instance_id)
        if not hmac.compare_digest(req.instance_secret.encode(), expected.encode()):
            self.dropped["deregister_secret"] += 1
            log.warning("refused a deregister of %s without its instance's secret", req.fellow_id)
            return self._reject(
                ErrorCode.INSTANCE_SECRET_INVALID,
                "a deregister needs the secret the leader gave this instance when it registered",
            )
        if req.outcome is not None:
            entry.record.outcome = req.outcome
        if entry.record.status is not FellowStatus.OFFLINE:
            self._go_offline(entry, f"deregistered: {req.reason}")
        entry.deregistered = True
        log.info("fellow %s deregistered (%s)", req.fellow_id, loggable(req.reason))
        return self._accept("deregistered")

    def heartbeat(self, hb: Heartbeat) -> bool:
        """Apply one heartbeat; False when it was dropped (it belongs to a stale instance)."""
        fid = hb.fellow.fellow_id
        if self._is_released(fid, hb.fellow.instance_id):
            self.dropped["released"] += 1
            self._released_heard.add(fid)
            return False
        entry = self._entries.get(fid)
        if entry is None:
            self._forget_release(fid)  # another instance took the id
            self.dirty.add(fid)
            # A fellow we never heard register: the leader restarted and lost its memory,
            # or the register reply was lost. The heartbeat says all we need.
            self._entries[fid] = self._new_entry(
                hb.fellow, hb.hardware, hb.status, "adopted from heartbeat"
            )
            entry = self._entries[fid]
        elif entry.record.instance_id != hb.fellow.instance_id:
            if not self._is_gone(entry):
                self.dropped["instance_mismatch"] += 1
                log.warning(
                    "dropped heartbeat for %s from instance %s: instance %s holds the id",
                    fid,
                    loggable(hb.fellow.instance_id, 80),
                    loggable(entry.record.instance_id, 80),
                )
                return False
            self._revive_if_offline(entry, "new instance heartbeating")
        elif entry.deregistered:
            self.dropped["after_deregister"] += 1
            return False
        else:
            self._revive_if_offline(entry, "heartbeat after offline")
        self._refresh(entry, hb.fellow, hb.hardware)
        record = entry.record
        record.job_id, record.attempt = hb.job_id, hb.attempt
        record.step, record.loss, record.outcome = hb.step, hb.loss, hb.outcome
        record.bytes_sent, record.bytes_received = hb.bytes_sent, hb.bytes_received
        record.last_heartbeat_at = self._wall()
        record.heartbeats += 1
        if hb.link_probe is not None:
            entry.link_probe = hb.link_probe
        self._set_status(entry, hb.status, "reported by fellow")
        return True

    # --- operators and the store -----------------------------------------------------------

    def release(self, fellow_id: str) -> FellowRecord:
        """Forget a fellow; the agent instance that held the id is ignored from now on."""
        entry = self._entries.pop(fellow_id, None)
        if entry is None:
            raise KeyError(fellow_id)
        for peer in entry.record.links:
            self._links.drop((fellow_id, peer))
        self._released.pop(fellow_id, None)  # the newest last: the oldest go first
        self._released[fellow_id] = ReleasedFellow(
            fellow_id=fellow_id, instance_id=entry.record.instance_id, released_at=self._wall()
        )
        self.released_dirty.add(fellow_id)
        while len(self._released) > RELEASED_KEPT:
            oldest = next(iter(self._released))
            del self._released[oldest]
            self.released_dirty.add(oldest)
        self.dirty.add(fellow_id)
        log.info("fellow %s released", fellow_id)
        return entry.record

    def restore_released(self, records: list[ReleasedFellow]) -> None:
        """The released instances loaded from the store at start-up, oldest first."""
        for record in sorted(records, key=lambda r: r.released_at):
            self._released.setdefault(record.fellow_id, record)

    def take_released_dirty(self) -> list[tuple[str, ReleasedFellow | None]]:
        """The release markers added or dropped (None) since the last call."""
        out = [(fid, self._released.get(fid)) for fid in sorted(self.released_dirty)]
        self.released_dirty.clear()
        return out

    def take_released_heard(self) -> set[str]:
        """The fellow ids whose released instance was heard since the last call."""
        heard, self._released_heard = self._released_heard, set()
        return heard

    def _is_released(self, fellow_id: str, instance_id: str) -> bool:
        marker = self._released.get(fellow_id)
        return marker is not None and marker.instance_id == instance_id

    def _forget_release(self, fellow_id: str) -> None:
        if self._released.pop(fellow_id, None) is not None:
            self.released_dirty.add(fellow_id)

    def restore(self, records: list[FellowRecord]) -> None:
        """Records loaded from the store at start-up; each gets a fresh offline window.

        A fellow heard before the store was read keeps its live state and gets its saved
        past back (first registration, count, history).
        """
        for saved in records:
            entry = self._entries.get(saved.fellow_id)
            if entry is None:
                self._entries[saved.fellow_id] = _Entry(record=saved, last_seen=self._clock())
                self._index_links(saved)
                continue
            live = entry.record
            live.links = {**saved.links, **live.links}  # the saved ones are the older
            self._trim_links(saved.fellow_id, live.links)
            self._index_links(live)
            live.registered_at = min(live.registered_at, saved.registered_at)
            live.registrations += saved.registrations
            live.history[:0] = saved.history
            del live.history[:-HISTORY_LEN]
            self.dirty.add(saved.fellow_id)

    def take_dirty(self) -> list[tuple[str, FellowRecord | None]]:
        """The changed records (None: removed) since the last call."""
        out = []
        for fid in sorted(self.dirty):
            entry = self._entries.get(fid)
            out.append((fid, None if entry is None else self._view(entry)))
        self.dirty.clear()
        return out

    # --- time ------------------------------------------------------------------------------

    def sweep(self) -> list[tuple[str, Transition]]:
        """Turn every stale fellow offline; returns the transitions made."""
        made: list[tuple[str, Transition]] = []
        for fid, entry in self._entries.items():
            if entry.record.status is not FellowStatus.OFFLINE and self._is_stale(entry):
                silent = self._clock() - entry.last_seen
                made.append((fid, self._go_offline(entry, f"no heartbeat for {silent:.1f}s")))
                log.warning("fellow %s is offline (no heartbeat for %.1fs)", fid, silent)
        return made

    # --- reads -----------------------------------------------------------------------------

    def record_speed(self, fellow_id: str, speed: float) -> None:
        """A speed the fellow's stage showed: smoothed into its record. Not marked dirty (it
        changes every step); the store keeps it whenever it next writes the record."""
        entry = self._entries.get(fellow_id)
        if entry is not None:
            entry.record.measured_speed = smoothed(entry.record.measured_speed, speed)

    def link_probe_of(self, fellow_id: str) -> LinkProbeReport | None:
        """The latest link probe report ``fellow_id``'s heartbeats carried."""
        entry = self._entries.get(fellow_id)
        return entry.link_probe if entry is not None else None

    def record_link(
        self, upstream: str, downstream: str, link: MeasuredLink, *, fresh: bool = False
    ) -> None:
        """A boundary ``upstream`` -> ``downstream`` measured ``link``: kept on the upstream
        fellow's record (the latest :data:`LINKS_KEPT` peers; the pair's link the other way,
        older, dropped) with the time, written by the store when its figures are new or
        changed (a stage repeats its latest measurement with every step); ``fresh``: a new
        measurement (an idle probe's), whose time counts even where its figures are the same.
        A job's report does not raise a link an idle probe recorded less than
        :data:`~silentswarm.types.links.LINK_CURRENT_S` ago (it may lower it; far below it,
        the link is marked for the next idle probe to measure again: ``recheck``)."""
        entry = self._entries.get(upstream)
        if entry is None or upstream == downstream:
            return
        links = entry.record.links
        now = self._wall()
        kept = self._links.between(upstream, downstream)
        if not fresh and _current_probe(kept, now):
            # A job's report is its upstream stage's word alone: it may lower a link both
            # ends of a probe agreed on, not raise it, until that link is old.
            assert kept is not None
            # Against what the probe agreed on, not what earlier reports lowered it to, so
            # that a link lowered step by step is measured again as one lowered at once.
            agreed_mbit_s = kept.agreed_mbit_s if kept.agreed_mbit_s is not None else kept.mbit_s
            agreed_rtt_ms = kept.agreed_rtt_ms if kept.agreed_rtt_ms is not None else kept.rtt_ms
            link = MeasuredLink(
                mbit_s=min(link.mbit_s, kept.mbit_s),
                rtt_ms=max(link.rtt_ms, kept.rtt_ms),
                measured_at=kept.measured_at,
                probed=True,
                agreed_mbit_s=agreed_mbit_s,
                agreed_rtt_ms=agreed_rtt_ms,
                recheck=kept.recheck or link.far_below(agreed_mbit_s, agreed_rtt_ms),
            )
            if link == kept:
                return
        elif not fresh and link.same_figures(links.get(downstream)):
            return
        elif link.probed:  # an idle probe's: what it agreed on is kept beside the figures
            link = msgspec.structs.replace(
                link, measured_at=now, agreed_mbit_s=link.mbit_s, agreed_rtt_ms=link.rtt_ms
            )
        else:
            link = msgspec.structs.replace(link, measured_at=now)
        links.pop(downstream, None)
        links[downstream] = link
        self._links.put((upstream, downstream), link)
        self._trim_links(upstream, links)
        self.dirty.add(upstream)
        # One link per pair, the newest: the other direction's figures are older.
        other = self._entries.get(downstream)
        if other is not None and other.record.links.pop(upstream, None) is not None:
            self._links.drop((downstream, upstream))
            self.dirty.add(downstream)

    def _index_links(self, record: FellowRecord) -> None:
        for peer, link in record.links.items():
            self._links.put((record.fellow_id, peer), link)

    def _trim_links(self, upstream: str, links: dict[str, MeasuredLink]) -> None:
        """Drop the oldest of ``upstream``'s links beyond :data:`LINKS_KEPT`."""
        while len(links) > LINKS_KEPT:
            oldest = next(iter(links))
            del links[oldest]
            self._links.drop((upstream, oldest))

    @property
    def links(self) -> LinkBook:
        """Every kept measured link, by (upstream, downstream) fellow pair and by fellow."""
        return self._links

    def get(self, fellow_id: str) -> FellowRecord | None:
        entry = self._entries.get(fellow_id)
        return None if entry is None else self._view(entry)

    def list(self) -> list[FellowRecord]:
        return [self._view(e) for _, e in sorted(self._entries.items())]

    def registered_at(self, fellow_id: str) -> float | None:
        """When a fellow last registered (None: unknown here)."""
        entry = self._entries.get(fellow_id)
        if entry is None:
            return None
        return entry.record.last_registered_at or entry.record.registered_at

    def read_each(self, read: Callable[[FellowRecord], T]) -> list[T]:
        """``read`` of every fellow's live record, in no particular order, without the copies
        :meth:`list` makes: for a caller that takes what it needs at once and keeps nothing of
        the record (the orchestrator's snapshots, four times a second: copying every record
        for them was a sixth of the leader's CPU at 5,000 fellows)."""
        return [read(entry.record) for entry in self._entries.values()]

    def online_ids(self) -> set[str]:
        """The fellows not offline."""
        return {
            fid for fid, e in self._entries.items() if e.record.status is not FellowStatus.OFFLINE
        }

    def counts(self) -> dict[str, int]:
        counts = Counter(e.record.status.value for e in self._entries.values())
        return {s.value: counts.get(s.value, 0) for s in FellowStatus}

    def host_count(self) -> int:
        """How many hosts; what /api/v1/info needs, without building every NodeView."""
        return len({_host_key(e.record) for e in self._entries.values()})

    def nodes(self) -> list[NodeView]:
        """One view per host (a host name and, where its fellows report one, its kernel's
        boot id: machines cloned from one image share a name), merged over all its fellows
        (:func:`silentswarm.leader.hostview.merge_host`)."""
        by_host: dict[tuple[str, str], list[HostFellow]] = {}
        for entry in self._entries.values():
            record = entry.record
            by_host.setdefault(_host_key(record), []).append(
                HostFellow(
                    fellow_id=record.fellow_id,
                    online=record.status is not FellowStatus.OFFLINE,
                    hardware=record.hardware,
                    seen_at=record.last_heartbeat_at or record.registered_at,
                )
            )
        return [merge_host(host, fellows) for (host, _), fellows in sorted(by_host.items())]

    # --- internals -------------------------------------------------------------------------

    def _accept(self, message: str) -> RegisterReply:
        return self._reply(True, None, message)

    def _reject(self, code: ErrorCode, message: str) -> RegisterReply:
        return self._reply(False, code, message)

    def _reply(self, accepted: bool, code: ErrorCode | None, message: str) -> RegisterReply:
        return RegisterReply(
            accepted=accepted,
            code=code,
            message=message,
            heartbeat_interval_s=self.heartbeat_interval_s,
            offline_after_s=self.offline_after_s,
            leader_version=self.leader_version,
        )

    def _new_entry(
        self,
        ident: FellowIdentity,
        hardware: HardwareSnapshot,
        status: FellowStatus,
        reason: str,
    ) -> _Entry:
        now = self._wall()
        record = FellowRecord(
            fellow_id=ident.fellow_id,
            instance_id=ident.instance_id,
            hostname=ident.hostname,
            version=ident.version,
            pid=ident.pid,
            data_address=ident.data_address,
            sync_address=ident.sync_address,
            pool=ident.pool,
            labels=dict(ident.labels),
            status=status,
            hardware=hardware,
            registered_at=now,
            registrations=1 if reason == "registered" else 0,
            last_registered_at=now if reason == "registered" else None,
            history=[Transition(at=now, from_status=None, to_status=status, reason=reason)],
        )
        return _Entry(record=record, last_seen=self._clock())

    def _refresh(self, entry: _Entry, ident: FellowIdentity, hardware: HardwareSnapshot) -> None:
        record = entry.record
        record.instance_id, record.hostname = ident.instance_id, ident.hostname
        record.version, record.pid, record.data_address = (
            ident.version,
            ident.pid,
            ident.data_address,
        )
        record.sync_address = ident.sync_address
        record.pool, record.labels = ident.pool, dict(ident.labels)
        record.hardware = hardware
        entry.last_seen = self._clock()

    def _revive_if_offline(self, entry: _Entry, reason: str) -> None:
        if entry.record.status is FellowStatus.OFFLINE:
            self._transition(
                entry, next_status(FellowStatus.OFFLINE, FellowEvent.RECONNECT), reason
            )
            entry.record.offline_reason = None
            entry.record.registered_at = self._wall()

    def _set_status(self, entry: _Entry, status: FellowStatus, reason: str) -> None:
        if status is not entry.record.status:
            self._transition(entry, status, reason)

    def _go_offline(self, entry: _Entry, reason: str) -> Transition:
        entry.record.offline_reason = reason
        if can_go_offline(entry.record.status):
            status = next_status(entry.record.status, FellowEvent.HEARTBEAT_STALE)
        else:
            status = FellowStatus.OFFLINE
        return self._transition(entry, status, reason)

    def _transition(self, entry: _Entry, status: FellowStatus, reason: str) -> Transition:
        record = entry.record
        self.dirty.add(record.fellow_id)
        t = Transition(at=self._wall(), from_status=record.status, to_status=status, reason=reason)
        record.status = status
        record.history.append(t)
        del record.history[:-HISTORY_LEN]
        return t

    def _is_stale(self, entry: _Entry) -> bool:
        if self._connected_since is None:
            return False
        since = max(entry.last_seen, self._connected_since)
        return self._clock() - since > self.offline_after_s

    def _is_gone(self, entry: _Entry) -> bool:
        return entry.record.status is FellowStatus.OFFLINE or self._is_stale(entry)

    def _view(self, entry: _Entry) -> FellowRecord:
        record = msgspec.structs.replace(
            entry.record, history=list(entry.record.history), links=dict(entry.record.links)
        )
        if record.last_heartbeat_at is not None:
            record.last_heartbeat_age_s = round(
                max(0.0, self._wall() - record.last_heartbeat_at), 3
            )
        return record


def _current_probe(link: MeasuredLink | None, now: float) -> bool:
    """Whether ``link`` is one an idle probe's two ends agreed on less than
    :data:`~silentswarm.types.links.LINK_CURRENT_S` before ``now`` (the wall clock)."""
    return link is not None and link.probed and link.current(now)


def _host_key(record: FellowRecord) -> tuple[str, str]:
    """Which host view a fellow's record joins: its host name and its kernel's boot id."""
    return (record.hostname, record.hardware.machine_id or "")
