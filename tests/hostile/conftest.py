"""An authenticated swarm with a job running, for attacks made with one fellow's own
credentials: a real nats-server that trusts only the swarm's authority, a real leader,
two honest fellows training a 2-stage job over the NATS relay, and ``mallory``, a fellow
the authority admitted (its own NATS user) that no job placed.

One swarm serves a whole module (a job takes seconds to start); every attack checks that
the job beside it is untouched (:meth:`Beside.assert_untouched`), and the module's last
test waits for it to complete in its first attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
import pytest

from silentswarm.natsauth import NatsAuthority
from tests.conftest import NatsControl, leader_process, secure_env, start_agent
from tests.helpers import Leader, Processes, wait_for
from tests.integration.test_jobs import tiny

T = TypeVar("T")
HONEST = ("h1", "h2")
JOB = tiny(name="beside", stages=2)


@dataclass
class Beside:
    """The swarm, and the job running in it while the attacks are made."""

    procs: Processes
    nats: NatsControl
    authority: NatsAuthority
    leader: Leader
    job_id: str
    steps: int
    mallory_creds: Path

    def connect(self, creds: Path | None, **options: Any) -> Awaitable[nats.NATS]:
        if creds is not None:
            options["user_credentials"] = str(creds)
        return nats.connect(
            self.nats.url, allow_reconnect=False, max_reconnect_attempts=0, **options
        )

    def run(self, fn: Callable[[], Awaitable[T]]) -> T:
        return asyncio.run(asyncio.wait_for(fn(), 60))

    def creds(self, name: str) -> Path:
        """A fresh user of the fellow ``name`` (as a thief of its credentials would hold)."""
        return self.authority.write_fellow_creds("swarm", name)

    def job(self) -> dict[str, Any]:
        return self.leader.job(self.job_id)

    def assert_untouched(self) -> dict[str, Any]:
        """The job beside runs (or ran) in its first attempt, on the honest fellows only,
        and every metric it shows came from them."""
        job = self.job()
        assert job["state"] in ("RUNNING", "COMPLETED"), job["reason"]
        assert job["attempt"] == 1 and job["resumes"] == []
        assert sorted(p["fellow_id"] for p in job["progress"]) == sorted(HONEST)
        metrics = self.leader.get(f"/api/v1/jobs/{self.job_id}/metrics")
        assert metrics["attempt"] == 1
        assert sorted(f["fellow_id"] for f in metrics["fellows"]) == sorted(HONEST), metrics
        assert metrics["step"] <= self.steps
        history = self.leader.get(f"/api/v1/jobs/{self.job_id}/metrics/history")
        steps = [point["step"] for point in history]
        assert steps == sorted(set(steps)) and all(1 <= s <= self.steps for s in steps)
        assert all(point["loss"] is None or point["loss"] < 10 for point in history)
        workers = self.leader.workers()
        assert all(workers[name]["status"] == "training" or job["state"] == "COMPLETED"
                   for name in HONEST), {n: workers[n]["status"] for n in HONEST}  # fmt: skip
        return job


@pytest.fixture(scope="module")
def beside(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Beside]:
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "proc-logs").mkdir()
    procs = Processes(tmp / "proc-logs")
    authority = NatsAuthority.load_or_create(tmp / "nats-auth")
    control = NatsControl(tmp, authority)
    leaders = leader_process(procs, control, tmp, **secure_env(authority))
    try:
        leader = next(leaders)
        for name in HONEST:
            creds = authority.write_fellow_creds("swarm", name)
            # No data address: the stages talk over the relay, which the attacks go after.
            start_agent(
                procs, control.url, name, SWARM_NATS_CREDS=str(creds), SWARM_DATA_ADDRESS=""
            )
        for name in HONEST:
            leader.wait_status(name, "ready", timeout=30)
        steps = 400  # lasts the attacks (seconds) with room for a slow machine
        job_id = leader.submit(**JOB, steps=steps)["job_id"]
        leader.wait_job(job_id, "RUNNING", timeout=60)
        wait_for(
            lambda: min(p["step"] for p in leader.job(job_id)["progress"]) >= 3,
            timeout=60,
            what="the job beside to train",
        )
        yield Beside(
            procs=procs,
            nats=control,
            authority=authority,
            leader=leader,
            job_id=job_id,
            steps=steps,
            mallory_creds=authority.write_fellow_creds("swarm", "mallory"),
        )
    finally:
        leaders.close()
        procs.cleanup()
        control.stop()
