"""Whether a fellow takes a START, and how it refuses a signal it cannot read: pure.

:func:`decide` looks at what the agent is doing (:class:`AgentState`) and at the START, and
says :class:`Start` (the plan made this fellow's, where the run lives, what to fetch first)
or :class:`Refusal` (a code and why). The runner (:mod:`silentswarm.agent.runner`) does the I/O
either way: the attempt's NATS user, the runtime, the acknowledgement. Refusals, in order:

- ``AGENT_STOPPING``: the agent is shutting down;
- ``FELLOW_BUSY``: it is not ready, runs a stage, or installs an update;
- ``PLAN_INVALID``: the plan has problems, is for another fellow, or names another job or
  attempt than the signal;
- ``START_STALE``: that attempt of that job is not newer than the last one that ran here
  (every START round is a new attempt: an older one is a replay);
- ``START_INVALID``: the swarm has NATS users and START brought none for the attempt.

A signal that does not decode at all is refused by :func:`malformed`, with the code of what
was wrong when its id and kind can still be read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from silentswarm.errors import ErrorCode
from silentswarm.natsconn import NatsAccess
from silentswarm.plan import StagePlan
from silentswarm.protocol import FellowStatus, SignalHead, SignalKind, StartSignal
from silentswarm.rings import fellow_ports
from silentswarm.types.signals import DatasetArgs, InitArgs, ResumeArgs


@dataclass(frozen=True)
class AgentState:
    """What START depends on: the agent's state and its own settings."""

    fellow_id: str
    status: FellowStatus
    nats: NatsAccess  # how this agent reaches NATS; its credentials mean the swarm has users
    subject_prefix: str
    fellow_dir: Path
    stopping: bool = False
    running_job: str | None = None  # the job of the stage run it holds, if any
    updating: bool = False  # an UPDATE is installing
    data_bind: str | None = None  # SWARM_DATA_BIND: where its stage binds instead
    sync_bind: str | None = None  # SWARM_SYNC_BIND: where its stage binds its ring port instead
    last_run: tuple[str, int] | None = None  # (job, attempt) of the last run that ended here


@dataclass(frozen=True)
class Refusal:
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class Start:
    """START accepted: run ``plan`` in ``workdir``; with ``resume``, fetch its shard into
    ``resume_dir`` first (the plan already resumes from there)."""

    plan: StagePlan
    workdir: Path
    nats_creds: str | None = None
    resume: ResumeArgs | None = None
    resume_dir: Path | None = None
    # Uploaded datasets to download into the data cache first (stage 0 only).
    datasets: DatasetArgs | None = None
    # The export the job starts from (init_from "job:"/"export:"): its files go to init_dir.
    init: InitArgs | None = None
    init_dir: Path | None = None

    @property
    def fetches(self) -> bool:
        """Whether something must be downloaded before the runtime starts."""
        return self.resume is not None or self.datasets is not None or self.init is not None

    @property
    def message(self) -> str:
        if self.resume is not None:
            return f"stage {self.plan.stage} resuming from step {self.resume.step}"
        return f"stage {self.plan.stage} started"


Decision = Start | Refusal


def decide(state: AgentState, signal: StartSignal) -> Decision:
    """Take the START or refuse it (see the module's docstring for the refusals)."""
    plan = localised(state, signal.args.plan)
    refusal = (
        _unavailable(state)
        or _invalid(state, signal, plan)
        or _stale(state, plan)
        or _without_user(state, signal)
    )
    if refusal is not None:
        return refusal
    run = f"{plan.job_id}-a{plan.attempt}"
    resume, resume_dir = signal.args.resume, None
    init, init_dir = signal.args.init, None
    if resume is not None:
        resume_dir = state.fellow_dir / "resume" / run
        plan = msgspec.structs.replace(
            plan, resume_from=str(resume_dir / f"stage-{plan.stage}.json")
        )
    # The leader sends both only for an adapter, whose checkpoint holds the adapter alone.
    if init is not None:
        init_dir = state.fellow_dir / "init" / run
        plan = msgspec.structs.replace(plan, init_dir=str(init_dir))
    return Start(
        plan=plan,
        workdir=state.fellow_dir / "jobs" / run,
        nats_creds=signal.args.nats_creds or None,
        resume=resume,
        resume_dir=resume_dir,
        datasets=signal.args.datasets if plan.is_first else None,
        init=init,
        init_dir=init_dir,
    )


def _unavailable(state: AgentState) -> Refusal | None:
    if state.stopping:
        return Refusal(ErrorCode.AGENT_STOPPING, "the agent is shutting down")
    if state.status is not FellowStatus.READY or state.running_job is not None:
        doing = f" (job {state.running_job})" if state.running_job else ""
        return Refusal(ErrorCode.FELLOW_BUSY, f"fellow is {state.status}{doing}")
    if state.updating:
        return Refusal(ErrorCode.FELLOW_BUSY, "fellow is installing an update")
    return None


def _invalid(state: AgentState, signal: StartSignal, plan: StagePlan) -> Refusal | None:
    problems = plan.problems()
    if plan.fellow_id != state.fellow_id:
        problems.append(f"the plan is for {plan.fellow_id!r}, not {state.fellow_id!r}")
    if (signal.job_id, signal.attempt) != (plan.job_id, plan.attempt):
        problems.append("the signal's job and attempt do not match the plan's")
    return Refusal(ErrorCode.PLAN_INVALID, "; ".join(problems)) if problems else None


def _stale(state: AgentState, plan: StagePlan) -> Refusal | None:
    if state.last_run is None:
        return None
    job, attempt = state.last_run
    if plan.job_id != job or plan.attempt > attempt:
        return None
    return Refusal(
        ErrorCode.START_STALE,
        f"attempt {plan.attempt} of job {job} is not newer than attempt {attempt}, "
        "which already ran here",
    )


def _without_user(state: AgentState, signal: StartSignal) -> Refusal | None:
    if signal.args.nats_creds or not state.nats.creds:
        return None
    return Refusal(
        ErrorCode.START_INVALID,
        "START brought no NATS user for this attempt, and this swarm has NATS users: "
        "the leader needs its NATS authority (SWARM_NATS_AUTH_DIR)",
    )


def localised(state: AgentState, plan: StagePlan) -> StagePlan:
    """The leader's plan with what only this fellow knows: how it reaches NATS, its subject
    prefix, where it keeps checkpoints, and the addresses its stage binds (SWARM_DATA_BIND,
    and SWARM_SYNC_BIND for its replicas' ring)."""
    plan = msgspec.structs.replace(
        plan,
        nats=state.nats,
        subject_prefix=state.subject_prefix,
        checkpoint_dir=str(state.fellow_dir / "checkpoints"),
    )
    if plan.data_address and state.data_bind:
        plan = msgspec.structs.replace(plan, data_address=state.data_bind)
    binds = fellow_ports(state.sync_bind)
    if plan.sync_ports and binds:  # port j of the advertised range binds port j of this one
        plan = msgspec.structs.replace(plan, sync_ports=binds[: len(plan.sync_ports)])
    return plan


# The refusal of a signal whose arguments did not decode, by its kind.
INVALID_ARGS = {
    SignalKind.START.value: ErrorCode.START_INVALID,
    SignalKind.CHECKPOINT.value: ErrorCode.CHECKPOINT_INVALID,
    SignalKind.STOP.value: ErrorCode.STOP_INVALID,
    SignalKind.UPDATE.value: ErrorCode.UPDATE_INVALID,
    SignalKind.PURGE.value: ErrorCode.PURGE_INVALID,
    SignalKind.RING.value: ErrorCode.RING_INVALID,
    SignalKind.PROBE.value: ErrorCode.PROBE_INVALID,
}


def malformed(head: SignalHead | None, error: str) -> Refusal:
    """How to refuse a signal that did not decode (``error`` says why).

    With its id and a known kind readable (``head``), the refusal names what was wrong: the
    plan (``PLAN_INVALID``) or another argument (``<KIND>_INVALID``); otherwise the payload is
    no signal at all (``PROTOCOL_ERROR``).
    """
    invalid = INVALID_ARGS.get(head.kind) if head is not None else None
    if invalid is None:
        return Refusal(ErrorCode.PROTOCOL_ERROR, error)
    if "$.args.plan" in error:
        return Refusal(ErrorCode.PLAN_INVALID, error)
    return Refusal(invalid, error)


__all__ = ["AgentState", "Decision", "Refusal", "Start", "decide", "localised", "malformed"]
