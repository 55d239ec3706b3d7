"""The rings that keep replicas in sync when they split the layers differently
(silentswarm.rings), pure: sync port ranges, segments, each member's rings, and the
leader's ring changes and permissions over them."""

from __future__ import annotations

import msgspec
import pytest

from silentswarm.errors import ConfigError
from silentswarm.jobspec import JobSpec, PlacedStage, Placement
from silentswarm.leader import elastic
from silentswarm.leader.jobs import JobManager
from silentswarm.plan import ModelConfig, Transport
from silentswarm.rings import (
    Seat,
    build_rings,
    fellow_ports,
    ports_needed,
    public_key,
    segments,
    stage_segments,
    sync_ports,
    uniform,
)
from silentswarm.settings import Settings
from tests.fakes import Clock, cpu_candidate

# --- ports ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "ports"),
    [
        (None, []),
        ("tcp://h:7000", ["tcp://h:7000"]),
        ("tcp://h:7000-7000", ["tcp://h:7000"]),
        ("tcp://10.0.0.5:7000-7002", ["tcp://10.0.0.5:7000", "tcp://10.0.0.5:7001",
                                      "tcp://10.0.0.5:7002"]),
        ("tcp://[::1]:9-10", ["tcp://[::1]:9", "tcp://[::1]:10"]),
    ],
)  # fmt: skip
def test_a_sync_address_names_one_port_or_a_range(address, ports):
    assert sync_ports(address) == ports
    assert fellow_ports(address) == ports


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("tcp://h:7002-7000", "ascending"),
        ("tcp://h:0-3", "ascending"),
        ("tcp://h:65535-65536", "ascending"),
        ("tcp://h:7000-7064", "at most 64"),
    ],
)
def test_a_bad_port_range_is_refused_naming_it_and_ignored_from_a_fellow(address, why):
    with pytest.raises(ConfigError, match=why):
        sync_ports(address)
    assert fellow_ports(address) == []  # a fellow's word: no ports (relay, or not placed)


def test_an_agent_with_a_bad_sync_range_does_not_start():
    with pytest.raises(ConfigError, match=r"SWARM_SYNC_ADDRESS.*ascending"):
        Settings(sync_address="tcp://h:7002-7000")
    with pytest.raises(ConfigError, match="SWARM_SYNC_BIND"):
        Settings(sync_bind="tcp://0.0.0.0:1-100")
    assert Settings(sync_address="tcp://h:7000-7003").sync_address == "tcp://h:7000-7003"


# --- segments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("splits", "expected"),
    [
        ([[(0, 4)]], [(0, 4)]),
        ([[(0, 2), (2, 4)], [(0, 2), (2, 4)]], [(0, 2), (2, 4)]),
        ([[(0, 1), (1, 4)], [(0, 2), (2, 4)]], [(0, 1), (1, 2), (2, 4)]),
        ([[(0, 3), (3, 8)], [(0, 5), (5, 8)], [(0, 1), (1, 8)]],
         [(0, 1), (1, 3), (3, 5), (5, 8)]),
        ([[(0, 2), (2, 3), (3, 6)], [(0, 4), (4, 5), (5, 6)]],
         [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]),
    ],
)  # fmt: skip
def test_segments_cut_the_layers_at_every_replicas_boundaries(splits, expected):
    assert segments(splits) == expected
    assert uniform(splits) == (len({tuple(s) for s in splits}) == 1)
    # every stage holds whole segments, and the segments of a replica's stages are all
    for split in splits:
        held = [seg for a, b in split for seg in stage_segments(a, b, expected)]
        assert held == expected


@pytest.mark.parametrize(
    ("splits", "why"),
    [
        ([], "one non-empty split"),
        ([[(0, 2), (2, 4)], [(0, 3)]], "different layers"),
        ([[(0, 2), (3, 4)]], "not contiguous"),
        ([[(0, 2), (2, 2), (2, 4)]], "without layers"),
    ],
)
def test_splits_that_do_not_tile_the_same_layers_are_refused(splits, why):
    with pytest.raises(ConfigError, match=why):
        segments(splits)


def test_the_ports_a_stage_needs_are_the_rings_it_is_in():
    assert ports_needed([[(0, 1), (1, 4)], [(0, 2), (2, 4)]]) == [[1, 2], [2, 1]]
    assert ports_needed([[(0, 2), (2, 4)], [(0, 2), (2, 4)]]) == [[1, 1], [1, 1]]


# --- each member's rings --------------------------------------------------------------------


def seats(splits: list[list[tuple[int, int]]], ports: int = 2) -> dict[int, list[Seat]]:
    return {
        r: [
            Seat(
                replica=r,
                stage=s,
                fellow_id=f"r{r}s{s}",
                layer_start=a,
                layer_end=b,
                ports=tuple(f"tcp://r{r}s{s}:{7000 + j}" for j in range(ports)),
            )
            for s, (a, b) in enumerate(split)
        ]
        for r, split in enumerate(splits)
    }


def test_each_segment_has_one_ring_over_its_holders_in_replica_order():
    splits = [[(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 2), (2, 4)]]
    rings = build_rings(seats(splits), curve=True, relay=True)
    assert [[(r.layer_start, r.layer_end) for r in rings[(0, s)]] for s in (0, 1)] == [
        [(0, 1)],
        [(1, 2), (2, 4)],
    ]
    assert [(r.layer_start, r.layer_end) for r in rings[(1, 0)]] == [(0, 1), (1, 2)]
    # The ring of segment [1, 2): r0s1 -> r1s0 -> r2s0 -> r0s1.
    seg = {key: next(r for r in ring if r.layer_start == 1) for key, ring in rings.items()
           if any(r.layer_start == 1 for r in ring)}  # fmt: skip
    assert set(seg) == {(0, 1), (1, 0), (2, 0)}
    order = [(0, 1), (1, 0), (2, 0)]
    for i, key in enumerate(order):
        ring, nxt = seg[key], seg[order[(i + 1) % 3]]
        assert ring.next.fellow_id == f"r{order[(i + 1) % 3][0]}s{order[(i + 1) % 3][1]}"
        assert nxt.prev.fellow_id == f"r{key[0]}s{key[1]}"
        # the successor binds its port for its j-th ring; the link's secrets match end to end
        assert ring.next.data_address == f"tcp://{ring.next.fellow_id}:{7000 + nxt.port}"
        assert ring.curve_down.peer_public == nxt.curve_up.public
        assert ring.relay_down_token == nxt.relay_up_token
    assert seg[(0, 1)].port == 0 and seg[(1, 0)].port == 1 and seg[(2, 0)].port == 1
    # every link has its own secrets
    tokens = [r.relay_down_token for ring in rings.values() for r in ring]
    assert len(tokens) == len(set(tokens)) == 3 + 3 + 3


def test_members_of_a_ring_of_three_or_more_sign_with_keys_of_their_own():
    """Each member gets its own seed, every member the same public keys (one per replica,
    each its seed's); a ring of two forwards nothing and signs nothing."""
    rings = build_rings(seats([[(0, 4)]] * 3), curve=True, relay=True)
    own = {r: rings[(r, 0)][0] for r in range(3)}
    assert len({ring.sign_seed for ring in own.values()}) == 3
    assert all(ring.signers == own[0].signers for ring in own.values())
    assert own[0].signers == {r: public_key(ring.sign_seed) for r, ring in own.items()}
    again = build_rings(seats([[(0, 4)]] * 3), curve=True, relay=True)
    assert again[(0, 0)][0].sign_seed != own[0].sign_seed, "fresh keys for every ring"
    two = build_rings(seats([[(0, 4)]] * 2), curve=True, relay=True)
    assert all(r[0].sign_seed is None and r[0].signers == {} for r in two.values())


def test_a_ring_past_a_fellows_ports_goes_over_the_relay():
    rings = build_rings(
        seats([[(0, 1), (1, 4)], [(0, 2), (2, 4)]], ports=1), curve=True, relay=True
    )
    second = rings[(0, 1)][1]  # r0s1's second ring: no port of its own
    assert second.port is None
    holder = next(r for r in rings[(1, 1)] if r.layer_start == 2)
    assert holder.next.data_address is None, "its predecessor connects over the relay"
    assert rings[(0, 1)][0].port == 0


def test_one_split_gives_one_ring_per_stage_at_port_0():
    rings = build_rings(seats([[(0, 2), (2, 4)]] * 2), curve=False, relay=False)
    for ring in rings.values():
        assert len(ring) == 1 and ring[0].port == 0
        assert ring[0].curve_up is None and ring[0].relay_up_token is None


# --- the leader -----------------------------------------------------------------------------


def placed(replica: int, stage: int, a: int, b: int, ports: str = "7000-7001") -> PlacedStage:
    fid = f"r{replica}s{stage}"
    return PlacedStage(
        stage=stage,
        fellow_id=fid,
        replica=replica,
        sync_address=f"tcp://{fid}:{ports}",
        hostname=fid,
        layer_start=a,
        layer_end=b,
        data_address=f"tcp://{fid}:1",
    )


def split_job(splits: list[list[tuple[int, int]]], transport=Transport.P2P):
    jobs = JobManager(wall=Clock())
    spec = JobSpec(
        model=ModelConfig(n_layers=4), replicas=len(splits), stages=2, steps=50, allow_cpu=True
    )
    job = jobs.submit(spec)
    placement = Placement(
        stages=[placed(r, s, a, b) for r, split in enumerate(splits) for s, (a, b) in
                enumerate(split)],
        transport=transport,
    )  # fmt: skip
    jobs.begin_start(job.job_id, placement)
    jobs.start_succeeded(job.job_id)
    return jobs, job


def test_a_placement_names_the_segments_each_stage_may_sync():
    _, job = split_job([[(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 2), (2, 4)]])
    placement = job.placement
    assert [placement.sync_segments(s) for s in placement.stages] == [
        [0],
        [1, 2],
        [0, 1],
        [2],
        [0, 1],
        [2],
    ]


def test_when_the_odd_split_is_lost_the_survivors_rings_merge():
    jobs, job = split_job([[(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 2), (2, 4)]])
    before = elastic.ring_changes(job, members=[0, 1, 2], epoch=1, at_step=3)
    assert [(r.layer_start, r.layer_end) for r in before["r1s0"].rings] == [(0, 1), (1, 2)]
    jobs.lose_stage(job.job_id, "r0s1", "went offline")
    assert job.placement.live_replicas == [1, 2] and job.placement.lead == 1
    changes = elastic.ring_changes(job, members=[1, 2], epoch=2, at_step=9)
    assert set(changes) == {"r1s0", "r1s1", "r2s0", "r2s1"}
    for fid, change in changes.items():
        (ring,) = change.rings  # one split left: one ring per stage
        stage = job.placement.stage_of(fid)
        assert (ring.layer_start, ring.layer_end) == (stage.layer_start, stage.layer_end)
        assert not change.problems(stage.replica, (stage.layer_start, stage.layer_end))
        assert change.donor == 1


def test_when_an_evenly_split_replica_is_lost_the_others_keep_their_segments():
    jobs, job = split_job([[(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 2), (2, 4)]])
    jobs.lose_stage(job.job_id, "r2s1", "went offline")
    changes = elastic.ring_changes(job, members=[0, 1], epoch=1, at_step=9)
    assert [(r.layer_start, r.layer_end) for r in changes["r0s1"].rings] == [(1, 2), (2, 4)]
    assert [(r.layer_start, r.layer_end) for r in changes["r1s0"].rings] == [(0, 1), (1, 2)]
    a = next(r for r in changes["r0s1"].rings if r.layer_start == 1)
    b = next(r for r in changes["r1s0"].rings if r.layer_start == 1)
    assert a.next.fellow_id == "r1s0" and b.next.fellow_id == "r0s1"
    assert a.next.data_address == "tcp://r1s0:7001", "r1s0's second ring: its second port"
    assert b.next.data_address == "tcp://r0s1:7000"
    assert a.curve_down.peer_public == b.curve_up.public


def cand(fid: str, ports: str):
    return msgspec.structs.replace(cpu_candidate(fid, 16), sync_address=f"tcp://{fid}:{ports}")


def test_a_replacement_takes_the_lead_split():
    jobs, job = split_job([[(0, 1), (1, 4)], [(0, 2), (2, 4)]])
    jobs.lose_stage(job.job_id, "r1s0", "went offline")
    stages = elastic.replacement(job, [cand("n1", "7000"), cand("n2", "7000")])
    assert isinstance(stages, list)
    # the lead's split: its segments are the only ones left, one ring (port) per stage
    assert [(s.layer_start, s.layer_end) for s in stages] == [(0, 1), (1, 4)]


def test_under_p2p_a_replacement_needs_a_port_per_ring_its_stages_will_be_in():
    from silentswarm.leader.placement import Unplaceable

    jobs, job = split_job([[(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 2), (2, 4)]])
    jobs.lose_stage(job.job_id, "r2s0", "went offline")
    # The lead's stage 1 holds layers 1-3: segments [1, 2) and [2, 4) among the others'.
    refused = elastic.replacement(job, [cand("n1", "7000"), cand("n2", "7000")])
    assert isinstance(refused, Unplaceable)
    stages = elastic.replacement(job, [cand("n1", "7000-7001"), cand("n2", "7000-7001")])
    assert isinstance(stages, list)
    assert [(s.layer_start, s.layer_end) for s in stages] == [(0, 1), (1, 4)]


def test_p2p_does_not_place_replicas_on_a_fellow_whose_sync_range_is_malformed():
    import msgspec

    from silentswarm.leader.placement import Unplaceable, place

    fellows = [cand(f"f{i}", "7000") for i in range(3)]
    fellows.append(msgspec.structs.replace(cand("bad", "7000"), sync_address="tcp://bad:9-1"))
    spec = JobSpec(
        model=ModelConfig(n_layers=4), replicas=2, stages=2, allow_cpu=True, transport="p2p"
    )
    refused = place(spec, fellows)
    assert isinstance(refused, Unplaceable) and "bad" in refused.reason


def test_a_resume_after_the_lead_changed_takes_the_split_its_shards_were_pushed_with():
    from silentswarm.protocol import JobState
    from silentswarm.types.jobs import ShardReceipt

    jobs, job = split_job([[(0, 1), (1, 4)], [(0, 2), (2, 4)]])
    for stage in (0, 1):  # the lead (replica 0, split 1-3) pushes a complete step 20
        receipt = ShardReceipt(
            fellow_id=f"r0s{stage}", stage=stage, step=20, attempt=1, size=1, sha256="0", at=1.0
        )
        jobs.record_push(job.job_id, receipt, 20 if stage == 1 else None)
    assert job.pushed_step == 20 and job.pushed_ranges == [(0, 1), (1, 4)]
    jobs.lose_stage(job.job_id, "r0s0", "went offline")
    assert job.placement.lead == 1  # split 2-2: its shards are not pushed yet
    jobs.lose_stage(job.job_id, "r1s1", "went offline")  # no replica left: a resume
    assert job.state is JobState.PENDING and job.resume_step == 20
    assert job.layer_ranges == [(0, 1), (1, 4)], "the shards' split, not the last lead's"


def test_a_sync_bind_range_must_match_the_advertised_one():
    with pytest.raises(ConfigError, match="port j binds for port j"):
        Settings(sync_address="tcp://h:7000-7003", sync_bind="tcp://0.0.0.0:9000-9001")
    both = Settings(sync_address="tcp://h:7000-7001", sync_bind="tcp://0.0.0.0:9000-9001")
    assert both.sync_bind == "tcp://0.0.0.0:9000-9001"


def test_free_ports_finds_a_range_a_stage_can_bind_port_by_port():
    import socket

    from silentswarm.procs import free_ports

    first = free_ports(3)
    address = f"tcp://127.0.0.1:{first}-{first + 2}"
    socks = []
    try:
        for port in sync_ports(address):
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", int(port.rsplit(":", 1)[1])))
    finally:
        for sock in socks:
            sock.close()
    assert len(socks) == 3
