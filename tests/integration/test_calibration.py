"""Links measured, not assumed: the probe over real ZeroMQ, the NATS relay and emulated slow
paths, a hostile peer's probe refused, and real stages choosing codecs and a schedule."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from silentswarm.agent.errors import FrameError
from silentswarm.agent.pipe import probe
from silentswarm.agent.pipe.relay import RelayLink
from silentswarm.agent.pipe.zmq import ZmqLink
from silentswarm.agent.runtime.launch import run_plans, steps
from silentswarm.plan import ModelConfig, Peer, TrainConfig, Transport, chain_plans
from silentswarm.procs import free_port
from tests.helpers import REPO, bench_module, child_env, shaped_paths_unavailable

pytestmark = pytest.mark.integration
no_paths = pytest.mark.skipif(
    (why := shaped_paths_unavailable()) is not None, reason=f"no shaped paths here: {why}"
)


def both_ends(upstream, downstream, *, timeout_s: float = 20.0):
    """Run the two halves of a probe at once; both ends' results."""
    got: dict[str, Any] = {}

    def down() -> None:
        try:
            got["down"] = probe.measure_as_downstream(
                downstream, boundary=3, step=7, timeout_s=timeout_s
            )
        except Exception as exc:  # handed to the test below
            got["down"] = exc

    thread = threading.Thread(target=down)
    thread.start()
    try:
        got["up"] = probe.measure_as_upstream(upstream, boundary=3, step=7, timeout_s=timeout_s)
    finally:
        thread.join(timeout_s)
    return got["up"], got["down"]


def test_both_ends_of_a_zmq_boundary_measure_the_same_fast_link(zmq_pair):
    binder, connector = zmq_pair
    up, down = both_ends(connector, binder)
    assert up == down
    assert (up.boundary, up.step) == (3, 7)
    assert 0 < up.rtt_ms < 50
    assert up.fwd_mbit_s > 500 and up.bwd_mbit_s > 500  # loopback: gigabits


def test_the_relay_is_measured_the_same_way(nats_server):
    a = RelayLink(name="a", nats=nats_server.url, send_subject="p.fwd", recv_subject="p.bwd")
    b = RelayLink(name="b", nats=nats_server.url, send_subject="p.bwd", recv_subject="p.fwd")
    try:
        up, down = both_ends(a, b)
    finally:
        a.close()
        b.close()
    assert up == down and up.rtt_ms > 0 and up.fwd_mbit_s > 50


@pytest.mark.parametrize(
    ("hostile", "complaint"),
    [
        # a frame where a probe message belongs
        (lambda link: link.send([b"header", b"payload"]), "expected a link probe message"),
        # a probe message of the wrong kind
        (lambda link: probe.send_msg(link, probe.Rate(0, 1.0), 5), "expected Ping"),
        # a burst bigger than any probe sends: refused while decoding
        (
            lambda link: link.send(
                [
                    probe.CALIB,
                    msgspec.msgpack.encode(
                        {"kind": "burst", "round": 0, "nbytes": 2**40, "chunks": 1}
                    ),
                ]
            ),
            "bad link probe message",
        ),
    ],
)
def test_a_hostile_peer_probe_is_refused_with_a_reason(zmq_pair, hostile: Callable, complaint):
    binder, connector = zmq_pair
    hostile(connector)
    with pytest.raises(FrameError, match=complaint):
        probe.measure_as_downstream(binder, boundary=0, step=0, timeout_s=5)


def pings_then(connector, bursts: Callable) -> None:
    """A connector that answers the probe's pings as it should, then sends ``bursts(link,
    nonce)`` with the nonce the receiver's Go gave."""
    for seq in probe.nonces(probe.PINGS):
        probe.send_msg(connector, probe.Ping(seq), 5)
        probe.recv_msg(connector, probe.Pong, 5)
    bursts(connector, probe.recv_msg(connector, probe.Go, 5).nonce)


def pieces(link, sizes: list[int]) -> None:
    for size in sizes:
        link.send([probe.CALIB_DATA, bytes(size)])


FULL = probe.FIRST_BURST // probe.CHUNK  # the pieces of a first burst


@pytest.mark.parametrize(
    ("bursts", "complaint"),
    [
        # fewer pieces than its bytes take
        (
            lambda link, n: probe.send_msg(link, probe.Burst(0, probe.FIRST_BURST, 1, n), 5),
            "pieces",
        ),
        # its bytes in empty pieces, which arrive together: an instant link
        (
            lambda link, n: (
                probe.send_msg(link, probe.Burst(0, probe.FIRST_BURST, FULL, n), 5),
                pieces(link, [0] * FULL),
            ),
            "probe piece 0 of 0 bytes",
        ),
        # a burst the receiver did not ask for (queued ahead, it would be read at once)
        (
            lambda link, n: probe.send_msg(
                link, probe.Burst(0, probe.FIRST_BURST, FULL, (n + 1) % probe.MAX_NONCE), 5
            ),
            "did not ask for",
        ),
        # a burst too small to time
        (
            lambda link, n: probe.send_msg(link, probe.Burst(0, probe.CHUNK, 1, n), 5),
            "a probe burst of",
        ),
    ],
)
def test_a_burst_is_timed_only_as_asked_for_and_announced(zmq_pair, bursts: Callable, complaint):
    binder, connector = zmq_pair
    hostile = threading.Thread(target=pings_then, args=(connector, bursts))
    hostile.start()
    try:
        with pytest.raises(FrameError, match=complaint):
            probe.measure_as_downstream(binder, boundary=0, step=0, timeout_s=5)
    finally:
        hostile.join(10)


def test_answers_sent_before_the_pings_fail_the_round_trip(zmq_pair):
    """A binder that sends its pongs before any ping came (the pings' numbers are random):
    the connector's round trip is not a few microseconds, it is refused."""
    binder, connector = zmq_pair
    for seq in range(probe.PINGS):
        probe.send_msg(binder, probe.Pong(seq), 5)
    with pytest.raises(FrameError, match="answers no ping"):
        probe.measure_as_upstream(connector, boundary=0, step=0, timeout_s=5)


FAR_HALF = textwrap.dedent(
    """
    import sys, msgspec
    from silentswarm.agent.pipe.probe import measure_as_downstream
    from silentswarm.agent.pipe.zmq import ZmqLink
    link = ZmqLink(name="far", bind=sys.argv[1])
    stats = measure_as_downstream(link, boundary=0, step=0, timeout_s=60)
    print(msgspec.json.encode(stats).decode(), flush=True)
    link.close()
    """
)


@no_paths
@pytest.mark.timeout(120)
def test_an_emulated_path_is_measured_per_direction():
    linkemu = bench_module("linkemu")
    # forward 10 Mbit/s, backward 40 Mbit/s, 20 ms each way
    prof = linkemu.Profile("asym", linkemu.Direction(10e6, 0.020), linkemu.Direction(40e6, 0.020))
    port = free_port()
    with linkemu.FarSide(prof) as far:
        far_half = subprocess.Popen(
            [*far.prefix, sys.executable, "-c", FAR_HALF, f"tcp://{far.far_ip}:{port}"],
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=REPO,
        )
        try:
            host, entry = far.relay(far=False, target=(far.far_ip, port))
            link = ZmqLink(name="near", connect=f"tcp://{host}:{entry}")
            try:
                up = probe.measure_as_upstream(link, boundary=0, step=0, timeout_s=60)
            finally:
                link.close()
            out, _ = far_half.communicate(timeout=60)
        finally:
            far_half.kill()
            far_half.wait()
    down = msgspec.json.decode(out.strip().splitlines()[-1])
    assert down == msgspec.to_builtins(up), "both ends hold the same figures"
    assert 40 <= up.rtt_ms < 70, up  # 40 ms of path; a loaded machine adds its scheduling
    assert 7.5 <= up.fwd_mbit_s <= 10.5, up
    assert 30 <= up.bwd_mbit_s <= 42, up


SMALL = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32)
# The CPU weight of each stage of the deferral test against a busy process's 1024: enough to
# keep its compute near a quiet machine's beside the other tests, not so much that they
# starve while it runs.
WEIGHT = 4096


def auto_run(tmp_path, far=None) -> list[list[dict]]:
    """A 2-stage run with compression and micro_batches "auto", over ``far`` if given."""
    train = TrainConfig(
        steps=8,
        batch_size=8,
        micro_batches="auto",
        max_data_bytes=300_000,
        val_batches=2,
        link_probe_every=3,
        jit_compile=False,  # measurement and choices, not numerics: XLA's compile is not needed
    )
    port = free_port()
    plans = chain_plans(
        job_id="auto",
        model=SMALL,
        train=train,
        addresses=[None, f"tcp://127.0.0.1:{port}"],
        compression="auto",
        transport=Transport.P2P,
        intra_op_threads=1,
    )
    prefixes = {} if far is None else across(far, plans, port)
    return run_plans(plans, tmp_path, timeout=300, command_prefixes=prefixes)


def across(far, plans: list, port: int) -> dict[int, list[str]]:
    """Put stage 1 of a 2-stage chain (its data socket on ``port``) on ``far``'s side of the
    path, stage 0 reaching it through the path's relay; the command prefixes for run_plans."""
    host, entry = far.relay(far=False, target=(far.far_ip, port))
    plans[1] = msgspec.structs.replace(plans[1], data_address=f"tcp://{far.far_ip}:{port}")
    plans[0] = msgspec.structs.replace(
        plans[0], next=Peer(fellow_id=plans[1].fellow_id, data_address=f"tcp://{host}:{entry}")
    )
    return {1: far.prefix}


def calibrations(events: list[dict]) -> list[dict]:
    return [
        e
        for e in events
        if e["event"] == "links"
        and "step" in (e.get("tuning") or {})
        and not e.get("deferral_check")
    ][1:]


@no_paths
@pytest.mark.timeout(300)
def test_stages_choose_codecs_and_a_schedule_from_what_they_measured(tmp_path):
    """Loopback keeps full precision; a 2 Mbit/s path gets the fewest bytes. Both stages
    agree on every decision, and the frames really use the chosen codec."""
    linkemu = bench_module("linkemu")
    fast = auto_run(tmp_path / "fast")
    with linkemu.FarSide(linkemu.symmetric("slow", 2e6, 0.010)) as far:
        slow = auto_run(tmp_path / "slow", far)
    for first, last in (fast, slow):
        ups, downs = calibrations(first), calibrations(last)
        assert [e["tuning"] for e in ups] == [e["tuning"] for e in downs]
        # At the start, after the warm-up, then every 3 steps, or 2 after a new count.
        tunings = [e["tuning"] for e in ups]
        assert [t["step"] for t in tunings[:2]] == [0, 2]
        for earlier, decided, after in zip(tunings, tunings[1:], tunings[2:], strict=False):
            changed = decided["micro_batches"] != earlier["micro_batches"]
            assert after["step"] - decided["step"] == (2 if changed else 3), tunings
        assert all(e["tuning"]["auto"] for e in ups)
        assert all(8 % e["tuning"]["micro_batches"] == 0 for e in ups)
        assert len(steps(last)) == 8 and steps(last)[-1]["loss"] < steps(last)[0]["loss"]
    fast_link = [e["down_link"] for e in calibrations(fast[0])]
    slow_link = [e["down_link"] for e in calibrations(slow[0])]
    assert all(link["fwd_mbit_s"] > 500 for link in fast_link)
    assert all(1.5 <= link["fwd_mbit_s"] <= 2.1 for link in slow_link), slow_link
    assert all(20 <= link["rtt_ms"] < 40 for link in slow_link), slow_link
    # Decided after the warm-up: full precision on loopback, the fewest bytes at 2 Mbit/s.
    assert {(x["fwd_codec"], x["bwd_codec"]) for x in fast_link[1:]} == {("none", "none")}
    assert {(x["fwd_codec"], x["bwd_codec"]) for x in slow_link[1:]} == {
        ("fixed_int4", "fixed_int4")
    }
    # What crossed the slow boundary in a step after the decision (the probes' bursts are
    # left out of what a stage reports): about an eighth of float32's bytes.
    i = 6

    def sent(run: list[list[dict]]) -> int:
        ss = steps(run[0])
        return ss[i]["down_bytes_sent"] - ss[i - 1]["down_bytes_sent"]

    assert sent(slow) < 0.2 * sent(fast)


@pytest.mark.timeout(300)
def test_a_three_stage_chain_measures_every_boundary_and_agrees(tmp_path):
    train = TrainConfig(
        steps=6,
        batch_size=8,
        micro_batches="auto",
        max_data_bytes=300_000,
        val_batches=2,
        jit_compile=False,
    )
    plans = chain_plans(
        job_id="auto3",
        model=ModelConfig(n_layers=3, d_model=64, n_heads=4, seq_len=32),
        train=train,
        addresses=[None] + [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)],
        compression="auto",
        transport=Transport.P2P,
        intra_op_threads=1,
    )
    runs = run_plans(plans, tmp_path, timeout=300)
    per_stage = [calibrations(events) for events in runs]
    assert [len(c) for c in per_stage] == [len(per_stage[0])] * 3 and len(per_stage[0]) >= 2
    for stage in (0, 1):  # each boundary reported by its upstream end, at every calibration
        assert [e["down_link"]["boundary"] for e in per_stage[stage]] == [stage] * len(
            per_stage[stage]
        )
        assert all(e["down_link"]["rtt_ms"] > 0 for e in per_stage[stage])
    tunings = [[e["tuning"] for e in c] for c in per_stage]
    assert tunings[0] == tunings[1] == tunings[2]
    assert len(steps(runs[2])) == 6


@no_paths
@pytest.mark.timeout(400)
def test_the_last_stage_keeps_a_proposed_deferral_only_as_its_steps_measure(tmp_path):
    """Over a 100 Mbit/s, 25 ms path the model proposes deferring some of the last stage's
    weight passes (``defer_weight_grads: "auto"``): the last stage runs the proposal, then
    the count before it, each for one untimed step and four timed ones, keeps the one whose
    steps were faster, and says so; every step event says what it ran."""
    linkemu = bench_module("linkemu")
    train = TrainConfig(
        steps=16,
        batch_size=16,
        micro_batches=8,
        in_flight=8,
        max_data_bytes=300_000,
        val_batches=2,
    )
    # The first calibration's costs come from one timed step; on a machine busy with other
    # tests the stages' compute slows against the path's fixed delay and the model rightly
    # proposes less, down to nothing (CI: three runs in a row). Each stage runs in a CPU
    # group of WEIGHT, so it computes near a quiet machine's speed (beside four busy loops,
    # proposals 3-4 at 4096, 0-3 at 3072, 0-2 without a weight). A run whose proposal is
    # nothing anyway is checked for running nothing deferred, and the job runs again.
    cpuquota = bench_module("cpuquota")
    for run in range(3):
        port = free_port()
        plans = chain_plans(
            job_id=f"defer{run}",
            model=ModelConfig(n_layers=2, d_model=256, n_heads=4, seq_len=128),
            train=train,
            addresses=[None, f"tcp://127.0.0.1:{port}"],
            compression="fixed_int8",
            transport=Transport.P2P,
            intra_op_threads=1,
        )
        why: list[str] = []
        with (
            cpuquota.cpu_group(2.0, weight=WEIGHT, why=why) as near_group,
            cpuquota.cpu_group(2.0, weight=WEIGHT, why=why) as far_group,
            linkemu.FarSide(linkemu.profile("wan100")) as far,
        ):
            prefixes = across(far, plans, port)
            if near_group is not None and far_group is not None:
                prefixes = {0: near_group.prefix, 1: far_group.prefix + prefixes[1]}
            first, last = run_plans(
                plans, tmp_path / str(run), timeout=300, command_prefixes=prefixes
            )
        (proposal,) = [t for t in (e["tuning"] for e in calibrations(first)) if t["step"] == 2]
        k = proposal["deferred"]
        if k > 0:
            break
        assert not [e for e in last if e.get("deferral_check")]
        assert all(e.get("deferred", 0) == 0 for e in steps(last))
    else:
        pytest.fail("three runs' first calibrations proposed no deferral")
    assert k < 8, proposal
    checks = [e for e in last if e["event"] == "links" and e.get("deferral_check")]
    assert len(checks) == 1, checks
    verdict = checks[0]["tuning"]["deferral"]
    assert verdict["step"] == 12 and {verdict["kept"], verdict["other"]} == {k, 0}
    assert checks[0]["tuning"]["deferred"] == verdict["kept"]
    ran = {e["step"]: e.get("deferred", 0) for e in steps(last)}
    assert [ran[s] for s in range(16)] == [0, 0] + [k] * 5 + [0] * 5 + [verdict["kept"]] * 4
    assert all(e.get("deferred", 0) == 0 for e in steps(first))  # only the last stage defers
    seconds = {e["step"]: e["step_time_s"] for e in steps(last)}

    def median(xs: list[float]) -> float:
        xs = sorted(xs)
        return (xs[1] + xs[2]) / 2

    timed = {
        k: median([seconds[s] for s in (3, 4, 5, 6)]),
        0: median([seconds[s] for s in (8, 9, 10, 11)]),
    }
    assert verdict["kept_step_s"] == pytest.approx(timed[verdict["kept"]], abs=1e-4)
    assert verdict["other_step_s"] == pytest.approx(timed[verdict["other"]], abs=1e-4)
    faster = k if timed[k] < timed[0] * (1 - 0.005) else 0
    assert verdict["kept"] == faster
