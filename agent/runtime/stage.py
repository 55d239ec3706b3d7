"""The stage loop: run one stage of the pipeline for every step of a plan.

Micro-batches follow the 1F1B schedule; activations go downstream and gradients upstream
through the boundary links, encoded by the wire codec of the plan's compression spec.
Between steps the stage answers checkpoint requests from its control channel, if it has one.

Under the ``overlap`` schedule the steps between two points where the whole chain must be
quiet (a calibration, a validation, the end) run as one stretch of 1F1B
(:func:`~silentswarm.agent.runtime.schedule.overlapped`), each update applied a step late
(:class:`~silentswarm.agent.runtime.schedule.DelayedUpdates`); a step is over on a stage
when its last backward is, and what follows a step (its event, checkpoints) happens there.

A replicated stage (a job's ``replicas``) also keeps its weights in sync with the replicas'
stages that hold the same layers, over one ring per segment of layers it holds
(:mod:`silentswarm.rings`, :mod:`~silentswarm.agent.runtime.replicas`,
:mod:`~silentswarm.agent.runtime.ring_state`): the gradients averaged every step before the
update (``allreduce``), or DiLoCo's outer step every ``sync_every`` steps (``diloco``); its
stage 0 keeps its own rows of the global batch.

Elastic membership: before each step a replicated stage takes the ring commands its control
channel has queued (:meth:`StageRunner.take_ring_changes`). A change is applied right before
its ``at_step`` (:meth:`StageRunner.switch_ring`): the new rings' links, then the donor's
state (weights, optimizer, DiLoCo's outer state, stage 0's data position) once around each,
checked against this member's own weights unless it joins, adopted, and its digests reported
on the next step event. A change whose step has passed is a :class:`RingChangeError`. A
joining stage (``plan.joining``) opens its pipeline boundaries only, says ``joining``, waits
for its change and trains from its ``at_step``.
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import tensorflow as tf

from silentswarm import subjects
from silentswarm.agent.errors import (
    CheckpointError,
    DonorRefusedError,
    FrameError,
    PeerTimeoutError,
    RingChangeError,
)
from silentswarm.agent.pipe.base import Parts
from silentswarm.agent.pipe.link import CurveKeys, Link, RelayLink, TransportKind, accept_upstream
from silentswarm.agent.pipe.link import connect_downstream as open_downstream
from silentswarm.agent.pipe.probe import ChainBack
from silentswarm.agent.pipe.relay import DROP_LOG_EVERY_S
from silentswarm.agent.pipe.wire import (
    Direction,
    Frame,
    WireCodec,
    decode_frame,
    encode_frame,
    frame_header,
    frame_nbytes,
    token_dtype,
    token_ids,
)
from silentswarm.agent.runtime import calibrate, tuning
from silentswarm.agent.runtime.checkpoint import (
    checkpoint_tokenizer,
    load_checkpoint,
    pending_update,
    restore_into,
    save_stage,
)
from silentswarm.agent.runtime.control import ControlChannel
from silentswarm.agent.runtime.data import (
    TOKENIZER,
    DataState,
    TextDataset,
    job_dataset,
    job_tokenizer,
    job_val_batches,
)
from silentswarm.agent.runtime.deferral import DeferralCheck
from silentswarm.agent.runtime.presets import init_from_preset, preset_dir
from silentswarm.agent.runtime.replicas import (
    JOIN_TIMEOUT_S,
    ROW,
    ReplicaRings,
    StateSpec,
    adam_moment_bound,
    donor_refusal,
    nesterov_step,
    pack,
    pack_state,
    position_refusal,
    relay_opener,
    ring_rows,
    state_digest,
    state_rows,
    unpack,
    unpack_state,
)
from silentswarm.agent.runtime.ring_state import RingState, ring_states, variable_bounds
from silentswarm.agent.runtime.schedule import (
    DelayedUpdates,
    Op,
    PendingUpdate,
    one_f_one_b,
    overlapped,
)
from silentswarm.agent.runtime.stage_model import StageModel
from silentswarm.agent.runtime.warmstart import ExportStart
from silentswarm.compression import parse_wire_codec
from silentswarm.cpus import ThrottleClock, usable_cores
from silentswarm.plan import CurveKeys as PlanCurveKeys
from silentswarm.plan import RingChange, StagePlan, may_defer
from silentswarm.throttle import Throttle
from silentswarm.types.links import LinkStats, Tuning
from silentswarm.types.stage import (
    CheckpointEvent,
    CheckpointRequest,
    DoneEvent,
    JoiningEvent,
    LinksEvent,
    PlacementEvent,
    StageEvent,
    StepEvent,
)

log = logging.getLogger(__name__)
MESSAGE_CHARS = 4096  # a failed checkpoint's message, cut to fit the event's bound
BUSY_SAMPLES_KEPT = 20  # per micro-batch count: the median of the latest steps' work
Emit = Callable[[StageEvent], None]
# A forward's tape (None under recompute: its backward runs it again), input and output.
_Held = tuple[tf.GradientTape | None, tf.Tensor, tf.Tensor]
Batch = tuple[np.ndarray, np.ndarray]  # a step's (inputs, targets), as stage 0 reads them
# The training fields only stage 0 needs (it reads the data and tells the stages after it how
# many validation batches come): those stages need neither the files nor the same values.
DATA_FIELDS = frozenset({"data", "max_data_bytes", "val_fraction", "val_batches"})
# How long a stage waits at least for its upstream's first HELLO: stage 0 prepares its data
# first (downloads, BPE training, encoding a large corpus: minutes on a first start). An
# upstream that died meanwhile is the leader's to notice (its fellow's failure or silence ends
# the attempt, and this stage with it); ``peer_timeout_s`` bounds every wait after the HELLO.
FIRST_HELLO_S = 900.0
# How long a stage waits at least for its downstream to confirm the end of the run: the
# stages after it validate the last step first, and that validation is often the run's
# first (its graph compiles: seconds, more on a loaded machine). A downstream that died
# meanwhile is, again, the leader's to notice.
LAST_DONE_S = 300.0


@dataclass
class Boundary:
    """One end of a boundary: a link plus the codecs and the ordering checks."""

    link: Link
    index: int
    name: str
    job: str
    attempt: int
    send_codec: WireCodec
    timeout_s: float
    # The model's vocabulary: a received target id outside it is a FrameError (None: unchecked).
    vocab_size: int | None = field(default=None, kw_only=True)
    dropped: int = 0
    wait_s: float = 0.0  # time spent blocked waiting for the peer
    # What the link probes moved (agent/pipe/probe.py): on the wire, but no training traffic,
    # so the bytes a boundary reports leave them out.
    probe_sent: int = 0
    probe_received: int = 0
    # A peer can send stray frames as fast as the link goes: a line of them every 5 s.
    _drop_logs: Throttle = field(default_factory=lambda: Throttle(DROP_LOG_EVERY_S), repr=False)

    @property
    def bytes_sent(self) -> int:
        return self.link.bytes_sent - self.probe_sent

    @property
    def bytes_received(self) -> int:
        return self.link.bytes_received - self.probe_received

    def send(
        self,
        array: np.ndarray,
        *,
        step: int,
        micro: int,
        direction: Direction,
        phase: str = "train",
        targets: np.ndarray | None = None,
        eval_batches: int = 0,
    ) -> None:
        """Send ``array`` (and, forward, the micro-batch's target ids) as one frame."""
        _, parts = encode_frame(
            array,
            self.send_codec,
            job=self.job,
            attempt=self.attempt,
            step=step,
            micro=micro,
            direction=direction,
            phase=phase,
            targets=targets,
            eval_batches=eval_batches,
        )
        started = time.perf_counter()
        self.link.send(parts, timeout_s=self.timeout_s)  # blocks only on a full link
        self.wait_s += time.perf_counter() - started

    def recv(
        self,
        *,
        step: int,
        micro: int,
        direction: Direction,
        phase: str = "train",
        shape: tuple[int | None, ...] | None = None,
    ) -> Frame:
        """The next frame of this job and attempt, which must be the one named, of ``shape``
        (None: any size on that axis) when given; a forward frame must carry its targets
        (the stage after reads no data), and every value finite (NaN or inf from a peer
        would reach the weights unseen). Frames of another job or attempt are dropped, but
        the peer timeout runs from the call, not from each of them."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            started = time.perf_counter()
            parts = self.link.recv(max(0.0, deadline - time.monotonic()))
            self.wait_s += time.perf_counter() - started
            # The header first: a payload is decoded (sized by the peer) only for a frame
            # this stage waits for.
            try:
                header = frame_header(parts)
            except FrameError as exc:
                raise FrameError(f"{self.name}: {exc}") from None
            if header.job != self.job or header.attempt != self.attempt:
                self.dropped += 1
                if self._drop_logs.allow("other job") is not None:
                    log.warning(
                        "%s: dropped a frame of %.80r attempt %d",
                        self.name,
                        header.job,
                        header.attempt,
                    )
                continue
            got = (header.phase, header.step, header.micro, header.direction)
            want = (phase, step, micro, direction)
            if got != want:
                raise FrameError(f"{self.name}: expected frame {want}, got {got!r}")
            if shape is not None and not _fits(header.shape, shape):
                raise FrameError(
                    f"{self.name}: frame {want} is shaped {list(header.shape)}, "
                    f"expected {['any' if d is None else d for d in shape]}"
                )
            try:
                frame = decode_frame(parts, vocab_size=self.vocab_size, header=header)
            except FrameError as exc:
                raise FrameError(f"{self.name}: {exc}") from None
            if direction is Direction.FWD and frame.targets is None:
                raise FrameError(f"{self.name}: forward frame {want} carries no targets")
            if not np.isfinite(frame.array).all():
                raise FrameError(
                    f"{self.name}: frame {want} holds values that are not finite (NaN or inf): "
                    "the peer's model diverged, or the peer is not honest"
                )
            return frame


def _fits(got: tuple[int, ...], want: tuple[int | None, ...]) -> bool:
    return len(got) == len(want) and all(
        w is None or g == w for g, w in zip(got, want, strict=True)
    )


@dataclass
class StepResult:
    step: int
    loss: float | None
    lr: float
    seconds: float


class StageRunner:
    def __init__(self, plan: StagePlan, emit: Emit, control: ControlChannel | None = None) -> None:
        self.plan = plan
        self.emit = emit
        self.control = control
        self._checkpoints: dict[int, str] = {}  # steps done -> step directory written
        self.model = StageModel(plan)
        self.up: Boundary | None = None
        self.down: Boundary | None = None
        # Only stage 0 reads data (a 1-stage job is stage 0 too): the targets travel down the
        # chain with the activations, so the stages after it need no files.
        # A resumed attempt starts where the checkpoint left off: weights, optimizer state
        # (its step count too), data position and tokenizer (stage 0).
        checkpoint = None if plan.resume_from is None else load_checkpoint(plan.resume_from)
        # A job that starts from an export (init_from "job:"/"export:"): its weights, and on
        # stage 0 its tokenizer; a resumed attempt has its own checkpoint instead.
        start = None
        adapter = plan.train.adapter is not None
        if plan.init_dir is not None and (checkpoint is None or adapter):
            # An adapter's checkpoint holds the adapter only: the export is under it.
            start = ExportStart(Path(plan.init_dir))
        self.data: TextDataset | None = None
        if plan.is_first:
            if checkpoint is not None:
                tokenizer = checkpoint_tokenizer(plan, checkpoint.meta)
            elif start is not None:
                tokenizer = start.tokenizer()
            else:
                tokenizer = job_tokenizer(plan.train, plan.model.vocab_size)
            self.data = job_dataset(plan.train, plan.model.seq_len, tokenizer=tokenizer)
        self.start_step = 0
        # The overlap schedule's delayed update (the gradient set aside); where the data stood
        # before each step read its batch.
        self.delayed = DelayedUpdates()
        self._data_before: dict[int, DataState] = {}
        self._step_clock = 0.0  # when the step before ended (the overlap schedule)
        if start is not None:  # before a checkpoint: an adapter's restores on top of it
            count = start.load_into(self.model)
            log.info(
                "%d variables from job %s's export (step %d)",
                count,
                start.manifest.job_id,
                start.manifest.step,
            )
        elif checkpoint is None and plan.train.init_from is not None:
            directory = preset_dir(plan.train.init_from)
            layers = [piece.layer for piece in self.model.pieces]
            count = init_from_preset(directory, plan.model, layers)
            log.info("%d variables from the preset %s", count, directory)
        self.model.reset_anchor()  # DiLoCo: the start; a checkpoint restores its own
        # The rings of this stage's replicas (agent/runtime/replicas.py), opened with the links.
        self.replicas: ReplicaRings | None = None
        if checkpoint is not None:
            restore_into(self.model, self.data, checkpoint)
            self.start_step = int(checkpoint.meta["steps_done"])
            self.delayed.pending = pending_update(checkpoint)
            log.info("resumed from %s at step %d", plan.resume_from, self.start_step)
        spec, self.grad_codec = plan.codecs()  # the codec table's; validated in the plan
        self.act_codec = spec.codec
        # What "auto" may change, and what is in force: the schedule every stage shares
        # (``tuning``) and this stage's downstream boundary as last measured and agreed.
        self.auto_fwd = spec.auto
        self.auto_bwd = spec.auto and plan.grad_compression is None
        self.wire_dims = spec.dims(plan.model.d_model)
        m, window = plan.train.initial_micro_batches, plan.train.initial_in_flight
        if plan.n_stages == 1 and plan.train.auto_micro_batches:
            m = window = 1  # nothing to pipeline: one call per step
        self.tuning = Tuning(
            step=0,
            micro_batches=m,
            in_flight=window,
            auto=plan.train.auto_micro_batches,
            overlap=plan.train.overlap,
            deferred=plan.train.initial_deferred if plan.n_stages > 1 else 0,
        )
        # The deferred passes the last stage runs now: the agreed count, or under "auto" the
        # one its check of the model's proposal runs (agent.runtime.deferral).
        self._deferred_now = self.tuning.deferred
        self._deferral: DeferralCheck | None = None
        if plan.is_last and plan.n_stages > 1 and may_defer(plan.model, plan.train):
            codecs = ((self.act_codec.name, self.grad_codec.name),) * (plan.n_stages - 1)
            self._deferral = DeferralCheck(self._deferred_now, (m, window, codecs))
        self.down_link: LinkStats | None = None
        # Seconds of work per step (its time less its waits on peers), by micro-batch count:
        # what the tuner fits each stage's cost to.
        self._busy: dict[int, list[float]] = {}
        self._skip_sample = True  # the next step compiles (the first, or a new micro-batch size)
        # The seconds a CPU quota held this process back (0 without one): a step's share is
        # reported apart from its work, so the leader learns the work's speed.
        self._throttle = ThrottleClock(plan.intra_op_threads or usable_cores())
        self._throttled_mark = self._throttle.read()
        self._next_calibration: int | None = self.start_step if plan.n_stages > 1 else None
        # Elastic membership: the ring epoch in force (0: the plan's), the changes taken that
        # wait for their step, and what the next step event reports of the latest switch
        # (the members and the state's digest). A change may hand this stage the duty to
        # checkpoint for the leader: the plan's settings until then.
        self.sync_epoch = 0
        self._ring_changes: list[RingChange] = []
        self._switched: tuple[list[int], dict[int, str]] | None = None
        self.checkpoint_every = plan.checkpoint_every
        self.checkpoint_at_end = plan.checkpoint_at_end

    @property
    def m(self) -> int:
        """Micro-batches per step, as agreed by the chain's latest calibration."""
        return self.tuning.micro_batches

    @property
    def in_flight(self) -> int:
        """The forward window in force (:func:`silentswarm.plan.stage_in_flight`)."""
        return self.tuning.in_flight

    @property
    def deferred(self) -> int:
        """The weight-gradient passes this stage defers this step: only the last one does."""
        return min(self._deferred_now, self.m - 1) if self.plan.is_last else 0

    # --- links ----------------------------------------------------------------------------

    def fingerprint(self) -> bytes:
        """What both ends of a boundary must share: job, attempt, the model config (its
        vocabulary size and seq_len among it), the tokenizer and the training schedule.

        Not the corpus: only stage 0 reads it, and the targets travel with the activations,
        so the stages after it cannot disagree with it about them. What they must agree on
        is what the ids mean (the tokenizer and the vocabulary), the shapes, and the schedule
        every stage steps through (steps, batch, micro-batches, learning rate, ...), less the
        fields only stage 0 uses (:data:`DATA_FIELDS`).
        """
        plan = self.plan
        train = msgspec.to_builtins(plan.train)
        schedule = {k: v for k, v in train.items() if k not in DATA_FIELDS}
        digest = hashlib.sha256()
        digest.update(f"{plan.job_id}/{plan.attempt}".encode())
        digest.update(msgspec.json.encode(plan.model))
        digest.update(f"tokenizer {TOKENIZER}".encode())
        digest.update(msgspec.json.encode(schedule))
        return digest.digest()

    def _relay(
        self, boundary: int, name: str, send: str, recv: str, token: str | None
    ) -> Callable[[], RelayLink] | None:
        """How to open the relay end of a boundary; None without NATS in the plan. Each
        replica's boundaries have subjects of their own (:func:`subjects.relay_link`)."""
        plan = self.plan
        link = subjects.relay_link(boundary, plan.replica)
        return relay_opener(
            plan, link, name, send, recv, token, max_frame_bytes=boundary_message_bytes(plan)
        )

    def open_links(self) -> None:
        plan = self.plan
        transport = TransportKind(plan.transport.value)
        fingerprint = self.fingerprint()
        if not plan.is_first:
            b = plan.stage - 1
            name = f"boundary {b} ({plan.prev.fellow_id} -> {plan.fellow_id})"
            link = accept_upstream(
                name=name,
                transport=transport,
                bind=plan.data_address,
                relay=self._relay(b, name, "bwd", "fwd", plan.relay_up_token),
                timeout_s=max(plan.peer_timeout_s, FIRST_HELLO_S),
                p2p_grace_s=plan.p2p_probe_timeout_s,
                fingerprint=fingerprint,
                curve=_curve(plan.curve_up),
                max_message_bytes=boundary_message_bytes(plan),
            )
            self.up = Boundary(
                link,
                b,
                name,
                plan.job_id,
                plan.attempt,
                self.grad_codec,
                plan.peer_timeout_s,
                vocab_size=plan.model.vocab_size,
            )
        if not plan.is_last:
            b = plan.stage
            name = f"boundary {b} ({plan.fellow_id} -> {plan.next.fellow_id})"
            link = open_downstream(
                name=name,
                transport=transport,
                address=plan.next.data_address,
                relay=self._relay(b, name, "fwd", "bwd", plan.relay_down_token),
                timeout_s=plan.peer_timeout_s,
                fingerprint=fingerprint,
                curve=_curve(plan.curve_down),
                max_message_bytes=boundary_message_bytes(plan),
            )
            self.down = Boundary(
                link,
                b,
                name,
                plan.job_id,
                plan.attempt,
                self.act_codec,
                plan.peer_timeout_s,
                vocab_size=plan.model.vocab_size,
            )
        if plan.replicated:  # after the pipeline's links: those never wait on another replica
            self.replicas = ReplicaRings(
                plan, fingerprint, max_message_bytes=ring_message_bytes(self.model.n_params)
            )
            if not plan.joining:  # a joining stage's ring comes with its ring command
                self.replicas.open()
        self.emit_links()

    def _boundaries(self) -> list[Boundary]:
        return [b for b in (self.up, self.down) if b is not None]

    def close(self) -> None:
        for boundary in self._boundaries():
            boundary.link.close()
        if self.replicas is not None:
            self.replicas.close()

    # --- training -------------------------------------------------------------------------

    def _rows(self, array: np.ndarray, i: int) -> np.ndarray:
        """Micro-batch ``i``'s rows of a step's batch rows."""
        mb = self.plan.train.batch_size // self.m
        return array[i * mb : (i + 1) * mb]

    def _micro(self, array: np.ndarray, i: int) -> tf.Tensor:
        """Micro-batch ``i`` of a step's batch rows."""
        return tf.constant(self._rows(array, i))

    def _read_batch(self, step: int) -> Batch | None:
        """Stage 0: step ``step``'s batch, and where the data stood before it (for a
        checkpoint taken after the previous step). The stages after it read no data: None."""
        if self.data is None:
            return None
        self._data_before[step] = self.data.state()
        for old in [k for k in self._data_before if k < step - 2]:
            del self._data_before[old]
        # Replicas: every one reads the global batch and keeps its own rows, so their data
        # positions agree (one checkpoint resumes them all).
        rows, r = self.plan.train.batch_size, self.plan.replica
        inputs, targets = self.data.next_batch(rows * self.plan.n_replicas)
        if self.plan.replicated:
            inputs, targets = inputs[r * rows : (r + 1) * rows], targets[r * rows : (r + 1) * rows]
        return inputs, targets

    def _ids(self, targets: np.ndarray) -> np.ndarray:
        """Target ids as a forward frame carries them (the vocabulary's smallest dtype)."""
        return token_ids(targets, self.plan.model.vocab_size)

    def _recv_forward(
        self, step: int, i: int, phase: str = "train"
    ) -> tuple[tf.Tensor, np.ndarray, Frame]:
        """A forward frame from upstream: its activations, its target ids, the frame."""
        frame = self.up.recv(
            step=step,
            micro=i,
            direction=Direction.FWD,
            phase=phase,
            shape=(None, self.plan.model.seq_len, self.wire_dims),
        )
        assert frame.targets is not None  # Boundary.recv refuses a forward frame without
        return tf.constant(frame.array), frame.targets, frame

    def train_step(self, step: int) -> StepResult:
        plan, model = self.plan, self.model
        m = self.m
        started = time.perf_counter()
        batch = self._read_batch(step)
        lr = model.set_lr(step)
        allreduce = self.replicas is not None and plan.train.sync == "allreduce"
        if plan.n_stages == 1 and m == 1 and not allreduce:  # one compiled call
            inputs, targets = batch
            model.local_step(self._micro(inputs, 0), self._micro(targets, 0))
        else:
            if plan.is_last:
                self._last_micros(step, batch)
            else:
                self._tape_step(step, batch)
            model.apply_mean(self._average_gradients(step, m) if allreduce else m)
        loss = model.take_loss() / m if plan.is_last else None
        if self.replicas is not None and plan.train.sync == "diloco":
            every = plan.train.sync_every
            if (step + 1) % every == 0 or step + 1 == plan.train.steps:
                self._outer_step(step)
        return StepResult(step=step, loss=loss, lr=lr, seconds=time.perf_counter() - started)

    def _average_gradients(self, step: int, m: int) -> int:
        """Allreduce: the accumulated gradients become the replicas' average of their
        mean gradients (each replica's sum over its ``m`` micro-batches, over ``m``, so the
        replicas' micro-batch counts need not agree); the count to apply the mean over (1).

        With equal rows per replica the mean of the replicas' means is the mean over all
        their rows: one pipeline with ``n_replicas`` times the batch, step by step."""
        assert self.replicas is not None
        model = self.model
        packed = model.accumulated_packed(1.0 / m)
        shapes = [tuple(v.shape) for v in model.variables]
        rows = ring_rows(shapes, variable_bounds(model, self.replicas.rings))
        results = self.replicas.round(step, [packed[a:b] for a, b in rows])
        # A new matrix (each average is one): the contributions may still be on their way
        # out of ZeroMQ, which sends without copying them.
        averages = [r.average for r in results]
        model.set_accumulated_packed(
            averages[0] if len(averages) == 1 else np.concatenate(averages)
        )
        return 1

    def _outer_step(self, step: int) -> None:
        """DiLoCo's sync after ``step``: the replicas average their pseudo-gradients (anchor
        minus weights), an outer SGD with Nesterov momentum moves the anchor, and the weights
        become the new anchor (the same on every replica that was in the round)."""
        assert self.replicas is not None
        model, train = self.model, self.plan.train
        anchors = [a.numpy() for a in model.anchor]
        deltas = [a - w for a, w in zip(anchors, model.weights(), strict=True)]
        bounds = variable_bounds(model, self.replicas.rings)
        results = self.replicas.round(step, [pack(deltas[a:b]) for a, b in bounds])
        averaged = [
            delta
            for (a, b), result in zip(bounds, results, strict=True)
            for delta in unpack(result.average, [d.shape for d in deltas[a:b]])
        ]
        for i, delta in enumerate(averaged):
            anchor, momentum = nesterov_step(
                anchors[i],
                model.outer_momentum[i].numpy(),
                delta,
                lr=train.outer_learning_rate,
                mu=train.outer_momentum,
            )
            model.anchor[i].assign(anchor)
            model.outer_momentum[i].assign(momentum)
            model.variables[i].assign(anchor)

    def _last_micros(self, step: int, batch: Batch | None) -> None:
        """The last stage's micro-batches of ``step``, gradients accumulated: 1F1B there is
        F0 B0 F1 B1 ..., one compiled call for each pair, the targets those the forward
        frame brought; the whole model (``batch``: its own), one call each. The last
        :attr:`deferred` micro-batches first get a call for the input's gradient alone, and
        their whole call once the step's last gradient is on its way upstream."""
        model = self.model
        deferred: list[tuple[tf.Tensor, tf.Tensor]] = []
        first_deferred = self.m - self.deferred
        for i in range(self.m):
            if batch is not None:  # the whole model: stage 0 is the last stage
                inputs, targets = batch
                model.local_micro(self._micro(inputs, i), self._micro(targets, i))
                continue
            x, ids, _ = self._recv_forward(step, i)
            targets = tf.constant(ids.astype(np.int32))
            if i >= first_deferred:
                dx = model.input_grad(x, targets)
                deferred.append((x, targets))
            else:
                dx = model.last_micro(x, targets)
            self.up.send(dx.numpy(), step=step, micro=i, direction=Direction.BWD)
        # The weights' passes while the last gradient travels (the input's, recomputed, is
        # dropped): the same accumulated gradients and loss as undeferred calls.
        for x, targets in deferred:
            model.last_micro(x, targets)

    def _tape_step(self, step: int, batch: Batch | None) -> None:
        """A stage before the last: forwards and backwards in 1F1B order, gradients
        accumulated; the backward of each micro-batch is the tape kept from its forward."""
        plan = self.plan
        inflight: dict[tuple[int, int], _Held] = {}
        for op, i in one_f_one_b(plan.stage, plan.n_stages, self.m, self.in_flight):
            if op is Op.FORWARD:
                self._tape_forward(step, i, batch, inflight)
            else:
                self._tape_backward(step, i, inflight)

    def _tape_forward(
        self, step: int, i: int, batch: Batch | None, inflight: dict[tuple[int, int], _Held]
    ) -> None:
        """Micro-batch ``i`` of ``step`` forward under a tape kept in ``inflight``; its output
        downstream with its target ids (stage 0's from ``batch``, a middle stage's as they
        came)."""
        if batch is not None:
            inputs, targets = batch
            x, ids = self._micro(inputs, i), self._ids(self._rows(targets, i))
        else:
            x, ids, _ = self._recv_forward(step, i)
        tape, out = self.model.tape_forward(x, input_grad=not self.plan.is_first)
        self.down.send(out.numpy(), step=step, micro=i, direction=Direction.FWD, targets=ids)
        inflight[(step, i)] = (tape, x, out)

    def _tape_backward(self, step: int, i: int, inflight: dict[tuple[int, int], _Held]) -> None:
        """Micro-batch ``i`` of ``step`` backward through its tape with the gradient from
        downstream; its input's gradient upstream."""
        tape, x, out = inflight.pop((step, i))
        frame = self.down.recv(step=step, micro=i, direction=Direction.BWD, shape=tuple(out.shape))
        received = tf.constant(frame.array)
        dx = self.model.tape_backward(tape, x, out, received, input_grad=not self.plan.is_first)
        if dx is not None:
            self.up.send(dx.numpy(), step=step, micro=i, direction=Direction.BWD)

    # --- the overlap schedule -------------------------------------------------------------

    def _run_overlapped(self, first: int, end: int, after: Callable[[StepResult], None]) -> None:
        """Steps ``[first, end)`` as one stretch of the overlap schedule; ``after`` runs once a
        step is over on this stage (its last backward done, its gradient set aside)."""
        self._step_clock = time.perf_counter()
        if self.plan.is_last:
            self._overlapped_last(first, end, after)
        else:
            self._overlapped_tape(first, end, after)

    def _overlapped_last(self, first: int, end: int, after: Callable[[StepResult], None]) -> None:
        """The last stage (or the whole model): a forward and its backward together, as in
        the synchronous step; only the updates come a step late."""
        for k in range(first, end):
            self._last_micros(k, self._first_forward(k))
            self._step_over(k, after)

    def _overlapped_tape(self, first: int, end: int, after: Callable[[StepResult], None]) -> None:
        """A stage before the last: :func:`overlapped`'s ops, each backward the tape kept from
        its forward (which holds the weights that forward read, whatever was applied since)."""
        plan, m = self.plan, self.m
        batch = None
        inflight: dict[tuple[int, int], _Held] = {}
        for op, j, i in overlapped(plan.stage, plan.n_stages, m, end - first, self.in_flight):
            k = first + j
            if op is Op.FORWARD:
                if i == 0:
                    batch = self._first_forward(k)
                self._tape_forward(k, i, batch, inflight)
                continue
            self._tape_backward(k, i, inflight)
            if i == m - 1:
                self._step_over(k, after)

    def _first_forward(self, step: int) -> Batch | None:
        """Before step ``step``'s first forward: its batch read (stage 0), an update that is
        due applied."""
        batch = self._read_batch(step)
        self._apply_delayed(self.delayed.before_forward(step))
        return batch

    def _step_over(self, step: int, after: Callable[[StepResult], None]) -> None:
        """Step ``step``'s last backward is done here: its gradient set aside (after the update
        that was still due), its result to ``after``. The run's last step keeps nothing back."""
        plan, model = self.plan, self.model
        self._apply_delayed(self.delayed.step_done(step, self.m))
        model.stash()
        if step + 1 == plan.train.steps:
            self._apply_delayed(self.delayed.flush())
        loss = model.take_loss() / self.m if plan.is_last else None
        now = time.perf_counter()
        seconds, self._step_clock = now - self._step_clock, now
        after(StepResult(step=step, loss=loss, lr=model.lr_of(step), seconds=seconds))

    def _apply_delayed(self, update: PendingUpdate | None) -> None:
        """Apply the gradient set aside (``update`` says whose), at its step's learning rate."""
        if update is not None:
            self.model.set_lr(update.step)
            self.model.apply_pending(update.micro_batches)

    def _stretch_end(self, step: int) -> int:
        """Where a stretch of the overlap schedule from ``step`` must stop: the chain is quiet
        for a calibration and for a validation, and at the end."""
        train = self.plan.train
        end = train.steps
        if self._next_calibration is not None and self._next_calibration > step:
            end = min(end, self._next_calibration)
        if train.val_every:
            end = min(end, (step // train.val_every + 1) * train.val_every)
        return end

    def evaluate(self, step: int) -> float | None:
        """Forward-only validation through the whole pipeline; the last stage gets the loss.

        Stage 0 reads the batches; its eval frames carry their targets and the pass's batch
        count, so the stages after it know when the pass ends without reading any data. A
        pass without a batch is one empty frame that says so."""
        if not self.plan.is_first:
            return self._evaluate_received(step)
        model, losses = self.model, []
        batches = list(job_val_batches(self.data, self.plan.train))
        for i, (inputs, targets) in enumerate(batches):
            x = tf.constant(inputs)
            if self.plan.is_last:  # the whole model
                losses.append(float(model.forward_loss(x, tf.constant(targets), training=False)))
            else:
                out = model.forward(x, training=False).numpy()
                self._send_eval(step, i, len(batches), out, self._ids(targets))
        if not batches and not self.plan.is_last:
            self._send_empty_eval(step)
        return sum(losses) / len(losses) if losses else None

    def _evaluate_received(self, step: int) -> float | None:
        """:meth:`evaluate` on a stage after the first: as many batches as stage 0 said."""
        model, losses = self.model, []
        i, count = 0, None
        while count is None or i < count:
            x, ids, frame = self._recv_forward(step, i, phase="eval")
            if count is None:
                count = frame.header.eval_batches
            elif frame.header.eval_batches != count:
                raise FrameError(
                    f"{self.up.name}: eval frame {i} says {frame.header.eval_batches} batches, "
                    f"the first said {count}"
                )
            if count == 0:  # no batch: pass the news on
                if not self.plan.is_last:
                    self._send_empty_eval(step)
                break
            if self.plan.is_last:
                targets = tf.constant(ids.astype(np.int32))
                losses.append(float(model.forward_loss(x, targets, training=False)))
            else:
                self._send_eval(step, i, count, model.forward(x, training=False).numpy(), ids)
            i += 1
        return sum(losses) / len(losses) if losses else None

    def _send_eval(self, step: int, i: int, count: int, out: np.ndarray, ids: np.ndarray) -> None:
        """Eval batch ``i`` of ``count`` downstream: its activations and target ids."""
        self.down.send(
            out,
            step=step,
            micro=i,
            direction=Direction.FWD,
            phase="eval",
            targets=ids,
            eval_batches=count,
        )

    def _send_empty_eval(self, step: int) -> None:
        """The frame that tells the stages after this one that the pass has no batch."""
        seq_len = self.plan.model.seq_len
        out = np.zeros((0, seq_len, self.wire_dims), dtype=np.float32)
        self._send_eval(step, 0, 0, out, self._ids(np.zeros((0, seq_len), dtype=np.int32)))

    def run(self) -> DoneEvent:
        plan = self.plan
        self.emit(PlacementEvent(stage=plan.stage, devices=self.model.devices()))
        self.open_links()
        tokens_per_step = plan.train.batch_size * plan.model.seq_len
        step_times: list[float] = []
        results: list[StepResult] = []

        def after(result: StepResult) -> None:
            step = result.step
            results.append(result)
            step_times.append(result.seconds)
            wait_s, traffic = self.take_wait(), self.bytes_summary()  # before validation
            throttled_s = min(self.take_throttled(), max(0.0, result.seconds - wait_s))
            sync_s = 0.0 if self.replicas is None else self.replicas.take_seconds()
            self._sample_compute(result.seconds - wait_s - sync_s)  # the sync is no work
            ran = self.deferred
            self._check_deferral(step, result.seconds)
            val_loss = None
            every = plan.train.val_every
            if every and (step + 1) % every == 0 and step + 1 < plan.train.steps:
                val_loss = self.evaluate(step)
                self.take_wait()  # the validation's waits are no step's
            self.emit(
                StepEvent(
                    stage=plan.stage,
                    step=step,
                    loss=result.loss,
                    lr=result.lr,
                    step_time_s=round(result.seconds, 5),
                    tokens_per_s=round(tokens_per_step / result.seconds, 1),
                    wait_s=round(wait_s, 5),
                    throttled_s=round(throttled_s, 5),
                    val_loss=val_loss,
                    sync_s=round(sync_s, 5),
                    deferred=ran,
                    **self._ring_fields(),
                    **traffic,
                )
            )
            self.serve_checkpoints(step + 1)
            every = self.checkpoint_every
            if every and (step + 1) % every == 0 and step + 1 < plan.train.steps:
                self.checkpoint(CheckpointRequest(id=f"every-{step + 1}"), step + 1)
            self.take_throttled()  # validation and checkpoints are no step's work

        step = self.join() if plan.joining else self.start_step
        while step < plan.train.steps:
            self.take_ring_changes(step)
            if step == self._next_calibration:
                self.calibrate(step)
            if plan.train.overlap:
                end = self._stretch_end(step)
                self._run_overlapped(step, end, after)
                step = end
            else:
                after(self.train_step(step))
                step += 1
        self._apply_delayed(self.delayed.flush())  # resumed after the last step: still held
        last = results[-1] if results else None
        val_loss = self.evaluate(plan.train.steps)
        self.finish()
        if self.replicas is not None:
            self.replicas.finish()
        self.close_control()
        if self.checkpoint_at_end:
            self.checkpoint(CheckpointRequest(id="end"), plan.train.steps)
        # The first steps pay for tracing: report the steady state.
        steady = step_times[len(step_times) // 5 :] or step_times
        mean_step = sum(steady) / len(steady) if steady else 0.0  # resumed at the very end
        summary = DoneEvent(
            stage=plan.stage,
            steps=plan.train.steps,
            loss=None if last is None else last.loss,
            val_loss=val_loss,
            step_time_s=round(mean_step, 5),
            tokens_per_s=round(tokens_per_step / mean_step, 1) if mean_step else 0.0,
            params=self.model.n_params,
            dropped_frames=sum(b.dropped for b in self._boundaries())
            + (0 if self.replicas is None else self.replicas.dropped),
            relay_dropped_by_reason=self.relay_dropped(),
            **self.bytes_summary(),
        )
        self.emit(summary)
        return summary

    # --- elastic membership ---------------------------------------------------------------

    def join(self) -> int:
        """A joining stage, its boundaries open: say so, wait for the ring command that lists
        this replica as joining, switch to that ring (taking the donor's state) and return its
        step, the first this stage trains. RingChangeError when none comes in
        :data:`JOIN_TIMEOUT_S`."""
        plan = self.plan
        where = f"stage {plan.stage} of replica {plan.replica}"
        if self.control is None or self.replicas is None:
            raise RingChangeError(
                f"{where} joins a running job: it needs its control channel (--control-stdin) "
                "and a replicated plan"
            )
        self.emit(JoiningEvent(stage=plan.stage))
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            remaining = deadline - time.monotonic()
            change = self.control.wait_joining(plan.replica, self.sync_epoch, max(0.0, remaining))
            if change is None:
                raise RingChangeError(
                    f"{where} joins, but no ring command listed it as joining within "
                    f"{JOIN_TIMEOUT_S:.0f}s"
                )
            if change.at_step < plan.train.steps:
                break
            log.warning(
                "ignoring ring epoch %d: at step %d, the run has %d steps",
                change.epoch,
                change.at_step,
                plan.train.steps,
            )
        self.start_step = change.at_step
        if self._next_calibration is not None:
            self._next_calibration = change.at_step
        log.info("%s joins ring epoch %d at step %d", where, change.epoch, change.at_step)
        self.switch_ring(change)
        return change.at_step

    def take_ring_changes(self, step: int) -> None:
        """Before training ``step``: take the ring changes the control channel has queued and
        switch to the one due now. Only the newest epoch waits: an older one not applied yet
        is overtaken (the leader gave its ring up). A change due at a step
        already trained is a RingChangeError; one at or after the run's end is ignored."""
        if self.control is None:
            return
        plan = self.plan
        for change in self.control.take_ring_changes(plan.replica, self.sync_epoch):
            if self.replicas is None:
                log.warning("ignoring ring epoch %d: this stage has no replicas", change.epoch)
            elif change.at_step >= plan.train.steps:
                # Due at the run's end: it switches nothing, but the checkpoint duty it may
                # hand over (a lost lead's) holds at once.
                self._take_duty(change)
                log.warning(
                    "ring epoch %d at step %d, the run has %d steps: no switch; its checkpoint "
                    "duty holds",
                    change.epoch,
                    change.at_step,
                    plan.train.steps,
                )
            elif change.at_step < step:
                raise RingChangeError(
                    f"stage {plan.stage} of replica {plan.replica}: ring epoch {change.epoch} "
                    f"was due before step {change.at_step}, but the command came when this "
                    f"stage had trained steps {change.at_step} to {step - 1} already "
                    f"(next: step {step})"
                )
            else:
                self._ring_changes.append(change)
        # The leader's newest ring is the truth: an older one still waiting for its step
        # would form a ring the leader has given up (one with a member lost since).
        newest = max((c.epoch for c in self._ring_changes), default=0)
        for old in [c for c in self._ring_changes if c.epoch < newest]:
            log.warning("ring epoch %d is overtaken by epoch %d", old.epoch, newest)
        self._ring_changes = [c for c in self._ring_changes if c.epoch == newest]
        due = [c for c in self._ring_changes if c.at_step == step]
        if not due:
            return
        self._ring_changes = []
        self.switch_ring(due[0])

    def _state_specs(self, variables: Sequence[tf.Variable], *, data: bool) -> list[StateSpec]:
        specs: list[StateSpec] = [
            (tuple(int(d) for d in v.shape), np.dtype(_np_dtype(v))) for v in variables
        ]
        if data:  # stage 0's first ring: where the data stands (epoch, index)
            specs.append(((2,), np.dtype(np.int64)))
        return specs

    def switch_ring(self, change: RingChange) -> None:
        """Switch to ``change``'s rings before its ``at_step``: open their links, hand the
        donor's state around each (this stage's own, if it is the donor; each ring carries
        its share: :func:`~silentswarm.agent.runtime.ring_state.ring_states`), check it
        against this member's unless it joins (weights farther than
        :data:`MAX_DONOR_DISTANCE`: RingChangeError), adopt it, and keep the digests for the
        next step event."""
        plan = self.plan
        assert self.replicas is not None
        joining = plan.replica in change.joining
        timeout_s = max(plan.peer_timeout_s, JOIN_TIMEOUT_S) if joining else plan.peer_timeout_s
        problems = change.problems(plan.replica, (plan.layer_start, plan.layer_end))
        if problems:
            raise RingChangeError(f"ring change epoch {change.epoch}: {'; '.join(problems)}")
        states = ring_states(self.model, change.rings)
        # Stage 0's data position goes with its first ring (every replica's stage 0 holds it).
        with_data = [self.data is not None and i == 0 for i in range(len(states))]
        specs = [
            self._state_specs(state.variables, data=data)
            for state, data in zip(states, with_data, strict=True)
        ]
        own = None
        if plan.replica == change.donor:
            own = []
            for state, data in zip(states, with_data, strict=True):
                arrays = [np.asarray(v.numpy()) for v in state.variables]
                if data:
                    assert self.data is not None
                    position = self.data.state()
                    arrays.append(np.array([position.epoch, position.index], dtype=np.int64))
                own.append(pack_state(arrays))
        started = time.perf_counter()
        self.replicas.switch(change, timeout_s)
        shapes = [(state_rows(spec), ROW) for spec in specs]
        matrices = self.replicas.hand_over(change, own, shapes, timeout_s)
        if own is None:
            for state, spec, matrix, data in zip(states, specs, matrices, with_data, strict=True):
                self._adopt(change, matrix, state, spec, joining=joining, data=data)
        digests = {
            ring.segment: state_digest(matrix)
            for ring, matrix in zip(change.rings, matrices, strict=True)
        }
        self.sync_epoch = change.epoch
        self._switched = (list(change.members), digests)
        self._take_duty(change)
        log.info(
            "stage %d of replica %d: ring epoch %d, members %s, %d ring(s), state of replica %d "
            "(sha256 %s) in %.2fs",
            plan.stage,
            plan.replica,
            change.epoch,
            change.members,
            len(change.rings),
            change.donor,
            ", ".join(f"layers from {g}: {d[:16]}" for g, d in digests.items()),
            time.perf_counter() - started,
        )

    def _take_duty(self, change: RingChange) -> None:
        """The checkpoint duty a change hands this stage (a lost lead's), where it says."""
        if change.checkpoint_every is not None:
            self.checkpoint_every = change.checkpoint_every
        if change.checkpoint_at_end is not None:
            self.checkpoint_at_end = change.checkpoint_at_end

    def _adopt(
        self,
        change: RingChange,
        matrix: np.ndarray,
        state: RingState,
        specs: Sequence[StateSpec],
        *,
        joining: bool,
        data: bool,
    ) -> None:
        """Take the donor's state, so replicas that drifted apart (rounds that missed a
        member) are equal again, after :func:`donor_refusal`'s checks: every value finite,
        AdamW's moments such as AdamW makes them, and a member with state of its own checks
        each class against its own (the weights and DiLoCo's anchors close, the moments and
        the outer momentum within a looser bound, the optimizer's step count equal) and keeps
        its own data position (the same as the donor's in replicas in step). A joining stage
        has nothing to compare: it takes all (and its data position from the ring that carries
        one: ``data``)."""
        plan = self.plan
        variables = state.variables
        where = f"stage {plan.stage} of replica {plan.replica}"
        arrays = unpack_state(matrix, specs)
        optimizer = self.model.optimizer
        why = donor_refusal(
            arrays[: len(variables)],
            None if joining else [np.asarray(v.numpy()) for v in variables],
            n_weights=state.n_weights,
            moments=state.moments,
            anchors=state.anchors,
            moment_bound=adam_moment_bound(float(optimizer.beta_1), float(optimizer.beta_2)),
            counts=state.counts,
            steps_done=change.at_step,
        )
        position = None
        if why is None and self.data is not None and joining and data:
            position = DataState(*(int(x) for x in arrays[-1]))
            why = position_refusal(position.epoch, position.index)
        if why is not None:
            raise DonorRefusedError(
                f"{where}: refused the state of donor replica {change.donor} (ring epoch "
                f"{change.epoch}): {why}"
            )
        if self.data is not None and position is not None:
            try:
                self.data.restore(position)
            except ValueError as exc:  # this joiner's dataset may be the one that differs
                raise RingChangeError(
                    f"{where}: donor replica {change.donor}'s data position: {exc}"
                ) from None
        for variable, array in zip(variables, arrays, strict=False):
            variable.assign(array)

    def _ring_fields(self) -> dict[str, object]:
        """A step event's ring fields: the epoch in force (with replicas), and on the first
        step after a switch its members and the state's digest."""
        if self.replicas is None:
            return {}
        out: dict[str, object] = {"sync_epoch": self.sync_epoch}
        if self._switched is not None:
            members, digests = self._switched
            self._switched = None
            out["sync_members"] = members
            out["state_digests"] = digests
        return out

    # --- calibration ----------------------------------------------------------------------

    def _sample_compute(self, busy_s: float) -> None:
        """Keep a step's seconds of work (not the first after a compile), less what deferred
        passes added to it: the model adds that itself."""
        if self._skip_sample:
            self._skip_sample = False
        elif busy_s > 0:
            busy_s = tuning.undeferred_busy(busy_s, self.m, self.deferred)
            samples = self._busy.setdefault(self.m, [])
            samples.append(busy_s)
            del samples[:-BUSY_SAMPLES_KEPT]

    def busy_points(self) -> list[tuple[int, float]]:
        """(micro-batches, median seconds of work per step) for every count this stage ran."""
        return [(m, statistics.median(v)) for m, v in sorted(self._busy.items()) if v]

    def _rules(self) -> calibrate.Rules:
        plan, train = self.plan, self.plan.train
        auto_names = [c.name for c in tuning.AUTO_CODECS]
        return calibrate.Rules(
            n_stages=plan.n_stages,
            batch_size=train.batch_size,
            fwd_codecs=auto_names if self.auto_fwd else [self.act_codec.name],
            bwd_codecs=auto_names if self.auto_bwd else [self.grad_codec.name],
            max_in_flight=train.in_flight,
            fixed=None if train.auto_micro_batches else (self.m, self.in_flight),
            overlap=train.overlap,
            deferred=None if may_defer(plan.model, train) else train.fixed_deferred,
        )

    def calibrate(self, step: int) -> None:
        """Measure the links with the rest of the chain and take up what it decided."""
        plan = self.plan
        up = None if self.up is None else _Tally(self.up.link)
        down = None if self.down is None else _Tally(self.down.link)
        current = None
        if self.down is not None:
            bwd = self.grad_codec.name if self.down_link is None else self.down_link.bwd_codec
            current = (self.down.send_codec.name, bwd)
        back = calibrate.calibrate(
            stage=plan.stage,
            n_stages=plan.n_stages,
            up=up,
            down=down,
            step=step,
            busy=self.busy_points(),
            current=current,
            decide=self._decide,
            rules=self._rules(),
            timeout_s=plan.peer_timeout_s,
        )
        for boundary, tally in ((self.up, up), (self.down, down)):
            if boundary is not None and tally is not None:
                boundary.probe_sent += tally.sent
                boundary.probe_received += tally.received
        if self.up is not None:
            self.up.send_codec = parse_wire_codec(back.links[plan.stage - 1].bwd_codec)
        if self.down is not None:
            self.down_link = back.links[plan.stage]
            self.down.send_codec = parse_wire_codec(self.down_link.fwd_codec)
        changed = back.tuning.micro_batches != self.m
        if changed or back.tuning.deferred != self._deferred_now:
            self._skip_sample = True  # a new count compiles
        self._next_calibration = calibrate.next_due(
            step,
            start_step=self.start_step,
            probe_every=plan.train.link_probe_every,
            changed=changed,
        )
        self.tuning = back.tuning
        self._deferred_now = back.tuning.deferred
        log.info(
            "calibrated before step %d: %s; %d micro-batches, window %d, %d deferred",
            step,
            ", ".join(
                f"boundary {s.boundary} rtt {s.rtt_ms:.1f} ms, {s.fwd_mbit_s:.0f}/"
                f"{s.bwd_mbit_s:.0f} Mbit/s, {s.fwd_codec}/{s.bwd_codec}"
                for s in back.links
            ),
            self.m,
            self.in_flight,
            self.tuning.deferred,
        )
        self.emit_links()

    def _decide(self, links: list[LinkStats], busy: list[calibrate.Busy]) -> ChainBack:
        """The last stage's decision for the whole chain (:func:`tuning.tune`)."""
        plan, train = self.plan, self.plan.train
        codecs = [(parse_wire_codec(s.fwd_codec), parse_wire_codec(s.bwd_codec)) for s in links]
        step = links[0].step
        result = tuning.tune(
            tuning.TuneInput(
                batch_size=train.batch_size,
                seq_len=plan.model.seq_len,
                dims=self.wire_dims,
                links=links,
                busy=busy,
                codecs=codecs,
                auto_fwd=self.auto_fwd,
                auto_bwd=self.auto_bwd,
                micro_batches=self.m,
                in_flight=self.in_flight,
                auto_micro_batches=train.auto_micro_batches,
                in_flight_cap=train.in_flight,
                overlap=train.overlap,
                target_bytes=token_dtype(plan.model.vocab_size).itemsize,
                deferred=train.fixed_deferred,
                auto_deferred=may_defer(plan.model, train),
            )
        )
        predicted = None if result.predicted_step_s is None else round(result.predicted_step_s, 5)
        deferred, verdict = result.deferred, None
        if self._deferral is not None and predicted is None:  # nothing measured: no proposal
            deferred = self._deferred_now
        elif self._deferral is not None:
            setting = (
                result.micro_batches,
                result.in_flight,
                tuple((fwd.name, bwd.name) for fwd, bwd in result.codecs),
            )
            deferred = self._deferral.propose(
                result.deferred, setting, most=result.micro_batches - 1
            )
            verdict = self._deferral.last_verdict
        return ChainBack(
            links=[
                msgspec.structs.replace(s, fwd_codec=fwd.name, bwd_codec=bwd.name)
                for s, (fwd, bwd) in zip(links, result.codecs, strict=True)
            ],
            tuning=Tuning(
                step=step,
                micro_batches=result.micro_batches,
                in_flight=result.in_flight,
                auto=train.auto_micro_batches,
                overlap=train.overlap,
                predicted_step_s=predicted,
                deferred=deferred,
                deferral=verdict,
            ),
        )

    def _check_deferral(self, step: int, seconds: float) -> None:
        """The last stage under "auto": the step's time to its check of the deferral, which
        says what the next step runs; a verdict is the schedule's news."""
        if self._deferral is None:
            return
        out = self._deferral.after_step(step, self.deferred, seconds)
        if out.next_count != self._deferred_now:
            self._skip_sample = True  # its first input-gradient call may compile
        self._deferred_now = out.next_count
        v = out.verdict
        if v is not None:
            log.info(
                "deferred weight passes from step %d: %d (%.4f s a step; %d: %.4f s)",
                v.step,
                v.kept,
                v.kept_step_s,
                v.other,
                v.other_step_s,
            )
            self.tuning = msgspec.structs.replace(
                self.tuning, step=v.step, deferred=v.kept, deferral=v
            )
            self.emit_links(deferral_check=True)

    def emit_links(self, *, deferral_check: bool = False) -> None:
        self.emit(
            LinksEvent(
                stage=self.plan.stage,
                up=None if self.up is None else self.up.link.transport,
                down=None if self.down is None else self.down.link.transport,
                down_link=self.down_link,
                tuning=self.tuning,
                deferral_check=deferral_check,
            )
        )

    # --- checkpoints ----------------------------------------------------------------------

    def serve_checkpoints(self, steps_done: int) -> None:
        """Answer the control channel's requests that are due after ``steps_done`` steps."""
        if self.control is not None:
            for request in self.control.due_checkpoints(steps_done, self.plan.train.steps):
                self.checkpoint(request, steps_done)

    def close_control(self) -> None:
        """Stop taking requests; those that came after the last step get the final state."""
        if self.control is not None:
            for request in self.control.close():
                self.checkpoint(request, self.plan.train.steps)

    def checkpoint(self, request: CheckpointRequest, steps_done: int) -> None:
        """Write (once per step) and report a checkpoint; a failure is reported, not raised.

        A checkpoint is a convenience: a full disk or a missing directory must not end a run
        that may have hours of training in it.
        """
        plan = self.plan
        path, message = None, ""
        try:
            path = self._write_checkpoint(steps_done)
        except (OSError, CheckpointError) as exc:
            log.warning("checkpoint %r after step %d failed: %s", request.id, steps_done, exc)
            message = str(exc)[:MESSAGE_CHARS] or type(exc).__name__
        self.emit(
            CheckpointEvent(
                stage=plan.stage,
                id=request.id,
                step=steps_done,
                path=path,
                final=steps_done >= plan.train.steps,
                ok=path is not None,
                message=message,
            )
        )

    def _write_checkpoint(self, steps_done: int) -> str:
        if steps_done in self._checkpoints:
            return self._checkpoints[steps_done]
        if self.plan.checkpoint_dir is None:
            raise CheckpointError("the stage plan has no checkpoint_dir")
        path = save_stage(
            self.plan.checkpoint_dir,
            self.model,
            self.data,  # None past stage 0: no data position to keep
            steps_done=steps_done,
            data_state=self._data_before.get(steps_done),
            pending=self.delayed.pending,
        )
        self._checkpoints[steps_done] = str(path)
        return str(path)

    def finish(self) -> None:
        """End the run in order: from the last stage upwards, each end confirms DONE.

        Without it an upstream stage could exit (and close its socket) while its last frames
        were still queued, and the downstream stage would wait for them in vain.
        """
        wait_s = max(self.plan.peer_timeout_s, LAST_DONE_S)
        if self.down is not None and not self.down.link.wait_done(wait_s):
            raise PeerTimeoutError(
                f"{self.down.name}: the downstream stage did not confirm the end of the run "
                f"within {wait_s:.0f}s"
            )
        if self.up is not None:
            self.up.link.send_done()

    def take_throttled(self) -> float:
        """Seconds the CPU quota held this process back since the last call."""
        now = self._throttle.read()
        taken, self._throttled_mark = self._throttle.held(self._throttled_mark, now), now
        return taken

    def take_wait(self) -> float:
        """Seconds blocked on peers since the last call (the pipeline bubble, seen from here)."""
        total = 0.0
        for boundary in self._boundaries():
            total, boundary.wait_s = total + boundary.wait_s, 0.0
        return total

    def bytes_summary(self) -> dict[str, int]:
        """The traffic fields of step and done events
        (:class:`silentswarm.types.stage.StepEvent`)."""
        out: dict[str, int] = {}
        for key, boundary in (("up", self.up), ("down", self.down)):
            if boundary is not None:
                out[f"{key}_boundary"] = boundary.index
                out[f"{key}_bytes_sent"] = boundary.bytes_sent
                out[f"{key}_bytes_received"] = boundary.bytes_received
        out["relay_dropped"] = sum(self.relay_dropped().values())
        if self.replicas is not None:
            out["sync_bytes_sent"] = self.replicas.bytes_sent
            out["sync_bytes_received"] = self.replicas.bytes_received
            out["sync_clipped"] = self.replicas.clipped
            out["sync_missed"] = self.replicas.missed
        return out

    def relay_dropped(self) -> dict[str, int]:
        """Relay messages dropped unread (junk, forged, replayed), by reason, both ends."""
        out: dict[str, int] = {}
        for boundary in self._boundaries():
            if isinstance(boundary.link, RelayLink):
                for reason, n in boundary.link.dropped_by_reason.items():
                    out[reason] = out.get(reason, 0) + n
        if self.replicas is not None:
            for reason, n in self.replicas.relay_dropped().items():
                out[reason] = out.get(reason, 0) + n
        return out


class _Tally:
    """A link as the probes use it, counting the bytes of their own messages (what the
    link itself handles on the way, such as a late HELLO, stays the link's traffic)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.name = link.name
        self.sent = 0
        self.received = 0

    def send(self, parts: Sequence[bytes | memoryview], timeout_s: float = 60.0) -> None:
        self.link.send(parts, timeout_s=timeout_s)
        self.sent += frame_nbytes(parts)

    def recv(self, timeout_s: float) -> Parts:
        parts = self.link.recv(timeout_s)
        self.received += frame_nbytes(parts)
        return parts


# What a peer may send in one message part over a p2p link: ZeroMQ drops the connection of
# one that sends a larger part before it is in memory (libzmq caps parts one by one, not
# their number; the relay has its own frame limit).
# Generous on purpose: a limit a legitimate frame could reach would hang a job.
MESSAGE_SLACK_BYTES = 64 << 20


def boundary_message_bytes(plan: StagePlan) -> int:
    """A boundary's limit: four times a frame of the whole batch (a validation batch is
    the largest) at the model's width in float32, with its targets, plus slack."""
    width = 4 * plan.model.d_model + 8
    return 4 * plan.train.batch_size * plan.model.seq_len * width + MESSAGE_SLACK_BYTES


def ring_message_bytes(n_params: int) -> int:
    """A ring link's limit: the donor's state (the weights, AdamW's two moments, DiLoCo's
    anchor and momentum: five float32 values a parameter) with room to spare, plus slack."""
    return 24 * n_params + MESSAGE_SLACK_BYTES


def _curve(keys: PlanCurveKeys | None) -> CurveKeys | None:
    if keys is None:
        return None
    return CurveKeys(public=keys.public, secret=keys.secret, peer_public=keys.peer_public)


def _np_dtype(variable: tf.Variable) -> np.dtype:
    """A variable's numpy dtype (Keras and TensorFlow variables alike)."""
    dtype = variable.dtype
    return np.dtype(getattr(dtype, "as_numpy_dtype", dtype))


__all__ = [
    "Boundary",
    "StageRunner",
]
