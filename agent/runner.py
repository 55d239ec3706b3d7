"""The fellow's NATS session: register, heartbeat, answer signals, deregister on the way out.

The agent drives its own status through :mod:`silentswarm.lifecycle`. It reconnects to NATS
forever, and after every reconnect registers again (the leader may have restarted, or
judged it offline) without restarting the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from silentswarm import __version__
from silentswarm import subjects as topics
from silentswarm.agent.datafetch import fetch_datasets
from silentswarm.agent.decide import AgentState, Refusal, Start, decide, malformed
from silentswarm.agent.errors import FetchError, NotRegisteredError, UpdateError
from silentswarm.agent.hardware import HardwareProbe, limits_from
from silentswarm.agent.linkprobe import run_probe
from silentswarm.agent.logship import FellowLogShipper
from silentswarm.agent.reinstall import PackageRef, reinstall
from silentswarm.agent.shardpush import Shard, ShardPusher, fetch_init, fetch_shard
from silentswarm.agent.supervisor import StageRun, sync_fields
from silentswarm.errors import ErrorCode, IllegalTransitionError, ProtocolError
from silentswarm.lifecycle import FellowEvent, next_status
from silentswarm.natsauth import write_private
from silentswarm.natsconn import NatsAccess, connect_forever
from silentswarm.protocol import (
    ACK_MESSAGE_CHARS,
    EXPORT_ERROR_CHARS,
    CheckpointSignal,
    DeregisterRequest,
    FellowIdentity,
    FellowStatus,
    Heartbeat,
    LinkProbeReport,
    ProbeSignal,
    Progress,
    ProgressEvent,
    PurgeSignal,
    RegisterRequest,
    RingSignal,
    Signal,
    SignalAck,
    SignalHead,
    StageOutcome,
    StageResult,
    StartSignal,
    StopSignal,
    UpdateSignal,
)
from silentswarm.retrying import Backoff, WarnOnNewReason
from silentswarm.sdnotify import notify, watchdog_forever
from silentswarm.settings import Settings
from silentswarm.types.links import LinkStats, Tuning
from silentswarm.types.signals import PROBE_TIMEOUT_S
from silentswarm.types.stage import (
    MAX_COMMAND_BYTES,
    CheckpointEvent,
    CheckpointRequest,
    JoiningEvent,
    LinksEvent,
    RingCommand,
    StageEvent,
    StepEvent,
    encode_command,
)

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 2.0
# How long START may take to connect as the attempt's own NATS user.
ATTEMPT_CONNECT_S = 5.0
# How long a finished stage's last shard pushes may hold up its report of the end.
PUSH_DRAIN_S = 300.0
# Registration is asked again until accepted, after 0.25 s doubling up to 1 s (no jitter).
REGISTER_RETRIES = Backoff(wait_initial=0.25, wait_max=1.0)
SEEN_SIGNALS = 256
# A link probe's report rides in the heartbeats this long after it ended (one may be lost).
PROBE_REPORT_FOR_S = 10.0
# The most a START waits for a link probe to free the data port: the probe's own deadline
# (PROBE_TIMEOUT_S, handshake included) with room for the link's close.
PROBE_WAIT_S = PROBE_TIMEOUT_S + 5.0
MESSAGE_CHARS = 1000  # a progress message's bound (swarm.protocol): longer ones are cut


def default_fellow_id() -> str:
    """The host name, cut down to a valid subject token."""
    raw = socket.gethostname().split(".")[0]
    token = "".join(c if c.isalnum() or c in "-_" else "-" for c in raw)[:64]
    return token or "fellow"


class FellowAgent:
    def __init__(
        self,
        settings: Settings,
        *,
        nats: NatsAccess,
        fellow_id: str,
        probe: HardwareProbe | None = None,
    ) -> None:
        self.settings = settings
        self.nats = nats
        self.nats_url = nats.url
        self.prefix = settings.subject_prefix
        self.probe = probe or HardwareProbe(
            limits=limits_from(settings), compute_speed=settings.fellow_compute_speed
        )
        self.identity = FellowIdentity(
            fellow_id=fellow_id,
            instance_id=uuid.uuid4().hex[:16],
            hostname=self.probe.hostname,
            version=__version__,
            pid=os.getpid(),
            data_address=settings.data_address or None,  # "": none (--data-address "")
            sync_address=settings.sync_address or None,
            pool=settings.pool,
            labels=settings.labels,
        )
        self.status = FellowStatus.REGISTERING
        self.heartbeat_interval_s = settings.heartbeat_interval_s
        self.nc: Client | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._seq = 0
        self._registered = asyncio.Event()
        self._need_register = asyncio.Event()
        self._acks: OrderedDict[str, SignalAck] = OrderedDict()
        self._stop: asyncio.Event | None = None
        self.run_: StageRun | None = None
        self.step: int | None = None
        self.loss: float | None = None
        self.outcome: StageOutcome | None = None
        self._checkpoint_final = False
        # The run's own final checkpoint (id "end"): handed to the pusher, or why it could not
        # be written. Together they say whether the final shard reached the leader.
        self._end_submitted = False
        self._end_error: str | None = None
        # Set by UPDATE: the agent process restarts (re-exec) once it has stopped.
        self.restart_requested = False
        self._update_when_idle = False
        self._update_package: PackageRef | None = None
        self._updating: asyncio.Task[None] | None = None
        self.exit_reason: str | None = None
        self.shipper = FellowLogShipper(fellow_id)
        self._down_transport: str | None = None
        self._down_link: LinkStats | None = None  # the latest calibration's, and schedule
        self._tuning: Tuning | None = None
        self.pusher: ShardPusher | None = None
        # The current run's connection as its attempt's own NATS user (progress, shards);
        # None in a swarm without NATS users, where the agent's own connection serves.
        self.run_nc: Client | None = None
        # Handed out by the leader when it registered us: only this process can deregister.
        self._instance_secret = ""
        # A link probe (PROBE) running in a thread, and the latest one's report, repeated in
        # the heartbeats until PROBE_REPORT_FOR_S after it ended (a heartbeat may be lost).
        self._probe: asyncio.Task[LinkProbeReport] | None = None
        self._probe_report: LinkProbeReport | None = None
        self._probe_report_until = 0.0
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def fellow_id(self) -> str:
        return self.identity.fellow_id

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then deregister and close."""
        connect = asyncio.create_task(
            connect_forever(
                self.nats,
                name=f"swarm-fellow-{self.fellow_id}",
                inbox_prefix=topics.inbox_prefix(self.fellow_id),
                on_disconnected=self._on_disconnected,
                on_reconnected=self._on_reconnected,
            )
        )
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({connect, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not connect.done():
            connect.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await connect
            log.info("stopped before NATS %s was reachable", self.nats_url)
            return
        stopper.cancel()
        self._stop = stop
        self.nc = connect.result()
        self.pusher = ShardPusher(self.nc, self.prefix, self.fellow_id)
        await self.nc.subscribe(
            topics.SIGNAL.subject(self.prefix, fellow=self.fellow_id), cb=self._on_signal
        )
        self._need_register.set()
        notify("READY=1", f"STATUS=fellow {self.fellow_id} connected to {self.nats_url}")
        tasks = [
            asyncio.create_task(self._registrar(stop), name="registrar"),
            asyncio.create_task(self._heartbeats(stop), name="heartbeats"),
            asyncio.create_task(watchdog_forever(), name="systemd-watchdog"),
        ]
        tasks.append(asyncio.create_task(self._probe_devices(), name="device-probes"))
        shipping = asyncio.create_task(
            self.shipper.run(self.nc, self.prefix, stop), name="log-shipper"
        )
        try:
            await stop.wait()
        finally:
            # A re-exec (UPDATE) keeps the pid: systemd must see a reload, not a stop.
            notify("RELOADING=1" if self.restart_requested else "STOPPING=1")
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.run_ is not None:
                await self.run_.stop("the agent is stopping")
            await self._deregister()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(shipping, 2.0)
                subject = topics.LOG.subject(self.prefix, fellow=self.fellow_id)
                await asyncio.wait_for(self.shipper.flush_to(self.nc, subject), 2.0)
            with contextlib.suppress(Exception):
                await self.nc.drain()
            self.probe.close()

    # --- registration ----------------------------------------------------------------------

    async def _on_disconnected(self) -> None:
        self._registered.clear()

    async def _on_reconnected(self) -> None:
        self._need_register.set()

    async def _registrar(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._need_register.wait()
            self._need_register.clear()
            await self._register_until_accepted(stop)

    async def _register_until_accepted(self, stop: asyncio.Event) -> None:
        """Register, asking again (REGISTER_RETRIES) until the leader accepts; the agent's
        stop cancels the wait."""
        self._registered.clear()
        warn = WarnOnNewReason(log, "registration not accepted: %s (retrying)", NotRegisteredError)
        async for attempt in REGISTER_RETRIES.context(on=warn):
            if stop.is_set():
                return
            with attempt:
                reason = await self._try_register()
                if reason is not None:
                    raise NotRegisteredError(reason)
        if self.status is FellowStatus.REGISTERING:
            self.status = next_status(self.status, FellowEvent.REGISTERED)
        self._registered.set()
        await self._send_heartbeat()
        if self._update_when_idle and self.status is FellowStatus.READY and not self.run_:
            self._update_now()

    async def _try_register(self) -> str | None:
        """None when the leader accepted us, else why not."""
        assert self.nc is not None
        req = RegisterRequest(
            fellow=self.identity, hardware=self.probe.snapshot(), status=self.status
        )
        subject = topics.REGISTER.subject(self.prefix, fellow=self.fellow_id)
        try:
            msg = await self.nc.request(subject, topics.encode(req), timeout=REQUEST_TIMEOUT_S)
            reply = topics.REGISTER.decode_reply(msg.data)
        except (NatsError, TimeoutError) as exc:
            return f"no leader answered on {subject} ({type(exc).__name__})"
        except ProtocolError as exc:
            return str(exc)
        if not reply.accepted:
            if reply.code == ErrorCode.RELEASED:
                self._exit("released by an operator")
            # PURGE_PENDING: released, but a purge is coming; keep asking until it does.
            return f"{reply.code}: {reply.message}"
        self.heartbeat_interval_s = reply.heartbeat_interval_s or self.heartbeat_interval_s
        self._instance_secret = reply.instance_secret or self._instance_secret
        log.info("registered as %s with leader %s", self.fellow_id, reply.leader_version)
        return None

    async def _deregister(self) -> None:
        if self.nc is None or not self.nc.is_connected or not self._registered.is_set():
            return
        req = DeregisterRequest(
            fellow_id=self.fellow_id,
            instance_id=self.identity.instance_id,
            instance_secret=self._instance_secret,
            outcome=self.outcome,
        )
        subject = topics.REGISTER.subject(self.prefix, fellow=self.fellow_id)
        try:
            msg = await self.nc.request(subject, topics.encode(req), timeout=REQUEST_TIMEOUT_S)
            reply = topics.REGISTER.decode_reply(msg.data)
            log.info("deregistered: %s", reply.message or reply.code)
        except (NatsError, TimeoutError, ProtocolError) as exc:
            log.warning("could not deregister (%s); the leader will time us out", exc)

    async def _probe_devices(self) -> None:
        """Where NVML sees GPUs, learn which TensorFlow can use; then measure the compute
        speed on the device a stage would train on (unless the operator declared it). Each
        answer goes to the leader at once."""
        if self.probe.sees_gpus:
            await self.probe.probe_tensorflow()
            if self._registered.is_set():
                await self._send_heartbeat()
        if not self.probe.speed_declared:
            await self.probe.probe_speed()
            if self._registered.is_set():
                await self._send_heartbeat()

    # --- heartbeats ------------------------------------------------------------------------

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._registered.wait()
            await self._send_heartbeat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.heartbeat_interval_s)

    async def _send_heartbeat(self) -> None:
        # Skipped while disconnected: a burst of stale heartbeats after a reconnect helps nobody.
        if self.nc is None or not self.nc.is_connected:
            return
        self._seq += 1
        run = self.run_
        hb = Heartbeat(
            fellow=self.identity,
            seq=self._seq,
            status=self.status,
            job_id=run.job_id if run else None,
            attempt=run.attempt if run else None,
            step=self.step if run else None,
            loss=self.loss if run else None,
            outcome=self.outcome,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            hardware=self.probe.snapshot(),
            link_probe=self._probe_report if time.monotonic() < self._probe_report_until else None,
        )
        try:
            await self.nc.publish(
                topics.HEARTBEAT.subject(self.prefix, fellow=self.fellow_id), topics.encode(hb)
            )
        except NatsError as exc:
            log.debug("heartbeat not sent: %s", exc)

    # --- signals ---------------------------------------------------------------------------

    async def _on_signal(self, msg: Msg) -> None:
        try:
            sig = topics.SIGNAL.decode(msg.data)
        except ProtocolError as exc:
            await self._refuse_malformed(msg, exc)
            return
        seen = self._acks.get(sig.signal_id)
        if seen is not None:
            await self._respond(msg, _as_duplicate(seen))
            return
        try:
            ack = await self._handle(sig)
        except Exception as exc:  # a bug must still be answered, and not kill the agent
            log.exception("signal %s failed", sig.kind)
            ack = self._ack(sig, False, ErrorCode.SIGNAL_FAILED, f"{type(exc).__name__}: {exc}")
        self._remember_ack(ack)
        await self._respond(msg, ack)

    async def _refuse_malformed(self, msg: Msg, exc: ProtocolError) -> None:
        """Answer a signal that does not decode: by its id and with what was wrong, when those
        can still be read (and that answer again to a retry), else as a protocol error."""
        try:
            head: SignalHead | None = msgspec.msgpack.decode(msg.data, type=SignalHead)
        except msgspec.DecodeError:
            head = None
        refusal = malformed(head, str(exc))
        log.warning("refused a malformed signal on %s: %s", msg.subject, exc)
        signal_id = head.signal_id if head is not None else ""
        seen = self._acks.get(signal_id) if signal_id else None
        if seen is not None:
            await self._respond(msg, _as_duplicate(seen))
            return
        ack = SignalAck(
            signal_id=signal_id,
            fellow_id=self.fellow_id,
            ok=False,
            code=refusal.code,
            message=refusal.message[:ACK_MESSAGE_CHARS],
        )
        if signal_id:
            self._remember_ack(ack)
        await self._respond(msg, ack)

    def _remember_ack(self, ack: SignalAck) -> None:
        self._acks[ack.signal_id] = ack
        while len(self._acks) > SEEN_SIGNALS:
            self._acks.popitem(last=False)

    async def _handle(self, sig: Signal) -> SignalAck:
        log.info("signal %s (%s) for job %s", sig.kind, sig.signal_id, sig.job_id)
        match sig:
            case StartSignal():
                return await self._on_start(sig)
            case StopSignal():
                return await self._on_stop(sig)
            case CheckpointSignal():
                return await self._on_checkpoint(sig)
            case UpdateSignal():
                return await self._on_update(sig)
            case PurgeSignal():
                return await self._on_purge(sig)
            case RingSignal():
                return await self._on_ring(sig)
            case ProbeSignal():
                return self._on_probe(sig)

    def _ack(
        self, sig: Signal, ok: bool, code: ErrorCode | None = None, message: str = ""
    ) -> SignalAck:
        return SignalAck(
            signal_id=sig.signal_id,
            fellow_id=self.fellow_id,
            ok=ok,
            code=code,
            message=message[:ACK_MESSAGE_CHARS],
        )

    # --- jobs ------------------------------------------------------------------------------

    def _matches(self, sig: Signal) -> bool:
        run = self.run_
        if run is None:
            return False
        return sig.job_id in (None, run.job_id) and sig.attempt in (None, run.attempt)

    def start_state(self) -> AgentState:
        """What :func:`silentswarm.agent.decide.decide` needs to know about this agent."""
        ended = self.outcome
        return AgentState(
            fellow_id=self.fellow_id,
            status=self.status,
            nats=self.nats,
            subject_prefix=self.prefix,
            fellow_dir=self.fellow_dir,
            stopping=self._stop is not None and self._stop.is_set(),
            running_job=self.run_.job_id if self.run_ is not None else None,
            updating=self._updating is not None,
            data_bind=self.settings.data_bind,
            sync_bind=self.settings.sync_bind,
            last_run=None if ended is None else (ended.job_id, ended.attempt),
        )

    async def _on_start(self, sig: StartSignal) -> SignalAck:
        decision = decide(self.start_state(), sig)
        if isinstance(decision, Refusal):
            return self._ack(sig, False, decision.code, decision.message)
        refusal = await self._start(decision)
        if refusal is not None:
            return self._ack(sig, False, refusal.code, refusal.message)
        return self._ack(sig, True, message=decision.message)

    async def _start(self, start: Start) -> Refusal | None:
        """Act on an accepted START: the attempt's NATS connection, then the runtime (after
        its shard arrives, for a resumed attempt). A refusal when that cannot be done."""
        plan = start.plan
        run_nc: Client | None = None
        if start.nats_creds is not None:
            attempt_nats = await self._attempt_access(start.nats_creds, start.workdir)
            try:
                run_nc = await asyncio.wait_for(
                    connect_forever(
                        attempt_nats,
                        name=f"swarm-fellow-{self.fellow_id}-{plan.job_id}-a{plan.attempt}",
                        inbox_prefix=topics.inbox_prefix(self.fellow_id),
                    ),
                    ATTEMPT_CONNECT_S,
                )
            except (TimeoutError, NatsError, OSError) as exc:
                return Refusal(
                    ErrorCode.START_FAILED, f"cannot connect as the attempt's NATS user: {exc}"
                )
            plan = msgspec.structs.replace(plan, nats=attempt_nats)
        run = StageRun(plan, start.workdir, self._on_stage_event, self._on_stage_output)
        waits = bool(start.fetches) or self._probe is not None
        if not waits:
            try:
                await run.start()
            except OSError as exc:
                await _close(run_nc)
                return Refusal(ErrorCode.START_FAILED, f"cannot start the runtime: {exc}")
        self.run_, self.outcome, self.step, self.loss = run, None, 0, None
        self.run_nc = run_nc
        self._down_transport = None
        self._down_link, self._tuning = None, None
        self._checkpoint_final = False
        self._end_submitted, self._end_error = False, None
        self._set_status(FellowEvent.START)
        if waits:
            self._background(self._fetch_and_start(run, start), "stage-fetch")
        self._background(self._supervise(run), "stage-supervisor")
        return None

    async def _attempt_access(self, creds: str, workdir: Path) -> NatsAccess:
        """How the run reaches NATS: as the attempt's own user, its credentials written 0600
        in the run's private folder."""
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o700)
        path = workdir / "attempt.creds"
        await asyncio.to_thread(write_private, path, creds)
        return msgspec.structs.replace(self.nats, creds=str(path))

    def _background(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch_and_start(self, run: StageRun, start: Start) -> None:
        """Download the stage's datasets, then the shard it resumes from or the export it
        starts from, then start it, once a link probe that holds the data port has ended."""
        fetches = []
        if start.datasets is not None:
            fetches.append(("the uploaded data", fetch_datasets, (start.datasets,)))
        if start.resume is not None:
            fetches.append(
                ("the shard to resume from", fetch_shard, (start.resume, start.resume_dir))
            )
        if start.init is not None:
            fetches.append(("the export to start from", fetch_init, (start.init, start.init_dir)))
        for what, fetch, args in fetches:
            try:
                await asyncio.to_thread(fetch, *args)
            except (FetchError, OSError) as exc:
                log.error("job %s: cannot fetch %s: %s", run.job_id, what, exc)
                run.fail_unstarted(f"cannot fetch {what}: {exc}")
                return
            log.info("job %s: fetched %s", run.job_id, what)
        probe = self._probe
        if probe is not None:
            # Its thread holds the data port the stage binds: it ends by its own deadline.
            log.info("job %s: waiting for the link probe to end", run.job_id)
            await asyncio.wait({probe}, timeout=PROBE_WAIT_S)  # never raises
        if run.finished.done():  # stopped meanwhile
            return
        try:
            await run.start()
        except OSError as exc:
            run.fail_unstarted(f"cannot start the runtime: {exc}")

    async def _on_stop(self, sig: StopSignal) -> SignalAck:
        reason = sig.args.reason or "stopped by the leader"
        stopped = ""
        if self.run_ is not None and (self._matches(sig) or sig.args.release):
            # Acknowledged once the runtime has its SIGTERM; its outcome follows in progress
            # and heartbeats. Waiting here would hold up every other signal to this fellow.
            self.run_.terminate(reason)
            stopped = f"stopping job {sig.job_id or self.run_.job_id}"
        if sig.args.release:
            self._exit("released by an operator")
            return self._ack(sig, True, message=(stopped + "; " if stopped else "") + "exiting")
        return self._ack(sig, True, message=stopped or "nothing to stop")

    async def _on_checkpoint(self, sig: CheckpointSignal) -> SignalAck:
        run = self.run_
        if run is None or not self._matches(sig):
            return self._ack(
                sig, False, ErrorCode.NOT_TRAINING, "this fellow is not running that job"
            )
        at_step = sig.args.at_step
        sent = await run.command(CheckpointRequest(id=sig.args.checkpoint_id, at_step=at_step))
        if not sent:
            return self._ack(sig, False, ErrorCode.RUNTIME_GONE, "the stage runtime has exited")
        if self.status is FellowStatus.TRAINING:
            self._set_status(FellowEvent.CHECKPOINT)
        return self._ack(sig, True, message=f"checkpoint at step {at_step}")

    async def _on_ring(self, sig: RingSignal) -> SignalAck:
        """Elastic membership: hand the stage its ring's new membership. A change that does
        not fit the stage (another replica's, a ring without it) is refused here."""
        run = self.run_
        if run is None or not self._matches(sig) or sig.job_id is None:
            return self._ack(
                sig, False, ErrorCode.NOT_TRAINING, "this fellow is not running that job"
            )
        change = sig.args.change
        plan = run.plan
        problems = (
            list(change.problems(plan.replica, (plan.layer_start, plan.layer_end)))
            if plan.replicated
            else ["no replicas"]
        )
        size = len(encode_command(RingCommand(change=change)))
        if size > MAX_COMMAND_BYTES:
            problems.append(
                f"the change is {size} bytes, over the {MAX_COMMAND_BYTES} a stage reads"
            )
        if problems:
            return self._ack(sig, False, ErrorCode.RING_INVALID, "; ".join(problems))
        if not await run.command(RingCommand(change=change)):
            return self._ack(sig, False, ErrorCode.RUNTIME_GONE, "the stage runtime has exited")
        if change.checkpoint_at_end is not None:
            run.leads = change.checkpoint_at_end
        return self._ack(
            sig,
            True,
            message=f"ring {change.epoch} of replicas {change.members} from step {change.at_step}",
        )

    def _on_probe(self, sig: ProbeSignal) -> SignalAck:
        """Measure the link to another fellow, in a thread, while this one runs no stage;
        the result goes out in the next heartbeats."""
        args = sig.args
        busy = self._busy_for_probe()
        if busy is not None:
            return self._ack(sig, False, ErrorCode.PROBE_REFUSED, f"no link probe: {busy}")
        bind = self.settings.data_bind or self.identity.data_address
        if args.bind and bind is None:
            return self._ack(
                sig, False, ErrorCode.PROBE_REFUSED, "no link probe: no data address to bind"
            )
        probe = asyncio.get_running_loop().create_task(
            asyncio.to_thread(run_probe, args, bind=bind), name=f"probe-{args.probe_id}"
        )
        self._probe = probe
        probe.add_done_callback(self._probe_ended)
        role = "binding" if args.bind else f"connecting to {args.address}"
        return self._ack(sig, True, message=f"probing the link to {args.peer}, {role}")

    def _busy_for_probe(self) -> str | None:
        """Why this fellow cannot probe a link now (None: it can)."""
        if self.run_ is not None:
            return "it runs a stage"
        if self._probe is not None:
            return "it is probing another link"
        if self._updating is not None or (self._stop is not None and self._stop.is_set()):
            return "it is updating or stopping"
        if self.status is not FellowStatus.READY:
            return f"it is {self.status.value}"
        return None

    def _probe_ended(self, task: asyncio.Task[LinkProbeReport]) -> None:
        self._probe = None
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # a bug: the probe reports the link's faults itself
            log.error("link probe failed", exc_info=exc)
            return
        self._probe_report = task.result()
        self._probe_report_until = time.monotonic() + PROBE_REPORT_FOR_S
        self._background(self._send_heartbeat(), "probe-report")

    async def _on_update(self, sig: UpdateSignal) -> SignalAck:
        package: PackageRef | None = sig.args.package
        if self.settings.fellow_prefix is None:
            package = None  # installed by other means (a .deb, pip): restart as installed
        if self._updating is not None:
            return self._ack(sig, True, message="an update is already under way")
        self._update_package = package
        if self.status is FellowStatus.READY and self.run_ is None:
            self._update_now()
            if package is not None:
                return self._ack(sig, True, message=f"reinstalling {package.file}, then restarting")
            return self._ack(sig, True, message=f"restarting agent (version {__version__})")
        self._update_when_idle = True
        job = self.run_.job_id if self.run_ else "the current job"
        return self._ack(sig, True, message=f"deferred: will update when {job} ends")

    def _update_now(self) -> None:
        """Reinstall first when the leader named a package and fellow.sh installed us."""
        self._update_when_idle = False
        package, self._update_package = self._update_package, None
        if package is None:
            self._restart()
            return
        prefix = self.settings.fellow_prefix
        assert prefix is not None

        async def update() -> None:
            log.info("update: installing %s from %s", package.file, package.url)
            try:
                done = await asyncio.to_thread(
                    reinstall, package, prefix, self.settings.fellow_pip_args
                )
            except UpdateError as exc:
                log.error("update failed, still running %s: %s", __version__, exc.message)
                return
            finally:
                self._updating = None
            log.info("update: %s", done)
            self._restart()

        self._updating = asyncio.get_running_loop().create_task(update())

    async def _on_purge(self, sig: PurgeSignal) -> SignalAck:
        """Stop, remove what this fellow keeps (and, when fellow.sh installed it, the whole
        install: its systemd user unit, venv, configuration), answer, then exit."""
        if self.run_ is not None:
            await self.run_.stop("purged")
        removed = await asyncio.to_thread(
            purge_install, self.fellow_dir, self.settings.fellow_prefix
        )
        self._exit("purged by an operator")
        return self._ack(sig, True, message=f"removed {', '.join(removed)}; exiting")

    @property
    def fellow_dir(self):
        return self.settings.fellow_dir(self.fellow_id).resolve()

    def _on_stage_event(self, event: StageEvent) -> None:
        run = self.run_
        if run is None:
            return
        if isinstance(event, LinksEvent):
            self._down_transport = event.down
            self._down_link = event.down_link or self._down_link
            self._tuning = event.tuning or self._tuning
        elif isinstance(event, StepEvent):
            self._on_step(run, event)
        elif isinstance(event, CheckpointEvent):
            self._on_checkpoint_written(run, event)
        elif isinstance(event, JoiningEvent):
            self._publish_progress(
                run, ProgressEvent.JOINING, step=0, **sync_fields(run.plan, None)
            )

    def _on_step(self, run: StageRun, event: StepEvent) -> None:
        self.step, self.loss = event.step + 1, event.loss
        self.bytes_sent, self.bytes_received = event.bytes_sent, event.bytes_received
        # Every step: the leader's history stream keeps the whole curve.
        self._publish_progress(
            run,
            ProgressEvent.STEP,
            step=self.step,
            total_steps=run.plan.train.steps,
            loss=event.loss,
            val_loss=event.val_loss,
            lr=event.lr,
            step_time_s=event.step_time_s,
            wait_s=event.wait_s,
            throttled_s=event.throttled_s,
            tokens_per_s=event.tokens_per_s,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            down_bytes_sent=event.down_bytes_sent or 0,
            down_bytes_received=event.down_bytes_received or 0,
            down_transport=self._down_transport,
            down_link=self._down_link,
            tuning=self._tuning,
            relay_dropped=event.relay_dropped,
            **sync_fields(run.plan, event),
        )

    def _on_checkpoint_written(self, run: StageRun, event: CheckpointEvent) -> None:
        written = event.ok and event.path is not None
        periodic = event.id.startswith("every-")
        if event.id == "end":
            if written:
                self._end_submitted = self.pusher is not None
            else:
                self._end_error = event.message or "the checkpoint failed"
        if written and self.pusher is not None:
            assert event.path is not None
            # Every checkpoint goes to the leader (the export, and where a resume starts);
            # a periodic one may be overtaken by the next, the others are kept.
            self.pusher.submit(
                Shard(
                    job_id=run.job_id,
                    attempt=run.attempt,
                    stage=run.plan.stage,
                    replica=run.plan.replica,
                    lead=run.leads,
                    step=event.step,
                    directory=Path(event.path),
                    periodic=periodic,
                    client=self.run_nc,
                )
            )
        if periodic or event.id == "end":
            return  # the stage's own checkpoints: no operator's CHECKPOINT to answer
        self._publish_progress(
            run,
            ProgressEvent.CHECKPOINT,
            step=event.step,
            ok=event.ok,
            message=event.message[:MESSAGE_CHARS],
            checkpoint_path=event.path,
            checkpoint_id=event.id,
        )
        if event.final:
            self._checkpoint_final = True
        elif self.status is FellowStatus.CHECKPOINTING:
            self._set_status(FellowEvent.CHECKPOINT_WRITTEN)

    def _on_stage_output(self, stream: str, line: str) -> None:
        """A line the runtime wrote: into the fellow's shipped logs."""
        level = "ERROR" if line.startswith(("swarm-stage: error", "Traceback")) else "INFO"
        self.shipper.add(level, f"stage.{stream}", line)

    async def _supervise(self, run: StageRun) -> None:
        """Wait for the runtime to end, push its last shards, report how, go back to ready."""
        outcome = await run.finished
        if len(outcome.message) > MESSAGE_CHARS:
            outcome = msgspec.structs.replace(outcome, message=outcome.message[:MESSAGE_CHARS])
        # The export must be whole when the job is COMPLETED: report the end after it, and
        # if the final shard did not make it, say why.
        if outcome.result is StageResult.COMPLETED:
            outcome = await self._with_export_error(run, outcome)
        self.outcome = outcome
        self.step = outcome.step
        log.info(
            "job %s attempt %d: %s %s", run.job_id, run.attempt, outcome.result, outcome.message
        )
        if outcome.result is StageResult.FAILED:
            self._set_status(FellowEvent.FAILURE)
        ended = self._publish_progress(
            run,
            ProgressEvent.ENDED,
            step=outcome.step or 0,
            outcome=outcome,
            **sync_fields(run.plan, run.done),
        )
        if ended is not None:
            await ended
        await self._send_heartbeat()
        self.run_ = None
        run_nc, self.run_nc = self.run_nc, None
        await _close(run_nc)  # flushes what is still buffered, then the attempt's user goes
        self._back_to_ready()
        await self._send_heartbeat()
        if self.settings.fellow_exit_after_training:
            self._exit("SWARM_FELLOW_EXIT_AFTER_TRAINING is set")
        elif self._update_when_idle and self.status is FellowStatus.READY:
            self._update_now()

    async def _with_export_error(self, run: StageRun, outcome: StageOutcome) -> StageOutcome:
        """A completed run's outcome, with why its final shard is not on the leader if not.

        Only the lead replica pushes shards (the export is its pipeline's: replica 0's, or
        the one a ring change made lead): another replica's outcome says nothing of an
        export."""
        if not run.leads:
            return outcome
        drained = self.pusher is not None and await self.pusher.drain(PUSH_DRAIN_S)
        push_error = None
        if self.pusher is not None:
            push_error = self.pusher.failure(run.job_id, run.attempt, run.plan.train.steps)
        export_error = final_export_error(
            submitted=self._end_submitted,
            checkpoint_error=self._end_error,
            drained=drained,
            push_error=push_error,
        )
        if export_error is None:
            return outcome
        log.error("job %s: the final shard is not on the leader: %s", run.job_id, export_error)
        return msgspec.structs.replace(outcome, export_error=export_error[:EXPORT_ERROR_CHARS])

    def _back_to_ready(self) -> None:
        if self.status is FellowStatus.FAILED:
            self._set_status(FellowEvent.RECOVERED)
        elif self.status is FellowStatus.CHECKPOINTING and self._checkpoint_final:
            self._set_status(FellowEvent.FINAL_CHECKPOINT_WRITTEN)
        elif self.status in (FellowStatus.TRAINING, FellowStatus.CHECKPOINTING):
            self._set_status(FellowEvent.JOB_TERMINAL)

    def _publish_progress(
        self, run: StageRun, event: ProgressEvent, **fields: Any
    ) -> asyncio.Task[None] | None:
        # While NATS is away nats-py buffers what we publish (up to PENDING_BYTES) and sends it
        # on reconnect: the durable history keeps every step through an outage.
        nc = self.run_nc if self.run_nc is not None else self.nc
        if nc is None or nc.is_closed:
            return None
        fields.setdefault("replica", run.plan.replica)
        msg = Progress(
            job_id=run.job_id,
            fellow_id=self.fellow_id,
            attempt=run.attempt,
            stage=run.plan.stage,
            event=event,
            **fields,
        )
        subject = topics.PROGRESS.subject(self.prefix, job=run.job_id, fellow=self.fellow_id)
        return asyncio.get_running_loop().create_task(
            _publish(nc, subject, topics.encode(msg)), name="progress"
        )

    def _set_status(self, event: FellowEvent) -> None:
        try:
            self.status = next_status(self.status, event)
        except IllegalTransitionError as exc:
            log.error("%s (ignored)", exc.message)
            return
        if self.nc is not None and self._registered.is_set():
            asyncio.get_running_loop().create_task(self._send_heartbeat())

    def _restart(self) -> None:
        log.info("restarting the agent for an update")
        self.restart_requested = True
        if self._stop is not None:
            self._stop.set()

    def _exit(self, reason: str) -> None:
        log.info("exiting: %s", reason)
        self.exit_reason = reason
        if self._stop is not None:
            self._stop.set()

    async def _respond(self, msg: Msg, ack: SignalAck) -> None:
        if msg.reply:
            with contextlib.suppress(NatsError):
                await msg.respond(topics.encode(ack))


def final_export_error(
    *, submitted: bool, checkpoint_error: str | None, drained: bool, push_error: str | None
) -> str | None:
    """Why a completed stage's final shard is not on the leader; None when it is.

    ``submitted``: its final checkpoint was written and handed to the pusher;
    ``checkpoint_error``: why it could not be written; ``drained``: the pushes ended within
    PUSH_DRAIN_S; ``push_error``: why the final push failed, if it did."""
    if checkpoint_error is not None:
        return checkpoint_error
    if not submitted:
        return "the stage wrote no final checkpoint (or this agent cannot push shards)"
    if not drained:
        return f"the final shard push was still running after {PUSH_DRAIN_S:.0f}s"
    return push_error


async def _publish(nc: Client, subject: str, payload: bytes) -> None:
    with contextlib.suppress(NatsError):
        await nc.publish(subject, payload)


async def _close(nc: Client | None) -> None:
    if nc is not None and not nc.is_closed:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.drain(), 5.0)


def purge_install(fellow_dir: Path, prefix: Path | None) -> list[str]:
    """Delete the fellow's state, and its whole install when it has a prefix of its own."""
    removed = []
    shutil.rmtree(fellow_dir, ignore_errors=True)
    removed.append(str(fellow_dir))
    if prefix is not None and prefix.is_dir():
        unit = Path.home() / ".config" / "systemd" / "user" / "swarm-fellow.service"
        if unit.exists() and (str(prefix) in unit.read_text()):
            subprocess.run(
                ["systemctl", "--user", "disable", "swarm-fellow.service"],
                capture_output=True,
                timeout=30,
                check=False,
            )
            unit.unlink(missing_ok=True)
            removed.append(str(unit))
        # The running venv may go: the process keeps its open files until it exits.
        for child in prefix.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        removed.append(f"{prefix}/*")
    return removed


def _as_duplicate(ack: SignalAck) -> SignalAck:
    return SignalAck(
        signal_id=ack.signal_id,
        fellow_id=ack.fellow_id,
        ok=ack.ok,
        code=ack.code,
        message=ack.message,
        duplicate=True,
    )
