"""The link emulator's and the WAN benchmark's pure parts: shaping arguments, release times,
profiles, and which arms a run plans."""

from __future__ import annotations

import argparse

import pytest

from tests.helpers import bench_module

linkemu = bench_module("linkemu")
wan = bench_module("wan")


@pytest.mark.parametrize(
    ("rate", "one_by_one"),
    [(2e6, True), (100e6, True), (199e6, True), (200e6, False), (1e9, False)],
)
def test_slow_directions_send_packets_one_by_one(rate, one_by_one):
    assert linkemu.packet_by_packet(rate) is one_by_one
    commands = linkemu.shaping_commands("dev0", rate)
    gso = ["ip", "link", "set", "dev", "dev0", "gso_max_segs", "1"]
    assert (gso in commands) is one_by_one
    assert commands[-1] == ["tc", "qdisc", "add", "dev", "dev0", "root", *linkemu.tbf_args(rate)]


@pytest.mark.parametrize(
    ("rate", "burst", "limit"),
    [
        (2e6, 8 * 1024, 256 * 1024),  # small rates: the floors (packets one by one)
        (20e6, 10_000, 256 * 1024),  # 4 ms = 10 KB
        (100e6, 50_000, 1_250_000),  # 4 ms = 50 KB; 100 ms = 1.25 MB
        (250e6, 125_000, 3_125_000),  # GSO segments: 64 KiB would fit
        (1e9, 500_000, 12_500_000),
    ],
)
def test_tbf_args_bucket_and_queue(rate, burst, limit):
    args = linkemu.tbf_args(rate)
    assert args[0] == "tbf"
    got = dict(zip(args[1::2], args[2::2], strict=True))
    assert got == {"rate": f"{int(rate)}bit", "burst": str(burst), "limit": str(limit)}


@pytest.mark.parametrize(
    ("previous", "arrival", "delay", "jitter", "expected"),
    [
        (0.0, 10.0, 0.025, 0.0, 10.025),  # plain delay
        (0.0, 10.0, 0.025, 0.010, 10.035),  # plus the jitter sample
        (10.050, 10.0, 0.025, 0.0, 10.050),  # never before the chunk ahead of it
        (10.030, 10.010, 0.025, 0.0, 10.035),  # the one ahead left earlier: own time
    ],
)
def test_release_keeps_order(previous, arrival, delay, jitter, expected):
    assert linkemu.release_at(previous, arrival, delay, jitter) == pytest.approx(expected)


def test_profiles_are_the_named_ones():
    p = linkemu.PROFILES
    assert set(p) == {"loopback", "lan", "wan100", "wan20"}
    assert not p["loopback"].shaped
    for name, rate, delay in [
        ("lan", 1e9, 0.25e-3),
        ("wan100", 100e6, 25e-3),
        ("wan20", 20e6, 50e-3),
    ]:
        assert p[name].shaped
        for d in (p[name].forward, p[name].backward):
            assert (d.rate_bit_s, d.delay_s) == (rate, delay)
    with pytest.raises(ValueError, match=r"unknown link profile 'wan5'.*wan100"):
        linkemu.profile("wan5")


def test_plan_arms_adds_each_reference_once():
    arms = wan.plan_arms(["wan100", "wan20"], ["none", "fixed_int8"], ["p2p"], ["1f1b"], [8])
    ref = wan.Arm("loopback", "none", "p2p", "1f1b", 8)
    assert arms[0] == ref and arms.count(ref) == 1
    assert len(arms) == 5
    assert all(a.reference == ref for a in arms)


def test_plan_arms_reference_per_transport_and_m():
    arms = wan.plan_arms(["wan100"], ["fixed_int8"], ["p2p", "tunnel"], ["1f1b"], [4, 8])
    refs = {a for a in arms if a.profile == "loopback"}
    assert refs == {
        wan.Arm("loopback", "none", t, "1f1b", m) for t in ("p2p", "tunnel") for m in (4, 8)
    }
    assert len(arms) == 8


def test_plan_arms_keeps_an_asked_for_reference():
    arms = wan.plan_arms(["loopback", "wan20"], ["none"], ["p2p"], ["1f1b"], [8])
    assert arms == [
        wan.Arm("loopback", "none", "p2p", "1f1b", 8),
        wan.Arm("wan20", "none", "p2p", "1f1b", 8),
    ]


def test_each_deferral_has_its_own_reference_and_shares_the_loss_runs():
    arms = wan.plan_arms(["wan100"], ["fixed_int8"], ["p2p"], ["1f1b"], [8], [8], [0, "auto"])
    assert sorted(a.tag for a in arms) == [
        "loopback-none-p2p-m8-w8",
        "loopback-none-p2p-m8-w8-d0",
        "wan100-fixed-int8-p2p-m8-w8",
        "wan100-fixed-int8-p2p-m8-w8-d0",
    ]
    assert all(a.reference.defer == a.defer for a in arms)
    assert len({a.math for a in arms if a.compression == "fixed_int8"}) == 1


def test_loss_runs_are_shared_by_math_not_link():
    a = wan.Arm("wan100", "fixed_int8", "p2p", "1f1b", 8)
    b = wan.Arm("wan20", "fixed_int8", "p2p", "1f1b", 8)
    assert a.math == b.math and a.tag != b.tag
    assert a.math != wan.Arm("wan100", "fp16", "p2p", "1f1b", 8).math
    assert a.math == wan.Arm("wan20", "fixed_int8", "p2p", "1f1b", 8, in_flight=8).math


def test_an_auto_arm_trains_over_its_own_link():
    a = wan.Arm("wan100", "auto", "p2p", "1f1b", 8)
    b = wan.Arm("wan20", "auto", "p2p", "1f1b", 8)
    assert a.adaptive and a.math != b.math
    c = wan.Arm("wan20", "none", "p2p", "1f1b", "auto")
    assert c.adaptive and c.reference == wan.Arm("loopback", "none", "p2p", "1f1b", "auto")
    assert c.math != wan.Arm("wan100", "none", "p2p", "1f1b", "auto").math
    assert wan.micro_batches("auto") == "auto" and wan.micro_batches("8") == 8
    with pytest.raises(argparse.ArgumentTypeError):
        wan.micro_batches("lots")


def test_tunnel_is_compared_with_its_p2p_twin_round_by_round():
    p2p = wan.Arm("wan100", "fixed_int8", "p2p", "1f1b", 8, 8)
    tunnel = wan.Arm("wan100", "fixed_int8", "tunnel", "1f1b", 8, 8)
    lonely = wan.Arm("wan20", "none", "tunnel", "1f1b", 8)
    got = wan.tunnel_vs_p2p(
        {p2p: [100.0, 200.0, 100.0], tunnel: [90.0, 220.0, 99.0], lonely: [5.0]}
    )
    assert [(r["profile"], r["in_flight"]) for r in got] == [("wan100", 8)]
    assert got[0]["ratio"] == pytest.approx(0.99)  # median of 0.90, 1.10, 0.99


def row(profile, codec, retention, loss):
    return {
        "profile": profile,
        "compression": codec,
        "schedule": "1f1b",
        "retention": retention,
        "val_loss_vs_reference": loss,
    }


@pytest.mark.parametrize(
    ("rows", "relay", "expected"),
    [
        ([], [], {}),  # no arm of a target: no verdict
        (
            [row("wan100", "fixed_int8", 0.80, 0.0), row("wan100", "fixed_int8", 0.93, 0.004)],
            [],
            {"wan100_fixed_int8_retention_ge_0.90_loss_le_1pct": True},  # any arm meeting it
        ),
        (
            [row("wan20", "learned_dim32_int8", 0.85, 0.05)],  # fast but too lossy
            [{"profile": "wan100", "ratio": 0.94}],
            {
                "wan20_learned_dim32_int8_retention_ge_0.80_loss_le_3pct": False,
                "wan100_tunnel_within_5pct_of_p2p": False,
            },
        ),
    ],
)
def test_targets_judge_only_the_arms_present(rows, relay, expected):
    assert wan.targets(rows, relay) == expected


def test_an_overlap_arm_brings_its_reference_and_synchronous_twins():
    arms = wan.plan_arms(["wan100"], ["fixed_int8"], ["p2p"], ["overlap"], [8])
    assert set(arms) == {
        wan.Arm(p, c, "p2p", s, 8)
        for p, c in (("loopback", "none"), ("wan100", "fixed_int8"))
        for s in ("1f1b", "overlap")
    }
    over = wan.Arm("wan100", "fixed_int8", "p2p", "overlap", 8)
    assert over.synchronous == wan.Arm("wan100", "fixed_int8", "p2p", "1f1b", 8)
    assert over.math != over.synchronous.math and over.tag.endswith("-overlap")


def test_targets_count_an_overlap_arms_loss_against_the_synchronous_reference():
    def arm(profile, codec, schedule, val_loss, vs_reference, retention=1.0, per_seed=None):
        return {
            "profile": profile,
            "compression": codec,
            "schedule": schedule,
            "transport": "p2p",
            "micro_batches": 8,
            "in_flight": 8,
            "val_loss": val_loss,
            "val_loss_per_seed": per_seed or {"0": val_loss},
            "val_loss_vs_reference": vs_reference,
            "retention": retention,
        }

    sync_ref = arm("loopback", "none", "1f1b", 2.30, 0.0)
    over_ref = arm("loopback", "none", "overlap", 2.70, 0.0)
    sync = arm("wan100", "fixed_int8", "1f1b", 2.34, 0.0174, retention=0.95)
    over = arm("wan100", "fixed_int8", "overlap", 2.71, 0.0037, retention=1.1)
    rows = [sync_ref, over_ref, sync, over]
    assert wan.loss_cost(over, rows) == pytest.approx(2.71 / 2.30 - 1)
    assert wan.loss_cost(sync, rows) == 0.0174
    name = "wan100_fixed_int8_retention_ge_0.90_loss_le_1pct"
    assert wan.targets(rows, [])[name] is False  # +0.37% against its own reference is no pass
    good = dict(sync, val_loss_vs_reference=0.005)
    assert wan.targets([sync_ref, good], [])[name] is True
    assert wan.loss_cost(over, [over_ref, over]) == float("inf")
    # over several seeds: the mean of each seed against the same seed's reference
    two_ref = arm("loopback", "none", "1f1b", 2.0, 0.0, per_seed={"0": 2.0, "1": 3.0})
    two = arm("wan100", "none", "overlap", 2.5, 0.0, per_seed={"0": 2.2, "1": 3.0})
    assert wan.loss_cost(two, [two_ref, two]) == pytest.approx(0.05)


def test_loss_differences_pair_each_seed_with_its_own_reference():
    runs = {0: {"val_loss": 2.2}, 1: {"val_loss": 2.9}}
    refs = {1: {"val_loss": 3.0}, 0: {"val_loss": 2.0}}
    assert wan.versus(runs, refs) == pytest.approx([0.1, 2.9 / 3.0 - 1])
