"""Which idle fellows the leader has measure their link, and what it keeps of their reports
(silentswarm.leader.linkprobes; the probe itself over real fellows:
tests/integration/test_link_probes.py)."""

from __future__ import annotations

import pytest

from silentswarm.hosts import endpoint_host, routable_endpoint
from silentswarm.leader.balance import LinkBook
from silentswarm.leader.linkprobes import (
    LINK_STALE_S,
    LINKS_WANTED,
    MAX_HOLD_S,
    PROBE_EXPIRES_S,
    RETRY_AFTER_S,
    LinkProber,
    ProbePlan,
    agreed_link,
    hosts_of,
    next_pair,
    next_pairs,
)
from silentswarm.leader.placement import Candidate
from silentswarm.leader.registry import FellowRegistry
from silentswarm.protocol import (
    FellowIdentity,
    HardwareSnapshot,
    LinkProbeReport,
    RegisterRequest,
)
from silentswarm.types.links import LinkStats, MeasuredLink

NOW = 10_000.0


def fellow(
    fid: str,
    host: str | None = "default",
    *,
    hostname: str | None = None,
    pool: str = "default",
    version: str = "1.0",
) -> Candidate:
    """A candidate whose data address is on ``host`` (``"default"``: a host of its own; None:
    it advertises none)."""
    if host == "default":
        host = f"10.0.0.{int(fid[1:]) if fid[1:].isdigit() else 99}"
    return Candidate(
        fellow_id=fid,
        hostname=hostname or f"host-{fid}",
        data_address=None if host is None else f"tcp://{host}:5701",
        cpu_cores=2,
        ram_available_bytes=2**30,
        pool=pool,
        version=version,
    )


LINK = MeasuredLink(mbit_s=100.0, rtt_ms=10.0, probed=True)


def book(*pairs: tuple[str, str]) -> LinkBook:
    return LinkBook({pair: LINK for pair in pairs})


@pytest.mark.parametrize(
    ("idle", "links", "tried", "want"),
    [
        # the plain case: the first fellow binds, the second connects
        ([fellow("f1"), fellow("f2")], (), {}, ("f1", "f2")),
        # one machine (the same data address host): its loopback, nothing to measure
        ([fellow("f1", "10.0.0.5"), fellow("f2", "10.0.0.5")], (), {}, None),
        # one advertises no address: it connects; the other binds
        ([fellow("f1", None), fellow("f2")], (), {}, ("f2", "f1")),
        # neither advertises an address: no direct link to measure
        ([fellow("f1", None), fellow("f2", None)], (), {}, None),
        # one without an address on the same machine (host name) as the other
        ([fellow("f1", None, hostname="m"), fellow("f2", hostname="m")], (), {}, None),
        # other pools or versions never share a job
        ([fellow("f1"), fellow("f2", pool="gpu")], (), {}, None),
        ([fellow("f1"), fellow("f2", version="1.1")], (), {}, None),
        # measured already, either way round
        ([fellow("f1"), fellow("f2")], (("f2", "f1"),), {}, None),
        # tried a while ago: not yet again; long enough ago: again
        ([fellow("f1"), fellow("f2")], (), {("f1", "f2"): NOW - 10}, None),
        ([fellow("f1"), fellow("f2")], (), {("f1", "f2"): NOW - RETRY_AFTER_S}, ("f1", "f2")),
        # the fellows with the fewest measured links first: f3 has none, f1 and f2 one each
        (
            [fellow("f1"), fellow("f2"), fellow("f3"), fellow("f4")],
            (("f1", "f4"), ("f2", "f4")),
            {},
            ("f3", "f1"),
        ),
    ],
)
def test_next_pair(idle, links, tried, want):
    tried = {frozenset(pair): at for pair, at in tried.items()}
    plan, _ = next_pair(idle, book(*links), tried, now=NOW)
    if want is None:
        assert plan is None
        return
    binder, connector = want
    by_id = {c.fellow_id: c for c in idle}
    assert plan is not None and (plan.binder, plan.connector) == (binder, connector)
    assert plan.address == by_id[binder].data_address
    assert plan.hosts == hosts_of(by_id[binder]) | hosts_of(by_id[connector])


def test_a_fellow_with_enough_measured_links_is_left_alone():
    idle = [fellow(f"f{i}") for i in range(1, LINKS_WANTED + 3)]
    # f1 has LINKS_WANTED links, to the fellows beyond the idle ones
    links = book(*(("f1", f"x{i}") for i in range(LINKS_WANTED)))
    plan, _ = next_pair(idle, links, {}, now=NOW)
    assert plan is not None and "f1" not in (plan.binder, plan.connector)
    assert next_pair([idle[0], idle[1]], links, {}, now=NOW) == (None, 0)


def test_a_scan_cut_short_goes_on_where_it_stopped():
    # 30 fellows of another pool sort first (no links), then one pair that qualifies.
    crowd = [fellow(f"a{i:02}", None, pool="other") for i in range(30)]
    pair = [fellow("z1", "10.2.2.2"), fellow("z2", "10.3.3.3")]
    links = LinkBook({("z1", "x"): LINK, ("z2", "y"): LINK})  # z1, z2 sort last
    assert next_pair([*crowd, *pair], links, {}, now=NOW)[0] is not None  # no limit: found
    start, found = 0, None
    for _ in range(40):  # each call looks at 100 pairs at most, from where the last stopped
        found, start = next_pair([*crowd, *pair], links, {}, now=NOW, start=start, max_scan=100)
        if found is not None:
            break
    assert found is not None and {found.binder, found.connector} == {"z1", "z2"}
    # From the start each time, the pair behind the crowd is never reached.
    assert next_pair([*crowd, *pair], links, {}, now=NOW, max_scan=100)[0] is None


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.9.9.9",
        "[::1]",
        "localhost",
        "localhost.",
        "169.254.1.1",
        "0.0.0.0",
        "127.1",  # what inet_aton also reads as loopback
        "2130706433",
        "0x7f000001",
        "[::ffff:127.0.0.1]",
        "[fe80::1%eth0]",
    ],
)
def test_an_address_no_other_machine_reaches_never_binds(host):
    # f2 advertises it: an honest f1 would connect to a port of its own machine.
    idle = [fellow("f1", None), fellow("f2", host)]
    assert next_pair(idle, LinkBook(), {}, now=NOW) == (None, 0)
    assert not routable_endpoint(f"tcp://{host}:5701")
    # With a reachable end, that one binds.
    idle = [fellow("f1", "10.0.0.1"), fellow("f2", host)]
    plan, _ = next_pair(idle, LinkBook(), {}, now=NOW)
    assert plan is not None and plan.binder == "f1"


def test_fellows_held_back_are_not_probed():
    idle = [fellow("f1"), fellow("f2"), fellow("f3")]
    plan, _ = next_pair(idle, LinkBook(), {}, now=NOW, held_back={"f1": NOW + 1})
    assert plan is not None and plan.binder == "f2" and plan.connector == "f3"
    plan, _ = next_pair(idle, LinkBook(), {}, now=NOW, held_back={"f1": NOW})
    assert plan is not None and plan.binder == "f1"


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("tcp://10.0.0.1:5701", "10.0.0.1"),
        ("tcp://Node-A.example:5701", "node-a.example"),
        ("tcp://[fe80::1%eth0]:5701", "[fe80::1%eth0]"),
        (None, None),
    ],
)
def test_endpoint_host(address, host):
    assert endpoint_host(address) == host


def stats(fwd: float, bwd: float, rtt: float) -> LinkStats:
    return LinkStats(boundary=0, step=0, rtt_ms=rtt, fwd_mbit_s=fwd, bwd_mbit_s=bwd)


def test_the_worse_of_both_ends_figures_is_kept():
    assert agreed_link(stats(90, 80, 12), stats(95, 70, 10)) == MeasuredLink(
        mbit_s=70, rtt_ms=12, probed=True
    )


def report(run_id: str, peer: str, ok: bool = True, s: LinkStats | None = None) -> LinkProbeReport:
    return LinkProbeReport(
        probe_id=run_id,
        peer=peer,
        ok=ok,
        stats=(s or stats(90, 80, 12)) if ok else None,
        message="" if ok else "no HELLO",
    )


PLAN = ProbePlan(binder="b", connector="c", address="tcp://10.0.0.2:5701")


def test_a_probe_is_recorded_once_both_ends_report_it():
    prober = LinkProber(every_s=10)
    assert prober.due(NOW)
    run = prober.begin(PLAN, now=NOW)
    assert prober.busy() == {"b", "c"} and not prober.due(NOW + 100)
    # a stranger's report, another probe's, one naming the wrong peer: ignored
    assert prober.report("x", report(run.probe_id, "b"), now=NOW) is None
    assert prober.report("b", report("0" * 16, "c"), now=NOW) is None
    assert prober.report("b", report(run.probe_id, "x"), now=NOW) is None
    assert prober.report("b", report(run.probe_id, "c"), now=NOW) is None  # one end: not yet
    assert prober.report("b", report(run.probe_id, "c"), now=NOW) is None  # a repeat: nothing
    result = prober.report("c", report(run.probe_id, "b"), now=NOW)
    assert result is not None and result.link == MeasuredLink(mbit_s=80, rtt_ms=12, probed=True)
    assert prober.running == {} and prober.busy() == frozenset()
    assert dict(prober.results) == {"measured": 1}
    assert not prober.due(NOW + 9) and prober.due(NOW + 10)


@pytest.mark.parametrize("liar", ["b", "c"])
def test_a_boasting_end_gets_the_honest_ends_figures(liar):
    """Each end reports its own round trip and the rate it timed: a liar's boast (either
    end) is capped by what its honest peer measured itself."""
    prober = LinkProber(every_s=10)
    run = prober.begin(PLAN, now=NOW)
    honest = "c" if liar == "b" else "b"
    prober.report(liar, report(run.probe_id, honest, s=stats(9e6, 9e6, 0)), now=NOW)
    result = prober.report(honest, report(run.probe_id, liar, s=stats(90, 80, 12)), now=NOW)
    assert result is not None and result.link == MeasuredLink(mbit_s=80, rtt_ms=12, probed=True)


@pytest.mark.parametrize("how", ["failed", "refused", "expired"])
def test_a_probe_that_fails_records_nothing_and_holds_the_pair_back(how):
    prober = LinkProber(every_s=10)
    run = prober.begin(PLAN, now=NOW)
    if how == "failed":
        result = prober.report("c", report(run.probe_id, "b", ok=False), now=NOW)
        assert result is not None and "no HELLO" in result.reason
    elif how == "refused":
        result = prober.refused(run.probe_id, "b: PROBE_REFUSED: it runs a stage", now=NOW)
    else:
        assert prober.expire(NOW + PROBE_EXPIRES_S - 1) == []
        (result,) = prober.expire(NOW + PROBE_EXPIRES_S)
        assert "no report from b, c" in result.reason
    assert result is not None and result.link is None
    assert prober.running == {} and prober.results == {how: 1}
    assert frozenset(("b", "c")) in prober.tried  # next_pair waits RETRY_AFTER_S for it
    ended = NOW + (PROBE_EXPIRES_S if how == "expired" else 0)
    assert prober.held_back == {"b": ended + RETRY_AFTER_S, "c": ended + RETRY_AFTER_S}


def test_failures_in_a_row_hold_a_fellow_back_longer_and_a_success_clears_them():
    prober = LinkProber(every_s=10)
    now = NOW
    for failures in (1, 2, 3):
        run = prober.begin(ProbePlan(binder="b", connector=f"c{failures}", address="x"), now=now)
        prober.refused(run.probe_id, "no answer", now=now)
        assert prober.held_back["b"] == now + RETRY_AFTER_S * 2 ** (failures - 1)
        now += 1
    for _ in range(20):  # the hold stops growing at MAX_HOLD_S
        run = prober.begin(ProbePlan(binder="b", connector="cx", address="x"), now=now)
        prober.refused(run.probe_id, "no answer", now=now)
    assert prober.held_back["b"] == now + MAX_HOLD_S
    run = prober.begin(ProbePlan(binder="b", connector="c9", address="x"), now=now)
    prober.report("b", report(run.probe_id, "c9"), now=now)
    prober.report("c9", report(run.probe_id, "b"), now=now)
    assert "b" not in prober.held_back and "b" not in prober.failures


def test_probes_are_off_at_zero():
    assert not LinkProber(every_s=0).due(NOW)


def test_a_link_recorded_a_day_ago_is_measured_again():
    old = MeasuredLink(mbit_s=100.0, rtt_ms=10.0, measured_at=NOW - LINK_STALE_S, probed=True)
    recent = MeasuredLink(mbit_s=100.0, rtt_ms=10.0, measured_at=NOW - 60, probed=True)
    idle = [fellow("f1"), fellow("f2")]
    recent_book = LinkBook({("f1", "f2"): recent})
    assert next_pair(idle, recent_book, {}, now=NOW, wall_now=NOW)[0] is None
    plan, _ = next_pair(idle, LinkBook({("f1", "f2"): old}), {}, now=NOW, wall_now=NOW)
    assert plan is not None and {plan.binder, plan.connector} == {"f1", "f2"}
    # Without the wall clock (or a link's time), no link is old.
    assert next_pair(idle, LinkBook({("f1", "f2"): old}), {}, now=NOW)[0] is None
    # Old links do not count towards a fellow's LINKS_WANTED: f1's are all old.
    many_old = LinkBook({("f1", f"x{i}"): old for i in range(LINKS_WANTED)})
    assert next_pair(idle, many_old, {}, now=NOW, wall_now=NOW)[0] is not None


def test_a_link_only_a_job_reported_is_probed_once_both_ends_are_idle():
    """A job's report is its upstream stage's word alone: a fellow claimed 10 Pbit/s to a
    pair never probed, which kept it current for a day and drew placement to it. The pair
    is probed (and its probe's figures replace the claim, test_registry's)."""
    claim = MeasuredLink(mbit_s=1e10, rtt_ms=0.0, measured_at=NOW - 60)
    idle = [fellow("f1"), fellow("f2")]
    plan, _ = next_pair(idle, LinkBook({("f1", "f2"): claim}), {}, now=NOW, wall_now=NOW)
    assert plan is not None and {plan.binder, plan.connector} == {"f1", "f2"}
    claims = LinkBook({("f1", f"x{i}"): claim for i in range(LINKS_WANTED)})
    assert next_pair(idle, claims, {}, now=NOW, wall_now=NOW)[0] is not None, "none counts"


def test_a_measured_pair_waits_before_it_is_probed_again():
    prober = LinkProber(every_s=10)
    run = prober.begin(PLAN, now=NOW)
    prober.report("b", report(run.probe_id, "c"), now=NOW)
    assert prober.report("c", report(run.probe_id, "b"), now=NOW) is not None
    assert prober.tried[frozenset(("b", "c"))] == NOW


def registry_of(*fellows: str, now: list[float]) -> FellowRegistry:
    """A registry whose wall clock reads ``now[0]``, with ``fellows`` registered."""
    registry = FellowRegistry(
        heartbeat_interval_s=1.0, offline_after_s=3.0, leader_version="t", wall=lambda: now[0]
    )
    registry.bus_connected()
    hardware = HardwareSnapshot(
        hostname="h", cpu_cores=2, ram_total_bytes=8 << 30, ram_available_bytes=4 << 30
    )
    for fid in fellows:
        ident = FellowIdentity(fellow_id=fid, instance_id="i", hostname="h", version="t", pid=1)
        assert registry.register(RegisterRequest(fellow=ident, hardware=hardware)).accepted
    return registry


def test_the_registry_keeps_a_links_time_until_its_figures_change():
    now = [1000.0]
    registry = registry_of("up", now=now)
    reported = MeasuredLink(mbit_s=100.0, rtt_ms=10.0)  # a job's boundary's
    registry.record_link("up", "down", reported)
    assert registry.links["up", "down"].measured_at == 1000.0
    now[0] = 2000.0
    registry.record_link("up", "down", reported)  # a stage repeats its figures: no new time
    assert registry.links["up", "down"].measured_at == 1000.0
    registry.record_link("up", "down", reported, fresh=True)  # measured again
    assert registry.links["up", "down"].measured_at == 2000.0
    now[0] = 3000.0
    registry.record_link("up", "down", MeasuredLink(mbit_s=50.0, rtt_ms=10.0))
    assert registry.links["up", "down"] == MeasuredLink(
        mbit_s=50.0, rtt_ms=10.0, measured_at=3000.0
    )


def test_a_pair_keeps_one_link_the_newest():
    """A probe records connector -> binder; the pair's older link the other way (a job's
    boundary) goes, so placement and the next probe read the new figures."""
    now = [1000.0]
    registry = registry_of("a", "b", now=now)
    registry.record_link("a", "b", LINK)
    registry.take_dirty()
    now[0] = 2000.0
    registry.record_link("b", "a", MeasuredLink(mbit_s=5.0, rtt_ms=80.0), fresh=True)
    assert dict(registry.links) == {
        ("b", "a"): MeasuredLink(mbit_s=5.0, rtt_ms=80.0, measured_at=2000.0)
    }
    assert registry.links.between("a", "b").mbit_s == 5.0
    assert registry.get("a").links == {} and sorted(f for f, _ in registry.take_dirty()) == [
        "a",
        "b",
    ]


def test_a_jobs_report_lowers_a_probed_link_but_does_not_raise_it_until_it_is_old():
    """A job's boundary figures are its upstream stage's word alone: against a link both ends
    of a probe agreed on less than a day ago they count only where they are worse."""
    now = [1000.0]
    registry = registry_of("a", "b", now=now)
    probed = agreed_link(stats(80, 90, 12), stats(85, 95, 10))
    registry.record_link("a", "b", probed, fresh=True)
    agreed = {"agreed_mbit_s": 80, "agreed_rtt_ms": 12}
    assert registry.links.between("a", "b") == MeasuredLink(
        mbit_s=80, rtt_ms=12, measured_at=1000.0, probed=True, **agreed
    )
    now[0] = 2000.0
    registry.take_dirty()
    registry.record_link("b", "a", MeasuredLink(mbit_s=9e6, rtt_ms=0.0))  # a boast
    assert registry.links.between("a", "b").mbit_s == 80 and registry.take_dirty() == []
    registry.record_link("a", "b", MeasuredLink(mbit_s=60.0, rtt_ms=14.0))  # worse: kept
    assert registry.links.between("a", "b") == MeasuredLink(
        mbit_s=60, rtt_ms=14, measured_at=1000.0, probed=True, **agreed
    )
    now[0] = 1000.0 + LINK_STALE_S  # a day on, the job's own figures count again
    registry.record_link("a", "b", MeasuredLink(mbit_s=300.0, rtt_ms=5.0))
    assert registry.links.between("a", "b") == MeasuredLink(
        mbit_s=300, rtt_ms=5, measured_at=now[0]
    )


@pytest.mark.parametrize(
    ("job", "recheck"),
    [
        (MeasuredLink(mbit_s=41.0, rtt_ms=23.0), False),  # worse, not far: kept as it is
        (MeasuredLink(mbit_s=39.0, rtt_ms=12.0), True),  # under half the probe's rate
        (MeasuredLink(mbit_s=80.0, rtt_ms=25.0), True),  # over twice its round trip
    ],
)
def test_a_jobs_report_far_below_a_probed_link_has_the_next_probe_measure_it_again(job, recheck):
    now = [1000.0]
    registry = registry_of("f1", "f2", now=now)
    registry.record_link("f1", "f2", agreed_link(stats(80, 90, 12), stats(85, 95, 10)), fresh=True)
    now[0] = 2000.0
    registry.record_link("f1", "f2", job)
    lowered = registry.links.between("f1", "f2")
    assert lowered is not None and lowered.recheck is recheck and lowered.probed
    assert lowered.mbit_s == min(80, job.mbit_s) and lowered.measured_at == 1000.0
    idle = [fellow("f1"), fellow("f2")]
    plan, _ = next_pair(idle, registry.links, {}, now=NOW, wall_now=2000.0)
    assert (plan is not None) is recheck, "only a link marked for a recheck is probed again"
    registry.take_dirty()
    registry.record_link("f1", "f2", job)  # the stage repeats its figures: nothing new
    assert registry.take_dirty() == [] and registry.links.between("f1", "f2") == lowered
    # The probe measures it again: its figures stand, whatever the job said, unmarked.
    now[0] = 2500.0
    again = agreed_link(stats(70, 75, 13), stats(72, 74, 12))
    registry.record_link("f2", "f1", again, fresh=True)
    assert registry.links.between("f1", "f2") == MeasuredLink(
        mbit_s=70, rtt_ms=13, measured_at=2500.0, probed=True, agreed_mbit_s=70, agreed_rtt_ms=13
    )
    assert next_pair(idle, registry.links, {}, now=NOW, wall_now=2500.0)[0] is None


@pytest.mark.parametrize(
    ("agreed", "reports", "recheck"),
    [
        # Each a little below the last, together far below what the probe agreed on.
        ((80, 12), [(60, 12), (45, 12), (41, 12), (39, 12)], True),
        ((80, 12), [(80, 16), (80, 20), (80, 25)], True),
        ((80, 12), [(60, 16), (45, 20)], False),
        # A LAN's fraction of a millisecond, doubled by jitter: not far below.
        ((900, 0.3), [(900, 0.9)], False),
        # A slow link that loses less than half a megabit: not far below either.
        ((0.8, 30), [(0.35, 30)], False),
        ((0.8, 30), [(0.25, 30)], True),
    ],
)
def test_far_below_is_against_what_the_probe_agreed_on(agreed, reports, recheck):
    now = [1000.0]
    registry = registry_of("f1", "f2", now=now)
    probed = MeasuredLink(mbit_s=agreed[0], rtt_ms=agreed[1], probed=True)
    registry.record_link("f1", "f2", probed, fresh=True)
    for mbit_s, rtt_ms in reports:
        registry.record_link("f1", "f2", MeasuredLink(mbit_s=mbit_s, rtt_ms=rtt_ms))
    link = registry.links.between("f1", "f2")
    assert link is not None and link.recheck is recheck, link
    assert (link.agreed_mbit_s, link.agreed_rtt_ms) == agreed


def test_probes_side_by_side_share_no_machine():
    """Four fellows on three machines (f1 and f2 share one): one probe is all that fits;
    five fellows on five machines: two side by side, sharing no machine."""
    three = [fellow("f1", "10.0.0.1"), fellow("f2", "10.0.0.1"), fellow("f3"), fellow("f4")]
    plans, _ = next_pairs(three, book(), {}, slots=4, now=NOW)
    assert len(plans) == 1
    five = [fellow("f1"), fellow("f2"), fellow("f3"), fellow("f4"), fellow("f5")]
    plans, _ = next_pairs(five, book(), {}, slots=4, now=NOW)
    assert len(plans) == 2
    assert not plans[0].hosts & plans[1].hosts
    assert len({f for p in plans for f in (p.binder, p.connector)}) == 4
    # Machines cloned from one image (one host name, their own addresses): side by side.
    clones = [fellow(f"f{i}", hostname="ubuntu") for i in range(1, 5)]
    assert len(next_pairs(clones, book(), {}, slots=4, now=NOW)[0]) == 2
    # A fellow without an address is on its host name's machine: not beside a probe of
    # a fellow with that host name.
    busy = hosts_of(fellow("f9", hostname="m"))
    alone = [fellow("f1", None, hostname="m"), fellow("f2"), fellow("f3")]
    plans, _ = next_pairs(alone, book(), {}, slots=4, busy_hosts=busy, now=NOW)
    assert [{p.binder, p.connector} for p in plans] == [{"f2", "f3"}]
    # No more than the slots, and none on the hosts of the probes in flight.
    assert len(next_pairs(five, book(), {}, slots=1, now=NOW)[0]) == 1
    busy = hosts_of(fellow("f1")) | hosts_of(fellow("f2"))
    plans, _ = next_pairs(five, book(), {}, slots=4, busy_hosts=busy, now=NOW)
    assert [{p.binder, p.connector} for p in plans] == [{"f3", "f4"}]


def test_the_prober_runs_up_to_at_once_probes_and_ends_each_by_its_own_reports():
    prober = LinkProber(every_s=10, at_once=2)
    first = ProbePlan(binder="b", connector="c", address="x", hosts=frozenset({"h1", "h2"}))
    second = ProbePlan(binder="d", connector="e", address="y", hosts=frozenset({"h3", "h4"}))
    assert prober.due(NOW) and prober.slots() == 2
    one = prober.begin(first, now=NOW)
    two = prober.begin(second, now=NOW)
    assert prober.slots() == 0 and not prober.due(NOW + 100)
    assert prober.busy() == {"b", "c", "d", "e"}
    assert prober.busy_hosts() == {"h1", "h2", "h3", "h4"}
    # A report of one probe from a fellow of the other is no answer.
    assert prober.report("d", report(one.probe_id, "c"), now=NOW) is None
    prober.report("d", report(two.probe_id, "e"), now=NOW)
    result = prober.report("e", report(two.probe_id, "d"), now=NOW)
    assert result is not None and result.plan == second
    assert set(prober.running) == {one.probe_id} and prober.busy() == {"b", "c"}
    assert prober.slots() == 1 and prober.due(NOW + 10) and not prober.due(NOW + 9)
    (expired,) = prober.expire(NOW + PROBE_EXPIRES_S)
    assert expired.plan == first and prober.running == {}


def test_a_later_round_leaves_the_machines_of_the_probes_in_flight_alone():
    """What the orchestrator does each round: the idle fellows less those probing, the
    slots left, the hosts in flight; f5 shares f1's machine."""
    prober = LinkProber(every_s=10, at_once=4)
    fleet = [fellow("f1"), fellow("f2"), fellow("f5", "10.0.0.1"), fellow("f3"), fellow("f4")]
    (first,), resume = next_pairs(fleet, book(), {}, slots=1, now=NOW)
    prober.begin(first, now=NOW, resume=resume)
    assert {first.binder, first.connector} == {"f1", "f2"}
    idle = [c for c in fleet if c.fellow_id not in prober.busy()]
    plans, _ = next_pairs(
        idle, book(), prober.tried, slots=prober.slots(), busy_hosts=prober.busy_hosts(), now=NOW
    )
    assert [{p.binder, p.connector} for p in plans] == [{"f3", "f4"}]
