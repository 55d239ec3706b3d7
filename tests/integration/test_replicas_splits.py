"""Replicas that split the layers differently, end to end: a real leader with NATS users
places a ``balanced`` job of two replicas of two stages on four real fellows whose declared
speeds differ, so each replica gets its own split; every stage is in one ring per segment of
layers it holds (silentswarm.rings). Each fellow has one sync port: a stage's first ring
binds it, a second ring goes over the NATS relay (transport auto), on the subjects its
attempt user may use. The job completes in one attempt with no round missed, and the two
replicas end with the same model (their last stages validate to the same loss)."""

from __future__ import annotations

import pytest

from tests.conftest import start_agent
from tests.helpers import Leader
from tests.integration.test_jobs import tiny, wait_ready
from tests.integration.test_replicas_placement import started_plan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = {"vocab_size": 256, "seq_len": 32, "n_layers": 6, "d_model": 32, "n_heads": 2}


def splits_of(job: dict) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = {}
    for s in sorted(job["placement"]["stages"], key=lambda s: (s["replica"], s["stage"])):
        out.setdefault(s["replica"], []).append((s["layer_start"], s["layer_end"]))
    return out


def test_replicas_with_their_own_splits_train_in_sync_over_rings_per_segment(
    procs, secure_nats, nats_authority, secure_leader: Leader, tmp_path
):
    leader = secure_leader
    # One fellow three times as fast as the others: the replica it lands in splits unlike
    # the replica of two equal fellows.
    speeds = {"s1": "1", "s2": "1", "s3": "1", "fast": "3"}
    for name, speed in speeds.items():
        creds = nats_authority.write_fellow_creds("swarm", name, tmp_path / f"{name}.creds")
        start_agent(
            procs,
            secure_nats.url,
            name,
            SWARM_NATS_CREDS=str(creds),
            SWARM_FELLOW_COMPUTE_SPEED=speed,
        )
    wait_ready(leader, *speeds)
    spec = tiny(
        name="splits",
        model=MODEL,
        replicas=2,
        stages=2,
        partition="balanced",
        steps=12,
        val_every=6,
        sync_timeout_s=60.0,
    )
    job_id = leader.submit(**spec)["job_id"]
    job = leader.wait_job(job_id, "COMPLETED", timeout=240)
    splits = splits_of(job)
    assert splits[0] != splits[1], splits
    # A stage whose layers span two segments is in two rings: its first binds its sync
    # port, its second has none (its fellow has one port), so the link into it goes over the
    # relay (its predecessor has no address to connect to).
    plans = [started_plan(procs, name, job_id) for name in speeds]
    assert all(plan is not None for plan in plans)
    rings = [ring for plan in plans if plan is not None for ring in plan.sync_rings]
    assert sorted(len(plan.sync_rings) for plan in plans if plan is not None) == [1, 1, 2, 2]
    assert any(ring.port is None for ring in rings)
    assert any(ring.next is not None and ring.next.data_address is None for ring in rings)
    assert job["attempt"] == 1 and not job["resumes"] and not job["membership"]
    progress = job["progress"]
    assert len(progress) == 4
    for stage in progress:
        assert stage["result"] == "completed" and stage["step"] == 12
        assert stage["sync_bytes_sent"] > 0 and stage["sync_bytes_received"] > 0
        assert stage["sync_missed"] == 0 and stage["sync_clipped"] == 0
    # Averaged per layer every step: both replicas hold the same model, whatever their split.
    last = [p for p in progress if p["stage"] == 1]
    losses = {p["val_loss"] for p in last}
    assert len(losses) == 1 and None not in losses, last
