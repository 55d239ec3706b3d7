"""A job with replicas, seen everywhere (issue 23 item 4), the pure parts: the job view (sum
of the replicas' tokens/s, mean of their last stages' losses), the record (each fellow's
stage kept with its replica), Prometheus (per replica series), the export (replica 0's only),
the agent's progress fields and shard pushes, and the CLI's lines."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from silentswarm import subjects as topics
from silentswarm.agent.shardpush import Shard, ShardPusher
from silentswarm.agent.supervisor import sync_fields
from silentswarm.cli import render
from silentswarm.cli.commands.jobs import stage_table
from silentswarm.cli.watch import Snapshot, view_lines
from silentswarm.jobspec import JobSpec, PlacedStage, Placement
from silentswarm.leader.aggregate import JobMetricsAggregator, RateMeter, job_metrics
from silentswarm.leader.bus import LeaderBus
from silentswarm.leader.exports import REPLICA_DROP, ExportService
from silentswarm.leader.jobs import JobManager
from silentswarm.leader.metrics import job_families
from silentswarm.leader.registry import FellowRegistry
from silentswarm.natsconn import NatsAccess
from silentswarm.plan import ModelConfig, Transport
from silentswarm.protocol import JobState, Progress, ProgressEvent, ShardChunk, StageOutcome
from silentswarm.protocol import StageResult as R
from silentswarm.types.manifests import decode_run_manifest
from silentswarm.types.stage import DoneEvent, StepEvent
from silentswarm.types.views import JobView, StageProgress, job_view
from tests.fakes import Clock

# --- the job view ----------------------------------------------------------------------------


def progress(replica: int, stage: int, **kw) -> StageProgress:
    return StageProgress(stage=stage, replica=replica, fellow_id=f"r{replica}s{stage}", **kw)


def test_the_view_of_replicas_sums_their_rates_and_averages_their_last_losses():
    stages = [
        progress(1, 1, step=5, loss=3.0, val_loss=3.5, tokens_per_s=900.0, step_time_s=0.6,
                 lr=1e-3, bytes_sent=10, sync_s=0.2, sync_bytes_sent=100,
                 sync_bytes_received=90),
        progress(0, 0, step=7, loss=None, tokens_per_s=2000.0, bytes_sent=1, sync_s=0.1,
                 sync_bytes_sent=50, sync_bytes_received=40),
        progress(0, 1, step=6, loss=2.0, val_loss=2.5, tokens_per_s=1000.0, step_time_s=0.5,
                 lr=1e-3, bytes_sent=20, sync_s=0.3, sync_bytes_sent=70,
                 sync_bytes_received=80),
        progress(1, 0, step=6, loss=None, tokens_per_s=1800.0, bytes_sent=2),
    ]  # fmt: skip
    view = job_view(stages, total_steps=100)
    assert view.step == 5  # the slowest stage of all (replica 1's last)
    assert view.loss == pytest.approx(2.5)  # the mean of the replicas' last stages
    assert view.val_loss == pytest.approx(3.0)
    assert view.tokens_per_s == pytest.approx(1900.0)  # each pipeline's (its last stage's)
    assert view.step_time_s == 0.6  # the slowest replica's
    assert view.lr == 1e-3
    assert (view.bytes_sent, view.sync_bytes_sent, view.sync_bytes_received) == (33, 220, 210)
    assert view.fellows == ["r0s0", "r0s1", "r1s0", "r1s1"]  # by replica, then stage
    assert [(r.replica, r.step, r.loss, r.tokens_per_s, r.sync_s) for r in view.replicas] == [
        (0, 6, 2.0, 1000.0, 0.3),
        (1, 5, 3.0, 900.0, 0.2),
    ]
    assert view.replicas[1].fellows == ["r1s0", "r1s1"]
    assert view.replicas[0].sync_bytes_sent == 120
    # The final loss still wins; a replica whose head has no loss yet is left out of the mean.
    assert job_view(stages, final_loss=1.0).loss == 1.0
    early = [progress(0, 0, loss=4.0), progress(1, 0, loss=None)]
    assert job_view(early).loss == 4.0


def test_one_replica_is_the_view_of_one_pipeline_exactly():
    stages = [
        progress(0, 0, step=6, tokens_per_s=2000.0, step_time_s=0.7, bytes_sent=1),
        progress(0, 1, step=5, loss=2.1, val_loss=2.3, lr=0.1, tokens_per_s=1000.1,
                 step_time_s=0.5),
    ]  # fmt: skip
    assert job_view(stages, total_steps=9) == JobView(
        step=5,
        total_steps=9,
        loss=2.1,
        val_loss=2.3,
        lr=0.1,
        step_time_s=0.5,
        tokens_per_s=1000.1,
        bytes_sent=1,
        fellows=["r0s0", "r0s1"],
    )


# --- the job's record ------------------------------------------------------------------------

FELLOWS = {(r, s): f"f{r}{s}" for r in (0, 1) for s in (0, 1)}


def placement() -> Placement:
    """Two replicas of a two-stage pipeline, ordered by (replica, stage) as placement does."""
    return Placement(
        stages=[
            PlacedStage(
                stage=s,
                replica=r,
                fellow_id=FELLOWS[(r, s)],
                hostname="h",
                layer_start=2 * s,
                layer_end=2 * s + 2,
            )
            for r in (0, 1)
            for s in (0, 1)
        ],
        transport=Transport.AUTO,
    )


def running(manager: JobManager, clock: Clock, export_dir: Path | None = None):
    clock.now += 1
    job = manager.submit(JobSpec(model=ModelConfig(n_layers=4), stages=2, replicas=2, steps=10))
    manager.begin_start(job.job_id, placement())
    manager.start_succeeded(job.job_id)
    if export_dir is not None:
        job.export_dir = str(export_dir)
    return job


def step(job, replica: int, stage: int, n: int, **kw) -> Progress:
    return Progress(
        job_id=job.job_id,
        fellow_id=FELLOWS[(replica, stage)],
        attempt=job.attempt,
        stage=stage,
        replica=replica,
        step=n,
        **kw,
    )


def test_the_record_keeps_each_replicas_stages_apart():
    clock = Clock()
    manager = JobManager(wall=clock)
    job = running(manager, clock)
    assert [(p.replica, p.stage, p.fellow_id) for p in job.progress] == [
        (0, 0, "f00"), (0, 1, "f01"), (1, 0, "f10"), (1, 1, "f11")
    ]  # fmt: skip
    manager.record_progress(
        step(
            job,
            0,
            1,
            4,
            loss=2.0,
            tokens_per_s=100.0,
            sync_s=0.25,
            sync_bytes_sent=8,
            sync_bytes_received=9,
            sync_clipped=1,
        )
    )
    manager.record_progress(step(job, 1, 1, 3, loss=4.0, tokens_per_s=50.0, sync_missed=2))
    manager.record_progress(step(job, 0, 0, 5))
    manager.record_progress(step(job, 1, 0, 5))
    # A fellow that says it is of another replica than it was placed in: not taken.
    assert manager.record_progress(step(job, 1, 1, 9, loss=99.0)) is not None
    liar = msgspec.structs.replace(step(job, 1, 1, 12, loss=0.5), replica=0)
    assert manager.record_progress(liar) is None
    head0, head1 = job.stage_progress("f01"), job.stage_progress("f11")
    assert (head0.replica, head0.step, head0.loss, head0.sync_s) == (0, 4, 2.0, 0.25)
    assert (head0.sync_bytes_sent, head0.sync_bytes_received, head0.sync_clipped) == (8, 9, 1)
    assert (head1.replica, head1.step, head1.sync_missed) == (1, 9, 0)
    assert head1.loss == 99.0  # the honest record before the liar
    assert job.view.loss == pytest.approx((2.0 + 99.0) / 2)
    assert job.view.tokens_per_s == pytest.approx(150.0)
    assert [r.replica for r in job.view.replicas] == [0, 1]

    # Completed: the final loss is the mean of the replicas' last stages'; the export is
    # replica 0's only, so the others' missing shards are no export error.
    for (r, s), fid in FELLOWS.items():
        loss = {(0, 1): 1.0, (1, 1): 3.0}.get((r, s))
        outcome = StageOutcome(job_id=job.job_id, attempt=1, result=R.COMPLETED, step=10, loss=loss)
        manager.record_outcome(fid, outcome)
    assert job.state is JobState.COMPLETED
    assert job.final_loss == pytest.approx(2.0)
    assert job.export_error is not None
    assert "stage 0 on fellow f00" in job.export_error
    assert "f10" not in job.export_error and "f11" not in job.export_error


def test_a_resume_keeps_one_pipelines_layer_ranges():
    clock = Clock()
    manager = JobManager(wall=clock)
    job = running(manager, clock)
    job.pushed_step = 4
    manager.fail(job.job_id, "lost f11")
    assert job.layer_ranges == [(0, 2), (2, 4)]


# --- Prometheus ------------------------------------------------------------------------------


def samples(jobs) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    class Collector:
        def collect(self) -> Iterator:
            yield from job_families(jobs)

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_metrics_stream_drops_a_lost_replica_as_the_record_does():
    """A stream's replay saw replica 1's first stage before it was lost; once the job's
    placement holds its replacement, the stream shows what a stream started now shows: no
    dead fellow holding the job's step back, the replacement's boundary."""
    clock = Clock()
    manager = JobManager(wall=clock)
    job = running(manager, clock)
    replay = JobMetricsAggregator(job.job_id)
    for r, s, n in ((0, 0, 199), (0, 1, 199), (1, 0, 199), (1, 1, 199)):
        replay.apply(step(job, r, s, n, at=clock.now, loss=2.0 if s else None))
    manager.lose_stage(job.job_id, "f11", "went offline")
    for r, s, n in ((0, 0, 400), (0, 1, 400)):
        replay.apply(step(job, r, s, n, at=clock.now, loss=2.0 if s else None))
    assert replay.view().step == 199, "without retain the lost replica holds the step back"
    replay.retain(job.placement.fellow_ids)
    view = replay.view()
    assert view.step == 400 and {f.fellow_id for f in view.fellows} == {"f00", "f01"}
    assert [(b.upstream, b.downstream) for b in view.boundaries] == [("f00", "f01")]
    fresh = JobMetricsAggregator(job.job_id)
    for fellow in view.fellows:
        fresh.apply(step(job, fellow.replica, fellow.stage, 400, at=clock.now))
    assert [f.fellow_id for f in fresh.view().fellows] == [f.fellow_id for f in view.fellows]


def test_metrics_have_per_replica_series_and_keep_the_old_ones():
    clock = Clock()
    manager = JobManager(wall=clock)
    job = running(manager, clock)
    manager.record_progress(
        step(
            job,
            0,
            0,
            5,
            tokens_per_s=300.0,
            sync_s=0.5,
            sync_bytes_sent=1000,
            sync_bytes_received=900,
        )
    )
    manager.record_progress(
        step(
            job,
            0,
            1,
            4,
            loss=2.0,
            tokens_per_s=200.0,
            sync_s=0.1,
            sync_bytes_sent=10,
            sync_clipped=2,
        )
    )
    manager.record_progress(step(job, 1, 0, 5, tokens_per_s=250.0, sync_missed=1))
    manager.record_progress(step(job, 1, 1, 4, loss=3.0, tokens_per_s=260.0))
    got = samples([job])
    jid = ("job_id", job.job_id)
    # The job: the sum of each replica's rate (its slowest stage's), the mean loss.
    assert got[("swarm_job_tokens_per_second", (jid,))] == 450.0
    assert got[("swarm_job_loss", (jid,))] == 2.5
    # The old stage series, told apart by their fellow, without a replica label.
    stage = (("fellow", "f11"), jid, ("stage", "1"))
    assert got[("swarm_job_stage_tokens_per_second", stage)] == 260.0
    # Per replica.
    r0, r1 = (jid, ("replica", "0")), (jid, ("replica", "1"))
    assert got[("swarm_job_replica_tokens_per_second", r0)] == 200.0
    assert got[("swarm_job_replica_tokens_per_second", r1)] == 250.0
    assert got[("swarm_job_replica_step", r0)] == 4
    assert got[("swarm_job_replica_loss", r1)] == 3.0
    assert got[("swarm_job_replica_sync_seconds", r0)] == 0.5
    assert got[("swarm_job_replica_sync_sent_bytes_total", r0)] == 1010
    assert got[("swarm_job_replica_sync_received_bytes_total", r0)] == 900
    assert got[("swarm_job_replica_sync_clipped_total", r0)] == 2
    assert got[("swarm_job_replica_sync_missed_total", r1)] == 1
    # Per stage, with the replica.
    s00 = (("fellow", "f00"), jid, ("replica", "0"), ("stage", "0"))
    assert got[("swarm_job_stage_sync_seconds", s00)] == 0.5
    assert got[("swarm_job_stage_sync_sent_bytes_total", s00)] == 1000
    # A job that lost all but one replica keeps that one's series (its slots stay 2).
    manager.lose_stage(job.job_id, "f10", "went offline")
    got = samples([job])
    assert got[("swarm_job_replica_step", r0)] == 4 and ("swarm_job_replica_step", r1) not in got
    assert got[("swarm_job_stage_sync_seconds", s00)] == 0.5


def test_a_job_without_replicas_exports_no_replica_series():
    clock = Clock()
    manager = JobManager(wall=clock)
    clock.now += 1
    job = manager.submit(JobSpec(model=ModelConfig(n_layers=4), steps=10))
    one = Placement(stages=placement().stages[:1], transport=Transport.AUTO)
    manager.begin_start(job.job_id, one)
    manager.start_succeeded(job.job_id)
    manager.record_progress(step(job, 0, 0, 3, loss=2.0, tokens_per_s=300.0))
    got = samples([job])
    assert got[("swarm_job_tokens_per_second", (("job_id", job.job_id),))] == 300.0
    assert not any("replica" in name or "sync" in name for name, _ in got)


# --- the export ------------------------------------------------------------------------------


class Msg:
    """A NATS request as the leader's subscription hands it over (subject, reply, data)."""

    def __init__(self, chunk: ShardChunk) -> None:
        self.subject = topics.SHARD.subject("swarm", job=chunk.job_id, fellow=chunk.fellow_id)
        self.reply = f"_INBOX.{chunk.fellow_id}.x1"
        self.data = topics.encode(chunk)
        self.answers: list = []

    async def respond(self, payload: bytes) -> None:
        self.answers.append(topics.SHARD.decode_reply(payload))


def chunks(job, replica: int, stage: int, n: int) -> list[ShardChunk]:
    """The two one-piece files of a stage's shard, arrays first."""
    out = []
    for suffix, data in (("npz", f"arrays r{replica}".encode()), ("json", b"{}")):
        out.append(
            ShardChunk(
                job_id=job.job_id,
                fellow_id=FELLOWS[(replica, stage)],
                attempt=job.attempt,
                stage=stage,
                step=n,
                name=f"stage-{stage}.{suffix}",
                size=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                seq=0,
                total=1,
                data=data,
            )
        )
    return out


def test_only_replica_0_pushes_the_export(tmp_path):
    clock = Clock()
    manager = JobManager(wall=clock)
    job = running(manager, clock, tmp_path / "export")
    registry = FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="t")
    bus = LeaderBus(nats=NatsAccess(url="nats://127.0.0.1:1"), prefix="swarm", registry=registry)
    exports = ExportService(
        bus=bus,
        jobs=manager,
        prefix="swarm",
        export_root=tmp_path,
        secret=b"operator-token",
        public_url="http://leader:8000",
    )

    async def push(replica: int, stage: int, n: int = 4) -> list:
        answers = []
        for chunk in chunks(job, replica, stage, n):
            msg = Msg(chunk)
            await exports._on_shard(msg)
            answers.extend(msg.answers)
        return answers

    async def scenario() -> None:
        for stage in (0, 1):
            assert all(a.ok and a.done for a in await push(0, stage))
        refused = await push(1, 0)
        assert [a.ok for a in refused] == [False, False]
        assert "only replica 0 pushes shards" in refused[0].message
        beyond = await push(0, 0, job.spec.steps + 1)  # a step the job never reaches
        assert [a.ok for a in beyond] == [False, False]
        assert f"past the job's last ({job.spec.steps})" in beyond[0].message

    asyncio.run(scenario())
    export = Path(job.export_dir)
    assert (export / "shards" / "step-4" / "stage-0.npz").read_bytes() == b"arrays r0"
    assert (export / "stage-0" / "weights.npz").read_bytes() == b"arrays r0"
    assert exports.refused_replica_shards == 2
    assert bus.dropped[REPLICA_DROP] == 2
    assert job.pushed_step == 4
    manifest = json.loads((export / "run_manifest.json").read_bytes())
    assert [(s["stage"], s["fellow_id"]) for s in manifest["stages"]] == [(0, "f00"), (1, "f01")]
    assert [s["fellow_id"] for s in manifest["placement"]["stages"]] == ["f00", "f01"]


def test_an_export_of_a_lead_that_took_over_is_one_pipeline_glue_can_rebuild(tmp_path):
    """Replica 0 is lost, replica 1 leads and pushes: the manifest describes one pipeline
    without replicas (replica 0 of 1, lead 0), on the new lead's fellows, and its portable
    plans are that pipeline's (they failed with an IndexError when the manifest kept the
    lead's replica number)."""
    clock = Clock()
    manager = JobManager(wall=clock)
    job = running(manager, clock, tmp_path / "export")
    manager.lose_stage(job.job_id, "f00", "went offline")
    assert job.placement.lead == 1
    exports = ExportService(
        bus=LeaderBus(
            nats=NatsAccess(url="nats://127.0.0.1:1"),
            prefix="swarm",
            registry=FellowRegistry(heartbeat_interval_s=1, offline_after_s=3, leader_version="t"),
        ),
        jobs=manager,
        prefix="swarm",
        export_root=tmp_path,
        secret=b"operator-token",
        public_url="http://leader:8000",
    )

    async def scenario() -> None:
        for stage in (0, 1):
            for chunk in chunks(job, 1, stage, 4):
                msg = Msg(chunk)
                await exports._on_shard(msg)
                assert all(a.ok for a in msg.answers), msg.answers

    asyncio.run(scenario())
    manifest = decode_run_manifest((Path(job.export_dir) / "run_manifest.json").read_bytes())
    placement = manifest.placement
    assert [(s.replica, s.stage, s.fellow_id) for s in placement.stages] == [
        (0, 0, "f10"),
        (0, 1, "f11"),
    ]
    assert (placement.n_replicas, placement.lead) == (1, 0)
    plans = manifest.portable_plans()
    assert [(p.stage, p.n_stages, p.replicated) for p in plans] == [(0, 2, False), (1, 2, False)]
    # An export written before: the lead's stages under their own replica number.
    old = msgspec.structs.replace(
        placement,
        stages=[msgspec.structs.replace(s, replica=1) for s in placement.stages],
        replica_slots=2,
        lead=1,
    )
    plans = msgspec.structs.replace(manifest, placement=old).portable_plans()
    assert [(p.stage, p.n_stages, p.replicated) for p in plans] == [(0, 2, False), (1, 2, False)]


# --- the agent -------------------------------------------------------------------------------


def traffic(**kw) -> dict:
    return {
        "stage": 0,
        "relay_dropped": 0,
        "sync_bytes_sent": 7,
        "sync_bytes_received": 6,
        "sync_clipped": 1,
        "sync_missed": 2,
        **kw,
    }


class Plan:
    """What sync_fields reads of a stage plan."""

    def __init__(self, replica: int, n_replicas: int) -> None:
        self.replica, self.n_replicas = replica, n_replicas

    @property
    def replicated(self) -> bool:
        return self.n_replicas > 1


def test_step_and_done_events_become_progress_fields():
    event = StepEvent(
        step=3,
        loss=None,
        lr=0.1,
        step_time_s=0.5,
        tokens_per_s=10.0,
        wait_s=0.0,
        sync_s=0.25,
        **traffic(),
    )
    fields = sync_fields(Plan(1, 2), event)  # type: ignore[arg-type]
    assert fields == {
        "replica": 1,
        "sync_s": 0.25,
        "sync_bytes_sent": 7,
        "sync_bytes_received": 6,
        "sync_clipped": 1,
        "sync_missed": 2,
    }
    msg = Progress(job_id="j", fellow_id="f", attempt=1, step=4, **fields)
    assert (msg.replica, msg.sync_s, msg.sync_missed) == (1, 0.25, 2)
    # Without replicas a step says no sync seconds (it never syncs); no event: the replica.
    assert "sync_s" not in sync_fields(Plan(0, 1), event)  # type: ignore[arg-type]
    assert sync_fields(Plan(2, 3), None) == {"replica": 2}  # type: ignore[arg-type]
    done = DoneEvent(
        steps=4,
        loss=1.0,
        val_loss=None,
        step_time_s=0.5,
        tokens_per_s=1.0,
        params=1,
        dropped_frames=0,
        relay_dropped_by_reason={},
        **traffic(),
    )
    assert sync_fields(Plan(1, 2), done)["sync_bytes_received"] == 6  # type: ignore[arg-type]
    assert "sync_s" not in sync_fields(Plan(1, 2), done)  # type: ignore[arg-type]


def test_only_replica_0_submits_shard_pushes(tmp_path):
    periodic = tmp_path / "every-4"
    periodic.mkdir()
    pusher = ShardPusher(None, "swarm", "f10")  # type: ignore[arg-type]
    shard = Shard(
        job_id="j",
        attempt=1,
        stage=0,
        replica=1,
        lead=False,
        step=4,
        directory=periodic,
        periodic=True,
    )
    assert pusher.submit(shard) is False
    assert not periodic.exists()  # written only to be pushed: not kept
    assert pusher._queue == [] and pusher._task is None


# --- the CLI ---------------------------------------------------------------------------------


def test_watch_shows_a_line_per_stage_per_replica_with_its_sync():
    stages = [
        progress(r, s, step=4, loss=2.0 + r, sync_s=0.125, sync_bytes_sent=2048 * (r + 1),
                 sync_bytes_received=512)
        for r in (0, 1)
        for s in (0, 1)
    ]  # fmt: skip
    metrics = job_metrics("j", 1, job_view(stages), stages, RateMeter("j"))
    lines = view_lines(Snapshot("j", "RUNNING", metrics=metrics))
    fellows = [line for key, line in lines.items() if key.startswith("fellow:")]
    assert len(fellows) == 4
    assert fellows[2].startswith("  replica 1 stage 0 r1s0")
    assert "sync 0.125 s 4.0 KiB sent / 512 B recv" in fellows[2]
    assert "loss 2.5000" in lines["summary"]
    # Boundaries are each replica's own.
    assert [(b.replica, b.boundary, b.upstream) for b in metrics.boundaries] == [
        (0, 0, "r0s0"),
        (1, 0, "r1s0"),
    ]
    # Without replicas the lines are what they were.
    one = [progress(0, 0, step=4)]
    plain = view_lines(
        Snapshot("j", "RUNNING", metrics=job_metrics("j", 1, job_view(one), one, RateMeter("j")))
    )
    assert plain["fellow:r0s0"].startswith("  stage 0 r0s0") and "sync" not in plain["fellow:r0s0"]


def test_job_summary_has_a_row_per_stage_per_replica(tmp_path):
    clock = Clock()
    manager = JobManager(wall=clock)
    job = running(manager, clock)
    manager.record_progress(step(job, 1, 1, 3, loss=4.0, sync_s=0.5, sync_bytes_sent=3 << 20))
    out = tmp_path / "out.txt"
    with out.open("w") as handle:
        render.show(render.console(handle, tty=False), stage_table(job))
    text = out.read_text()
    assert "REPLICA" in text and "SYNC S" in text
    row = next(line for line in text.splitlines() if "f11" in line)
    assert "0.500" in row and "3.0 MiB" in row and "4.0000" in row


def test_the_loss_curve_of_replicas_is_their_mean():
    aggregator = JobMetricsAggregator("j")

    def record(replica: int, n: int, loss: float) -> float | None:
        point = aggregator.apply(
            Progress(
                job_id="j",
                fellow_id=f"h{replica}",
                attempt=1,
                stage=1,
                replica=replica,
                step=n,
                loss=loss,
                event=ProgressEvent.STEP,
            )
        )
        return None if point is None else point.loss

    assert record(0, 1, 2.0) == 2.0
    assert record(1, 1, 4.0) == 3.0  # both replicas' step 1
    assert record(0, 2, 1.0) == 1.0
    view = aggregator.view()
    assert [f.replica for f in view.fellows] == [0, 1]
