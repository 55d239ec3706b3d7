"""Elastic membership of replicas (issue 23 item 2), end to end: a real leader and real
fellows train two replicas of a one-stage pipeline; the fellow of replica 0 is SIGKILLed
mid-job. The job goes on with replica 1 alone in the same attempt (its ring changes to one
member, and it takes over the export), a fellow started mid-job (ready before the loss, so
the test does not race the survivor, which trains alone in ~10 ms a step) is placed in the
lost slot, joins the ring at a sync boundary with the donor's state (the digests agree), and
the job completes in attempt 1 with both replicas' last stages and an export. The swarm has
NATS users: the lost fellow's user of the attempt is revoked, the others' stay."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from silentswarm.natsauth import NatsAuthority, attempt_user_name
from tests.conftest import start_agent
from tests.helpers import child_env, wait_for
from tests.integration.test_jobs import tiny, wait_ready, wait_steps

pytestmark = pytest.mark.timeout(300)


def kinds(job: dict) -> list[str]:
    return [m["kind"] for m in job["membership"]]


def attempt_users(authority: NatsAuthority) -> set[str]:
    """The names of the attempt users minted and not revoked."""
    users = json.loads((authority.dir / "users.json").read_text())
    return set(users["attempt_names"].values())


STEPS = 800


def test_a_lost_replica_does_not_stop_the_job_and_a_new_fellow_joins_its_slot(
    procs, secure_nats, nats_authority, secure_leader, tmp_path
):
    leader = secure_leader

    def agent(name: str):
        creds = nats_authority.write_fellow_creds("swarm", name, tmp_path / f"{name}.creds")
        return start_agent(procs, secure_nats.url, name, SWARM_NATS_CREDS=str(creds))

    agents = {name: agent(name) for name in ("e1", "e2")}
    wait_ready(leader, "e1", "e2")
    spec = tiny(
        name="elastic",
        # The replacement joins at about step 70 on a quiet machine (the survivor's solo steps
        # while its stage starts, then elastic.LEAD_S of steps ahead): 800 leave a wide margin.
        steps=STEPS,
        stages=1,
        replicas=2,
        transport="p2p",
        sync_timeout_s=3.0,
        val_every=0,
        shard_push_to_leader=True,
        shard_push_interval_steps=500,
    )
    job_id = leader.submit(**spec)["job_id"]
    leader.wait_job(job_id, "RUNNING", timeout=30)
    wait_steps(leader, job_id, 20)
    placed = {s["replica"]: s["fellow_id"] for s in leader.job(job_id)["placement"]["stages"]}
    victim, survivor = placed[0], placed[1]
    agent("e3")  # mid-job: every slot is placed, it waits
    wait_ready(leader, "e3")
    assert "e3" not in [s["fellow_id"] for s in leader.job(job_id)["placement"]["stages"]]
    agents[victim].send_signal(signal.SIGKILL)

    # Lost: the other replica goes on alone, in the same attempt, and leads the export.
    wait_for(lambda: "lost" in kinds(leader.job(job_id)), timeout=60, what="the loss noticed")
    job = leader.job(job_id)
    assert job["state"] == "RUNNING" and job["attempt"] == 1 and not job["resumes"]
    lost = job["membership"][0]
    assert (lost["replica"], lost["fellows"], lost["epoch"]) == (0, [victim], 1)
    assert job["placement"]["lead"] == 1 and job["ring_epoch"] == 1
    # The lost fellow's NATS user of the attempt is revoked; the survivor's stays.
    names = {f: attempt_user_name(f, job_id, 1) for f in (victim, survivor)}
    wait_for(
        lambda: names[victim] not in attempt_users(nats_authority),
        timeout=10,
        what="the lost fellow's attempt user revoked",
    )
    assert names[survivor] in attempt_users(nats_authority)

    def survivor_stage() -> dict:
        return next(p for p in leader.job(job_id)["progress"] if p["fellow_id"] == survivor)

    # Alone in ring 1 from its at_step on, its steps no longer wait sync_timeout_s (3 s) for
    # the lost replica: 10 of them take less than one such wait.
    wait_for(lambda: survivor_stage()["sync_epoch"] >= 1, timeout=60, what="the survivor in ring 1")
    switched = survivor_stage()["step"]
    wait_for(lambda: survivor_stage()["step"] >= switched + 10, timeout=3.0, what="10 quick steps")

    # The waiting fellow is placed in the free slot and joins at a sync boundary.
    wait_for(
        lambda: "joined" in kinds(leader.job(job_id)), timeout=120, what="the replacement joined"
    )
    job = leader.job(job_id)
    joined = job["membership"][-1]
    assert (joined["replica"], joined["fellows"], joined["epoch"]) == (0, ["e3"], 2)
    assert kinds(job) == ["lost", "placed", "joined"]
    at_step = joined["at_step"]

    def both_in_ring_2() -> bool:
        stages = leader.job(job_id)["progress"]
        return len(stages) == 2 and all(p["state_digests"] and p["sync_epoch"] == 2 for p in stages)

    wait_for(both_in_ring_2, timeout=60, what="both replicas in ring 2 with their digests")
    stages = {p["fellow_id"]: p for p in leader.job(job_id)["progress"]}
    assert stages["e3"]["state_digests"] == stages[survivor]["state_digests"]
    assert stages["e3"]["joining"] is None and stages["e3"]["step"] > at_step

    done = leader.wait_job(job_id, "COMPLETED", timeout=200)
    assert done["attempt"] == 1 and not done["resumes"]
    assert {p["fellow_id"] for p in done["progress"]} == {survivor, "e3"}
    assert all(p["result"] == "completed" and p["step"] == STEPS for p in done["progress"])
    assert [p["fellow_id"] for p in done["dropped"]] == [victim]
    # The export is the lead's (replica 1, which took over from the lost replica 0).
    assert done["export_error"] is None, done["export_error"]
    manifest = json.loads((Path(done["export_dir"]) / "run_manifest.json").read_text())
    assert [s["fellow_id"] for s in manifest["stages"]] == [survivor]
    # One pipeline without replicas, which glue rebuilds and checks against the stages.
    assert [s["replica"] for s in manifest["placement"]["stages"]] == [0]
    glued = subprocess.run(
        [sys.executable, "-m", "silentswarm.agent.runtime.glue", "--export-dir",
         done["export_dir"], "--out", str(tmp_path / "glued")],
        capture_output=True, text=True, timeout=180, env=child_env(TF_CPP_MIN_LOG_LEVEL="3"),
    )  # fmt: skip
    assert glued.returncode == 0, glued.stderr
