"""Which idle fellows the leader has measure their link, and what it keeps of their reports
(silentswarm.leader.linkprobes; the probe itself over real fellows:
tests/integration/test_link_probes.py)."""

from __future__ import annotations

import pytest

from silentswarm.leader.balance import LinkBook
from silentswarm.leader.linkprobes import (
    LINK_STALE_S,
    LINKS_WANTED,
    PROBE_EXPIRES_S,
    RETRY_AFTER_S,
    LinkProber,
    ProbePlan,
    address_host,
    agreed_link,
    next_pair,
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


LINK = MeasuredLink(mbit_s=100.0, rtt_ms=10.0)


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
    plan = next_pair(idle, book(*links), tried, now=NOW)
    if want is None:
        assert plan is None
        return
    binder, connector = want
    by_id = {c.fellow_id: c for c in idle}
    assert plan == ProbePlan(binder=binder, connector=connector, address=by_id[binder].data_address)


def test_a_fellow_with_enough_measured_links_is_left_alone():
    idle = [fellow(f"f{i}") for i in range(1, LINKS_WANTED + 3)]
    # f1 has LINKS_WANTED links, to the fellows beyond the idle ones
    links = book(*(("f1", f"x{i}") for i in range(LINKS_WANTED)))
    plan = next_pair(idle, links, {}, now=NOW)
    assert plan is not None and "f1" not in (plan.binder, plan.connector)
    assert next_pair([idle[0], idle[1]], links, {}, now=NOW) is None


def test_the_scan_is_bounded():
    # every pair of one host: nothing to probe, and no more than max_scan pairs looked at
    idle = [fellow(f"f{i}", "10.1.1.1") for i in range(300)]
    assert next_pair(idle, LinkBook(), {}, now=NOW, max_scan=100) is None


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("tcp://10.0.0.1:5701", "10.0.0.1"),
        ("tcp://Node-A.example:5701", "node-a.example"),
        ("tcp://[fe80::1%eth0]:5701", "[fe80::1%eth0]"),
        (None, None),
    ],
)
def test_address_host(address, host):
    assert address_host(address) == host


def stats(fwd: float, bwd: float, rtt: float) -> LinkStats:
    return LinkStats(boundary=0, step=0, rtt_ms=rtt, fwd_mbit_s=fwd, bwd_mbit_s=bwd)


def test_the_worse_of_both_ends_figures_is_kept():
    assert agreed_link(stats(90, 80, 12), stats(95, 70, 10)) == MeasuredLink(mbit_s=70, rtt_ms=12)


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
    assert prober.report("x", report(run.probe_id, "b")) is None
    assert prober.report("b", report("0" * 16, "c")) is None
    assert prober.report("b", report(run.probe_id, "x")) is None
    assert prober.report("b", report(run.probe_id, "c")) is None  # one end: not yet
    assert prober.report("b", report(run.probe_id, "c")) is None  # a repeat changes nothing
    result = prober.report("c", report(run.probe_id, "b"))
    assert result is not None and result.link == MeasuredLink(mbit_s=80, rtt_ms=12)
    assert prober.current is None and prober.busy() == frozenset()
    assert dict(prober.results) == {"measured": 1}
    assert not prober.due(NOW + 9) and prober.due(NOW + 10)


def test_ends_that_disagree_get_the_worse_figures_and_are_counted():
    prober = LinkProber(every_s=10)
    run = prober.begin(PLAN, now=NOW)
    prober.report("b", report(run.probe_id, "c", s=stats(900, 800, 1)))  # a boast
    result = prober.report("c", report(run.probe_id, "b", s=stats(90, 80, 12)))
    assert result is not None and result.link == MeasuredLink(mbit_s=80, rtt_ms=12)
    assert prober.results == {"measured": 1, "disagreed": 1}


@pytest.mark.parametrize("how", ["failed", "refused", "expired"])
def test_a_probe_that_fails_records_nothing_and_holds_the_pair_back(how):
    prober = LinkProber(every_s=10)
    run = prober.begin(PLAN, now=NOW)
    if how == "failed":
        result = prober.report("c", report(run.probe_id, "b", ok=False))
        assert result is not None and "no HELLO" in result.reason
    elif how == "refused":
        result = prober.refused(run.probe_id, "b: PROBE_REFUSED: it runs a stage")
    else:
        assert prober.expire(NOW + PROBE_EXPIRES_S - 1) is None
        result = prober.expire(NOW + PROBE_EXPIRES_S)
        assert result is not None and "no report from b, c" in result.reason
    assert result is not None and result.link is None
    assert prober.current is None and prober.results == {how: 1}
    assert frozenset(("b", "c")) in prober.tried  # next_pair waits RETRY_AFTER_S for it


def test_probes_are_off_at_zero():
    assert not LinkProber(every_s=0).due(NOW)


def test_a_link_recorded_a_day_ago_is_measured_again():
    old = MeasuredLink(mbit_s=100.0, rtt_ms=10.0, measured_at=NOW - LINK_STALE_S)
    recent = MeasuredLink(mbit_s=100.0, rtt_ms=10.0, measured_at=NOW - 60)
    idle = [fellow("f1"), fellow("f2")]
    assert next_pair(idle, LinkBook({("f1", "f2"): recent}), {}, now=NOW, wall_now=NOW) is None
    plan = next_pair(idle, LinkBook({("f1", "f2"): old}), {}, now=NOW, wall_now=NOW)
    assert plan is not None and {plan.binder, plan.connector} == {"f1", "f2"}
    # Without the wall clock (or a link's time), no link is old.
    assert next_pair(idle, LinkBook({("f1", "f2"): old}), {}, now=NOW) is None
    # Old links do not count towards a fellow's LINKS_WANTED: f1's are all old.
    many_old = LinkBook({("f1", f"x{i}"): old for i in range(LINKS_WANTED)})
    assert next_pair(idle, many_old, {}, now=NOW, wall_now=NOW) is not None


def test_a_measured_pair_waits_before_it_is_probed_again():
    prober = LinkProber(every_s=10)
    run = prober.begin(PLAN, now=NOW)
    prober.report("b", report(run.probe_id, "c"))
    assert prober.report("c", report(run.probe_id, "b")) is not None
    assert prober.tried[frozenset(("b", "c"))] == NOW


def test_the_registry_keeps_a_links_time_until_its_figures_change():
    now = [1000.0]
    registry = FellowRegistry(
        heartbeat_interval_s=1.0, offline_after_s=3.0, leader_version="t", wall=lambda: now[0]
    )
    registry.bus_connected()
    hardware = HardwareSnapshot(
        hostname="h", cpu_cores=2, ram_total_bytes=8 << 30, ram_available_bytes=4 << 30
    )
    ident = FellowIdentity(fellow_id="up", instance_id="i", hostname="h", version="t", pid=1)
    assert registry.register(RegisterRequest(fellow=ident, hardware=hardware)).accepted
    registry.record_link("up", "down", LINK)
    assert registry.links["up", "down"].measured_at == 1000.0
    now[0] = 2000.0
    registry.record_link("up", "down", LINK)  # a stage repeats its figures: no new time
    assert registry.links["up", "down"].measured_at == 1000.0
    registry.record_link("up", "down", LINK, fresh=True)  # a probe measured them again
    assert registry.links["up", "down"].measured_at == 2000.0
    now[0] = 3000.0
    registry.record_link("up", "down", MeasuredLink(mbit_s=50.0, rtt_ms=10.0))
    assert registry.links["up", "down"] == MeasuredLink(
        mbit_s=50.0, rtt_ms=10.0, measured_at=3000.0
    )
