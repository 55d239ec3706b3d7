"""A job that starts from another job's final weights: ``init_from: "job:ID"`` and
``"export:DIR"``, with a real leader, agents and stages.

Job A trains a tiny model and exports it; job B starts from A's export on other data, split
differently (one stage where A had two), and its first step's loss is A's level, far below a
fresh start's; C starts from the same export named by its directory. Jobs whose model does
not fit, or whose source is not a finished export, are refused at submit naming the field.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.helpers import REPO, Leader
from tests.integration.test_jobs import agents, tiny, wait_ready

pytestmark = pytest.mark.timeout(300)

# Other data than A's (the stdlib's sources): the repository's own docs.
NEW_DATA = [str(REPO / "docs" / "*.md"), str(REPO / "README.md")]


def first_loss(leader: Leader, job_id: str) -> float:
    history = leader.get(f"/api/v1/jobs/{job_id}/metrics/history")
    return next(p["loss"] for p in history if p["loss"] is not None)


def test_a_job_starts_from_a_finished_jobs_export_on_new_data(procs, nats_server, leader):
    agents(procs, nats_server, "w1", "w2")
    wait_ready(leader, "w1", "w2")
    a = leader.submit(
        **tiny(
            name="source",
            steps=80,
            stages=2,
        )
    )["job_id"]
    done = leader.wait_job(a, "COMPLETED", timeout=150)
    assert done["final_loss"] < 0.75 * math.log(256)

    b = leader.submit(**tiny(name="warm", steps=10, stages=1, data=NEW_DATA, init_from=f"job:{a}"))
    assert b["init_source"]["job_id"] == a and b["init_source"]["step"] == 80
    wait_ready(leader, "w1", "w2")
    fresh = leader.submit(**tiny(name="fresh", steps=10, stages=1, data=NEW_DATA))
    warm_job = leader.wait_job(b["job_id"], "COMPLETED", timeout=120)
    fresh_job = leader.wait_job(fresh["job_id"], "COMPLETED", timeout=120)
    warm, cold = first_loss(leader, b["job_id"]), first_loss(leader, fresh["job_id"])
    # From A's weights the first step on new text is already far from uniform (5.55 nats);
    # a fresh start is there.
    assert cold > 0.95 * math.log(256)
    assert warm < 0.8 * cold, (warm, cold)
    assert warm_job["final_loss"] < fresh_job["final_loss"]
    start = next(s for s in warm_job["signals"] if s["kind"] == "START")
    assert start["ok"]

    directory = Path(done["export_dir"])
    export_root = directory.parent.parent
    c = leader.submit(
        **tiny(
            name="by-dir",
            steps=2,
            stages=1,  # the export's own stages' shards, per stage: test_adapters' LoRA job
            init_from=f"export:{directory.relative_to(export_root)}",
        )
    )
    assert c["init_source"]["job_id"] == a
    leader.wait_job(c["job_id"], "COMPLETED", timeout=120)


BAD = [
    ("job:nope", None, "there is no job 'nope'"),
    ("export:../elsewhere", None, "without '..'"),
    ("export:missing", None, "holds no readable run_manifest.json"),
    ("job:{a}", {"d_model": 64}, "model.d_model is 64, the export's 32"),
    ("job:{running}", None, "is RUNNING"),
]


def test_a_job_whose_source_does_not_fit_is_refused_naming_init_from(procs, nats_server, leader):
    agents(procs, nats_server, "r1")
    wait_ready(leader, "r1")
    a = leader.submit(
        **tiny(
            name="small",
            steps=3,
            stages=1,
        )
    )
    leader.wait_job(a["job_id"], "COMPLETED", timeout=90)
    running = leader.submit(**tiny(name="long", steps=100_000, stages=1))["job_id"]
    leader.wait_job(running, "RUNNING", timeout=30)
    names = {"a": a["job_id"], "running": running}
    for init_from, model, needle in BAD:
        spec = tiny(name="bad", steps=2, stages=1, init_from=init_from.format(**names))
        if model is not None:
            spec["model"] = {**spec["model"], **model}
        response = leader.request("POST", "/api/v1/jobs", json=spec)
        assert response.status_code == 400, response.text
        body = response.json()
        assert body.get("field") == "init_from" and needle in body["message"], body
    # Not a form init_from has: refused by the spec's own check, naming the field.
    response = leader.request("POST", "/api/v1/jobs", json=tiny(name="x", init_from="elsewhere"))
    assert response.status_code == 400 and "init_from" in response.text, response.text
    assert leader.request("DELETE", f"/api/v1/jobs/{running}").status_code == 200
