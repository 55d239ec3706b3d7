"""The leader's export store: pieces in order, verified, stored; complete steps, pruning, the
manifest (real files in a temp dir; the NATS side is in tests/integration/test_exports.py)."""

from __future__ import annotations

import errno
import hashlib
import json
import os

import pytest

from silentswarm.jobspec import JobSpec
from silentswarm.leader import initsource
from silentswarm.leader.artifacts import ExportStore, partial_steps_to_drop
from silentswarm.leader.jobs import JobManager, plan_schedule
from silentswarm.leader.placement import Candidate
from silentswarm.plan import ModelConfig
from silentswarm.protocol import ShardChunk


def chunks(name: str, data: bytes, *, stage: int, step: int, piece: int = 4, fellow: str = "f1"):
    digest = hashlib.sha256(data).hexdigest()
    total = max(1, -(-len(data) // piece))
    return [
        ShardChunk(
            job_id="j-1",
            fellow_id=fellow,
            attempt=1,
            stage=stage,
            step=step,
            name=name,
            size=len(data),
            sha256=digest,
            seq=i,
            total=total,
            data=data[i * piece : (i + 1) * piece],
        )
        for i in range(total)
    ]


def send_shard(store: ExportStore, directory, stage: int, step: int):
    receipt = None
    for name, data in ((f"stage-{stage}.npz", b"arrays" * 3), (f"stage-{stage}.json", b"{}")):
        for chunk in chunks(name, data, stage=stage, step=step):
            ack, receipt = store.receive(directory, chunk, n_stages=2)
            assert ack.ok
    return receipt


def test_pieces_in_order_make_a_verified_file_and_the_json_a_receipt(tmp_path):
    store = ExportStore()
    receipt = send_shard(store, tmp_path, stage=1, step=20)
    assert (receipt.stage, receipt.step, receipt.size) == (1, 20, 18 + 2)
    assert receipt.sha256 == hashlib.sha256(b"arrays" * 3).hexdigest()
    stored = tmp_path / "shards" / "step-20" / "stage-1.npz"
    assert stored.read_bytes() == b"arrays" * 3
    assert store.sha256_of(stored) == receipt.sha256
    assert store.complete_steps(tmp_path, 2) == []  # stage 0 is missing
    send_shard(store, tmp_path, stage=0, step=20)
    assert store.complete_steps(tmp_path, 2) == [20]


def test_a_gap_asks_for_the_missing_piece_and_a_bad_checksum_stores_nothing(tmp_path):
    store = ExportStore()
    first, second, third = chunks("stage-0.npz", b"0123456789", stage=0, step=5)
    store.receive(tmp_path, first, 2)
    ack, _ = store.receive(tmp_path, third, 2)
    assert not ack.ok and ack.next_seq == 1
    # A leader that lost the transfer (restart) asks for piece 0.
    fresh = ExportStore()
    ack, _ = fresh.receive(tmp_path, second, 2)
    assert not ack.ok and ack.next_seq == 0
    tampered = chunks("stage-0.npz", b"0123456789", stage=0, step=5)
    tampered[-1].data = b"XX"
    for chunk in tampered:
        ack, _ = store.receive(tmp_path, chunk, 2)
    assert not ack.ok and ack.next_seq == 0 and "sha256" in ack.message
    assert not (tmp_path / "shards" / "step-5" / "stage-0.npz").exists()


def test_names_that_are_not_a_stage_file_are_refused(tmp_path):
    store = ExportStore()
    for name, stage in (("../../etc/passwd", 0), ("stage-1.npz", 0), ("stage-7.npz", 7)):
        [chunk] = chunks(name, b"x", stage=stage, step=1)
        ack, _ = store.receive(tmp_path, chunk, 2)
        assert not ack.ok, name
    assert store.file_path(tmp_path, 1, "../x") is None


def test_pruning_keeps_the_newest_two_complete_steps_and_a_resume_drops_later_ones(tmp_path):
    store = ExportStore()
    for step in (10, 20, 30):
        for stage in (0, 1):
            send_shard(store, tmp_path, stage=stage, step=step)
    send_shard(store, tmp_path, stage=0, step=40)  # incomplete
    store.prune(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [
        "step-20",
        "step-30",
        "step-40",
    ]
    store.drop_after(tmp_path, 30)
    assert store.complete_steps(tmp_path, 2) == [20, 30]
    assert not (tmp_path / "shards" / "step-40").exists()


def test_the_manifest_names_every_stage_of_the_newest_complete_step(tmp_path):
    job = placed_job()
    store = ExportStore()
    assert store.write_manifest(tmp_path, job) is None  # nothing complete yet
    for stage in (0, 1):
        send_shard(store, tmp_path, stage=stage, step=30)
    manifest = json.loads(store.write_manifest(tmp_path, job).read_text())
    assert manifest["step"] == 30 and manifest["job_id"] == job.job_id
    assert [s["stage"] for s in manifest["stages"]] == [0, 1]
    for stage in manifest["stages"]:
        data = (tmp_path / stage["weights"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == stage["weights_sha256"]
        assert stage["layer_end"] > stage["layer_start"]
    assert manifest["spec"]["steps"] == 30 and manifest["placement"]["stages"]


def test_each_stage_has_a_weights_npz_linked_to_the_newest_complete_step(tmp_path):
    """stage-<i>/weights.npz (the name earlier exports used) is the newest complete step's
    stage-<i>.npz itself: a hard link, moved on with each manifest, surviving the prune."""
    job = placed_job()
    store = ExportStore()
    for step in (10, 20, 30):
        for stage in (0, 1):
            send_shard(store, tmp_path, stage=stage, step=step)
        store.write_manifest(tmp_path, job)
        store.prune(tmp_path, 2)
        for stage in (0, 1):
            weights = tmp_path / f"stage-{stage}" / "weights.npz"
            shard = tmp_path / "shards" / f"step-{step}" / f"stage-{stage}.npz"
            assert weights.samefile(shard), (step, stage)
    assert not (tmp_path / "shards" / "step-10").exists()
    assert sorted(p.name for p in (tmp_path / "stage-0").iterdir()) == ["weights.npz"]
    assert (tmp_path / "stage-1" / "weights.npz").stat().st_nlink == 2


def test_weights_npz_is_a_copy_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    store = ExportStore()
    for stage in (0, 1):
        send_shard(store, tmp_path, stage=stage, step=30)
    store.write_manifest(tmp_path, placed_job())
    weights = tmp_path / "stage-1" / "weights.npz"
    shard = tmp_path / "shards" / "step-30" / "stage-1.npz"
    assert weights.read_bytes() == shard.read_bytes() and not weights.samefile(shard)


def placed_job():
    """A 2-stage job placed on two CPU fellows, its first attempt starting."""
    manager = JobManager()
    job = manager.submit(JobSpec(model=ModelConfig(n_layers=4), stages=2, steps=30))
    fellows = [
        Candidate(
            fellow_id=f,
            hostname=f,
            data_address="tcp://x:1",
            cpu_cores=2,
            ram_available_bytes=8 << 30,
        )
        for f in ("f1", "f2")
    ]
    [assignment], _ = plan_schedule(manager.pending(), fellows)
    manager.begin_start(job.job_id, assignment.placement)
    return job


def test_the_manifest_names_its_jobs_owner_and_init_from_learns_it(tmp_path):
    """Who may start from an export once its job's record is deleted: the manifest says."""
    job = placed_job()
    job.owner = "alice"
    root = tmp_path / "exports"
    directory = root / job.job_id / "model_export"
    store = ExportStore()
    for stage in (0, 1):
        send_shard(store, directory, stage=stage, step=30)
    manifest = json.loads(store.write_manifest(directory, job).read_text())
    assert manifest["owner"] == "alice"
    spec = JobSpec(model=ModelConfig(n_layers=4), init_from=f"export:{job.job_id}/model_export")
    source = initsource.resolve(spec, JobManager(), root)  # a leader that forgot the job
    assert source is not None and (source.job_id, source.owner) == (job.job_id, "alice")


# --- what one stranger's pushes can make the leader hold -----------------------------------


def test_a_piece_past_the_announced_size_ends_its_transfer_and_its_partial_file(tmp_path):
    store = ExportStore()
    first, second, third = chunks("stage-0.npz", b"0123456789", stage=0, step=5)
    for piece in (first, second):
        assert store.receive(tmp_path, piece, 2)[0].ok
    third.data = b"89" + b"x" * 100  # the announced 10 bytes, and then some
    ack, _ = store.receive(tmp_path, third, 2)
    assert not ack.ok and ack.next_seq == 0 and "more than the 10 bytes" in ack.message
    assert list((tmp_path / ".incoming").iterdir()) == []


def test_pieces_that_cannot_carry_the_announced_size_are_refused_at_once(tmp_path):
    store = ExportStore()
    [huge] = chunks("stage-0.npz", b"x", stage=0, step=5)
    huge.size, huge.total = 1 << 40, 2  # a terabyte in two pieces of at most 1 MiB
    ack, _ = store.receive(tmp_path, huge, 2)
    assert not ack.ok and "2 pieces cannot carry" in ack.message
    [many] = chunks("stage-0.npz", b"x", stage=0, step=5)
    many.total = 1000  # a thousand pieces for one byte
    assert "cannot carry" in store.receive(tmp_path, many, 2)[0].message
    assert not (tmp_path / ".incoming").exists() or not list((tmp_path / ".incoming").iterdir())


def test_a_file_that_would_leave_the_disk_short_is_refused_before_a_byte_is_written(tmp_path):
    store = ExportStore()
    [first, *_] = chunks("stage-0.npz", b"x" * 8, stage=0, step=5)
    disk = os.statvfs(tmp_path)
    first.size = disk.f_bavail * disk.f_frsize  # all the disk has left
    first.total = -(-first.size // (1 << 20))
    try:
        store.receive(tmp_path, first, 2)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC and "kept in reserve" in str(exc)
    else:
        raise AssertionError("taken on")
    assert list((tmp_path / ".incoming").iterdir()) == []


def test_a_fellow_holds_at_most_four_open_transfers(tmp_path):
    store = ExportStore()
    firsts = [chunks("stage-0.npz", b"0123456789", stage=0, step=s)[0] for s in range(1, 7)]
    for first in firsts:
        assert store.receive(tmp_path, first, 2)[0].ok
    incoming = sorted(p.name for p in (tmp_path / ".incoming").iterdir())
    assert incoming == [f"f1-a1-s{s}-stage-0.npz" for s in (3, 4, 5, 6)]
    # The given-up ones start over; another fellow's are its own.
    second_of_1 = chunks("stage-0.npz", b"0123456789", stage=0, step=1)[1]
    assert store.receive(tmp_path, second_of_1, 2)[0].next_seq == 0
    other = chunks("stage-0.npz", b"0123456789", stage=0, step=9, fellow="f2")[0]
    assert store.receive(tmp_path, other, 2)[0].ok
    assert len(list((tmp_path / ".incoming").iterdir())) == 5


AHEAD = {s: {1} for s in range(1, 31)}  # stage 1 alone, thirty steps on
PARTIAL = {
    # (the stages with a file at each step, the steps transfers write into) -> dropped
    "a slow stage's step stays while it may still push it": (
        ({10: {1}, 20: {1}, 30: {1}, 40: {1}, 50: {1}, 60: {1}}, set()),
        set(),
    ),
    "a step the slow stage skipped past is dead": (
        ({10: {1}, 20: {1}, 30: {0, 1}, 40: {1}}, set()),
        {10, 20},
    ),
    "so is the slow stage's own step the fast one never pushed": (
        ({10: {1}, 25: {0}, 30: {1}}, set()),
        {10, 25},
    ),
    "one stage far ahead keeps only the newest 16 it may still complete": (
        (AHEAD, set()),
        set(range(1, 15)),
    ),
    "a step a transfer is writing into is never dropped": ((AHEAD, {5}), set(range(1, 15)) - {5}),
}


@pytest.mark.parametrize(("given", "dropped"), PARTIAL.values(), ids=PARTIAL.keys())
def test_incomplete_steps_go_when_they_can_no_longer_complete(given, dropped):
    held, writing = given
    assert partial_steps_to_drop(held, set(), 2, writing) == dropped


def test_a_stage_that_pushes_slowly_still_completes_the_step_it_pushes(tmp_path):
    """Stage 1 pushes seven checkpoints while stage 0 is still pushing the first: that
    step completes when stage 0's files arrive (the oldest incomplete step is the one the
    slow stage is working on, not one to drop)."""
    store = ExportStore()
    for step in range(10, 80, 10):
        send_shard(store, tmp_path, stage=1, step=step)
    send_shard(store, tmp_path, stage=0, step=10)
    assert store.complete_steps(tmp_path, 2) == [10]
    send_shard(store, tmp_path, stage=0, step=70)  # it skips to its newest checkpoint
    assert store.complete_steps(tmp_path, 2) == [10, 70]
    store.prune(tmp_path, 2)
    assert store.step_numbers(tmp_path) == [10, 70]


def test_incomplete_steps_older_than_the_newest_complete_one_are_pruned(tmp_path):
    store = ExportStore()
    send_shard(store, tmp_path, stage=0, step=10)  # never completed: stage 1 went on
    for stage in (0, 1):
        send_shard(store, tmp_path, stage=stage, step=20)
    send_shard(store, tmp_path, stage=0, step=30)
    store.prune(tmp_path, 2)
    assert store.step_numbers(tmp_path) == [20, 30]
