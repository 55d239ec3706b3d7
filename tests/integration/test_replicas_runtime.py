"""Replicas of a stage kept in sync by the stage runtime (agent/runtime/replicas.py): real
StageRunners in threads of one process, real ZeroMQ rings, real TensorFlow on tiny models."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from silentswarm.plan import (
    ModelConfig,
    StagePlan,
    TrainConfig,
    Transport,
    replicated_chain_plans,
    single_process_plan,
)
from silentswarm.procs import free_port, free_ports
from silentswarm.types.stage import DoneEvent, StageEvent, StepEvent

pytestmark = pytest.mark.integration

TINY = ModelConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16)


def config(steps: int, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "steps": steps,
        "batch_size": 4,
        "micro_batches": 2,
        "max_data_bytes": 60_000,
        "val_batches": 1,
        "learning_rate": 3e-3,
        "warmup_steps": 1,
        "sync_timeout_s": 60.0,
        "link_probe_every": 0,
    }
    base.update(kw)
    return TrainConfig(**base)


def replicas(k: int, stages: int, train: TrainConfig) -> list[list[StagePlan]]:
    """``plans[r][s]`` on loopback, CURVE on every ring link."""

    def port() -> str:
        return f"tcp://127.0.0.1:{free_port()}"

    return replicated_chain_plans(
        job_id="reps",
        model=TINY,
        train=train,
        addresses=[[None] + [port() for _ in range(stages - 1)] for _ in range(k)],
        sync_addresses=[[port() for _ in range(stages)] for _ in range(k)],
        transport=Transport.P2P,
        intra_op_threads=1,
        secure=True,
    )


class Run:
    """A StageRunner in a thread, with the events it emitted."""

    def __init__(self, plan: StagePlan, on_event: Callable[[Run, StageEvent], None] | None = None):
        from silentswarm.agent.runtime.stage import StageRunner

        self.plan = plan
        self.events: list[StageEvent] = []
        self.on_event = on_event
        self.runner = StageRunner(plan, self._emit)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _emit(self, event: StageEvent) -> None:
        self.events.append(event)
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

    @property
    def done(self) -> DoneEvent:
        return next(e for e in self.events if isinstance(e, DoneEvent))

    def weights(self) -> list[np.ndarray]:
        return self.runner.model.weights()


def run_all(runs: list[Run], timeout: float = 300.0) -> list[Run]:
    for run in runs:
        run.thread.start()
    for run in runs:
        run.thread.join(timeout)
        assert not run.thread.is_alive(), f"stage {run.plan.stage} replica {run.plan.replica} hung"
    for run in runs:
        if run.error is not None:
            raise run.error
    return runs


def reference(train: TrainConfig, k: int) -> Run:
    """One process with ``k`` times the batch and ``k`` times the micro-batches (each as many
    rows as a replica's)."""
    m = train.micro_batches
    assert isinstance(m, int)
    wide = msgspec.structs.replace(train, batch_size=k * train.batch_size, micro_batches=k * m)
    (run,) = run_all([Run(single_process_plan(job_id="ref", model=TINY, train=wide))])
    return run


def assert_matches_reference(ref: Run, last_stage: list[Run], firsts: list[list[Run]]) -> None:
    """The replicas' mean loss is the reference's, step by step; every replica holds the
    reference's weights (within 1e-4), the replicas exactly the same ones."""
    want = [s.loss for s in ref.steps]
    got = [float(np.mean([r.steps[i].loss for r in last_stage])) for i in range(len(want))]
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: one process {a} vs replicas {b}"
    ref_weights = ref.weights()
    for row in firsts:  # one list of runs per replica, in stage order
        ours = [w for run in row for w in run.weights()]
        # the single process's variables in stage order: embedding, blocks, head
        assert len(ours) == len(ref_weights)
        for a, b in zip(ref_weights, ours, strict=True):
            np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
    for i in range(len(firsts[0])):
        for other in firsts[1:]:
            for a, b in zip(firsts[0][i].weights(), other[i].weights(), strict=True):
                np.testing.assert_array_equal(a, b)


def test_two_replicas_of_one_stage_train_as_one_process_with_twice_the_batch():
    train = config(4)
    plans = replicas(2, 1, train)
    runs = run_all([Run(row[0]) for row in plans])
    ref = reference(train, 2)
    assert_matches_reference(ref, runs, [[r] for r in runs])
    for run in runs:
        done = run.done
        assert done.sync_bytes_sent > 0 and done.sync_bytes_received > 0
        assert done.sync_clipped == 0 and done.sync_missed == 0
        assert all(s.sync_s > 0 for s in run.steps)
    # Two links between the pair, each way the same bytes.
    assert runs[0].done.sync_bytes_sent == runs[1].done.sync_bytes_received


def test_two_replicas_of_a_two_stage_pipeline_train_as_one_with_twice_the_batch():
    train = config(3)
    plans = replicas(2, 2, train)
    runs = [[Run(plan) for plan in row] for row in plans]
    run_all([run for row in runs for run in row])
    ref = reference(train, 2)
    assert_matches_reference(ref, [row[-1] for row in runs], runs)
    for row in runs:
        for run in row:
            assert run.done.sync_bytes_sent > 0


TINY4 = ModelConfig(n_layers=4, d_model=32, n_heads=2, seq_len=16)
SPLITS = [[(0, 1), (1, 4)], [(0, 2), (2, 4)]]  # segments [0, 1), [1, 2), [2, 4)


def port_range(n: int) -> str:
    """``n`` consecutive free loopback ports as a sync address range."""
    first = free_ports(n)
    return f"tcp://127.0.0.1:{first}-{first + n - 1}"


def split_replicas(train: TrainConfig) -> list[list[StagePlan]]:
    """Two replicas of two stages that split 4 layers differently: 1-3 and 2-2."""
    return replicated_chain_plans(
        job_id="splits",
        model=TINY4,
        train=train,
        addresses=[[None, f"tcp://127.0.0.1:{free_port()}"] for _ in range(2)],
        sync_addresses=[[port_range(2), port_range(2)] for _ in range(2)],
        splits=SPLITS,
        transport=Transport.P2P,
        intra_op_threads=1,
        secure=True,
    )


def every_weight(row: list[Run]) -> list[np.ndarray]:
    """A replica's weights in the model's order (embedding, blocks, head), whatever its split."""
    return [w for run in row for w in run.weights()]


def test_replicas_that_split_the_layers_differently_train_as_one_with_twice_the_batch():
    # Without XLA: the rings are the point here (the tests above train with it).
    train = config(3, jit_compile=False)
    plans = split_replicas(train)
    rings = [[len(plan.sync_rings) for plan in row] for row in plans]
    assert rings == [[1, 2], [2, 1]], "a stage is in one ring per segment it holds"
    runs = [[Run(plan) for plan in row] for row in plans]
    run_all([run for row in runs for run in row])
    wide = msgspec.structs.replace(train, batch_size=8, micro_batches=4)
    (ref,) = run_all([Run(single_process_plan(job_id="ref", model=TINY4, train=wide))])
    want = [s.loss for s in ref.steps]
    got = [float(np.mean([row[-1].steps[i].loss for row in runs])) for i in range(len(want))]
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: one process {a} vs replicas {b}"
    for ours in (every_weight(row) for row in runs):
        assert len(ours) == len(ref.weights())
        for a, b in zip(ref.weights(), ours, strict=True):
            np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
    # Averaged per layer, so both replicas hold the very same bits of every layer.
    for a, b in zip(every_weight(runs[0]), every_weight(runs[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    for row in runs:
        for run in row:
            assert run.done.sync_bytes_sent > 0 and run.done.sync_missed == 0


def test_diloco_replicas_that_split_differently_agree_on_every_layer_after_a_sync():
    train = config(
        4,
        sync="diloco",
        sync_every=2,
        outer_learning_rate=0.7,
        outer_momentum=0.9,
        jit_compile=False,
    )
    plans = split_replicas(train)
    runs = [[Run(plan) for plan in row] for row in plans]
    run_all([run for row in runs for run in row])
    ours, theirs = every_weight(runs[0]), every_weight(runs[1])
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)  # synced after the last step
    for row in runs:
        for run in row:
            assert [s.sync_s > 0 for s in run.steps] == [False, True, False, True]


def test_diloco_replicas_hold_the_same_weights_right_after_each_sync():
    train = config(5, sync="diloco", sync_every=2, outer_learning_rate=0.7, outer_momentum=0.9)
    snapshots: dict[tuple[int, int], list[np.ndarray]] = {}

    def snap(run: Run, event: StageEvent) -> None:
        if isinstance(event, StepEvent):  # emitted after the step (and its sync)
            snapshots[(run.plan.replica, event.step)] = run.weights()

    plans = replicas(2, 1, train)
    runs = run_all([Run(row[0], snap) for row in plans])
    for step in range(5):
        pairs = list(zip(snapshots[(0, step)], snapshots[(1, step)], strict=True))
        same = all(np.array_equal(a, b) for a, b in pairs)
        # synced after steps 1 and 3 (every 2) and after the last step, 4
        assert same == (step in (1, 3, 4)), f"step {step}"
    for run in runs:
        sizes = [s.sync_bytes_sent for s in run.steps]  # the handshake's bytes from the start
        assert sizes[0] < sizes[1] == sizes[2] < sizes[3] < sizes[4]
        assert [s.sync_s > 0 for s in run.steps] == [False, True, False, True, True]
        anchor = [a.numpy() for a in run.runner.model.anchor]
        for a, w in zip(anchor, run.weights(), strict=True):
            np.testing.assert_array_equal(a, w)


@pytest.mark.parametrize(("outer_lr", "outer_mu"), [(1.0, 0.0), (0.7, 0.9)])
def test_a_diloco_sync_applies_the_outer_step_to_the_replicas_mean_pseudo_gradient(
    monkeypatch, outer_lr, outer_mu
):
    """Each sync, on every replica: the anchor moves by DiLoCo's outer step (SGD with
    Nesterov momentum) on the mean of the replicas' pseudo-gradients (anchor minus weights,
    as each replica held them before the sync), and the weights become that anchor. Plain
    averaging (lr 1, no momentum) is the mean of the replicas' weights."""
    from silentswarm.agent.runtime.replicas import nesterov_step
    from silentswarm.agent.runtime.stage import StageRunner

    outer_step = StageRunner._outer_step
    seen: dict[tuple[int, int], tuple[list[np.ndarray], ...]] = {}

    def recorded(self: StageRunner, step: int) -> None:
        model = self.model
        anchor = [a.numpy() for a in model.anchor]
        momentum = [b.numpy() for b in model.outer_momentum]
        weights = model.weights()
        outer_step(self, step)
        seen[(self.plan.replica, step)] = (anchor, momentum, weights, model.weights())

    monkeypatch.setattr(StageRunner, "_outer_step", recorded)
    train = config(
        4,
        sync="diloco",
        sync_every=2,
        outer_learning_rate=outer_lr,
        outer_momentum=outer_mu,
        sync_clip_ratio=1e6,
    )
    run_all([Run(row[0]) for row in replicas(2, 1, train)])
    assert sorted(seen) == [(0, 1), (0, 3), (1, 1), (1, 3)]
    carried: list[np.ndarray] = []  # the momentum the first sync leaves
    for step in (1, 3):
        (anchor, momentum, w0, after0), (anchor1, momentum1, w1, after1) = (
            seen[(0, step)],
            seen[(1, step)],
        )
        for i, a in enumerate(anchor):
            # The replicas left the last sync with the same anchor and momentum.
            np.testing.assert_array_equal(a, anchor1[i])
            np.testing.assert_array_equal(momentum[i], momentum1[i])
            mean = ((a - w0[i]) + (a - w1[i])) / np.float32(2)
            expected, buffer = nesterov_step(a, momentum[i], mean, lr=outer_lr, mu=outer_mu)
            if step == 1:
                carried.append(buffer)
            else:  # the second sync starts from the momentum the first one left
                np.testing.assert_allclose(momentum[i], carried[i], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(after0[i], expected, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(after0[i], after1[i])
            if (outer_lr, outer_mu) == (1.0, 0.0):
                np.testing.assert_allclose(after0[i], (w0[i] + w1[i]) / 2, rtol=1e-5, atol=1e-6)
        # The replicas trained apart in between: the check is of an average, not of a copy.
        assert any(not np.array_equal(a, b) for a, b in zip(w0, w1, strict=True))


def test_diloco_outer_state_is_checkpointed_and_restored(tmp_path):
    from silentswarm.agent.runtime.checkpoint import load_checkpoint, restore_into, save_stage

    train = config(2, sync="diloco", sync_every=2)
    plans = replicas(2, 1, train)
    runs = run_all([Run(row[0]) for row in plans])
    model = runs[0].runner.model
    directory = save_stage(tmp_path, model, runs[0].runner.data, steps_done=2)
    checkpoint = load_checkpoint(directory / "stage-0.json")
    names = [n for n in checkpoint.arrays if n.startswith(("anchor/", "outer_momentum/"))]
    assert len(names) == 2 * len(model.variables)
    assert any(np.any(checkpoint.arrays[n] != 0) for n in names if n.startswith("outer_"))
    resumed_plan = msgspec.structs.replace(
        replicas(2, 1, train)[0][0], resume_from=str(directory / "stage-0.json")
    )
    from silentswarm.agent.runtime.stage import StageRunner

    resumed = StageRunner(resumed_plan, lambda event: None)
    for a, b in zip(model.outer_momentum, resumed.model.outer_momentum, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(model.anchor, resumed.model.anchor, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert resumed.start_step == 2
    # glue and a warm start build the stage without replicas: they take the weights only
    plain = StageRunner(single_process_plan(job_id="reps", model=TINY, train=train), print)
    restore_into(plain.model, None, checkpoint)
    for a, b in zip(model.weights(), plain.model.weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_hostile_replicas_scaled_up_gradient_is_clipped_and_counted():
    train = config(3, sync_clip_ratio=4.0)
    plans = replicas(2, 1, train)
    runs = [Run(row[0]) for row in plans]
    model = runs[1].runner.model
    honest = model.accumulated_packed
    model.accumulated_packed = lambda scale: honest(scale) * 1000.0  # type: ignore[method-assign]
    run_all(runs)
    for run in runs:
        assert run.done.sync_clipped == 3  # one per step, on both ends alike
        assert [s.sync_clipped for s in run.steps] == [1, 2, 3]
    for a, b in zip(runs[0].weights(), runs[1].weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(s.loss) for run in runs for s in run.steps)


def test_a_stalled_replica_is_left_out_of_the_round_and_counted():
    """Replica 1 holds back its step-2 contribution until replica 0 has ended step 2, which it
    can only do by leaving replica 1 out after ``sync_timeout_s``."""
    train = config(4, sync_timeout_s=6.0)
    over = threading.Event()

    def watch(run: Run, event: StageEvent) -> None:
        if isinstance(event, StepEvent) and run.plan.replica == 0 and event.step == 2:
            over.set()

    plans = replicas(2, 1, train)
    runs = [Run(row[0], watch) for row in plans]
    model = runs[1].runner.model
    honest = model.accumulated_packed
    calls = []

    def stalled(scale: float) -> np.ndarray:
        calls.append(1)
        if len(calls) == 3:  # step 2
            assert over.wait(60), "replica 0 never left replica 1 out"
        return honest(scale)

    model.accumulated_packed = stalled  # type: ignore[method-assign]
    run_all(runs)
    missed = [[s.sync_missed for s in run.steps] for run in runs]
    assert missed[0] == [0, 0, 1, 1] and missed[1] == [0, 0, 0, 0]
    assert runs[0].done.sync_missed == 1


def test_replica_processes_sync_over_the_relay(procs, nats_server, tmp_path):
    """``swarm-stage`` processes, transport tunnel: the ring through NATS, tagged with its
    tokens; both replicas end with the same weights' loss and count the ring's bytes."""
    from silentswarm.agent.runtime.launch import done, links, run_plans, steps

    train = config(3, sync_compression="fixed_int8")
    plans = replicated_chain_plans(
        job_id="relayreps",
        model=TINY,
        train=train,
        addresses=[[None], [None]],
        sync_addresses=[[None], [None]],
        transport=Transport.TUNNEL,
        nats_url=nats_server.url,
        intra_op_threads=1,
        secure=True,
    )
    results = run_plans([row[0] for row in plans], tmp_path)
    assert len(results) == 2
    for events in results:
        assert links(events)["up"] is None and len(steps(events)) == 3
        summary = done(events)
        assert summary["sync_bytes_sent"] > 0 and summary.get("sync_missed", 0) == 0
    # allreduce keeps the replicas' weights equal: the same validation loss
    assert done(results[0])["val_loss"] == done(results[1])["val_loss"]


@pytest.mark.parametrize("secure", [True, False], ids=["curve", "no-curve"])
def test_a_stray_socket_on_a_boundarys_port_takes_its_frames_only_without_curve(secure):
    """A socket left reconnecting to a port that was freed and handed out again (another
    test's, a killed stage's upstream) reaches the stage that binds it next. With CURVE, as a
    leader's plans and ``secure`` test plans have, it never completes the handshake; without,
    ZeroMQ deals what stage 1 sends upstream out between it and the placed neighbour: stage 0
    misses a link probe or a gradient and fails (a replicas test once did in CI, "expected
    frame ('train', 3, 0, bwd), got ('train', 3, 1, bwd)")."""
    import zmq

    from silentswarm.agent.errors import FrameError, PeerTimeoutError
    from silentswarm.plan import chain_plans

    address = f"tcp://127.0.0.1:{free_port()}"
    plans = chain_plans(
        job_id="stray",
        model=TINY,
        train=config(3),
        addresses=[None, address],
        transport=Transport.P2P,
        intra_op_threads=1,
        # Without CURVE a missing frame is waited for this long; with it nothing is missing,
        # and a stage's first compile on a loaded machine may take longer than that.
        peer_timeout_s=60.0 if secure else 10.0,
        secure=secure,
    )
    assert (plans[1].curve_up is not None) is secure
    stray = zmq.Context.instance().socket(zmq.DEALER)
    stray.setsockopt(zmq.LINGER, 0)
    stray.connect(address)
    try:
        runs = [Run(plan) for plan in plans]
        for run in runs:
            run.thread.start()
        for run in runs:
            run.thread.join(60)
            assert not run.thread.is_alive(), f"stage {run.plan.stage} hung"
        if secure:
            assert [r.error for r in runs] == [None, None]
            assert [s.step for s in runs[1].steps] == [0, 1, 2]
            assert not stray.poll(0), "the stray socket received a frame"
        else:
            assert isinstance(runs[0].error, FrameError | PeerTimeoutError), runs[0].error
            assert "boundary 0 (stage-0 -> stage-1)" in str(runs[0].error)
            assert stray.poll(0), "the stray socket took nothing"
    finally:
        stray.close()
