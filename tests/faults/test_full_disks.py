"""Full disks never lose the final model silently (issue 18, item 4).

A fellow whose state disk fills up while it trains (a small tmpfs, filled to the last byte):
the job still COMPLETES, its record's ``export_error`` names the stage, the fellow, the path
and "No space left on device", and both ``swarm submit --watch`` and ``swarm watch`` print it
and exit 4. The leader's export disk filling up: the same error on the record, no partial
upload left in ``.incoming/``, what was complete before untouched; and a stale ``.incoming``
file is swept when the leader starts.

Real processes throughout (nats-server, leader, agents, TensorFlow on the CPU); the tmpfs
mounts need root (skipped otherwise) and are unmounted whatever happens.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import RestartableLeader, start_agent
from tests.helpers import Leader, child_env, swarm_cli, wait_for
from tests.integration.nats_client import stored_job
from tests.integration.test_jobs import tiny, wait_ready

pytestmark = pytest.mark.timeout(300)

STEPS = 120  # long enough that the disk is full well before the last step
PUSH_EVERY = 10
EXPORT_MISSING_EXIT = 4


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """Mounts a tmpfs of a given size under the test's temp dir; unmounted at the end, even
    on failure (lazily if a process still holds it). Request it first: it is then torn down
    after the processes that use it are gone."""
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        path = tmp_path / name
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
        mounted.append(path)
        return path

    try:
        yield mount
    finally:
        for path in reversed(mounted):
            if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(disk: Path) -> None:
    """Fill ``disk``'s file system to the last byte (again: space freed since is taken)."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (1 << 20, 1 << 12, 1):
            block = b"\0" * size
            while True:
                try:
                    if os.write(fd, block) < size:
                        break
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    assert os.statvfs(disk).f_bavail == 0


def ended_with_disk_full(leader: Leader, job_id: str, disk: Path) -> dict | None:
    """The job once it ended, the disk kept full meanwhile (a push in flight when it was
    filled may free an older checkpoint's space)."""
    fill(disk)
    job = leader.job(job_id)
    return job if job["state"] in ("COMPLETED", "FAILED", "CANCELLED") else None


def test_a_full_fellow_disk_completes_with_an_export_error_and_a_failing_watch(
    small_disk, procs, nats_server, leader: Leader, tmp_path: Path
):
    disk = small_disk("d2-state", "48m")
    start_agent(procs, nats_server.url, "d1")
    start_agent(procs, nats_server.url, "d2", SWARM_STATE_DIR=str(disk))
    wait_ready(leader, "d1", "d2")
    config = tmp_path / "job.json"
    spec = tiny(
        name="fellow-disk",
        steps=STEPS,
        stages=2,
        shard_push_to_leader=True,
        shard_push_interval_steps=PUSH_EVERY,
    )
    config.write_text(json.dumps(spec))
    # `swarm submit --watch`, as a user runs it, follows the job from the start.
    cli = [sys.executable, "-m", "silentswarm.cli.app", "--leader-url", leader.url]
    watcher = procs.start(
        "submit-watch",
        [*cli, "submit", str(config), "--watch"],
        env=child_env(SWARM_API_TOKEN=leader.token or ""),
    )
    job_id = wait_for(
        lambda: next(
            (
                line.split()[1]
                for line in procs.log(watcher).splitlines()
                if line.startswith("submitted ")
            ),
            None,
        ),
        timeout=30,
        what="submit --watch to print the job id",
    )
    # d2's disk works at first: its shards reach the leader; then it fills up.
    wait_for(lambda: leader.job(job_id)["pushed_step"], timeout=120, what="a complete push")
    fill(disk)
    job = wait_for(
        lambda: ended_with_disk_full(leader, job_id, disk),
        timeout=200,
        what="the job to end",
    )

    assert job["state"] == "COMPLETED", job["reason"]
    stage = next(s["stage"] for s in job["placement"]["stages"] if s["fellow_id"] == "d2")
    error = job["export_error"]
    assert error is not None, "the final model is missing, and the record must say so"
    assert f"stage {stage} on fellow d2: cannot write {os.path.realpath(disk)}/" in error, error
    assert f"step-{STEPS}/stage-{stage}.npz" in error and "No space left on device" in error
    assert job["pushed_step"] is not None and job["pushed_step"] < STEPS
    assert "fellow d1" not in error, "d1's final shard arrived"

    watcher.wait(timeout=30)
    printed = procs.log(watcher)
    assert watcher.returncode == EXPORT_MISSING_EXIT, printed
    assert "COMPLETED" in printed and "No space left on device" in printed, printed

    watched = swarm_cli(leader, "watch", job_id, timeout=60)
    assert watched.returncode == EXPORT_MISSING_EXIT, watched.stdout + watched.stderr
    assert "No space left on device" in watched.stderr and "fellow d2" in watched.stderr


def test_a_full_export_disk_leaves_no_partial_upload_and_a_restart_sweeps_stale_ones(
    small_disk, procs, nats_server, tmp_path: Path
):
    root = small_disk("exports", "16m")
    leader = RestartableLeader(procs, nats_server.url, tmp_path / "leader-state")
    leader.env["SWARM_EXPORT_ROOT"] = str(root)
    try:
        leader.start()
        client = leader.client
        for name in ("e1", "e2"):
            start_agent(procs, nats_server.url, name)
        wait_ready(client, "e1", "e2")
        spec = tiny(
            name="export-disk",
            steps=STEPS,
            stages=2,
            shard_push_to_leader=True,
            shard_push_interval_steps=PUSH_EVERY,
        )
        job_id = client.submit(**spec)["job_id"]
        wait_for(lambda: client.job(job_id)["pushed_step"], timeout=120, what="a complete push")
        fill(root)
        # Nothing newer can complete now: the newest complete step is never pruned.
        kept_step = client.job(job_id)["pushed_step"]
        export = Path(client.job(job_id)["export_dir"])
        step_dir = export / "shards" / f"step-{kept_step}"
        kept = {p.name: p.read_bytes() for p in step_dir.iterdir()}
        # Ended, and its final manifest tried (on the full disk, in vain: the leader adds that to
        # the export error just after the job ends).
        job = wait_for(
            lambda: (
                (ended := ended_with_disk_full(client, job_id, root))
                and "run_manifest.json" in (ended["export_error"] or "")
                and ended
            ),
            timeout=200,
            what="the job to end and its final manifest to fail",
        )

        assert job["state"] == "COMPLETED", job["reason"]
        error = job["export_error"]
        assert error is not None and f"(step {STEPS}) is not in the export" in error, error
        assert "the leader: cannot store stage-" in error and "No space left on device" in error
        assert job["pushed_step"] == kept_step
        incoming = export / ".incoming"
        assert not incoming.exists() or list(incoming.iterdir()) == []
        assert {p.name: p.read_bytes() for p in step_dir.iterdir()} == kept
        assert json.loads((export / "run_manifest.json").read_text())["step"] == kept_step

        # A transfer cut off by a leader that died: swept when the leader starts again. The
        # leader writes changed records every tick: killed once the error is in the store.
        wait_for(
            lambda: stored_job(nats_server.url, job_id)["export_error"] == error,
            timeout=20,
            what="the export error in the JetStream record",
        )
        (root / "filler").unlink()
        incoming.mkdir(exist_ok=True)
        (incoming / f"e1-a1-s{STEPS}-stage-0.npz").write_bytes(b"half a shard")
        leader.kill()
        leader.start()
        assert not incoming.exists()
        assert {p.name: p.read_bytes() for p in step_dir.iterdir()} == kept
        assert client.job(job_id)["export_error"] == error
    finally:
        leader.client.close()
