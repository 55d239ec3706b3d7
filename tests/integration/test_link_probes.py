"""Idle fellows on different hosts measure their links before any job needs them: a real
leader pairs real agents, which probe each other over real ZeroMQ with CURVE keys made for
the probe; a stranger without the keys gets nothing (the pure choices:
tests/unit/test_linkprobes.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import subprocess
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from silentswarm import subjects as topics
from silentswarm.agent.errors import PeerTimeoutError
from silentswarm.agent.linkprobe import open_link
from silentswarm.agent.pipe import probe
from silentswarm.errors import ErrorCode
from silentswarm.leader.linkprobes import agreed_link
from silentswarm.natsd import start_nats_server
from silentswarm.plan import CurveKeys
from silentswarm.procs import free_port
from silentswarm.protocol import Heartbeat, LinkProbeReport, SignalAck, make_signal
from silentswarm.rings import boundary_keys
from silentswarm.types.links import LinkStats
from silentswarm.types.signals import ProbeArgs
from tests.conftest import leader_process, start_agent
from tests.helpers import bench_module, shaped_paths_unavailable, swarm_cli, wait_for
from tests.integration.nats_client import with_nats

pytestmark = pytest.mark.integration
no_paths = pytest.mark.skipif(
    (why := shaped_paths_unavailable()) is not None, reason=f"no shaped paths here: {why}"
)


def probe_counts(leader) -> dict[str, float]:
    text = leader.http.get("/api/v1/metrics").text
    return {
        sample.labels["result"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "swarm_link_probes"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def links_by_pair(leader) -> dict[frozenset[str], dict[str, Any]]:
    return {
        frozenset((fellow["fellow_id"], peer)): link
        for fellow in leader.get("/api/v1/workers")
        for peer, link in fellow["links"].items()
    }


@contextlib.contextmanager
def two_hosts(
    procs, tmp_path, profile, every_s: str = "0.2", **leader_env: str
) -> Iterator[tuple[Any, Any, Any]]:
    """A far side one ``profile`` path away (a network namespace), NATS on the path's near end
    (where both sides reach it, nowhere else), and a leader that probes every ``every_s``
    seconds: the far side, the NATS server and the leader's client."""
    with bench_module("linkemu").FarSide(profile) as far:
        nats = start_nats_server(
            host=far.near_ip,
            port=0,
            store_dir=tmp_path / "nats",
            log_path=tmp_path / "nats.log",
            tie_to_parent=True,
        )
        try:
            running = leader_process(
                procs, nats, tmp_path, SWARM_LINK_PROBE_EVERY_S=every_s, **leader_env
            )
            yield far, nats, next(running)  # ``running`` kept: collected, it closes the client
        finally:
            nats.stop()


def fellow_at(
    procs, nats, name: str, host: str, prefix: list[str] | None = None, **env: str
) -> None:
    start_agent(
        procs,
        nats.url,
        name,
        prefix=prefix,
        SWARM_DATA_ADDRESS=f"tcp://{host}:{free_port()}",
        SWARM_SYNC_ADDRESS=f"tcp://{host}:{free_port()}",
        **env,
    )


@no_paths
@pytest.mark.timeout(150)
def test_idle_fellows_on_different_hosts_measure_every_link_once(procs, tmp_path):
    """Two fellows on each side of a path: the four pairs across it are probed, once each,
    the two pairs that share a host never; ``swarm links`` shows them."""
    lan = linkemu_profile("lan")
    with two_hosts(procs, tmp_path, lan) as (far, nats, leader):
        hosts = {"f1": far.near_ip, "f2": far.far_ip, "f3": far.far_ip, "f4": far.near_ip}
        for name, host in hosts.items():
            fellow_at(procs, nats, name, host, far.prefix if host == far.far_ip else None)
        pairs = {frozenset((a, b)) for a in hosts for b in hosts if a < b and hosts[a] != hosts[b]}
        links = wait_for(
            lambda: (found := links_by_pair(leader)).keys() >= pairs and found,
            timeout=120,
            what="every pair of fellows on different hosts to have a measured link",
        )
        counts = probe_counts(leader)
        shown = swarm_cli(leader, "links", "--json")
        table = swarm_cli(leader, "links")
    assert links.keys() == pairs, "a pair on one host is not probed"
    for pair, link in links.items():
        assert link["mbit_s"] > 100 and 0 < link["rtt_ms"] < 100, (pair, link)
    # One probe per pair, each measured the first time.
    assert counts["measured"] == len(pairs), counts
    assert counts["refused"] == counts["failed"] == counts["expired"] == 0, counts
    # The operator sees them: one row per link, the connecting fellow first.
    assert shown.returncode == 0, shown.stderr
    listed = json.loads(shown.stdout)
    assert {frozenset((r["upstream"], r["downstream"])) for r in listed} == pairs
    assert table.returncode == 0 and "UPSTREAM" in table.stdout, table.stderr
    lines = table.stdout.splitlines()
    for row in listed:
        assert any(row["upstream"] in line and row["downstream"] in line for line in lines), row


LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"
BEGAN = re.compile(r"^(\S+ \S+) INFO .*link probe (\w+): (\S+) binds \S+, (\S+) connects")
ENDED = re.compile(r"^(\S+ \S+) INFO .*link probe (\w+): \S+ -> \S+ [\d.]+ Mbit/s")


def probe_spans(log: str) -> dict[str, tuple[float, float, frozenset[str]]]:
    """Each measured probe in a leader's log: (began, ended, its two fellows)."""

    def at(stamp: str) -> float:
        return datetime.strptime(stamp, LOG_TIME).timestamp()

    began = {}
    for line in log.splitlines():
        if m := BEGAN.match(line):
            began[m[2]] = (at(m[1]), frozenset(m.group(3, 4)))
    spans = {}
    for line in log.splitlines():
        if (m := ENDED.match(line)) and m[2] in began:
            start, fellows = began[m[2]]
            spans[m[2]] = (start, at(m[1]), fellows)
    return spans


@no_paths
@pytest.mark.timeout(150)
def test_probes_run_side_by_side_on_machines_of_their_own(procs, tmp_path):
    """Five fellows on four hosts (four addresses of a network namespace, f5 on f1's, NATS
    across a path from it): the nine pairs on different hosts are measured once each,
    probes ran side by side, and two that overlapped never shared a host."""
    lan = linkemu_profile("lan")
    with two_hosts(procs, tmp_path, lan, SWARM_LINK_PROBES_AT_ONCE="4") as (far, nats, leader):
        k = far.far_ip.split(".")[2]
        extra = [f"10.215.{k}.{i}" for i in (1, 2, 3)]
        ns = far.prefix
        for ip in extra:  # the namespace's own addresses (no dummy links in this kernel)
            subprocess.run([*ns, "ip", "addr", "add", f"{ip}/32", "dev", "lo"], check=True)
        hosts = dict(zip(("f1", "f2", "f3", "f4"), [far.far_ip, *extra], strict=True))
        hosts["f5"] = hosts["f1"]
        for name, host in hosts.items():
            fellow_at(procs, nats, name, host, ns)
        pairs = {frozenset((a, b)) for a in hosts for b in hosts if hosts[a] < hosts[b]}
        links = wait_for(
            lambda: (found := links_by_pair(leader)).keys() >= pairs and found,
            timeout=120,
            what="every pair of fellows on different hosts to have a measured link",
        )
        counts = probe_counts(leader)
    assert len(pairs) == 9 and links.keys() == pairs, sorted(map(sorted, links))
    assert counts["measured"] == len(pairs), counts
    log = "\n".join(p.read_text() for p in procs.log_dir.glob("leader-*.log"))
    spans = probe_spans(log)
    assert len(spans) == len(pairs), log[-3000:]
    overlapping = [
        (a, b) for a, b in itertools.combinations(spans.values(), 2) if a[0] < b[1] and b[0] < a[1]
    ]
    assert overlapping, f"no two probes ran side by side: {sorted(spans.values())}"
    for a, b in overlapping:
        shared = {hosts[f] for f in a[2]} & {hosts[f] for f in b[2]}
        assert not shared, ("two probes at once on one host", a, b)


def linkemu_profile(name: str, rate_bit_s: float | None = None) -> Any:
    return bench_module("linkemu").symmetric(name, rate_bit_s, 0.0)


def send_probe(url: str, fellow: str, args: ProbeArgs) -> SignalAck:
    sig = make_signal(args, signal_id=f"probe-{args.probe_id[:8]}-{args.bind}")

    async def ask(nc: Any) -> SignalAck:
        msg = await nc.request(
            topics.SIGNAL.subject("swarm", fellow=fellow), topics.encode(sig), timeout=5
        )
        return topics.SIGNAL.decode_reply(msg.data)

    return with_nats(url, ask)


def next_report(url: str, fellow: str, probe_id: str, timeout: float) -> LinkProbeReport:
    """The first heartbeat of ``fellow`` that reports probe ``probe_id``."""

    async def listen(nc: Any) -> LinkProbeReport:
        got: asyncio.Future[LinkProbeReport] = asyncio.get_running_loop().create_future()

        async def on_beat(msg: Any) -> None:
            hb = msgspec.msgpack.decode(msg.data, type=Heartbeat)
            report = hb.link_probe
            if report is not None and report.probe_id == probe_id and not got.done():
                got.set_result(report)

        await nc.subscribe(topics.HEARTBEAT.subject("swarm", fellow=fellow), cb=on_beat)
        return await asyncio.wait_for(got, timeout)

    return with_nats(url, listen)


def connect(address: str, probe_id: str, curve: CurveKeys, timeout_s: float):
    """The connecting end of probe ``probe_id``, opened as a fellow opens it, with ``curve``."""
    args = ProbeArgs(
        probe_id=probe_id,
        peer="binder",
        bind=False,
        address=address,
        curve=curve,
        timeout_s=timeout_s,
    )
    return open_link(args, bind=None)


@pytest.mark.timeout(90)
def test_a_probe_binds_for_its_keys_alone_and_reports_what_both_ends_measured(
    procs, nats_server, tmp_path
):
    """The test plays the leader (PROBE straight to the agent's signal subject; dev mode) and
    the other fellow: a peer without the probe's CURVE keys is never answered and the probe
    fails by its deadline; with them, the binder reports what it timed itself beside what
    the peer claims, and a peer's boast does not change what it timed."""
    running = leader_process(procs, nats_server, tmp_path, SWARM_LINK_PROBE_EVERY_S="0")
    leader = next(running)
    address = f"tcp://127.0.0.1:{free_port()}"
    start_agent(procs, nats_server.url, "binder", SWARM_DATA_ADDRESS=address)
    leader.wait_status("binder", "ready", timeout=30)

    connector_keys, binder_keys = boundary_keys(2)[0]
    args = ProbeArgs(
        probe_id="a1" * 8, peer="stranger", bind=True, curve=binder_keys, timeout_s=8.0
    )
    ack = send_probe(nats_server.url, "binder", args)
    assert ack.ok, ack
    # While it probes, another PROBE is refused, saying why.
    busy = send_probe(nats_server.url, "binder", msgspec.structs.replace(args, probe_id="b2" * 8))
    assert not busy.ok and busy.code == ErrorCode.PROBE_REFUSED and "probing" in busy.message
    # A peer with keys of its own: CURVE refuses it, no HELLO ever arrives.
    own_public, own_secret = (k.decode() for k in zmq.curve_keypair())
    with pytest.raises(PeerTimeoutError):
        stranger = CurveKeys(public=own_public, secret=own_secret, peer_public=binder_keys.public)
        connect(address, args.probe_id, stranger, 2)
    failed = next_report(nats_server.url, "binder", args.probe_id, timeout=15)
    assert not failed.ok and failed.stats is None and "HELLO" in failed.message, failed

    # The probe's own keys: the binder answers; it reports the backward rate we timed, and
    # its own forward rate and round trip.
    args = msgspec.structs.replace(args, probe_id="c3" * 8, timeout_s=15.0)
    assert send_probe(nats_server.url, "binder", args).ok
    link = connect(address, args.probe_id, connector_keys, 10)
    try:
        ours = probe.measure_as_upstream(link, boundary=0, step=0, timeout_s=10)
        probe.answer_pings(link, 10)
    finally:
        link.close()
    theirs = next_report(nats_server.url, "binder", args.probe_id, timeout=15)
    assert theirs.ok and theirs.peer == "stranger" and theirs.stats is not None, theirs
    assert theirs.stats.bwd_mbit_s == ours.bwd_mbit_s
    assert theirs.stats.fwd_mbit_s > 0 and theirs.stats.rtt_ms > 0


@no_paths
@pytest.mark.timeout(150)
def test_a_shaped_link_is_measured_at_its_rate_before_any_job(procs, tmp_path):
    """A fellow one 20 Mbit/s path away (a network namespace behind a shaped veth pair):
    the leader has it and a fellow here probe their link, and records about 20 Mbit/s."""
    with two_hosts(procs, tmp_path, linkemu_profile("probe", 20e6)) as (far, nats, leader):
        fellow_at(procs, nats, "near", far.near_ip)
        fellow_at(procs, nats, "far", far.far_ip, far.prefix)
        link = wait_for(
            lambda: links_by_pair(leader).get(frozenset(("near", "far"))),
            timeout=90,
            what="the probe of the shaped link",
        )
        counts = probe_counts(leader)
    assert 14 <= link["mbit_s"] <= 21, link  # the slower direction, 20 Mbit/s each
    assert link["rtt_ms"] < 50, link
    assert counts["measured"] == 1, counts


@no_paths
@pytest.mark.timeout(120)
def test_a_boasting_peer_cannot_make_a_slow_link_look_fast(procs, tmp_path):
    """The test plays a fellow that probes a far fellow over a 20 Mbit/s path and claims an
    instant round trip and 9 Pbit/s each way: the far fellow reports its own round trip and
    the forward rate it timed, so the link the leader would keep is the path's."""
    with two_hosts(procs, tmp_path, linkemu_profile("boast", 20e6), every_s="0") as (
        far,
        nats,
        leader,
    ):
        address = f"tcp://{far.far_ip}:{free_port()}"
        start_agent(procs, nats.url, "far", prefix=far.prefix, SWARM_DATA_ADDRESS=address)
        leader.wait_status("far", "ready", timeout=30)
        connector_keys, binder_keys = boundary_keys(2)[0]
        args = ProbeArgs(probe_id="e5" * 8, peer="boaster", bind=True, curve=binder_keys)
        assert send_probe(nats.url, "far", args).ok
        boast = LinkStats(boundary=0, step=0, rtt_ms=0.0, fwd_mbit_s=9e6, bwd_mbit_s=9e6)
        link = connect(address, args.probe_id, connector_keys, 10)
        try:
            for seq in range(probe.PINGS):
                probe.send_msg(link, probe.Ping(seq), 10)
                probe.recv_msg(link, probe.Pong, 10)
            probe.send_bursts(link, 10)
            probe.receive_bursts(link, 10)
            probe.send_msg(link, probe.Measured(boast), 10)
            probe.answer_pings(link, 10)
        finally:
            link.close()
        told = next_report(nats.url, "far", args.probe_id, timeout=20)
    assert told.ok and told.stats is not None, told
    assert told.stats.bwd_mbit_s == 9e6, told  # the boaster's word ...
    assert told.stats.fwd_mbit_s <= 21 and told.stats.rtt_ms > 0, told  # ... and what it timed
    kept = agreed_link(told.stats, boast)
    assert kept.mbit_s <= 21 and kept.rtt_ms == told.stats.rtt_ms, kept


@no_paths
@pytest.mark.timeout(240)
def test_probed_links_steer_the_first_balanced_job_off_a_slow_link(procs, tmp_path):
    """c is the fastest fellow but sits 2 Mbit/s away from a and b, which share a machine:
    before any job ran, probes measure c's links, and the first balanced 2-stage job takes a
    and b (their link, never probed, is the machine's loopback) instead of c and a."""
    with two_hosts(procs, tmp_path, linkemu_profile("slow", 2e6)) as (far, nats, leader):
        fellow_at(procs, nats, "a", far.near_ip, SWARM_FELLOW_COMPUTE_SPEED="2")
        fellow_at(procs, nats, "b", far.near_ip, SWARM_FELLOW_COMPUTE_SPEED="1.5")
        fellow_at(procs, nats, "c", far.far_ip, far.prefix, SWARM_FELLOW_COMPUTE_SPEED="3")
        probed = wait_for(
            lambda: (
                (found := links_by_pair(leader)).keys() >= {frozenset("ac"), frozenset("bc")}
                and found
            ),
            timeout=150,
            what="the probes of c's links",
        )
        job_id = leader.submit(
            name="along",
            model={"vocab_size": 256, "seq_len": 32, "n_layers": 4, "d_model": 32, "n_heads": 2},
            partition="balanced",
            stages=2,
            max_data_bytes=300_000,
            batch_size=8,
            micro_batches=2,
            steps=4,
            jit_compile=False,  # placement is tested here, not XLA
        )["job_id"]
        job = leader.wait_job(job_id, "COMPLETED", timeout=150)
    assert all(link["mbit_s"] < 2.5 for link in probed.values()), probed
    assert {s["fellow_id"] for s in job["placement"]["stages"]} == {"a", "b"}, job["placement"]


@no_paths
@pytest.mark.timeout(240)
def test_probed_links_keep_each_diloco_replica_on_one_site(procs, tmp_path):
    """Two sites 20 Mbit/s apart, two fellows each, ranked a b c d by their memory caps:
    dealt like cards, both replicas' pipelines would cross the slow path every micro-batch.
    Once probes measured the four pairs across it, a balanced DiLoCo job of 2 replicas x 2
    stages puts each pipeline on one site (its loopback) and only its syncs across, and
    completes in its first attempt."""
    with two_hosts(procs, tmp_path, linkemu_profile("sites", 20e6)) as (far, nats, leader):
        sites = {"a": far.near_ip, "b": far.near_ip, "c": far.far_ip, "d": far.far_ip}
        for at, (name, host) in enumerate(sites.items()):
            fellow_at(
                procs,
                nats,
                name,
                host,
                far.prefix if host == far.far_ip else None,
                SWARM_FELLOW_COMPUTE_SPEED="1",
                SWARM_FELLOW_MAX_MEMORY_GB=str(4 - at / 2),
            )
        across = {frozenset((a, b)) for a in "ab" for b in "cd"}
        probed = wait_for(
            lambda: (found := links_by_pair(leader)).keys() >= across and found,
            timeout=150,
            what="the probes of the four pairs across the path",
        )
        job_id = leader.submit(
            name="sites",
            model={"vocab_size": 256, "seq_len": 32, "n_layers": 4, "d_model": 32, "n_heads": 2},
            partition="balanced",
            replicas=2,
            stages=2,
            sync="diloco",
            sync_every=5,  # a round moves a stage's 1.1 Mbit: 0.011 s a step across
            max_data_bytes=300_000,
            batch_size=8,  # a step's 0.26 Mbit of activations: 0.013 s across
            micro_batches=2,
            steps=10,
            jit_compile=False,
        )["job_id"]
        job = leader.wait_job(job_id, "COMPLETED", timeout=150)
    assert probed.keys() == across, "a pair on one site is not probed"
    assert all(link["mbit_s"] < 25 for link in probed.values()), probed
    stages = job["placement"]["stages"]
    replicas = sorted(sorted(s["fellow_id"] for s in stages if s["replica"] == r) for r in (0, 1))
    assert replicas == [["a", "b"], ["c", "d"]], stages
    assert job["attempt"] == 1, job
