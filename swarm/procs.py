"""Process plumbing shared by the leader, the agent and the CLI: spawning children that die
with their parent, free and busy ports, and stopping processes without leaving any behind."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import psutil

from swarm.errors import PortInUseError

T = TypeVar("T")
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` that asks Linux to send ``sig`` to the child when its parent dies."""

    def _set() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)

    return _set


def spawn(
    argv: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    detach: bool = False,
    tie_to_parent: bool = False,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with stdout and stderr appended to ``log_path``.

    ``detach`` puts the child in its own session so it outlives the caller (start-cluster);
    ``tie_to_parent`` makes it die with the caller (a leader's own nats-server).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=detach,
            preexec_fn=die_with_parent() if tie_to_parent else None,
        )


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def ensure_port_free(host: str, port: int, *, what: str, setting: str, flag: str | None) -> None:
    """PortInUseError naming the port and how to change it, when something listens there."""
    if port and port_in_use(host, port):
        how = f"set {setting}" + (f" or pass {flag}" if flag else "")
        raise PortInUseError(f"port {port} on {host} ({what}) is already in use; {how}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_until(
    predicate: Callable[[], T | None],
    *,
    timeout: float,
    interval: float = 0.05,
    abort: Callable[[], str | None] | None = None,
) -> T | None:
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` passes.

    ``abort`` is checked between polls; a non-None string ends the wait early (for example a
    child process that exited). Returns the value, or None on timeout or abort.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if abort is not None and abort() is not None:
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def is_gone(proc: psutil.Process) -> bool:
    """Exited: no such process, or a zombie that nobody has reaped yet.

    Processes that start-cluster detached are reaped by PID 1, which may take its time.
    """
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stop_processes(procs: Sequence[psutil.Process], *, timeout: float = 15.0) -> None:
    """SIGTERM all, wait up to ``timeout``, then SIGKILL the rest: all are gone on return."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    wait_until(lambda: all(is_gone(p) for p in procs), timeout=timeout, interval=0.02)
    rest = [p for p in procs if not is_gone(p)]
    for proc in rest:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    wait_until(lambda: all(is_gone(p) for p in rest), timeout=5.0, interval=0.02)


def stop_process(proc: psutil.Process, *, timeout: float = 10.0) -> None:
    stop_processes([proc], timeout=timeout)


def tail(path: Path, lines: int = 20) -> str:
    """The last lines of a log file, for error messages."""
    try:
        data = path.read_bytes()[-16384:]
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])
