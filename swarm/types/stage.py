"""The stage runtime's two JSON-line channels, each a tagged union of msgspec Structs.

- **Events**, runtime → agent on stdout, tagged by ``event``: ``placement``, ``links``,
  ``step`` (every training step), ``checkpoint`` (one was written, or could not be), ``done``
  (the run's summary), ``error`` (why it failed) and ``joining`` (a joining stage is ready).
  :mod:`silentswarm.agent.runtime.stage` and :mod:`silentswarm.agent.runtime.main` write
  them with :func:`encode_event`; the agent (:mod:`silentswarm.agent.supervisor`) reads them
  with :func:`decode_event`.
- **Commands**, agent → runtime on stdin, tagged by ``cmd``: ``checkpoint``, ``ring``.
  :mod:`silentswarm.agent.runtime.control` reads them.

Lines leave out what they do not say (``omit_defaults``): ``val_loss`` on a step only when
that step was validated, ``up_*``/``down_*`` only for the boundaries the stage has,
``message`` on a checkpoint only when it failed. A non-finite float (a diverged loss) is
written as ``null``. Readers ignore fields they do not know; a line that is not one of these
Structs is the reader's to log and count, never a reason to stop.

Steps: ``StepEvent.step`` is the 0-based index of the step just trained; every other step
count here (``CheckpointEvent.step``, ``DoneEvent.steps``, ``CheckpointRequest.at_step``) counts
completed steps, as progress does.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from silentswarm.plan import RingChange, StateDigests
from silentswarm.types.links import LinkStats, Tuning

StageIndex = Annotated[int, msgspec.Meta(ge=0, le=4096)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
CheckpointId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Message = Annotated[str, msgspec.Meta(max_length=8192)]
Transport = Annotated[str, msgspec.Meta(max_length=16)]  # p2p, relay
Label = Annotated[str, msgspec.Meta(max_length=256)]
PathText = Annotated[str, msgspec.Meta(max_length=4096)]
# An ErrorCode (swarm.errors) as text: a reader keeps a code it does not know as it came.
CodeText = Annotated[str, msgspec.Meta(max_length=64)]


# --- events ---------------------------------------------------------------------------------


class _Event(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="event"):
    stage: StageIndex


class PlacementEvent(_Event, tag="placement", kw_only=True):
    """Where each piece's variables live: ``{"block_2": "/job:localhost/.../CPU:1"}``."""

    devices: Annotated[dict[Label, Label], msgspec.Meta(max_length=4096)]


class LinksEvent(_Event, tag="links", kw_only=True):
    """The transport each boundary settled on (None where the stage has no such boundary);
    after each calibration also what the downstream boundary measured and the codecs it
    uses (``down_link``), and the schedule in force (``tuning``). ``deferral_check``: sent by
    the last stage between calibrations, when its check of a proposed count of deferred
    weight passes took its verdict (``tuning.deferral``)."""

    up: Transport | None
    down: Transport | None
    down_link: LinkStats | None = None
    tuning: Tuning | None = None
    deferral_check: bool = False


class _Traffic(_Event, kw_only=True):
    """Bytes over each boundary since the run began (None: no such boundary), and the relay
    messages dropped unread at both ends."""

    up_boundary: StageIndex | None = None
    up_bytes_sent: Count | None = None
    up_bytes_received: Count | None = None
    down_boundary: StageIndex | None = None
    down_bytes_sent: Count | None = None
    down_bytes_received: Count | None = None
    relay_dropped: Count
    # Replicas (agent/runtime/replicas.py): bytes over the replicas' ring since the run
    # began, and the rounds' counts of contributions clipped and of replicas left out.
    sync_bytes_sent: Count = 0
    sync_bytes_received: Count = 0
    sync_clipped: Count = 0
    sync_missed: Count = 0

    @property
    def bytes_sent(self) -> int:
        return (self.up_bytes_sent or 0) + (self.down_bytes_sent or 0)

    @property
    def bytes_received(self) -> int:
        return (self.up_bytes_received or 0) + (self.down_bytes_received or 0)


class StepEvent(_Traffic, tag="step", kw_only=True):
    """Step ``step`` (0-based) is trained; ``loss`` on the last stage only."""

    step: Count
    loss: float | None
    lr: float
    step_time_s: float
    tokens_per_s: float
    wait_s: float  # blocked on peers during the step (the pipeline bubble, seen from here)
    # Of the rest, the seconds a CPU quota held the stage's process back (swarm.cpus).
    throttled_s: float = 0.0
    val_loss: float | None = None  # on the steps that were validated, on the last stage
    # Seconds of the step spent syncing with the stage's replicas (0 without a sync).
    sync_s: float = 0.0
    # The last stage's deferred weight-gradient passes in this step (defer_weight_grads).
    deferred: Count = 0
    # Elastic membership: the rings' epoch in force (0: the one the plan started with), and
    # on the step new rings formed before, their members and the sha256 (hex) of the state
    # every member took from the donor in each ring, by its segment's first layer (the
    # leader records them and checks that they agree).
    sync_epoch: Count = 0
    sync_members: Annotated[list[StageIndex], msgspec.Meta(max_length=4096)] | None = None
    state_digests: StateDigests | None = None


class CheckpointEvent(_Event, tag="checkpoint", kw_only=True):
    """Checkpoint ``id`` after ``step`` completed steps: written to ``path`` (``ok``), or not
    (``message`` says why). ``final``: it holds the run's last step. The stage's own ids are
    ``every-<n>`` (periodic) and ``end``; any other answers an operator's CHECKPOINT."""

    id: CheckpointId
    step: Count
    path: PathText | None
    final: bool
    ok: bool
    message: Message = ""


class DoneEvent(_Traffic, tag="done", kw_only=True):
    """The run's summary: ``steps`` completed, the last loss, the final validation loss, and
    the steady state's step time and throughput."""

    steps: Count
    loss: float | None
    val_loss: float | None
    step_time_s: float
    tokens_per_s: float
    params: Count
    dropped_frames: Count
    relay_dropped_by_reason: Annotated[dict[Label, Count], msgspec.Meta(max_length=64)]


class ErrorEvent(_Event, tag="error", kw_only=True):
    """The run failed; the runtime exits 1 after this line. ``code`` is the failure's
    ``ErrorCode`` (``STAGE_FAILED`` for one without a code of its own)."""

    message: Message
    code: CodeText = ""


class JoiningEvent(_Event, tag="joining", kw_only=True):
    """A joining stage (``StagePlan.joining``) has built its model and opened its pipeline
    boundaries: it waits for its ``ring`` command."""


StageEvent = (
    PlacementEvent
    | LinksEvent
    | StepEvent
    | CheckpointEvent
    | DoneEvent
    | ErrorEvent
    | JoiningEvent
)

_EVENT_DECODER = msgspec.json.Decoder(StageEvent)


def encode_event(event: StageEvent) -> bytes:
    """One event as its JSON line, without the newline."""
    return msgspec.json.encode(event)


def decode_event(line: bytes | str) -> StageEvent:
    """The event on one line; ``msgspec.DecodeError`` (or its ``ValidationError``) when the
    line is not JSON or not one of the events."""
    return _EVENT_DECODER.decode(line)


# --- commands -------------------------------------------------------------------------------


class CheckpointRequest(msgspec.Struct, frozen=True, tag_field="cmd", tag="checkpoint"):
    """Write a checkpoint once ``at_step`` training steps have completed (None: at once)."""

    id: CheckpointId
    at_step: Count | None = None

    def is_due(self, steps_done: int, total_steps: int) -> bool:
        """Due at the first step boundary at or after ``at_step``; at the last step at the latest.

        A request that arrives after its step has passed is honoured at the next boundary, and
        one for a step beyond the run is honoured after the last step (a final checkpoint).
        """
        return self.at_step is None or self.at_step <= steps_done or steps_done >= total_steps


class RingCommand(msgspec.Struct, frozen=True, tag_field="cmd", tag="ring"):
    """Elastic membership: the stage's replicas' ring changes (see ``RingChange``)."""

    change: RingChange


Command = CheckpointRequest | RingCommand
COMMANDS: dict[str, type[Command]] = {"checkpoint": CheckpointRequest, "ring": RingCommand}


MAX_COMMAND_BYTES = 4 << 20
"""The longest command line a stage reads from its agent: a ring change of a stage in one ring
per layer of a deep model (about 800 bytes a ring) fits; a longer line is no command of
ours, and the stage drops it rather than buffer without bound, so the agent refuses to send
one (the leader then hears a refused RING, not a silent success)."""


def encode_command(command: Command) -> bytes:
    """One command as its JSON line, with the newline."""
    return msgspec.json.encode(command) + b"\n"


__all__ = [
    "COMMANDS",
    "MAX_COMMAND_BYTES",
    "CheckpointEvent",
    "CheckpointRequest",
    "Command",
    "DoneEvent",
    "ErrorEvent",
    "JoiningEvent",
    "LinksEvent",
    "PlacementEvent",
    "RingCommand",
    "StageEvent",
    "StepEvent",
    "decode_event",
    "encode_command",
    "encode_event",
]
