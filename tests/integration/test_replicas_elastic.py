"""Elastic membership of the replicas' rings (agent/runtime: replicas.py, stage.py,
control.py): real StageRunners in threads of one process, real ZeroMQ rings with CURVE, real
TensorFlow on tiny models, ring commands through each stage's control channel as the agent
writes them.

A lost replica's survivors form a ring of their own and stop waiting for it; a joining
replica takes the donor's state and trains in step with the others; a far-off donor and a
ring command that comes after its step are fatal, with messages that say why.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from silentswarm.agent.errors import RingChangeError
from silentswarm.agent.runtime.control import ControlChannel
from silentswarm.agent.runtime.launch import stage_command, stage_env, write_plans
from silentswarm.plan import RingChange, StagePlan, TrainConfig, Transport, replicated_chain_plans
from silentswarm.procs import free_port
from silentswarm.types.stage import (
    DoneEvent,
    JoiningEvent,
    RingCommand,
    StageEvent,
    StepEvent,
    encode_command,
)
from tests.integration.test_replicas_runtime import TINY, TINY4, port_range
from tests.integration.test_replicas_runtime import config as runtime_config
from tests.unit.test_replica_sync import ring_changes

pytestmark = pytest.mark.integration

# Rounds that wait for a lost member take this long; others must never reach it, also with
# the suite's other worker (pytest-xdist) on the same two cores: 3 s was too short there.
SYNC_TIMEOUT_S = 10.0


def config(steps: int, **kw: Any) -> TrainConfig:
    """test_replicas_runtime's, without XLA: these tests are about membership, and compiling
    is most of a tiny stage's first step (test_replicas_runtime trains with XLA)."""
    return runtime_config(steps, **{"jit_compile": False, **kw})


class Abort(Exception):
    """Stops a runner from its own event callback: a replica that is lost."""


class Run:
    """A StageRunner in a thread with a control channel of its own (no stdin: the test feeds
    it the lines an agent would write), and the events it emitted."""

    def __init__(self, plan: StagePlan, on_event: Callable[[Run, StageEvent], None] | None = None):
        from silentswarm.agent.runtime.stage import StageRunner

        self.plan = plan
        self.events: list[StageEvent] = []
        self.on_event = on_event
        self.control = ControlChannel(on_eof=lambda: None)
        self.runner = StageRunner(plan, self._emit, self.control)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.snapshots: dict[int, list[np.ndarray]] = {}  # weights after each step

    def command(self, change: RingChange) -> None:
        self.control.feed_line(encode_command(RingCommand(change=change)))

    def _emit(self, event: StageEvent) -> None:
        self.events.append(event)
        if isinstance(event, StepEvent):
            self.snapshots[event.step] = self.runner.model.weights()
        if self.on_event is not None:
            self.on_event(self, event)

    def _run(self) -> None:
        try:
            self.runner.run()
        except BaseException as exc:
            self.error = exc
        finally:
            self.runner.close()

    @property
    def steps(self) -> list[StepEvent]:
        return [e for e in self.events if isinstance(e, StepEvent)]

    def step(self, i: int) -> StepEvent:
        return next(e for e in self.steps if e.step == i)

    @property
    def done(self) -> DoneEvent:
        return next(e for e in self.events if isinstance(e, DoneEvent))

    def weights(self) -> list[np.ndarray]:
        return self.runner.model.weights()


def run_all(runs: list[Run], timeout: float = 120.0, *, later: list[Run] | None = None) -> None:
    """Start ``runs`` (those in ``later`` are started by a callback) and wait for them all."""
    for run in runs:
        if run not in (later or []):
            run.thread.start()
    for run in runs:
        run.thread.join(timeout)
        assert not run.thread.is_alive(), f"replica {run.plan.replica} hung"


def stage_plans(k: int, train: TrainConfig, **kw: Any) -> list[StagePlan]:
    """One stage, ``k`` replicas on loopback, CURVE on every ring link: ``plans[r]``."""
    plans = replicated_chain_plans(
        job_id="elastic",
        model=TINY,
        train=train,
        addresses=[[None] for _ in range(k)],
        sync_addresses=[[f"tcp://127.0.0.1:{free_port()}"] for _ in range(k)],
        transport=Transport.P2P,
        intra_op_threads=1,
        secure=True,
        **kw,
    )
    return [row[0] for row in plans]


def abort_after(step: int) -> Callable[[Run, StageEvent], None]:
    def watch(run: Run, event: StageEvent) -> None:
        if isinstance(event, StepEvent) and event.step == step:
            raise Abort(f"replica {run.plan.replica} is lost after step {step}")

    return watch


def command_at(step: int, changes: dict[int, RingChange]) -> Callable[[Run, StageEvent], None]:
    """Each replica is sent its ring change once it has trained ``step``."""

    def deliver(run: Run, event: StageEvent) -> None:
        if isinstance(event, StepEvent) and event.step == step:
            run.command(changes[run.plan.replica])

    return deliver


def same_weights(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("k", [2, 3])
def test_the_survivors_of_a_lost_replica_form_a_ring_of_their_own(k):
    """The last replica is lost after step 1; the others get their ring command while they
    train step 2 (whose round waits ``sync_timeout_s`` for the lost one) and switch before
    step 3: from there no round waits, and the survivors hold the same state."""
    steps, at_step = 6, 3
    train = config(steps, sync_timeout_s=SYNC_TIMEOUT_S)
    plans = stage_plans(k, train)
    survivors = list(range(k - 1))
    changes = ring_changes(plans, survivors, epoch=1, at_step=at_step)

    deliver = command_at(1, changes)  # mid-run, ahead of at_step
    runs = [Run(plans[r], deliver) for r in survivors] + [Run(plans[k - 1], abort_after(1))]
    run_all(runs)
    lost = runs[-1]
    assert isinstance(lost.error, Abort)
    for run in runs[:-1]:
        assert run.error is None, run.error
        assert [s.step for s in run.steps] == list(range(steps))
        assert run.done.steps == steps
        assert [s.sync_epoch for s in run.steps] == [0] * at_step + [1] * (steps - at_step)
        switched = run.step(at_step)
        assert switched.sync_members == survivors and switched.state_digests
        assert all(s.state_digests is None for s in run.steps if s.step != at_step)
        assert run.step(2).sync_missed > 0, "the round before the switch waited for the lost one"
        for s in run.steps[at_step + 1 :]:  # after the switch: nobody to wait for
            assert s.step_time_s < SYNC_TIMEOUT_S / 2, (s.step, s.step_time_s)
            assert s.sync_missed == switched.sync_missed
            assert s.sync_s < SYNC_TIMEOUT_S / 2
    digests = {str(run.step(at_step).state_digests) for run in runs[:-1]}
    assert len(digests) == 1, "every survivor took the same state"
    for run in runs[1:-1]:
        assert same_weights(run.weights(), runs[0].weights())
        for step in range(at_step, steps):
            assert same_weights(run.snapshots[step], runs[0].snapshots[step]), step


@pytest.mark.parametrize("sync", ["allreduce", "diloco"])
def test_a_replica_joins_a_running_job_and_trains_in_step_from_the_donors_state(sync):
    """A 2-slot job: replica 1 is lost after step 1 and replica 0 goes on alone (epoch 1,
    from step 2); a joining replica 1 (a new fellow, a new sync address) says ``joining``,
    both get epoch 2 (members [0, 1], replica 1 joining, donor 0) at step 4, which replica 0
    has not reached: the joiner starts at step 4 with the donor's state (the same digest),
    and the two hold the same weights after every allreduce step from there (under DiLoCo,
    syncing every 2 steps, the switches come right after an outer sync, and the weights
    agree after each later one)."""
    steps, alone_at, join_at = 7, 2, 4
    train = config(steps, sync_timeout_s=SYNC_TIMEOUT_S, sync=sync, sync_every=2)
    plans = stage_plans(2, train)
    joiner_plan = msgspec.structs.replace(
        plans[1],
        joining=True,
        fellow_id="r1-joiner",
        sync_ports=[f"tcp://127.0.0.1:{free_port()}"],
        sync_rings=[],
    ).checked()
    alone = ring_changes(plans, [0], epoch=1, at_step=alone_at)
    joined = ring_changes([plans[0], joiner_plan], [0, 1], epoch=2, at_step=join_at, joining=[1])
    commanded = threading.Event()

    def first(run: Run, event: StageEvent) -> None:
        if isinstance(event, StepEvent) and event.step == 1:
            run.command(alone[0])
        if isinstance(event, StepEvent) and event.step == alone_at:
            runs[2].thread.start()  # the leader places the replacement once 1 is gone
        if isinstance(event, StepEvent) and event.step == join_at - 1:
            # The leader picks a step ahead of the running replica's progress.
            assert commanded.wait(60), "the joiner never said it was ready"

    def joiner_events(run: Run, event: StageEvent) -> None:
        if isinstance(event, JoiningEvent):  # the leader's answer to "joining"
            runs[0].command(joined[0])
            run.command(joined[1])
            commanded.set()

    runs = [Run(plans[0], first), Run(plans[1], abort_after(1)), Run(joiner_plan, joiner_events)]
    run_all(runs, later=[runs[2]])
    donor, lost, joiner = runs
    assert isinstance(lost.error, Abort)
    assert donor.error is None and joiner.error is None, (donor.error, joiner.error)
    kinds = [type(e) for e in joiner.events]
    assert kinds.index(JoiningEvent) < kinds.index(StepEvent)
    assert [s.step for s in donor.steps] == list(range(steps))
    assert [s.step for s in joiner.steps] == list(range(join_at, steps)), "from at_step on"
    assert donor.step(alone_at).sync_members == [0] and donor.step(alone_at).sync_epoch == 1
    first_joined = joiner.steps[0]
    assert first_joined.sync_members == donor.step(join_at).sync_members == [0, 1]
    assert first_joined.state_digests == donor.step(join_at).state_digests
    assert first_joined.state_digests
    assert [s.sync_epoch for s in joiner.steps] == [2] * (steps - join_at)
    synced = range(join_at, steps) if sync == "allreduce" else [5, 6]  # DiLoCo: 5, the last
    for step in range(join_at, steps):
        assert joiner.step(step).lr == donor.step(step).lr, "the schedule follows the step"
        same = same_weights(joiner.snapshots[step], donor.snapshots[step])
        assert same == (step in synced), step
        assert joiner.step(step).sync_missed == 0
    for run in (donor, joiner):
        assert run.done.steps == steps and np.isfinite(run.done.loss)
    # Stage 0 of both read the same global batches from step 4 on: the same position now.
    assert joiner.runner.data.state() == donor.runner.data.state()
    ours, theirs = joiner.runner.model, donor.runner.model
    if sync == "allreduce":
        optimizer = [v.numpy() for v in ours.optimizer.variables]
        other = [v.numpy() for v in theirs.optimizer.variables]
        assert same_weights(optimizer, other), "the optimizer's state, its step count included"
    else:
        for kind in ("anchor", "outer_momentum"):
            mine = [v.numpy() for v in getattr(ours, kind)]
            assert same_weights(mine, [v.numpy() for v in getattr(theirs, kind)]), kind
        assert int(ours.optimizer.iterations.numpy()) == steps, "the donor's count, then 3 more"


def test_a_donor_far_from_a_members_own_state_is_refused():
    """Replica 1's weights are tripled behind the ring's back; at the ring change before
    step 2 it compares donor 0's weights with its own and refuses, naming the donor and the
    distance. The donor trains on without it."""
    steps = 3
    # The donor's rounds after the refusal wait for replica 1 this long (and its end, for
    # replica 1's DONE, peer_timeout_s more); a round before it that timed out on a loaded
    # machine changes nothing asserted here (the tampered weights are 3x the donor's).
    train = config(steps, sync_timeout_s=4.0)
    plans = stage_plans(2, train, peer_timeout_s=4.0)
    changes = ring_changes(plans, [0, 1], epoch=1, at_step=2)

    def tamper(run: Run, event: StageEvent) -> None:
        if isinstance(event, StepEvent) and event.step == 1:
            for v in run.runner.model.variables:
                v.assign(v * 3.0)

    runs = [Run(plans[0]), Run(plans[1], tamper)]
    for run in runs:
        run.command(changes[run.plan.replica])
    run_all(runs)
    error = runs[1].error
    assert isinstance(error, RingChangeError), error
    message = str(error)
    assert "refused the state of donor replica 0" in message and "relative L2" in message
    distance = float(message.split("weights are ")[1].split(" away")[0])
    assert distance > 0.05
    assert runs[0].error is None and runs[0].done.steps == steps


def test_a_ring_command_for_a_step_already_trained_is_fatal():
    """The command for a switch before step 1 comes after step 2: the replica cannot take
    it any more, and says which steps."""
    train = config(5, sync_timeout_s=SYNC_TIMEOUT_S)
    plans = stage_plans(2, train)
    changes = ring_changes(plans, [0, 1], epoch=1, at_step=1)

    runs = [Run(plan, command_at(2, changes)) for plan in plans]
    run_all(runs)
    for run in runs:
        assert isinstance(run.error, RingChangeError), run.error
        message = str(run.error)
        assert "was due before step 1" in message and "steps 1 to 2" in message, message
        assert "next: step 3" in message
        assert [s.step for s in run.steps] == [0, 1, 2]


def joining_pipeline(lost: list[StagePlan], port: Callable[[], str]) -> list[StagePlan]:
    """Plans for a pipeline that joins in place of the ``lost`` one: new fellows, a new
    boundary address and new sync addresses, no ring yet (its ring command brings it)."""
    boundary = port()
    out = []
    for plan in lost:
        prev, nxt = plan.prev, plan.next
        out.append(
            msgspec.structs.replace(
                plan,
                joining=True,
                fellow_id=f"r1-joiner-{plan.stage}",
                data_address=boundary if plan.stage > 0 else None,
                prev=None
                if prev is None
                else msgspec.structs.replace(prev, fellow_id="r1-joiner-0"),
                next=None
                if nxt is None
                else msgspec.structs.replace(nxt, fellow_id="r1-joiner-1", data_address=boundary),
                sync_ports=[port()],
                sync_rings=[],
            ).checked()
        )
    return out


class JoinScript:
    """What the leader does for a pipeline that joins (``runs``: replica 0's stages, the
    lost ones, the joiners'): replica 0's stages get their ring of one after step 1; the
    joiners start once replica 0 is alone; once every joining stage said ``joining``, each
    stage's pair gets its ring, and replica 0 waits for that before ``join_at``."""

    def __init__(
        self,
        alone: list[dict[int, RingChange]],
        joined: list[dict[int, RingChange]],
        *,
        alone_at: int,
        join_at: int,
    ) -> None:
        self.alone, self.joined = alone, joined
        self.alone_at, self.join_at = alone_at, join_at
        self.runs: list[Run] = []
        self.ready = threading.Semaphore(0)
        self.commanded = threading.Event()

    def running(self, run: Run, event: StageEvent) -> None:
        if not isinstance(event, StepEvent):
            return
        n = len(self.alone)
        if event.step == 1:
            run.command(self.alone[run.plan.stage][0])
        if event.step == self.alone_at and run.plan.stage == 0:
            for joiner in self.runs[2 * n :]:
                joiner.thread.start()
        if event.step == self.join_at - 1:
            assert self.commanded.wait(60), "the joiners never said they were ready"

    def joining(self, run: Run, event: StageEvent) -> None:
        if not isinstance(event, JoiningEvent):
            return
        n = len(self.joined)
        self.ready.release()
        if run.plan.stage == n - 1:  # the leader answers once the whole pipeline is ready
            assert all(self.ready.acquire(timeout=60) for _ in range(n))
            for s in range(n):
                self.runs[s].command(self.joined[s][0])
                self.runs[2 * n + s].command(self.joined[s][1])
            self.commanded.set()


def test_a_joining_pipeline_of_two_stages_takes_each_stages_state():
    """2 replicas x 2 stages: replica 1's pipeline is lost after step 1, replica 0's two
    stages go on alone from step 2; a joining pipeline (new fellows, new boundary and sync
    addresses) opens its own boundary, says ``joining`` on both stages, and each stage
    joins its stage's ring at step 4 with replica 0's state of that stage; both pipelines
    then hold the same weights, stage by stage, after every step."""
    steps, alone_at, join_at = 6, 2, 4
    train = config(steps, sync_timeout_s=SYNC_TIMEOUT_S)

    def port() -> str:
        return f"tcp://127.0.0.1:{free_port()}"

    grid = replicated_chain_plans(
        job_id="elastic2",
        model=TINY,
        train=train,
        addresses=[[None, port()] for _ in range(2)],
        sync_addresses=[[port(), port()] for _ in range(2)],
        transport=Transport.P2P,
        intra_op_threads=1,
        secure=True,
    )
    joiners = joining_pipeline(grid[1], port)
    alone = [ring_changes([grid[0][s]], [0], epoch=1, at_step=alone_at) for s in range(2)]
    joined = [
        ring_changes([grid[0][s], joiners[s]], [0, 1], epoch=2, at_step=join_at, joining=[1])
        for s in range(2)
    ]
    leader = JoinScript(alone, joined, alone_at=alone_at, join_at=join_at)
    runs = [Run(plan, leader.running) for plan in grid[0]]
    runs += [Run(plan, abort_after(1)) for plan in grid[1]]
    runs += [Run(plan, leader.joining) for plan in joiners]
    leader.runs = runs
    run_all(runs, later=runs[4:])
    for run in runs[2:4]:
        assert isinstance(run.error, Abort)
    for run in [*runs[:2], *runs[4:]]:
        assert run.error is None, (run.plan.replica, run.plan.stage, run.error)
    for s in range(2):
        donor, joiner = runs[s], runs[4 + s]
        assert [e.step for e in joiner.steps] == list(range(join_at, steps))
        assert joiner.step(join_at).state_digests == donor.step(join_at).state_digests
        assert joiner.step(join_at).state_digests
        for step in range(join_at, steps):
            assert same_weights(joiner.snapshots[step], donor.snapshots[step]), (s, step)
        assert joiner.done.steps == donor.done.steps == steps
    assert np.isfinite(runs[5].done.loss) and np.isfinite(runs[1].done.loss)


def test_swarm_stage_processes_take_a_ring_command_on_stdin(tmp_path):
    """``swarm-stage --control-stdin``, as the agent runs it: a ring command line on stdin
    (the same two members, a fresh ring: new keys, donor 1) switches both processes before
    step 2; their step lines carry the epoch, and on step 2 the members and one digest."""
    plans = stage_plans(2, config(4, sync_timeout_s=SYNC_TIMEOUT_S))
    changes = ring_changes(plans, [0, 1], epoch=1, at_step=2, donor=1)
    procs = []
    for plan, path in zip(plans, write_plans(plans, tmp_path), strict=True):
        out = tmp_path / f"r{plan.replica}.out"
        with open(out, "wb") as stdout, open(out.with_suffix(".err"), "wb") as stderr:
            proc = subprocess.Popen(
                stage_command(path, control_stdin=True),
                stdin=subprocess.PIPE,
                stdout=stdout,
                stderr=stderr,
                env=stage_env(),
            )
        assert proc.stdin is not None
        proc.stdin.write(encode_command(RingCommand(change=changes[plan.replica])))
        proc.stdin.flush()
        procs.append((proc, out))
    try:
        for proc, out in procs:
            assert proc.wait(120) == 0, out.with_suffix(".err").read_text()[-2000:]
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
            proc.stdin.close()
    events = [
        [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
        for _, out in procs
    ]
    digests = set()
    for lines in events:
        steps = [e for e in lines if e["event"] == "step"]
        assert [s.get("sync_epoch", 0) for s in steps] == [0, 0, 1, 1]
        assert steps[2]["sync_members"] == [0, 1]
        digests.add(json.dumps(steps[2]["state_digests"], sort_keys=True))
        assert lines[-1]["event"] == "done"
    assert len(digests) == 1


def test_a_change_due_at_the_runs_end_switches_nothing_but_hands_over_the_checkpoints(
    tmp_path,
):
    """The run ends before a ring change could take effect: the leader's change is due at
    the last step, so nobody switches rings, but replica 1 takes over the lost lead's final
    checkpoint (and replica 0 gives it up)."""
    steps = 4
    plans = [
        msgspec.structs.replace(plan, checkpoint_dir=str(tmp_path / f"r{plan.replica}"))
        for plan in stage_plans(2, config(steps, sync_timeout_s=SYNC_TIMEOUT_S))
    ]
    plans[0] = msgspec.structs.replace(plans[0], checkpoint_at_end=True)
    changes = ring_changes(plans, [0, 1], epoch=1, at_step=steps)
    changes = {
        r: msgspec.structs.replace(change, checkpoint_at_end=r == 1, checkpoint_every=0)
        for r, change in changes.items()
    }

    runs = [Run(plan, command_at(0, changes)) for plan in plans]
    run_all(runs)
    for run in runs:
        assert run.error is None, run.error
        assert {e.sync_epoch for e in run.steps} == {0}  # no switch
        assert not any(e.state_digests for e in run.steps)
    ends = {
        run.plan.replica: [e for e in run.events if getattr(e, "id", None) == "end"] for run in runs
    }
    assert ends[0] == [] and len(ends[1]) == 1 and ends[1][0].ok
    assert list((tmp_path / "r1").rglob("*.npz")) and not list((tmp_path / "r0").rglob("*.npz"))


def survivor_changes(
    grid: list[list[StagePlan]], *, members: list[int], epoch: int, at_step: int
) -> dict[tuple[int, int], RingChange]:
    """What a leader sends each stage of the replicas ``members`` (``grid[r][s]``): one ring
    per segment of their splits (silentswarm.rings), fresh secrets, donor the first."""
    from silentswarm.rings import Seat, build_rings, fellow_ports

    seats = {r: [Seat.of(p, r, p.sync_ports) for p in grid[r]] for r in members}
    rings = build_rings(seats, curve=True, relay=True)
    assert all(fellow_ports(port) for row in grid for p in row for port in p.sync_ports)
    return {
        key: RingChange(epoch=epoch, at_step=at_step, members=members, donor=members[0], rings=ring)
        for key, ring in rings.items()
    }


def test_survivors_that_split_the_layers_differently_switch_every_ring_they_are_in():
    """Three replicas of two stages over four layers, replica 0 split 1-3, the others 2-2
    (segments [0, 1), [1, 2), [2, 4): replica 0's stage 1 and replica 1's stage 0 are in two
    rings each). Replica 2 is lost after step 1; the survivors switch every ring at step 2,
    the donor's state going around each ring with its segment's share (weights, AdamW's
    moments, the step count; stage 0's data position with its first ring), and from there
    hold the same bits of every layer."""
    steps, at_step = 5, 2  # the command comes with step 1: no round waits for the lost one
    train = config(steps, sync_timeout_s=SYNC_TIMEOUT_S)
    grid = replicated_chain_plans(
        job_id="elastic-splits",
        model=TINY4,
        train=train,
        addresses=[[None, f"tcp://127.0.0.1:{free_port()}"] for _ in range(3)],
        sync_addresses=[[port_range(2), port_range(2)] for _ in range(3)],
        splits=[[(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 2), (2, 4)]],
        transport=Transport.P2P,
        intra_op_threads=1,
        secure=True,
    )
    changes = survivor_changes(grid, members=[0, 1], epoch=1, at_step=at_step)
    assert [len(changes[(0, s)].rings) for s in (0, 1)] == [1, 2]
    deliver = {(r, s): command_at(1, {r: changes[(r, s)]}) for r in (0, 1) for s in (0, 1)}
    runs = [Run(grid[r][s], deliver[(r, s)]) for r in (0, 1) for s in (0, 1)]
    runs += [Run(plan, abort_after(1)) for plan in grid[2]]
    run_all(runs, timeout=240)
    for run in runs[4:]:
        assert isinstance(run.error, Abort)
    survivors = {(run.plan.replica, run.plan.stage): run for run in runs[:4]}
    for run in survivors.values():
        assert run.error is None, (run.plan.replica, run.plan.stage, run.error)
        assert [s.step for s in run.steps] == list(range(steps))
        assert [s.sync_epoch for s in run.steps] == [0] * at_step + [1] * (steps - at_step)
    digests = {key: run.step(at_step).state_digests for key, run in survivors.items()}
    assert set(digests[(0, 1)]) == {1, 2} and set(digests[(1, 0)]) == {0, 1}
    assert digests[(0, 0)][0] == digests[(1, 0)][0]
    assert digests[(0, 1)][1] == digests[(1, 0)][1]
    assert digests[(0, 1)][2] == digests[(1, 1)][2]
    for step in range(at_step, steps):
        ours = [w for s in (0, 1) for w in survivors[(0, s)].snapshots[step]]
        theirs = [w for s in (0, 1) for w in survivors[(1, s)].snapshots[step]]
        assert same_weights(ours, theirs), step
