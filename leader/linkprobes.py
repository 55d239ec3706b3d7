"""Links measured before a job needs them: the leader pairs idle fellows and has them probe.

Placement along links (``"partition": "balanced"``, :mod:`silentswarm.leader.balance`) knows
a pair's link once a job's boundary between them has measured it; a pair never measured is
guessed from its ends' other links. So, while fellows wait, the leader measures the links a
guess would stand for: every ``SWARM_LINK_PROBE_EVERY_S`` seconds it picks pairs
(:func:`next_pairs`) of idle fellows of one pool (where no job waits for placement) and one
version, on different hosts, whose link is not measured (or was recorded
:data:`LINK_STALE_S` ago, or a job found it far slower than its probe:
``MeasuredLink.recheck``) and was not tried in the last :data:`RETRY_AFTER_S`, and sends each
a PROBE (:class:`silentswarm.types.signals.ProbeArgs`): one binds its data address (one
another machine can reach: not loopback or link-local), the other connects, and both run the
boundary probe (round trip, bursts each way), then the binder its own pings
(:mod:`silentswarm.agent.linkprobe`). The fellows with the fewest current links go first, and
a fellow with :data:`LINKS_WANTED` of them is left alone: a swarm of thousands gets each
fellow's own rate (what :func:`silentswarm.leader.balance.guessed_links` guesses from) long
before every pair, of which there are millions.

Two fellows report one link, and either may lie: each end reports the round trip of its own
pings and the rate it timed itself beside the rate its peer claims (its own timing, which the
peer cannot shorten: pings and bursts carry random numbers that keep answers and bursts from
being sent ahead, :mod:`silentswarm.agent.pipe.probe`), the link is recorded only
when both report it, and then as the worse of their figures (the slowest rate, the longer
round trip), so neither can make a link look better than its honest peer measured it (a
liar can hide a slow direction behind the rate of the other, which its peer timed). A probe
that one end refuses, that fails, or whose reports do not both come within
:data:`PROBE_EXPIRES_S` is counted, its pair is tried again no sooner than
:data:`RETRY_AFTER_S` later, and both its fellows are held back from probes for that long,
twice as long after each failure in a row (a port no one reaches costs a few probes, not
every one). A fellow in a probe is not placed until the probe ends (it holds the data port a
stage binds).

Up to ``SWARM_LINK_PROBES_AT_ONCE`` probes run side by side, on machines of their own: two
probes that shared a host would share its link and each measure part of it
(:func:`own_host`: a fellow's data address's host, else its host name; :func:`hosts_of`).

Pure choices here (:func:`next_pair`, :func:`next_pairs`, :func:`agreed_link`) and the
bookkeeping of the probes in flight (:class:`LinkProber`); the orchestrator sends the
signals.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from silentswarm.hosts import endpoint_host, routable_endpoint
from silentswarm.leader.balance import LinkBook
from silentswarm.leader.placement import Candidate, same_host
from silentswarm.protocol import LinkProbeReport
from silentswarm.types.links import LINK_CURRENT_S, LinkStats, MeasuredLink
from silentswarm.types.signals import PROBE_TIMEOUT_S

# A fellow with this many measured links is not probed again: enough for its own rate.
LINKS_WANTED = 8
# A pair is not probed again for this long after a probe of it (failed or not).
RETRY_AFTER_S = 600.0
# A link recorded this long ago is measured again (links change: routes, other traffic).
LINK_STALE_S = LINK_CURRENT_S
# The longest a fellow's failed probes hold it back (RETRY_AFTER_S, doubling per failure).
MAX_HOLD_S = 86_400.0
# A probe whose two reports have not both come by then has failed: the fellows' deadline
# (PROBE_TIMEOUT_S, handshake included) and two heartbeats' worth of slack.
PROBE_EXPIRES_S = PROBE_TIMEOUT_S + 10.0
# Pairs :func:`next_pair` looks at per call at most: it runs on the leader's tick.
MAX_SCAN = 20_000

Pair = frozenset[str]


@dataclass(frozen=True)
class ProbePlan:
    """Who binds (its advertised data address is what the other connects to) and who
    connects."""

    binder: str
    connector: str
    address: str
    # Every host either end may be on (its data address's host, its host name): a probe
    # beside it shares none of them, so two probes never share a machine's link.
    hosts: frozenset[str] = frozenset()


def next_pair(
    idle: Sequence[Candidate],
    links: LinkBook,
    tried: Mapping[Pair, float],
    *,
    now: float,
    wall_now: float | None = None,
    held_back: Mapping[str, float] | None = None,
    start: int = 0,
    busy_hosts: frozenset[str] = frozenset(),
    wanted: int = LINKS_WANTED,
    retry_after_s: float = RETRY_AFTER_S,
    stale_after_s: float = LINK_STALE_S,
    max_scan: int = MAX_SCAN,
) -> tuple[ProbePlan | None, int]:
    """The pair of ``idle`` fellows to probe next (or None), and where the next call starts.

    A pair qualifies when both ends have fewer than ``wanted`` current links and are not
    ``held_back`` (fellow -> the time, on ``now``'s clock, until which its failed probes
    hold it back), share a pool and a version, are on different hosts, at least one
    advertises a data address another machine can reach
    (:func:`silentswarm.hosts.routable_endpoint`: it binds),
    their link is not measured either way (or only by a job's report, not a probe), was
    recorded ``stale_after_s`` before
    ``wall_now`` (the wall clock; None: no link is old) or is marked for a recheck
    (``MeasuredLink.recheck``: a job's boundary found it far slower than the probe that
    agreed on it), and it was not tried (``tried``:
    pair -> the time of its last try) in the last ``retry_after_s``. Of those, the first in
    the order of fewest current links (ties by fellow id), so that every fellow gets some
    before any gets many. At most ``max_scan`` pairs are looked at, from the ``start``-th
    fellow of that order on (wrapping); the second value is where a scan cut short stopped,
    so that the next call goes on from there (0 when this one looked at every pair). A
    fellow whose machine (:func:`own_host`) is one of ``busy_hosts`` (the probes in flight's,
    :func:`hosts_of`) is left out: probes side by side share no machine's link."""
    held = held_back or {}

    def current(link: MeasuredLink) -> bool:
        """Measured, not to be measured again yet: agreed by both ends of a probe (a job's
        report alone is its upstream stage's word: a probe measures the pair once both are
        idle, and its figures replace the report's), recorded less than ``stale_after_s``
        ago, and not marked for a recheck (a job found it far slower than its probe)."""
        if link.recheck or not link.probed:
            return False
        return wall_now is None or link.current(wall_now, stale_after_s)

    counts = {c.fellow_id: sum(map(current, links.of(c.fellow_id))) for c in idle}
    ordered = sorted(
        (
            c
            for c in idle
            if counts[c.fellow_id] < wanted
            and held.get(c.fellow_id, 0.0) <= now
            and own_host(c) not in busy_hosts
        ),
        key=lambda c: (counts[c.fellow_id], c.fellow_id),
    )
    n = len(ordered)
    binds = {c.fellow_id: routable_endpoint(c.data_address) for c in ordered}
    scanned = 0
    for k in range(n):
        i = (start + k) % n
        a = ordered[i]
        for b in ordered[i + 1 :]:
            scanned += 1
            if scanned > max_scan:
                return None, i
            a_binds, b_binds = binds[a.fellow_id], binds[b.fellow_id]
            if not (a_binds or b_binds):
                continue
            if a.pool != b.pool or a.version != b.version or same_host(a, b):
                continue
            last = tried.get(frozenset((a.fellow_id, b.fellow_id)))
            if last is not None and now - last < retry_after_s:
                continue
            measured = links.between(a.fellow_id, b.fellow_id)
            if measured is not None and current(measured):
                continue
            binder, connector = (a, b) if a_binds else (b, a)
            assert binder.data_address is not None
            plan = ProbePlan(
                binder=binder.fellow_id,
                connector=connector.fellow_id,
                address=binder.data_address,
                hosts=hosts_of(a) | hosts_of(b),
            )
            return plan, 0
    return None, 0


def next_pairs(
    idle: Sequence[Candidate],
    links: LinkBook,
    tried: Mapping[Pair, float],
    *,
    slots: int,
    busy_hosts: frozenset[str] = frozenset(),
    now: float,
    wall_now: float | None = None,
    held_back: Mapping[str, float] | None = None,
    start: int = 0,
) -> tuple[list[ProbePlan], int]:
    """Up to ``slots`` pairs to probe side by side (:func:`next_pair` one after another,
    each leaving out the hosts of the ones before and of ``busy_hosts``, each looking at
    its share of :data:`MAX_SCAN` pairs), and where the next scan starts."""
    plans: list[ProbePlan] = []
    hosts = set(busy_hosts)
    resume = start
    while len(plans) < slots:
        plan, resume = next_pair(
            idle,
            links,
            tried,
            now=now,
            wall_now=wall_now,
            held_back=held_back,
            start=resume,
            busy_hosts=frozenset(hosts),
            max_scan=max(1, MAX_SCAN // slots),
        )
        if plan is None:
            break
        plans.append(plan)
        hosts |= plan.hosts
    return plans, resume


def hosts_of(fellow: Candidate) -> frozenset[str]:
    """Every name of the machine ``fellow`` may be on, which a probe of it keeps from the
    probes beside it: its data address's host and its host name (a fellow's own claim:
    one that names another's only keeps its probes apart)."""
    return frozenset({own_host(fellow), f"name:{fellow.hostname}"})


def own_host(fellow: Candidate) -> str:
    """The machine ``fellow`` is on as :func:`~silentswarm.leader.placement.same_host` tells
    machines apart: its data address's host, or its host name where it advertises none (so
    fellows on machines cloned from one image, one host name and other addresses, are
    probed side by side)."""
    host = endpoint_host(fellow.data_address)
    return f"addr:{host}" if host is not None else f"name:{fellow.hostname}"


def agreed_link(first: LinkStats, second: LinkStats) -> MeasuredLink:
    """What is kept of a link both ends reported: the worse of their figures (the slower of
    every direction's rate, the longer round trip). Each end reports the rate it timed and
    the round trip of its own pings, so the kept link is no better than either honest end
    measured it."""
    rate = min(first.fwd_mbit_s, first.bwd_mbit_s, second.fwd_mbit_s, second.bwd_mbit_s)
    return MeasuredLink(mbit_s=rate, rtt_ms=max(first.rtt_ms, second.rtt_ms), probed=True)


@dataclass
class ProbeRun:
    """A probe in flight: its id, its plan, when it began (monotonic) and what each end
    has reported so far."""

    probe_id: str
    plan: ProbePlan
    started: float
    reports: dict[str, LinkProbeReport] = field(default_factory=dict)

    @property
    def fellows(self) -> tuple[str, str]:
        return (self.plan.binder, self.plan.connector)


@dataclass(frozen=True)
class ProbeResult:
    """A probe's end: the link to record (``upstream`` is the connecting end) or why none."""

    probe_id: str
    plan: ProbePlan
    link: MeasuredLink | None
    reason: str = ""


class LinkProber:
    """The probes in flight (at most ``at_once``, on machines of their own) and what the
    leader remembers of the ones before: when each
    pair was last tried, each fellow's failed probes in a row and until when they hold it
    back (:data:`RETRY_AFTER_S`, doubling up to :data:`MAX_HOLD_S`: a fellow whose port no
    one reaches does not take every probe), where the last scan stopped, when the last probe
    began, and counts by result (``measured``, ``refused``, ``failed``, ``expired``: what
    the metrics show)."""

    def __init__(self, *, every_s: float, at_once: int = 1) -> None:
        self.every_s = every_s
        self.at_once = at_once
        self.running: dict[str, ProbeRun] = {}  # by probe id
        self.tried: dict[Pair, float] = {}
        self.failures: dict[str, int] = {}
        self.held_back: dict[str, float] = {}
        self.scan_from = 0
        self.last_started: float | None = None
        self.results: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        return self.every_s > 0

    def busy(self) -> frozenset[str]:
        """The fellows in the probes in flight: not placed until theirs ends."""
        return frozenset(f for run in self.running.values() for f in run.fellows)

    def busy_hosts(self) -> frozenset[str]:
        """The hosts of the probes in flight (:func:`hosts_of`): no other probe uses them."""
        return frozenset(h for run in self.running.values() for h in run.plan.hosts)

    def slots(self) -> int:
        """How many more probes may run beside those in flight."""
        return max(0, self.at_once - len(self.running))

    def due(self, now: float) -> bool:
        """Whether new probes may begin: on, fewer than ``at_once`` in flight, the interval
        since the last began passed."""
        if not self.enabled or not self.slots():
            return False
        return self.last_started is None or now - self.last_started >= self.every_s

    def looked(self, now: float, *, resume: int) -> None:
        """A scan found nothing to probe: look again an interval later, from ``resume``."""
        self.last_started = now
        self.scan_from = resume

    def begin(self, plan: ProbePlan, *, now: float, resume: int = 0) -> ProbeRun:
        """A probe of ``plan`` in flight; ``resume``: where the scan that chose it stopped."""
        self._forget_old(now)
        run = ProbeRun(probe_id=secrets.token_hex(8), plan=plan, started=now)
        self.running[run.probe_id] = run
        self.tried[frozenset(run.fellows)] = now
        self.last_started = now
        self.scan_from = resume
        return run

    def refused(self, probe_id: str, reason: str, *, now: float) -> ProbeResult | None:
        """An end refused its PROBE (or did not answer): the probe is over."""
        return self._end(probe_id, None, "refused", reason, now=now)

    def report(self, fellow_id: str, report: LinkProbeReport, *, now: float) -> ProbeResult | None:
        """Take one end's report (a heartbeat's); the probe's result once it is decided. A
        report of another probe, from a fellow outside this one, or naming another peer is
        ignored (heartbeats repeat a report; a stranger's is no answer)."""
        run = self.running.get(report.probe_id)
        if run is None or fellow_id not in run.fellows:
            return None
        peer = run.plan.connector if fellow_id == run.plan.binder else run.plan.binder
        if report.peer != peer or fellow_id in run.reports:
            return None
        run.reports[fellow_id] = report
        if not report.ok or report.stats is None:
            why = f"{fellow_id}: {report.message}"
            return self._end(run.probe_id, None, "failed", why, now=now)
        if len(run.reports) < 2:
            return None
        first, second = (run.reports[f].stats for f in run.fellows)
        assert first is not None and second is not None
        return self._end(run.probe_id, agreed_link(first, second), "measured", "", now=now)

    def expire(self, now: float) -> list[ProbeResult]:
        """End the probes whose reports have not both come within :data:`PROBE_EXPIRES_S`."""
        ended = []
        for run in list(self.running.values()):
            if now - run.started < PROBE_EXPIRES_S:
                continue
            missing = sorted(set(run.fellows) - set(run.reports))
            why = f"no report from {', '.join(missing)}"
            result = self._end(run.probe_id, None, "expired", why, now=now)
            if result is not None:
                ended.append(result)
        return ended

    def _end(
        self, probe_id: str, link: MeasuredLink | None, result: str, reason: str, *, now: float
    ) -> ProbeResult | None:
        run = self.running.pop(probe_id, None)
        if run is None:
            return None
        self.results[result] += 1
        for fellow in run.fellows:
            # Either end may be the one at fault (a port no one reaches, a peer without the
            # keys): both are held back, and a success clears it.
            if link is not None:
                self.failures.pop(fellow, None)
                self.held_back.pop(fellow, None)
            else:
                failures = self.failures[fellow] = self.failures.get(fellow, 0) + 1
                hold = min(MAX_HOLD_S, RETRY_AFTER_S * 2 ** (failures - 1))
                self.held_back[fellow] = now + hold
        return ProbeResult(probe_id=probe_id, plan=run.plan, link=link, reason=reason)

    def _forget_old(self, now: float) -> None:
        """Drop the tries older than the retry interval (they no longer hold a pair back)
        and the failures of fellows held back no more for a day (released or gone ones)."""
        old = [pair for pair, at in self.tried.items() if now - at >= RETRY_AFTER_S]
        for pair in old:
            del self.tried[pair]
        gone = [f for f, until in self.held_back.items() if now - until >= MAX_HOLD_S]
        for fellow in gone:
            del self.held_back[fellow]
            self.failures.pop(fellow, None)


__all__ = [
    "LINKS_WANTED",
    "LINK_STALE_S",
    "MAX_HOLD_S",
    "PROBE_EXPIRES_S",
    "RETRY_AFTER_S",
    "LinkProber",
    "ProbePlan",
    "ProbeResult",
    "ProbeRun",
    "agreed_link",
    "hosts_of",
    "next_pair",
    "next_pairs",
    "own_host",
]
