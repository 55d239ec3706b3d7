"""Jobs end to end: a real nats-server, a real leader, real agents running real stages."""

from __future__ import annotations

import json
import math
import secrets
import signal
from pathlib import Path

import psutil
import pytest

from silentswarm import subjects
from silentswarm.plan import ModelConfig, StagePlan, TrainConfig
from silentswarm.protocol import StartSignal, StopSignal
from silentswarm.types.signals import StartArgs
from tests.conftest import agent_state_dir, start_agent
from tests.helpers import Leader, stage_processes, swarm_cli, wait_for
from tests.integration.nats_client import with_nats

pytestmark = pytest.mark.timeout(240)

# A model small enough that a job is mostly TensorFlow start-up (a few seconds). These jobs
# test the leader, the agents and the control plane, not the numerics, so their stages skip
# XLA: compiling is most of a tiny stage's first step (a 2-stage job 11.0 s with XLA, 7.6 s
# without, here). XLA training is tested by test_pipeline, test_overlap, test_replicas_runtime and
# the benchmarks' runs, which build their own plans.
TINY = {
    "model": {"vocab_size": 256, "seq_len": 32, "n_layers": 2, "d_model": 32, "n_heads": 2},
    "max_data_bytes": 300_000,
    "batch_size": 8,
    "micro_batches": 2,
    "learning_rate": 0.01,
    "warmup_steps": 5,
    "jit_compile": False,
}


def tiny(**overrides):
    return {**TINY, **overrides}


def agents(procs, nats_server, *names, **env):
    started = {name: start_agent(procs, nats_server.url, name, **env) for name in names}
    return started


def wait_steps(leader: Leader, job_id: str, steps: int) -> None:
    """Until every stage of the job has done ``steps`` steps."""
    wait_for(
        lambda: min(p["step"] for p in leader.job(job_id)["progress"]) >= steps,
        timeout=60,
        what=f"{steps} training steps",
    )


def wait_ready(leader: Leader, *names: str) -> None:
    for name in names:
        leader.wait_status(name, "ready", timeout=20)


def test_submit_trains_to_completion_with_falling_loss_and_the_cli_follows_it(
    procs, nats_server, leader, tmp_path
):
    agents(procs, nats_server, "f1", "f2")
    wait_ready(leader, "f1", "f2")
    config = tmp_path / "job.json"
    config.write_text(json.dumps(tiny(name="e2e", steps=60, stages=2)))
    cli = swarm_cli(leader, "submit", str(config), timeout=30)
    assert cli.returncode == 0, cli.stderr
    job_id = cli.stdout.strip()
    job = leader.wait_job(job_id, "RUNNING", timeout=20)
    assert job["attempt"] == 1
    assert sorted(s["fellow_id"] for s in job["placement"]["stages"]) == ["f1", "f2"]
    first_loss = wait_for(
        lambda: next(
            (p["loss"] for p in leader.job(job_id)["progress"] if p["loss"] is not None), None
        ),
        timeout=60,
        what="a first loss",
    )
    watch = swarm_cli(leader, "submit", "--watch", str(config), timeout=150)
    # The second job waits for the first one's fellows, then runs; --watch follows it.
    assert watch.returncode == 0, watch.stdout + watch.stderr
    assert "PENDING" in watch.stdout and "RUNNING" in watch.stdout
    assert "COMPLETED" in watch.stdout and "final loss" in watch.stdout
    job = leader.wait_job(job_id, "COMPLETED", timeout=10)
    assert job["final_loss"] is not None and job["final_val_loss"] is not None
    assert job["final_loss"] < first_loss
    assert job["final_val_loss"] < 0.75 * math.log(256)
    assert all(p["result"] == "completed" and p["step"] == 60 for p in job["progress"])
    assert [h["to_state"] for h in job["history"]] == ["PENDING", "RUNNING", "COMPLETED"]
    assert {s["kind"] for s in job["signals"]} == {"START"}
    wait_ready(leader, "f1", "f2")
    assert stage_processes(job_id) == []
    listed = leader.get("/api/v1/jobs")
    assert listed[0]["job_id"] == job_id and len(listed) == 2


def test_checkpoint_then_cancel_a_running_job(procs, nats_server, leader):
    agents(procs, nats_server, "c1", "c2")
    wait_ready(leader, "c1", "c2")
    job_id = leader.submit(**tiny(name="long", steps=100_000, stages=2))["job_id"]
    leader.wait_job(job_id, "RUNNING", timeout=20)
    wait_steps(leader, job_id, 3)
    # A fellow in a running job cannot be released.
    busy = leader.request("POST", "/api/v1/workers/c1/release", json={})
    assert busy.status_code == 409 and busy.json()["code"] == "FELLOW_BUSY"

    response = leader.request("POST", f"/api/v1/jobs/{job_id}/checkpoint")
    assert response.status_code == 202, response.text
    record = response.json()
    assert all(s["acknowledged"] for s in record["stages"])

    def written():
        [cp] = leader.job(job_id)["checkpoints"]
        return all(s["ok"] for s in cp["stages"]) and cp

    cp = wait_for(written, timeout=30, what="both stages to write the checkpoint")
    steps = {s["step"] for s in cp["stages"]}
    assert steps == {record["at_step"]}, "every stage checkpoints the same step"
    for stage in cp["stages"]:
        assert list(Path(stage["path"]).glob("stage-*.json")), stage

    response = leader.request("DELETE", f"/api/v1/jobs/{job_id}")
    assert response.status_code == 200 and response.json()["state"] == "CANCELLED"
    wait_ready(leader, "c1", "c2")
    wait_for(lambda: stage_processes(job_id) == [], timeout=15, what="the stages to exit")
    job = leader.job(job_id)
    stops = [s for s in job["signals"] if s["kind"] == "STOP"]
    assert sorted(s["fellow_id"] for s in stops) == ["c1", "c2"] and all(s["ok"] for s in stops)
    again = leader.request("DELETE", f"/api/v1/jobs/{job_id}")
    assert again.status_code == 409 and again.json()["code"] == "JOB_TERMINAL"


def test_a_job_waiting_for_a_third_fellow_lets_a_smaller_one_run_first(procs, nats_server, leader):
    agents(procs, nats_server, "w1", "w2")
    wait_ready(leader, "w1", "w2")
    big = leader.submit(
        **tiny(name="big", steps=20, stages=3, model={**TINY["model"], "n_layers": 3})
    )
    small = leader.submit(**tiny(name="small", steps=40, stages=1))
    job = leader.wait_job(small["job_id"], "RUNNING", timeout=20)
    assert leader.job(big["job_id"])["state"] == "PENDING"
    assert "waiting for 3 ready fellows" in leader.job(big["job_id"])["reason"]
    # The third fellow joins while the small job runs; it exits after its job (supervisors
    # that want a fresh process per job set this).
    third = start_agent(procs, nats_server.url, "w3", SWARM_FELLOW_EXIT_AFTER_TRAINING="1")
    leader.wait_job(small["job_id"], "COMPLETED", timeout=90)
    done = leader.wait_job(big["job_id"], "COMPLETED", timeout=120)
    assert sorted(s["fellow_id"] for s in done["placement"]["stages"]) == ["w1", "w2", "w3"]
    assert done["started_at"] > leader.job(small["job_id"])["started_at"]
    assert job["placement"]["stages"][0]["fellow_id"] in {"w1", "w2"}
    assert third.wait(timeout=20) == 0


def test_a_duplicated_start_is_acknowledged_once(procs, nats_server, leader):
    agents(procs, nats_server, "d1")
    wait_ready(leader, "d1")
    job_id = f"dup-{secrets.token_hex(4)}"  # stage_processes matches it in any process
    plan = StagePlan(
        job_id=job_id,
        attempt=1,
        stage=0,
        n_stages=1,
        layer_start=0,
        layer_end=2,
        model=ModelConfig(**TINY["model"]),
        train=TrainConfig(steps=100_000, batch_size=8, micro_batches=2, max_data_bytes=300_000),
        fellow_id="d1",
    )
    start = StartSignal(signal_id="sig-dup-1", job_id=job_id, attempt=1, args=StartArgs(plan=plan))

    async def send_twice(nc):
        subject = subjects.SIGNAL.subject("swarm", fellow="d1")
        acks = []
        for _ in range(2):
            msg = await nc.request(subject, subjects.encode(start), timeout=10)
            acks.append(subjects.SIGNAL.decode_reply(msg.data))
        return acks

    first, second = with_nats(nats_server.url, send_twice)
    assert first.ok and not first.duplicate
    assert second.ok and second.duplicate and second.signal_id == first.signal_id
    leader.wait_status("d1", "training", timeout=10)
    assert len(stage_processes(job_id)) == 1

    async def stop(nc):
        sig = StopSignal(signal_id="sig-dup-stop", job_id=job_id, attempt=1)
        msg = await nc.request(
            subjects.SIGNAL.subject("swarm", fellow="d1"), subjects.encode(sig), timeout=15
        )
        return subjects.SIGNAL.decode_reply(msg.data)

    assert with_nats(nats_server.url, stop).ok
    # STOP is acknowledged once the runtime has its SIGTERM (agent/runner.py): it exits after.
    wait_for(lambda: stage_processes(job_id) == [], timeout=15, what="the stage gone after STOP")
    leader.wait_status("d1", "ready", timeout=10)


def test_release_with_purge_of_an_offline_fellow_waits_and_is_delivered_on_return(
    procs, nats_server, leader
):
    agent = start_agent(procs, nats_server.url, "p1")
    leader.wait_status("p1", "ready", timeout=20)
    state = agent_state_dir(procs) / "fellows" / "p1"
    state.mkdir(parents=True, exist_ok=True)
    (state / "marker").write_text("local state")
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=15) == 0
    leader.wait_status("p1", "offline", timeout=10)

    response = leader.request("POST", "/api/v1/workers/p1/release", json={"purge_install": True})
    assert response.status_code == 200, response.text
    assert response.json()["purge"] == "pending"
    assert "p1" not in leader.workers()
    [pending] = leader.get("/api/v1/purges")
    assert pending["fellow_id"] == "p1"
    retry = leader.request("POST", "/api/v1/purges/retry", json={"fellow_id": "p1"}).json()
    assert retry == [{"fellow_id": "p1", "delivered": False, "error": retry[0]["error"]}]
    assert "NO_ANSWER" in retry[0]["error"]

    back = start_agent(procs, nats_server.url, "p1")
    assert back.wait(timeout=30) == 0, "the purged agent exits"
    assert not state.exists()
    assert leader.get("/api/v1/purges") == []
    wait_for(lambda: "p1" not in leader.workers(), timeout=10, what="p1 to be forgotten")


def test_update_restarts_an_idle_agent_in_place(procs, nats_server, leader):
    agent = start_agent(procs, nats_server.url, "u1")
    before = leader.wait_status("u1", "ready", timeout=20)
    response = leader.request("POST", "/api/v1/workers/update", json={"fellow_id": "u1"})
    assert response.status_code == 200, response.text
    [ack] = response.json()
    assert ack["ok"] and "restarting" in ack["message"]
    after = wait_for(
        lambda: (
            (w := leader.workers()["u1"])["instance_id"] != before["instance_id"]
            and w["status"] == "ready"
            and w
        ),
        timeout=30,
        what="u1 to come back as a new instance",
    )
    assert after["pid"] == before["pid"] == agent.pid
    assert psutil.Process(agent.pid).is_running()


@pytest.mark.parametrize(
    ("body", "status", "code", "field"),
    [
        (b'{"steps": 10, "stepz": 1}', 400, "INVALID_FIELD", "stepz"),
        (b'{"model": {"d_model": "big"}}', 400, "INVALID_FIELD", "model.d_model"),
        (b'{"steps": 10', 400, "INVALID_FIELD", "$"),
        (b'{"stages": 5, "model": {"n_layers": 4}}', 400, "JOB_INVALID", None),
        (b'{"model": {"d_model": 30, "n_heads": 4}}', 400, "JOB_INVALID", None),
        # Absurd numbers and strings: bounded, so the field is named (msgspec.Meta).
        (b'{"steps": 100000000000000000000000}', 400, "INVALID_FIELD", "steps"),
        (b'{"steps": 0}', 400, "INVALID_FIELD", "steps"),
        (b'{"model": {"d_model": 1000000000}}', 400, "INVALID_FIELD", "model.d_model"),
        (b'{"model": {"n_layers": 100000}}', 400, "INVALID_FIELD", "model.n_layers"),
        (b'{"model": {"seq_len": 1099511627776}}', 400, "INVALID_FIELD", "model.seq_len"),
        (b'{"batch_size": 1e9}', 400, "INVALID_FIELD", "batch_size"),
        (b'{"micro_batches": 10000000}', 400, "INVALID_FIELD", "micro_batches"),
        (b'{"learning_rate": 1e300}', 400, "INVALID_FIELD", "learning_rate"),
        (b'{"max_resumes": 1000000}', 400, "INVALID_FIELD", "max_resumes"),
        (b'{"peer_timeout_s": 1e12}', 400, "INVALID_FIELD", "peer_timeout_s"),
        (b'{"name": "' + b"n" * 5000 + b'"}', 400, "INVALID_FIELD", "name"),
    ],
)
def test_bad_job_bodies_are_400_naming_the_field(leader, body, status, code, field):
    response = leader.request(
        "POST", "/api/v1/jobs", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()
    assert error["code"] == code
    if field is not None:
        assert error["field"] == field
        assert error["message"].startswith(field if field != "$" else "the body is not valid JSON")
    assert leader.get("/api/v1/jobs") == []


def test_bad_requests_elsewhere_are_clear(leader):
    assert leader.request("GET", "/api/v1/jobs/nope").status_code == 404
    assert leader.request("DELETE", "/api/v1/jobs/nope").json()["code"] == "NOT_FOUND"
    job_id = leader.submit(**tiny(stages=3, model={**TINY["model"], "n_layers": 3}))["job_id"]
    pending = leader.request("POST", f"/api/v1/jobs/{job_id}/checkpoint")
    assert pending.status_code == 409 and pending.json()["code"] == "JOB_NOT_RUNNING"
    release = leader.request("POST", "/api/v1/workers/ghost/release", json={"purge": True})
    assert release.status_code == 400 and release.json()["field"] == "purge"
    assert leader.request("POST", "/api/v1/workers/ghost/release", json={}).status_code == 404
    cancelled = leader.request("DELETE", f"/api/v1/jobs/{job_id}").json()
    assert cancelled["state"] == "CANCELLED"


def test_a_stage_that_fails_fails_the_job_with_the_fellow_and_its_error(
    procs, nats_server, leader, tmp_path
):
    agents(procs, nats_server, "e1")
    wait_ready(leader, "e1")
    missing = str(tmp_path / "no-such-corpus" / "*.txt")
    job_id = leader.submit(**tiny(name="no-data", steps=10, stages=1, data=[missing]))["job_id"]
    job = wait_for(
        lambda: (j := leader.job(job_id))["state"] == "FAILED" and j,
        timeout=60,
        what="the job to fail",
    )
    assert job["reason"].startswith("fellow e1 (stage 0) failed: ")
    assert "no-such-corpus" in job["reason"], job["reason"]
    history = leader.wait_status("e1", "ready", timeout=10)["history"]
    assert [t["to_status"] for t in history][-3:] == ["training", "failed", "ready"]


def test_declared_memory_caps_weight_the_layers_and_fellows_without_addresses_use_the_relay(
    procs, nats_server, leader
):
    # Three fellows on one machine, told to offer 1.5, 3 and 4.5 GiB, and no data address.
    caps = {"m1": "1.5", "m2": "3", "m3": "4.5"}
    for name, gib in caps.items():
        start_agent(
            procs,
            nats_server.url,
            name,
            SWARM_FELLOW_MAX_MEMORY_GB=gib,
            SWARM_DATA_ADDRESS="",
        )
    wait_ready(leader, *caps)
    assert leader.workers()["m1"]["hardware"]["limits"]["max_memory_bytes"] == int(1.5 * 2**30)
    six_layers = {**TINY["model"], "n_layers": 6}
    job_id = leader.submit(
        **tiny(name="weighted", steps=15, stages=3, partition="weighted", model=six_layers)
    )["job_id"]
    job = leader.wait_job(job_id, "COMPLETED", timeout=150)
    placement = job["placement"]
    layers = {s["fellow_id"]: s["layer_end"] - s["layer_start"] for s in placement["stages"]}
    assert layers == {"m1": 1, "m2": 2, "m3": 3}
    assert placement["stages"][-1]["fellow_id"] == "m3", "the largest runs the last stage"
    assert placement["transport"] == "tunnel"
    for stage in placement["stages"]:
        assert 0 < stage["memory_estimate_bytes"] <= stage["memory_offered_bytes"]
    assert job["final_loss"] is not None


def test_swarm_pipeline_transport_is_the_transport_of_jobs_that_name_none(
    procs, nats_server, tmp_path
):
    from tests.conftest import leader_process

    fixture = leader_process(procs, nats_server, tmp_path, SWARM_PIPELINE_TRANSPORT="tunnel")
    leader = next(fixture)
    try:
        agents(procs, nats_server, "t1", "t2")  # both with data addresses: auto would be p2p
        wait_ready(leader, "t1", "t2")
        job_id = leader.submit(**tiny(name="unnamed", steps=100_000, stages=2))["job_id"]
        assert leader.job(job_id)["spec"]["transport"] == "tunnel", "the record keeps it"
        job = leader.wait_job(job_id, "RUNNING", timeout=60)
        assert job["placement"]["transport"] == job["config"]["transport"] == "tunnel"
        # A job that names a transport, even auto, keeps it.
        named = leader.submit(**tiny(name="named", steps=10, stages=2, transport="auto"))
        assert named["spec"]["transport"] == named["config"]["transport"] == "auto"
        for doomed in (job_id, named["job_id"]):
            leader.request("DELETE", f"/api/v1/jobs/{doomed}")
    finally:
        fixture.close()
