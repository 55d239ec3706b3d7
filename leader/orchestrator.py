"""The leader's job loop: the I/O around the pure JobManager, FellowRegistry and PurgeBook.

Once NATS is up it loads the durable state from JetStream, then, on every tick or wake-up:
reconciles running jobs with what their fellows report, places pending jobs and sends
START, stops orphaned stages, delivers pending purges, and writes what changed to the
store. Progress reports arrive on ``swarm.progress.<job>.<fellow>``. Signals go out through
the SignalHub; their outcomes are recorded on the job.

What to do is decided by pure functions (:mod:`silentswarm.leader.decide`,
:mod:`silentswarm.leader.jobs`); this module gathers their inputs, applies their answers and does
the I/O.

The operator's actions (submit, cancel, checkpoint, release, update, purge retries) live in
the domain services (:mod:`silentswarm.leader.services`); they reach the loop only through the few
methods under "what the domain services ask of the loop": its readiness, its signal hub,
a save and a wake-up, reserving fellows, ending a job, and one purge delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from silentswarm import subjects as topics
from silentswarm.errors import NotFoundError, ProtocolError
from silentswarm.jobspec import stage_plans
from silentswarm.leader import balance, decide, elastic, initsource, linkprobes, retention
from silentswarm.leader.admission import RateLimiter, Verdict
from silentswarm.leader.bootstrap import JoinSessions
from silentswarm.leader.bus import LeaderBus
from silentswarm.leader.datasets import DatasetStore
from silentswarm.leader.datasets import start_args as dataset_start_args
from silentswarm.leader.errors import NotReadyError
from silentswarm.leader.exports import ExportService
from silentswarm.leader.jobs import FellowState, JobManager, offered_to, plan_schedule
from silentswarm.leader.linkprobes import LinkProber, ProbeResult, ProbeRun
from silentswarm.leader.placement import (
    DEFAULTS,
    Candidate,
    PlacementDefaults,
    host_cores,
    speed_alone,
    stage_cores,
)
from silentswarm.leader.pools import AccountLookup, holdings, no_accounts
from silentswarm.leader.purges import PurgeBook
from silentswarm.leader.registry import FellowRegistry
from silentswarm.leader.signals import SignalHub
from silentswarm.leader.store import StateStore
from silentswarm.natsauth import NatsAuthority
from silentswarm.plan import RingChange, StagePlan
from silentswarm.protocol import JobState, Progress
from silentswarm.retrying import Backoff
from silentswarm.rings import boundary_keys
from silentswarm.text import loggable
from silentswarm.throttle import Throttle
from silentswarm.types.fleet import FellowRecord
from silentswarm.types.jobs import JobRecord
from silentswarm.types.signals import (
    REASON_CHARS,
    ProbeArgs,
    PurgeArgs,
    RingArgs,
    StartArgs,
    StopArgs,
)

log = logging.getLogger(__name__)

TICK_S = 0.25
# Progress a fellow may send: a record per step of a fast stage, with room to spare.
PROGRESS_PER_S = 200.0
PROGRESS_BURST = 1000.0
# And bytes: a step record is a few hundred, a stage's state digests after a ring change up
# to about 300 KB (one per ring, a ring per layer at most). A record is decoded only within
# its sender's budget, so a flood costs the leader about 2 ms a second per fellow.
PROGRESS_MAX_BYTES = 512 << 10
PROGRESS_BYTES_PER_S = float(256 << 10)
PROGRESS_BYTES_BURST = float(1 << 20)
RETAIN_EVERY_S = 1.0  # how often the retention policy is applied (archive, delete)
STORE_RETRIES = Backoff(wait_initial=1.0, wait_max=1.0)  # the state store: every 1 s
# A replacement replica is placed only when the run has at least this many seconds of steps
# left: its stages must start (TensorFlow, the model) before the ring change takes effect
# (one that is not ready before the end is stopped).
JOIN_LEAD_S = 10.0


class Orchestrator:
    def __init__(
        self,
        *,
        bus: LeaderBus,
        registry: FellowRegistry,
        jobs: JobManager,
        purges: PurgeBook,
        prefix: str,
        defaults: PlacementDefaults = DEFAULTS,
        on_progress: Callable[[Progress], None] | None = None,
        exports: ExportService | None = None,
        datasets: DatasetStore | None = None,
        authority: NatsAuthority | None = None,
        wake: asyncio.Event | None = None,
        account_of: AccountLookup = no_accounts,
        revoke_attempt: Callable[[str, str, int], None] | None = None,
        link_probe_every_s: float = 0.0,
        link_probes_at_once: int = 1,
        joins: JoinSessions | None = None,
    ) -> None:
        """``wake``: set (by anyone: the export service when a shard arrives) to run the
        next tick at once instead of after ``TICK_S``. ``account_of``: a job owner's account,
        whose pool limits placement keeps to (default: nobody is limited).
        ``revoke_attempt(fellow, job, attempt)``: revokes that fellow's NATS user of the
        attempt (a dropped replica's fellows; None: no NATS users to revoke).
        ``link_probe_every_s``: how often idle fellows' unmeasured links may be probed
        (:mod:`silentswarm.leader.linkprobes`; 0: never), ``link_probes_at_once`` of them
        side by side at most. ``joins``: the join sessions, kept in the store with the rest."""
        self.account_of = account_of
        self.joins = joins if joins is not None else JoinSessions()
        self.revoke_attempt = revoke_attempt
        self.bus = bus
        # Mints each placed stage of each attempt its own NATS user (None: no NATS users).
        self.authority = authority
        self.progress_limit = RateLimiter(PROGRESS_PER_S, PROGRESS_BURST)
        self.progress_bytes = RateLimiter(PROGRESS_BYTES_PER_S, PROGRESS_BYTES_BURST)
        self.exports = exports
        # Where the uploaded datasets a stage 0 downloads are (needs ``exports``' tokens).
        self.datasets = datasets
        self.registry = registry
        self.jobs = jobs
        self.purges = purges
        self.prefix = prefix
        self.defaults = defaults
        self.on_progress = on_progress
        self.hub: SignalHub | None = None
        self.store: StateStore | None = None
        self.loaded = asyncio.Event()
        self._wake = wake if wake is not None else asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        # Final manifests being written, by job: a job starting from one waits for it.
        self._final_exports: dict[str, asyncio.Task[Any]] = {}
        # Fellow id -> the purge delivery in flight (one at a time; others wait for it).
        self._purging: dict[str, asyncio.Future[bool]] = {}
        # Fellow id -> when its released agent was last told to exit (monotonic).
        self._released_told: dict[str, float] = {}
        # Fellows an operator action (release, update) is signalling: not placed meanwhile.
        self._reserved: set[str] = set()
        self.prober = LinkProber(every_s=link_probe_every_s, at_once=link_probes_at_once)
        self._cooldown: dict[str, float] = {}  # fellow id -> monotonic time it may be placed
        # When each stage last got a STOP (monotonic): the orphan sweep waits a while after.
        self._stops_sent: dict[decide.StageKey, float] = {}
        self._store_logs = Throttle()  # a store that stays unavailable: a line a minute
        self._tick_logs = Throttle()  # a part of the job loop that keeps failing: the same
        self.tick_failures: Counter[str] = Counter()  # failures of each part of the loop
        self._retain_due = 0.0  # monotonic time of the next retention pass

    # --- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        await self.bus.connected.wait()
        nc = self.bus.nc
        assert nc is not None
        self.hub = SignalHub(nc, prefix=self.prefix)
        await self._open_store()
        await nc.subscribe(topics.PROGRESS.wildcard(self.prefix), cb=self._on_progress)
        if self.exports is not None:
            await self.exports.start(nc)
        self.loaded.set()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            self._wake.clear()
            try:
                await self.tick()
            except Exception:  # one bad tick must not stop the loop
                log.exception("job loop tick failed")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.flush()

    def wake(self) -> None:
        self._wake.set()

    async def tick(self) -> None:
        """One pass of the job loop. Each part runs even where one before it failed (figures
        from a fellow that slipped past their bounds must not stop the placing, stopping and
        saving of every other job), and a failing part is logged at most once a minute."""
        # One snapshot of the fleet for the synchronous part below: no heartbeat can land
        # before the first await.
        fellows = self.registry.read_each(decide.fellow_state)
        parts: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("reconcile", lambda: self._reconcile(fellows)),
            ("stop resumed", self._stop_resumed),
            ("expire resumes", self._expire_resumes),
            ("stop orphans", lambda: self._stop_orphans(fellows)),
            ("schedule", self._schedule),
            ("stop dropped", self._stop_dropped),
            ("replace", self._replace),
            ("change rings", self._change_rings),
            ("deliver purges", self._deliver_purges),
            ("stop released", self._stop_released),
            ("probe links", self._probe_links),
            ("retain", self.retain),
            ("flush", self.flush),
        )
        for name, part in parts:
            try:
                done = part()
                if asyncio.iscoroutine(done):
                    await done
            except Exception:
                self.tick_failures[name] += 1
                held = self._tick_logs.allow(name)
                if held is not None:
                    more = f" ({held} more failures not logged)" if held else ""
                    log.exception("job loop: %s failed%s", name, more)

    def _expire_resumes(self) -> None:
        for job in self.jobs.expire_resumes():
            self.job_ended(job)

    def _idle(self, fleet: list[FellowRecord], *, now: float) -> list[Candidate]:
        """The fellows a job may be placed on now (:func:`decide.idle_candidates`): ready,
        in no job, not held by an operator action or a link probe, not cooling down, no
        purge pending."""
        return decide.idle_candidates(
            fleet,
            busy=self.jobs.busy_fellows(),
            reserved=self._reserved | self.prober.busy(),
            cooldown=self._cooldown,
            purging={p.fellow_id for p in self.purges.list()},
            now=now,
        )

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())
        self.wake()

    # --- durable state ---------------------------------------------------------------------

    async def _open_store(self) -> None:
        nc = self.bus.nc
        assert nc is not None
        async for attempt in STORE_RETRIES.context(on=Exception):
            with attempt:
                try:
                    self.store = await StateStore.open(nc, prefix=self.prefix)
                    state = await self.store.load()
                except Exception as exc:  # JetStream not ready yet, or off: say so and retry
                    if self._store_logs.allow("open") is not None:
                        log.error("cannot open the JetStream state store (%s); retrying", exc)
                    raise
        self.registry.restore(state.fellows)
        self.jobs.restore(state.jobs)
        self.purges.restore(state.purges)
        self.registry.restore_released(state.released)
        self.joins.restore(state.joins)
        log.info(
            "loaded %d job(s), %d fellow(s), %d pending purge(s), %d released agent(s), "
            "%d join session(s) from JetStream",
            len(state.jobs),
            len(state.fellows),
            len(state.purges),
            len(state.released),
            len(state.joins),
        )
        for job in decide.abandoned_starts(self.jobs.list()):
            assert job.placement is not None
            fellows = job.placement.fellow_ids
            self.jobs.start_failed(job.job_id, "the leader restarted while starting it")
            self._stop_all(job.job_id, job.attempt, fellows, "start abandoned")

    async def flush(self) -> None:
        """Write every changed record; a failed write stays dirty for the next tick."""
        store = self.store
        if store is None:
            return
        for job_id in sorted(self.jobs.dirty):
            self.jobs.dirty.discard(job_id)
            if not await _save(store, store.jobs, job_id, self.jobs.get(job_id)):
                self.jobs.dirty.add(job_id)
        for fid, record in self.registry.take_dirty():
            if not await _save(store, store.fellows, fid, record):
                self.registry.dirty.add(fid)
        for fid in sorted(self.purges.dirty):
            self.purges.dirty.discard(fid)
            if not await _save(store, store.purges, fid, self.purges.get(fid)):
                self.purges.dirty.add(fid)
        for fid, marker in self.registry.take_released_dirty():
            if not await _save(store, store.released, fid, marker):
                self.registry.released_dirty.add(fid)
        self.joins.settle(self.registry.registered_at)
        for session_id in self.joins.take_dirty():
            await self._write_join(store, session_id)

    async def save_join(self, session_id: str) -> bool | None:
        """Write one join session now (a creation or a claim, before the API answers);
        False when it could not be (it stays dirty), None before the store is open (the
        first flush after it opens writes it)."""
        if self.store is None:
            return None
        self.joins.dirty.discard(session_id)
        return await self._write_join(self.store, session_id)

    async def _write_join(self, store: StateStore, session_id: str) -> bool:
        """A join session's record as it is now (a claim saved meanwhile is not undone by an
        older one), or its deletion; dirty again when it could not be written."""
        if await _save(store, store.joins, session_id, self.joins.record(session_id)):
            return True
        self.joins.dirty.add(session_id)
        return False

    # --- retention ---------------------------------------------------------------------------

    async def retain(self) -> None:
        """Archive and delete finished jobs as the retention policy says
        (:mod:`silentswarm.leader.retention`), at most every RETAIN_EVERY_S. Archiving is saved
        by the flush that follows; a deletion that fails is tried again next time."""
        if self.store is None or time.monotonic() < self._retain_due:
            return
        self._retain_due = time.monotonic() + RETAIN_EVERY_S
        policy, now = self.jobs.retention, time.time()
        archived = [
            job_id
            for job_id in retention.jobs_to_archive(self.jobs.list(), now=now, policy=policy)
            if self.jobs.archive(job_id)
        ]
        if archived:
            log.info(
                "archived %d finished job(s) (hidden from the jobs list and the metrics; "
                "GET /api/v1/jobs?all=true lists them; keep %d, archive after %gs): %s",
                len(archived),
                policy.keep_finished,
                policy.archive_after_s,
                ", ".join(archived),
            )
        for job_id in retention.jobs_to_delete(self.jobs.list(), now=now, policy=policy):
            await self._delete_job(self.store, self.jobs.get(job_id), now)

    async def _delete_job(self, store: StateStore, job: JobRecord, now: float) -> None:
        try:
            await store.delete_job(job.job_id)
        except Exception as exc:
            held = self._store_logs.allow("delete")  # one key: a line a minute in all
            if held is not None:
                more = f" ({held} more failed tries since the last line)" if held else ""
                log.warning(
                    "job %s not deleted yet (tried again later)%s: %s", job.job_id, more, exc
                )
            return
        self.jobs.forget(job.job_id)
        log.info(
            "deleted job %s (%s, ended %.0fs ago, delete after %gs): its record and progress "
            "history; its export stays on disk%s",
            job.job_id,
            job.state.value,
            now - retention.ended_at(job),
            self.jobs.retention.delete_after_s,
            f" ({job.export_dir})" if job.export_dir else "",
        )

    # --- reconciling and scheduling --------------------------------------------------------

    def _reconcile(self, fellows: list[FellowState]) -> None:
        for fellow in fellows:
            if fellow.outcome is not None:  # of an attempt given up, one that ran out of memory
                self.jobs.record_late_outcome(fellow.fellow_id, fellow.outcome)
        running = self.jobs.running()
        if not running:
            return
        by_id = {f.fellow_id: f for f in fellows}
        now = time.time()
        for job in running:
            for finding in decide.judge_running(job, by_id, now=now):
                if isinstance(finding, decide.StageEnded):
                    self.jobs.record_outcome(finding.fellow_id, finding.outcome)
                else:
                    self.jobs.lose_stage(job.job_id, finding.fellow_id, finding.reason)
                if job.terminal:
                    self.job_ended(job)
                    break

    def _stop_resumed(self) -> None:
        """A resumed job: stop what still runs of the attempt that lost a fellow, and drop
        that attempt's partial shards beyond the resume step."""
        while self.jobs.resumed:
            job_id, (attempt, fellows) = self.jobs.resumed.popitem()
            job = self.jobs.get(job_id)
            if self.exports is not None and job.resume_step is not None:
                self.exports.resumed(job, job.resume_step)
            if fellows:
                self._stop_all(job_id, attempt, fellows, f"attempt {attempt} is being resumed")

    async def _schedule(self) -> None:
        pending = self.jobs.pending()
        if not pending:
            return
        fleet = self.registry.list()
        idle = self._idle(fleet, now=time.monotonic())
        assignments, waiting = plan_schedule(
            pending,
            idle,
            self.defaults,
            fleet=fleet,
            held=holdings(self.jobs.list(), starting=self.jobs.starting),
            account_of=self.account_of,
            links=self.registry.links,
            leader_version=self.registry.leader_version,
        )
        self.jobs.set_waiting(waiting)
        for assignment in assignments:
            self.jobs.begin_start(assignment.job_id, assignment.placement)
        if assignments:
            # The attempt and its placement are saved before any fellow hears START, so a
            # leader that dies now knows what to stop when it comes back.
            await self.flush()
        for assignment in assignments:
            self._spawn(self._start(assignment.job_id), f"start-{assignment.job_id}")

    async def _start(self, job_id: str) -> None:
        job = self.jobs.get(job_id)
        attempt, placement = job.attempt, job.placement
        assert placement is not None and self.hub is not None
        hub = self.hub
        try:
            if job.state is not JobState.PENDING:  # cancelled before the round began
                self.jobs.starting.pop(job_id, None)
                return
            plans = stage_plans(
                job_id=job_id,
                attempt=attempt,
                spec=job.spec,
                placement=placement,
                subject_prefix=self.prefix,
            )
            try:
                args = [self._start_args(job, plan) for plan in plans]
            except NotFoundError as exc:  # the export init_from names is gone or changed
                log.error("job %s cannot start: %s", job_id, exc.message)
                self.jobs.cannot_start(job_id, exc.message)
                return
            log.info("starting job %s attempt %d on %s", job_id, attempt, placement.fellow_ids)
            records = await asyncio.gather(
                *(
                    hub.send(plan.fellow_id, start, job_id=job_id, attempt=attempt)
                    for plan, start in zip(plans, args, strict=True)
                )
            )
        except BaseException as exc:
            self.jobs.start_failed(job_id, f"the START round broke: {exc!r}")
            self._stop_all(job_id, attempt, placement.fellow_ids, "start failed")
            raise
        for record in records:
            self.jobs.add_signal(job_id, record)
        verdict = decide.judge_start(records, now=time.monotonic())
        if not verdict.ok:
            self._cooldown.update(verdict.cooldown)
            self.jobs.start_failed(job_id, verdict.reason)
            self._stop_all(job_id, attempt, placement.fellow_ids, "start failed")
            return
        if self.jobs.start_succeeded(job_id) is None:  # cancelled while starting
            self._stop_all(job_id, attempt, placement.fellow_ids, "cancelled")

    def _start_args(self, job: JobRecord, plan: StagePlan) -> StartArgs:
        """START's arguments; a joining stage (elastic membership) takes its weights from a
        donor replica, so it gets no resume and no init export."""
        creds = None
        if self.authority is not None:
            # The stage's own NATS user for this attempt: its progress, shard and relay
            # subjects only. It travels only on the fellow's signal subject, is never stored.
            creds = self.authority.attempt_creds(
                self.prefix,
                fellow_id=plan.fellow_id,
                job_id=job.job_id,
                attempt=job.attempt,
                stage=plan.stage,
                n_stages=plan.n_stages,
                replica=plan.replica,
                n_replicas=plan.n_replicas,
                sync_segments=_sync_segments(job, plan),
            )
        resume = data = init = None
        if self.exports is not None:
            self.exports.directory(job)
            if not plan.joining:
                resume = self.exports.resume_args(job, plan.stage)
                init = initsource.init_args(
                    job,
                    plan,
                    token=self.exports.token(job.job_id, job.attempt, plan.stage),
                    public_url=self.exports.public_url,
                )
            if self.datasets is not None:
                data = dataset_start_args(
                    self.datasets,
                    plan,
                    job_id=job.job_id,
                    token=self.exports.token(job.job_id, job.attempt, plan.stage),
                    public_url=self.exports.public_url,
                )
        return StartArgs(plan=plan, nats_creds=creds, resume=resume, datasets=data, init=init)

    # --- elastic membership (leader/elastic.py decides) -------------------------------------

    def _stop_dropped(self) -> None:
        """STOP the stages still running of replicas that were dropped, and revoke their
        fellows' NATS users of the attempt: a dropped fellow reads no ring of the job again
        (under ``tunnel`` its ring subjects carry no CURVE)."""
        revokes, self.jobs.revokes = self.jobs.revokes, []
        if self.revoke_attempt is not None:
            for fellow_id, job_id, attempt in revokes:
                self.revoke_attempt(fellow_id, job_id, attempt)
        while self.jobs.drops:
            job_id, fellows = self.jobs.drops.popitem()
            job = self.jobs.get(job_id)
            self._stop_all(job_id, job.attempt, fellows, "its replica was lost; the others go on")

    def _replace(self) -> None:
        """Place a replacement pipeline in a lost replica's slot of a running job, when ready
        fellows can hold it and the run is long enough for it to join; START it joining."""
        jobs = [
            j
            for j in self.jobs.running()
            if elastic.free_slot(j) is not None
            and not elastic.joining_replicas(j)
            and elastic.switch_step(j, lead_s=JOIN_LEAD_S) is not None
        ]
        if not jobs:
            return
        idle = self._idle(self.registry.list(), now=time.monotonic())
        for job in jobs:
            try:
                stages = elastic.replacement(
                    job,
                    offered_to(job, idle),
                    self.defaults,
                    version=self._version_of(job),
                    links=self.registry.links,
                )
            except (ValueError, ArithmeticError) as exc:
                # As plan_schedule: fellows' figures that slipped past their bounds must not
                # keep every other job's replica from its replacement.
                if self._tick_logs.allow(f"replace {job.job_id}") is not None:
                    log.warning(
                        "job %s: no replacement on the fellows' figures: %s", job.job_id, exc
                    )
                continue
            if not isinstance(stages, list):
                continue  # not enough ready fellows yet (or none fit): the next tick tries
            if self.jobs.place_replacement(job.job_id, stages) is None:
                continue
            taken = {s.fellow_id for s in stages}
            idle = [c for c in idle if c.fellow_id not in taken]
            plans = elastic.joiner_plans(job, stages, subject_prefix=self.prefix)
            try:
                starts = [(p, self._start_args(job, p)) for p in plans]
            except NotFoundError as exc:  # the job's dataset is gone
                self.jobs.lose_stage(job.job_id, plans[0].fellow_id, exc.message)
                continue
            self._spawn(self._start_joiners(job.job_id, job.attempt, starts), f"join-{job.job_id}")

    def _version_of(self, job: JobRecord) -> str | None:
        """The version the job's live fellows run (one: placement never mixes them); None
        when none of them is known any more."""
        placement = job.placement
        assert placement is not None
        for replica in placement.live_replicas:
            for stage in placement.pipeline(replica):
                record = self.registry.get(stage.fellow_id)
                if record is not None:
                    return record.version
        return None

    async def _start_joiners(
        self, job_id: str, attempt: int, starts: list[tuple[StagePlan, StartArgs]]
    ) -> None:
        """START a replacement's stages (plans and arguments made when it was placed, for
        that attempt); one that refuses loses the replacement."""
        fellows = [plan.fellow_id for plan, _ in starts]
        log.info("job %s: starting replica %d on %s to join", job_id, starts[0][0].replica, fellows)
        hub = self.signal_hub()
        records = await asyncio.gather(
            *(
                hub.send(plan.fellow_id, args, job_id=job_id, attempt=attempt)
                for plan, args in starts
            )
        )
        for record in records:
            self.jobs.add_signal(job_id, record)
        verdict = decide.judge_start(records, now=time.monotonic())
        if not verdict.ok:
            self._cooldown.update(verdict.cooldown)
            refused = next(r.fellow_id for r in records if not r.ok)
            self.jobs.lose_stage(
                job_id,
                refused,
                f"the replacement did not start: {verdict.reason}",
                attempt=attempt,
            )

    async def _change_rings(self) -> None:
        """Send the rings' new membership to every member of the jobs whose rings must change
        (a replica lost; a replacement ready to join), from a step a little ahead.

        A replacement whose ring change went out but which has not trained yet cannot be
        part of another change (it is between two rings): after a loss it is dropped too and
        the new rings go on without it; a replacement ready meanwhile waits for it. The
        changes are saved before any member hears of them (as a START's attempt is): a
        leader that died in between would otherwise make the same epoch again with other
        secrets and steps, and members that took the first would refuse the second."""
        sends: list[tuple[JobRecord, str, RingChange]] = []
        later: set[str] = set()
        while self.jobs.ring_due:
            job = self.jobs.get(self.jobs.ring_due.pop())
            if job.state is not JobState.RUNNING or job.placement is None:
                continue
            after_loss = job.job_id in self.jobs.after_loss
            switching = sorted({p.replica for p in job.progress if p.joining == "switching"})
            if switching and not after_loss:
                later.add(job.job_id)
                continue
            for replica in switching:
                fid = job.placement.pipeline(replica)[0].fellow_id
                self.jobs.lose_stage(job.job_id, fid, "a replica was lost while it joined")
                self.jobs.ring_due.discard(job.job_id)  # this pass makes the change
            if job.state is not JobState.RUNNING:
                continue
            sends += [(job, fid, c) for fid, c in self._ring_changes(job, after_loss=after_loss)]
        self.jobs.ring_due |= later
        if sends:
            await self.flush()
        for job, fid, change in sends:
            self._spawn(self._send_ring(job.job_id, job.attempt, fid, change), f"ring-{fid}")

    def _ring_changes(self, job: JobRecord, *, after_loss: bool) -> list[tuple[str, RingChange]]:
        """The job's next ring change, recorded: each member's :class:`RingChange`."""
        assert job.placement is not None
        joining, ready = elastic.joining_replicas(job), self.jobs.ready_to_join(job)
        members = [r for r in job.placement.live_replicas if r not in joining or r in ready]
        at_step = elastic.switch_step(job, after_loss=after_loss)
        if at_step is None:
            for replica in ready:  # too late to join: the run ends first
                fid = job.placement.pipeline(replica)[0].fellow_id
                self.jobs.lose_stage(job.job_id, fid, "the run ends before it could join")
            members = [r for r in members if r not in ready]
            if not after_loss or job.state is not JobState.RUNNING:
                return []
            # The rings stay as they are to the end (each round waits sync_timeout_s for
            # the lost member), but the lead's checkpoint duty must reach its new holder:
            # a change due at the run's end switches nothing and hands over only that.
            epoch = job.ring_epoch + 1
            changes = elastic.ring_changes(
                job, members=members, epoch=epoch, at_step=job.spec.steps
            )
            donor = next(iter(changes.values())).donor
            self.jobs.ring_changed(
                job.job_id, epoch, job.spec.steps, donor, members=members, joined=[]
            )
            log.info(
                "job %s: the run ends before a ring change could take effect; replica %d "
                "takes over the checkpoints",
                job.job_id,
                job.placement.lead,
            )
        else:
            epoch = job.ring_epoch + 1
            changes = elastic.ring_changes(
                job, members=members, epoch=epoch, at_step=at_step, joining=ready
            )
            donor = next(iter(changes.values())).donor
            self.jobs.ring_changed(job.job_id, epoch, at_step, donor, members=members, joined=ready)
            log.info(
                "job %s: ring %d of replicas %s from step %d (state from replica %d%s)",
                job.job_id,
                epoch,
                members,
                at_step,
                donor,
                f"; replicas {ready} join" if ready else "",
            )
        return list(changes.items())

    async def _send_ring(
        self, job_id: str, attempt: int, fellow_id: str, change: RingChange
    ) -> None:
        record = await self.signal_hub().send(
            fellow_id, RingArgs(change=change), job_id=job_id, attempt=attempt
        )
        self.jobs.add_signal(job_id, record)
        if not record.ok and change.at_step < self.jobs.get(job_id).spec.steps:
            self.jobs.lose_stage(
                job_id,
                fellow_id,
                f"fellow {fellow_id} did not take ring {change.epoch}: {record.code}: "
                f"{record.message}",
                attempt=attempt,
            )

    def _stop_orphans(self, fellows: list[FellowState]) -> None:
        """STOP stages of attempts the leader does not run (any more): see
        :func:`silentswarm.leader.decide.orphan_stops`."""
        now = time.monotonic()
        self._stops_sent = decide.forget_old_stops(self._stops_sent, now=now)
        stops = decide.orphan_stops(
            fellows,
            {job.job_id: job for job in self.jobs.list()},
            starting=self.jobs.starting,
            stopped=self._stops_sent,
            now=now,
        )
        for stop in stops:
            log.warning(
                "fellow %s runs %s attempt %s, which is %s: stopping it",
                stop.fellow_id,
                stop.job_id,
                stop.attempt,
                stop.why,
            )
            self._stop_all(stop.job_id, stop.attempt, [stop.fellow_id], "orphaned stage")

    def _stop_all(self, job_id: str, attempt: int, fellows: list[str], reason: str) -> None:
        now = time.monotonic()
        for fid in fellows:
            # The orphan sweep leaves a stage alone for a while after any STOP to it.
            self._stops_sent[(fid, job_id, attempt)] = now
            self._spawn(self._stop(job_id, attempt, fid, reason), f"stop-{job_id}-{fid}")

    async def _stop(self, job_id: str, attempt: int, fellow_id: str, reason: str) -> None:
        assert self.hub is not None
        record = await self.hub.send(
            fellow_id, StopArgs(reason=reason[:REASON_CHARS]), job_id=job_id, attempt=attempt
        )
        self.jobs.add_signal(job_id, record)

    # --- link probes -----------------------------------------------------------------------

    def _probe_links(self) -> None:
        """The probes in flight: take their ends' reports, or let them expire. When more are
        due and no job waits for placement, pair idle fellows whose links are not measured,
        on hosts no probe in flight uses, and send them PROBE
        (:mod:`silentswarm.leader.linkprobes`)."""
        prober = self.prober
        if not prober.enabled:
            return
        now = time.monotonic()
        for run in list(prober.running.values()):
            for fellow_id in run.fellows:
                report = self.registry.link_probe_of(fellow_id)
                if report is not None:
                    self._probe_ended(prober.report(fellow_id, report, now=now))
        for result in prober.expire(now):
            self._probe_ended(result)
        if not prober.due(now):
            return
        # A pool where a job waits for placement keeps its fellows for it.
        waiting = {job.spec.run_pool for job in self.jobs.pending()}
        idle = [c for c in self._idle(self.registry.list(), now=now) if c.pool not in waiting]
        plans, resume = linkprobes.next_pairs(
            idle,
            self.registry.links,
            prober.tried,
            slots=prober.slots(),
            busy_hosts=prober.busy_hosts(),
            now=now,
            wall_now=time.time(),
            held_back=prober.held_back,
            start=prober.scan_from,
        )
        if not plans:
            prober.looked(now, resume=resume)  # look again an interval later
            return
        for plan in plans:
            run = prober.begin(plan, now=now, resume=resume)
            self._spawn(self._send_probes(run), f"probe-{run.probe_id}")

    async def _send_probes(self, run: ProbeRun) -> None:
        """PROBE to the binding end first (it binds, then waits for the other), then to the
        connecting end; an end that refuses or stays silent ends the probe."""
        assert self.hub is not None  # ticks run once NATS is up
        hub = self.hub
        plan = run.plan
        (connector_keys, binder_keys) = boundary_keys(2)[0]
        ends = (
            (
                plan.binder,
                ProbeArgs(probe_id=run.probe_id, peer=plan.connector, bind=True, curve=binder_keys),
            ),
            (
                plan.connector,
                ProbeArgs(
                    probe_id=run.probe_id,
                    peer=plan.binder,
                    bind=False,
                    address=plan.address,
                    curve=connector_keys,
                ),
            ),
        )
        for fellow_id, args in ends:
            if self.prober.running.get(run.probe_id) is not run:
                return  # it ended meanwhile (the binder reported a failure): no more PROBEs
            record = await hub.send(fellow_id, args)
            if not record.ok:
                why = f"{fellow_id}: {record.code}: {record.message}"
                self._probe_ended(self.prober.refused(run.probe_id, why, now=time.monotonic()))
                return
        log.info(
            "link probe %s: %s binds %s, %s connects",
            run.probe_id,
            plan.binder,
            plan.address,
            plan.connector,
        )

    def _probe_ended(self, result: ProbeResult | None) -> None:
        if result is None:
            return
        plan = result.plan
        if result.link is None:
            log.info(
                "link probe %s of %s and %s: no link recorded (%s)",
                result.probe_id,
                plan.connector,
                plan.binder,
                loggable(result.reason),
            )
            return
        # The connecting end is the upstream one, as on a pipeline boundary.
        self.registry.record_link(plan.connector, plan.binder, result.link, fresh=True)
        log.info(
            "link probe %s: %s -> %s %.1f Mbit/s, %.2f ms round trip",
            result.probe_id,
            plan.connector,
            plan.binder,
            result.link.mbit_s,
            result.link.rtt_ms,
        )
        self.wake()

    # --- progress --------------------------------------------------------------------------

    async def _on_progress(self, msg: Msg) -> None:
        # The sender's budget first, from the subject it may publish on: decoding is the
        # work a flood would make the leader do.
        try:
            sender = topics.PROGRESS.parse(self.prefix, msg.subject)["fellow"]
        except ProtocolError as exc:
            self.bus.drop(msg, str(exc))
            return
        size = len(msg.data)
        if size > PROGRESS_MAX_BYTES:
            reason = f"a progress record of {size} bytes (at most {PROGRESS_MAX_BYTES})"
            self.bus.drop(msg, reason, kind="progress_size")
            return
        if not self.progress_limit.allow(sender) or not self.progress_bytes.allow(sender, size):
            self.bus.drop(msg, "over the fellow's progress rate", kind="progress_rate")
            return
        progress = self.bus.decode_job_message(msg, topics.PROGRESS)
        if progress is None:
            return
        admission = self.jobs.admit_progress(progress)
        if admission.verdict is Verdict.REFUSE:
            self.bus.drop(msg, admission.reason)
            return
        if admission.verdict is Verdict.STALE:
            return
        if self.on_progress is not None:
            self.on_progress(progress)
        job = self.jobs.record_progress(progress)
        if job is not None:
            self._learn(job, progress)
        if job is not None and job.terminal:
            self.job_ended(job)
            self.wake()
        elif job is not None and job.state is JobState.PENDING:  # resumed
            self.wake()

    def _learn(self, job: JobRecord, progress: Progress) -> None:
        """What a step record tells of its fellow, for the next ``balanced`` placement: its
        speed (the step's work, its time less its waits; kept smoothed in the registry; the
        first steps compile and are left out; a CPU stage's on the footing of its fellow's
        cores alone, :func:`speed_alone`) and its downstream link's measured rate and
        round trip (kept on its record, per downstream fellow)."""
        if job.placement is None:
            return
        placed = job.placement.stage_of(progress.fellow_id)
        if placed is None or placed.stage != progress.stage:
            return
        stages = job.placement.pipeline(placed.replica)  # its own replica's boundaries
        if progress.down_link is not None:
            measured = balance.boundary_link(stages, progress.down_link)
            if measured is not None:
                (upstream, downstream), link = measured
                self.registry.record_link(upstream, downstream, link)
        busy = balance.stage_busy_s(progress)
        if busy is None:
            return
        speed = balance.measured_speed(
            job.spec.model,
            batch_size=job.spec.batch_size,
            layers=placed.layer_end - placed.layer_start,
            last=placed.stage == len(stages) - 1,
            busy_s=busy,
        )
        record = self.registry.get(progress.fellow_id)
        if speed is not None and record is not None:
            if not placed.gpu_slots:
                fellow = decide.candidate(record)
                cores = stage_cores(job.placement.stages, placed, host_cores(fellow))
                speed = speed_alone(fellow, speed, cores)
            self.registry.record_speed(progress.fellow_id, speed)

    # --- what the domain services ask of the loop (leader.services) -------------------------

    def require_loaded(self) -> None:
        """Job reads and writes wait for the durable state: before it, answers would lie."""
        if not self.loaded.is_set():
            raise NotReadyError("the leader is still loading its state; try again shortly")

    def signal_hub(self) -> SignalHub:
        """The hub that signals fellows, once NATS is up and the state is loaded."""
        if self.hub is None or not self.loaded.is_set():
            raise NotReadyError("the leader is not connected to NATS yet; try again shortly")
        return self.hub

    @contextlib.contextmanager
    def reserve(self, fellow_ids: Iterable[str]) -> Iterator[None]:
        """Fellows an operator action (release, update) is signalling: not placed meanwhile."""
        ids = set(fellow_ids) - self._reserved
        self._reserved |= ids
        try:
            yield
        finally:
            self._reserved -= ids

    def job_ended(self, job: JobRecord) -> None:
        """A job ended: its final manifest; stop the stages still running (after a failure or
        a cancel)."""
        if self.exports is not None:
            task = self._spawn(self.exports.job_ended(job), f"export-{job.job_id}")
            self._final_exports[job.job_id] = task
            task.add_done_callback(self._final_export_written)
        still = decide.stages_to_stop(job)
        if still:
            self._stop_all(job.job_id, job.attempt, still, job.reason)

    def _final_export_written(self, task: asyncio.Task[Any]) -> None:
        job_id = task.get_name().removeprefix("export-")
        if self._final_exports.get(job_id) is task:
            del self._final_exports[job_id]

    async def final_exports(self) -> None:
        """Return once the final manifests of the jobs that ended are written: a job turns
        terminal before its manifest is, and a job starting from its export must pin the final
        one."""
        pending = set(self._final_exports.values())
        if pending:
            await asyncio.wait(pending)

    # --- purges ----------------------------------------------------------------------------

    def _deliver_purges(self) -> None:
        """Try pending purges: at once for a fellow that is back, else every few seconds.

        A fellow that is back may be a new agent (registered) or the released one, which
        waits (PURGE_PENDING) instead of exiting; either answers on its signal subject. A
        fellow nobody serves answers "no responders" at once, so trying is cheap.
        """
        pending = self.purges.list()
        if not pending:
            return  # the usual case: no fellow to look at
        due = decide.purges_due(
            pending,
            online=self.registry.online_ids(),
            busy=self.jobs.busy_fellows(),
            in_flight=self._purging,
            now=time.time(),
        )
        for fid in due:
            self._spawn(self.deliver_purge(fid, deadline_s=2.0), f"purge-{fid}")

    def _stop_released(self) -> None:
        """Tell a released agent that is still heard to exit: one that was offline when an
        operator released it (the STOP went nowhere), or was released before this leader
        restarted. Its heartbeats are dropped either way; this ends its process too."""
        now = time.monotonic()
        heard = self.registry.take_released_heard()
        if not heard and not self._released_told:
            return  # the usual case
        self._released_told = {
            fid: at
            for fid, at in self._released_told.items()
            if now - at < decide.RELEASED_STOP_EVERY_S
        }
        pending = {p.fellow_id for p in self.purges.list()}
        told = self._released_told
        for fid in decide.released_to_stop(heard, purge_pending=pending, told=told, now=now):
            told[fid] = now
            self._spawn(self._tell_released(fid), f"released-{fid}")

    async def _tell_released(self, fellow_id: str) -> None:
        assert self.hub is not None
        record = await self.hub.send(
            fellow_id, StopArgs(release=True, reason="released by an operator"), deadline_s=2.0
        )
        log.info("told released fellow %s to exit: %s", fellow_id, record.message or record.code)

    async def deliver_purge(self, fellow_id: str, *, deadline_s: float = 8.0) -> bool:
        """One PURGE delivery per fellow at a time: a second caller (an operator's retry
        while the job loop is trying) waits for the one in flight and gets its result."""
        inflight = self._purging.get(fellow_id)
        if inflight is not None:
            return await asyncio.shield(inflight)
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._purging[fellow_id] = future
        try:
            delivered = await self._send_purge(fellow_id, deadline_s)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a caller that did not wait must not warn
            raise
        else:
            future.set_result(delivered)
            return delivered
        finally:
            del self._purging[fellow_id]

    async def _send_purge(self, fellow_id: str, deadline_s: float) -> bool:
        ack = await self.signal_hub().send(
            fellow_id, PurgeArgs(reason="released with --purge-install"), deadline_s=deadline_s
        )
        if ack.ok:
            self.purges.delivered(fellow_id)
            if self.registry.get(fellow_id) is not None:
                self.registry.release(fellow_id)
            log.info("purge delivered to %s: %s", fellow_id, ack.message)
            return True
        self.purges.failed(fellow_id, f"{ack.code}: {ack.message}")
        return False


async def _save(store: StateStore, bucket: KeyValue, key: str, value: Any) -> bool:
    """Write (or, for None, delete) one record; False, logged, when it could not be.

    ``key`` is a job or fellow id.
    """
    try:
        if value is None:
            await store.delete(bucket, key)
        else:
            await store.put(bucket, key, value)
    except Exception as exc:
        # Retried every tick: a full store must not write a line per record per tick.
        held = _SAVE_LOGS.allow(key)
        if held is not None:
            more = f" ({held} more tries since the last line)" if held else ""
            log.warning("record %s not saved yet (kept for the next try)%s: %s", key, more, exc)
        return False
    return True


_SAVE_LOGS = Throttle()


def _sync_segments(job: JobRecord, plan: StagePlan) -> list[int]:
    """The segments whose rings a replicated stage may be in this attempt (its NATS user's
    ring subjects)."""
    placement = job.placement
    placed = None if placement is None else placement.stage_of(plan.fellow_id)
    if placement is None or placed is None or not plan.replicated:
        return []
    return placement.sync_segments(placed)
