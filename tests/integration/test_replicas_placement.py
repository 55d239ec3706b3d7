"""Replicas on the control plane: a real leader with NATS users places a job with two
replicas on two real fellows, and each fellow's START carries its replica's plan (its ring
peer, the ring link's keys and tokens) and an attempt user the NATS server accepts. Whether
the replicas then train in sync is the runtime's (its own tests)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from silentswarm.natsauth import NatsAuthority
from silentswarm.plan import StagePlan
from silentswarm.procs import free_port
from tests.conftest import NatsControl, agent_state_dir, start_agent
from tests.helpers import Leader, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = {"vocab_size": 256, "seq_len": 32, "n_layers": 2, "d_model": 32, "n_heads": 2}


def started_plan(procs, fellow_id: str, job_id: str) -> StagePlan | None:
    """The plan the fellow's agent wrote for the stage it was started with, once it has."""
    path: Path = agent_state_dir(procs) / "fellows" / fellow_id / "jobs" / f"{job_id}-a1"
    plan = path / "plan.json"
    if not plan.is_file():
        return None
    try:
        return msgspec.json.decode(plan.read_bytes(), type=StagePlan)
    except msgspec.DecodeError:  # being written
        return None


def test_two_replicas_start_on_two_fellows_as_a_ring(
    procs, secure_nats: NatsControl, nats_authority: NatsAuthority, secure_leader: Leader
):
    sync = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("r1", "r2")}
    for name, address in sync.items():
        creds = nats_authority.write_fellow_creds("swarm", name)
        start_agent(
            procs,
            secure_nats.url,
            name,
            SWARM_NATS_CREDS=str(creds),
            SWARM_SYNC_ADDRESS=address,
        )
    for name in sync:
        record = secure_leader.wait_status(name, "ready", timeout=30)
        assert record["sync_address"] == sync[name]
    job_id = secure_leader.submit(
        name="replicas",
        model=MODEL,
        replicas=2,
        stages=1,
        steps=4,
        batch_size=4,
        micro_batches=2,
        max_data_bytes=100_000,
        transport="p2p",
    )["job_id"]
    job = wait_for(
        lambda: (j := secure_leader.job(job_id))["placement"] and j,
        timeout=30,
        what="the job to be placed",
    )
    placed = {s["fellow_id"]: s for s in job["placement"]["stages"]}
    assert sorted((s["replica"], s["stage"]) for s in placed.values()) == [(0, 0), (1, 0)]
    assert {f: s["sync_address"] for f, s in placed.items()} == sync
    plans = {
        name: wait_for(
            lambda name=name: started_plan(procs, name, job_id),
            timeout=60,
            what=f"{name}'s START",
        )
        for name in sync
    }
    by_replica = {p.replica: p for p in plans.values()}
    assert sorted(by_replica) == [0, 1]
    a, b = by_replica[0], by_replica[1]
    for plan, other in ((a, b), (b, a)):
        assert plan.n_replicas == 2 and plan.fellow_id == placed_id(placed, plan.replica)
        (ring,), (other_ring,) = plan.sync_rings, other.sync_rings
        assert plan.sync_ports == [sync[plan.fellow_id]] and ring.port == 0
        assert ring.next.fellow_id == ring.prev.fellow_id == other.fellow_id
        assert ring.next.data_address == sync[other.fellow_id]
        assert ring.curve_down.peer_public == other_ring.curve_up.public
    assert (a.checkpoint_at_end, b.checkpoint_at_end) == (True, False)

    # Both fellows took START: the attempt users the leader minted (each stage's ring
    # subjects among them) are valid JWTs, and the plans passed the agents' checks.
    def starts() -> dict[str, bool] | None:
        acks = {
            s["fellow_id"]: s["ok"]
            for s in secure_leader.job(job_id)["signals"]
            if s["kind"] == "START"
        }
        return acks if len(acks) == 2 else None

    assert wait_for(starts, timeout=60, what="both START acks") == {"r1": True, "r2": True}


def placed_id(placed: dict[str, dict], replica: int) -> str:
    return next(f for f, s in placed.items() if s["replica"] == replica)
