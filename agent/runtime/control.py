"""The stage's control channel: JSON-line commands from the supervising agent on stdin.

``swarm-stage --control-stdin`` is started by the fellow agent with stdin as a pipe. A daemon
thread reads it line by line; each line is one JSON object, a command of
:mod:`silentswarm.types.stage` (tagged by ``cmd``):

    {"cmd": "checkpoint", "id": "<request id>", "at_step": N}   (at_step null or absent: now)
    {"cmd": "ring", "change": {<a RingChange>}}      (elastic membership: the replicas' ring)

Checkpoint requests are taken when due (:meth:`ControlChannel.due_checkpoints`); ring changes
by :meth:`ControlChannel.take_ring_changes` before each step, or, on a joining stage, by
:meth:`ControlChannel.wait_joining` (which blocks). A ring change this stage cannot take
(``RingChange.problems`` for its replica) or whose epoch is not above the latest one taken
(a duplicate, or one overtaken) is logged and dropped.

A malformed line or an unknown command is logged as a warning and otherwise ignored: a bad
command must never stop training. End of file on stdin means the agent is gone (it holds the
write end for the stage's whole life), so the process exits at once with
:data:`EXIT_SUPERVISOR_GONE`, whatever the main thread is blocked in. This complements
PR_SET_PDEATHSIG, which follows the agent's thread that forked the stage rather than the agent.

No TensorFlow here: the channel is pure logic plus one thread, testable with a pipe.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import NoReturn

import msgspec

from silentswarm.plan import RingChange
from silentswarm.types.stage import (
    COMMANDS,
    MAX_COMMAND_BYTES,
    CheckpointRequest,
    Command,
    RingCommand,
)

log = logging.getLogger(__name__)

EXIT_SUPERVISOR_GONE = 70
"""Exit status when stdin reaches EOF: the supervising agent died (EX_SOFTWARE)."""

MAX_LINE_BYTES = MAX_COMMAND_BYTES
"""A longer line is no command of ours: it is dropped rather than buffered without bound."""


def parse_command(line: bytes | str) -> Command | None:
    """The command on one line, or None (with a warning) when the line is not a valid one.

    The ``cmd`` key is looked up first: msgspec would accept a lone tagged Struct without it.
    """
    try:
        raw = msgspec.json.decode(line)
        kind = raw.get("cmd") if isinstance(raw, dict) else None
        if not isinstance(kind, str) or kind not in COMMANDS:
            log.warning("ignoring control line %.200r: unknown or missing cmd %r", line, kind)
            return None
        return msgspec.convert(raw, COMMANDS[kind])
    except msgspec.DecodeError as exc:  # not JSON, or (ValidationError) not a valid command
        log.warning("ignoring control line %.200r: %s", line, exc)
        return None


def exit_supervisor_gone() -> NoReturn:
    """Leave now, without cleanup: threads blocked in ZeroMQ or TensorFlow must not hold us."""
    log.error("stdin closed, the supervising agent is gone; exiting")
    os._exit(EXIT_SUPERVISOR_GONE)


class ControlChannel:
    """Commands queued by the reader thread and taken by the training loop at step boundaries.

    ``on_eof`` runs when the input ends while the channel is open (by default: exit 70). After
    :meth:`close` (the run has ended) new commands are dropped and EOF is harmless, so an agent
    that closes the pipe once it has seen ``done`` does not turn a success into exit 70.
    """

    def __init__(self, on_eof: Callable[[], None] = exit_supervisor_gone) -> None:
        self._on_eof = on_eof
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # a ring change was queued
        self._pending: list[CheckpointRequest] = []
        self._rings: list[RingChange] = []  # in the order they came
        self._ring_epoch = 0  # the latest epoch taken: one not above it is a duplicate
        self._closed = False

    # --- the reader side ------------------------------------------------------------------

    def feed_line(self, line: bytes | str) -> None:
        """Parse one line and queue its command; blank lines are skipped silently."""
        if not line.strip():
            return
        command = parse_command(line)
        if command is None:
            return
        with self._lock:
            if self._closed:
                what = (
                    f"ring epoch {command.change.epoch}"
                    if isinstance(command, RingCommand)
                    else f"checkpoint {command.id!r}"
                )
                log.warning("the run has ended; ignoring %s", what)
                return
            if isinstance(command, RingCommand):
                change = command.change
                log.info(
                    "ring command: epoch %d, members %s, donor %d, at step %d",
                    change.epoch,
                    change.members,
                    change.donor,
                    change.at_step,
                )
                self._rings.append(change)
                self._arrived.notify_all()
            else:
                self._pending.append(command)

    def feed_chunks(self, chunks: Iterable[bytes]) -> None:
        """Split a byte stream into lines and feed them; the end of ``chunks`` is EOF."""
        buffer = b""
        for chunk in chunks:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                self.feed_line(line)
            if len(buffer) > MAX_LINE_BYTES:
                log.warning("dropping a line longer than %d bytes", MAX_LINE_BYTES)
                buffer = b""  # and the rest of that line, when it ends, is dropped as malformed
        if buffer.strip():
            self.feed_line(buffer)  # a last line without its newline still counts
        self._eof()

    def read_fd(self, fd: int) -> None:
        """Read ``fd`` until EOF (or a read error, which means the same: no supervisor)."""
        self.feed_chunks(_fd_chunks(fd))

    def start_reader(self, fd: int = 0) -> threading.Thread:
        """Read ``fd`` (stdin) in a daemon thread.

        It reads the raw descriptor with ``os.read``, not ``sys.stdin``: a daemon thread
        blocked inside a buffered reader makes interpreter shutdown abort on its lock.
        """
        thread = threading.Thread(target=self.read_fd, args=(fd,), name="control", daemon=True)
        thread.start()
        return thread

    def _eof(self) -> None:
        with self._lock:
            closed = self._closed
        if not closed:
            self._on_eof()

    # --- the training side ----------------------------------------------------------------

    def due_checkpoints(self, steps_done: int, total_steps: int) -> list[CheckpointRequest]:
        """Take the requests due now that ``steps_done`` of ``total_steps`` steps are complete."""
        due: list[CheckpointRequest] = []
        waiting: list[CheckpointRequest] = []
        with self._lock:
            for request in self._pending:
                (due if request.is_due(steps_done, total_steps) else waiting).append(request)
            self._pending = waiting
        return due

    def take_ring_changes(self, replica: int, epoch: int) -> list[RingChange]:
        """Take the ring changes queued since the last call, in the order they came, less
        those member ``replica`` cannot take and those whose epoch is not above ``epoch`` (the
        ring in force) nor above every one taken before (duplicates): each logged, dropped."""
        with self._lock:
            rings, self._rings = self._rings, []
            return [c for c in rings if self._acceptable(c, replica, epoch)]

    def wait_joining(self, replica: int, epoch: int, timeout_s: float) -> RingChange | None:
        """A joining stage's wait: the first acceptable ring change that lists ``replica`` in
        ``joining`` (those queued before it that do not are logged and dropped; those after
        it stay queued); None once ``timeout_s`` has passed without one."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                while self._rings:
                    change = self._rings.pop(0)
                    if not self._acceptable(change, replica, epoch, joining=True):
                        continue
                    return change
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._arrived.wait(remaining)

    def _acceptable(
        self, change: RingChange, replica: int, epoch: int, *, joining: bool = False
    ) -> bool:
        """Whether member ``replica`` (in ring ``epoch``) takes ``change``; the reason logged
        when not. Taking it makes its epoch the latest. Called with the lock held."""
        why = "; ".join(change.problems(replica))
        if not why and change.epoch <= max(epoch, self._ring_epoch):
            why = f"not above epoch {max(epoch, self._ring_epoch)} (a duplicate or overtaken)"
        if not why and joining and replica not in change.joining:
            why = f"this stage joins, and replica {replica} is not in 'joining' {change.joining}"
        if why:
            log.warning("ignoring ring command epoch %d: %s", change.epoch, why)
            return False
        self._ring_epoch = change.epoch
        return True

    def close(self) -> list[CheckpointRequest]:
        """End the channel; return the requests still pending so they can be answered.

        Atomic with respect to the reader: every accepted request is either returned here or
        was taken before, none is lost in between. Ring changes still queued are dropped: the
        run is over.
        """
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, []
            self._rings = []
        return pending


def _fd_chunks(fd: int) -> Iterable[bytes]:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError as exc:
            log.warning("cannot read the control input: %s", exc)
            return
        if not chunk:
            return
        yield chunk


__all__ = [
    "EXIT_SUPERVISOR_GONE",
    "CheckpointRequest",
    "Command",
    "ControlChannel",
    "RingChange",
    "RingCommand",
    "exit_supervisor_gone",
    "parse_command",
]
