"""Process plumbing shared by the leader, the agent and the CLI: spawning children that die
with their parent, free and busy ports, stopping processes without leaving any behind, telling
whether a pid is still the process we started, and file locks a child holds for its life."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import msgspec
import psutil

from silentswarm.errors import PortInUseError

T = TypeVar("T")
_PR_SET_PDEATHSIG = 1
PROC = Path("/proc")
BOOT_ID = PROC / "sys" / "kernel" / "random" / "boot_id"
# States of /proc/<pid>/stat that are not a running process: zombie, dead.
_DEAD_STATES = frozenset("ZXx")
# /proc/<pid>/stat after comm's closing ')': field 3 (state) is index 0, field 22
# (starttime, clock ticks since boot) is index 19.
_STATE_INDEX = 0
_START_TICKS_INDEX = 19


class ProcessIdentity(msgspec.Struct, frozen=True):
    """A process as the kernel knows it, in a way that neither a wall-clock step nor pid reuse
    can fool: its start time in clock ticks since boot (field 22 of ``/proc/<pid>/stat``,
    which never moves) and the boot it belongs to (so a reboot that reuses the pid is caught).
    psutil's ``create_time()`` adds the wall-clock boot time, so it moves when the clock does.
    """

    pid: int
    start_ticks: int
    boot_id: str


class ProcStat(msgspec.Struct, frozen=True):
    """The fields of ``/proc/<pid>/stat`` that identity needs."""

    state: str
    start_ticks: int


def parse_proc_stat(text: str) -> ProcStat:
    """Parse ``/proc/<pid>/stat``. Field 2 (comm) is in parentheses and may itself hold spaces
    and parentheses, so the fields are counted from after the LAST ``)``.

    Raises ValueError for text that is not a stat line.
    """
    close = text.rfind(")")
    if close < 0 or "(" not in text[:close]:
        raise ValueError(f"not a /proc/<pid>/stat line (no '(comm)'): {text[:80]!r}")
    fields = text[close + 1 :].split()
    if len(fields) <= _START_TICKS_INDEX:
        raise ValueError(f"/proc/<pid>/stat line too short ({len(fields) + 2} fields)")
    state, ticks = fields[_STATE_INDEX], fields[_START_TICKS_INDEX]
    if len(state) != 1 or not state.isalpha():
        raise ValueError(f"/proc/<pid>/stat: bad state {state!r}")
    if not ticks.isdigit():
        raise ValueError(f"/proc/<pid>/stat: bad starttime {ticks!r}")
    return ProcStat(state=state, start_ticks=int(ticks))


def boot_id() -> str:
    """This boot's id: a new random one after every reboot."""
    return BOOT_ID.read_text().strip()


def read_proc_stat(pid: int) -> ProcStat | None:
    """The stat of ``pid``, or None when no such process exists.

    Raises psutil.AccessDenied when a process with that pid exists but cannot be inspected
    (``/proc`` mounted with ``hidepid``): the caller cannot tell whose it is.
    """
    try:
        text = (PROC / str(pid) / "stat").read_text(errors="replace")
    except PermissionError:
        raise psutil.AccessDenied(pid) from None
    except (FileNotFoundError, ProcessLookupError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            raise psutil.AccessDenied(pid) from None
        return None  # it exited and the pid came back between the two looks: not ours
    return parse_proc_stat(text)


def identity_of(pid: int) -> ProcessIdentity | None:
    """The identity of the running process ``pid``; None if there is none (or a zombie)."""
    try:
        stat = read_proc_stat(pid)
    except psutil.AccessDenied:
        return None
    if stat is None or stat.state in _DEAD_STATES:
        return None
    return ProcessIdentity(pid=pid, start_ticks=stat.start_ticks, boot_id=boot_id())


def same_process(identity: ProcessIdentity) -> psutil.Process | None:
    """The process ``identity`` names if it is still running, else None (exited, a zombie,
    its pid reused, or the machine rebooted since). The wall clock plays no part.

    Raises psutil.AccessDenied when a process with that pid exists but cannot be inspected.
    """
    if identity.boot_id != boot_id():
        return None
    try:
        # psutil.Process first, /proc after: a match afterwards proves the psutil object was
        # made for our process (it started long before and still runs), not a predecessor.
        proc = psutil.Process(identity.pid)
    except psutil.NoSuchProcess:
        return None
    stat = read_proc_stat(identity.pid)
    if stat is None or stat.state in _DEAD_STATES or stat.start_ticks != identity.start_ticks:
        return None
    return proc


def die_with_parent(sig: int = signal.SIGTERM, *, parent: int | None = None) -> Callable[[], None]:
    """A function that asks Linux to send ``sig`` to the process calling it when its parent
    dies: a ``preexec_fn`` made in the parent (``parent`` defaults to the pid of the process
    making it), or, in a child that ties itself, called with the pid its parent had (a
    multiprocessing child: ``multiprocessing.parent_process().pid``).

    The request only covers a death after it is made: a parent killed between ``fork`` and
    the ``prctl`` (a window of milliseconds, wide on a loaded machine) has already handed the
    child to a reaper, and no signal would ever come. So the caller checks afterwards that
    its parent is still ``parent``, and exits at once if not.
    """
    expected = os.getpid() if parent is None else parent

    def _set() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != expected:
            os._exit(128 + sig)

    return _set


def spawn(
    argv: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    detach: bool = False,
    tie_to_parent: bool = False,
    cwd: Path | None = None,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with stdout and stderr appended to ``log_path``.

    ``detach`` puts the child in its own session so it outlives the caller (start-cluster);
    ``tie_to_parent`` makes it die with the caller (a leader's own nats-server);
    ``pass_fds`` are inherited by the child (a lock it holds for its life, see ``try_lock``).
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
            pass_fds=tuple(pass_fds),
        )


def try_lock(path: Path) -> int | None:
    """An open fd on ``path`` (created if missing) that holds an exclusive ``flock``, or None
    when another open file already holds it.

    A flock belongs to the open file description, not to a process: a child that inherits
    the fd (``spawn(pass_fds=[fd])``) holds the lock for as long as it lives, after this
    process has closed its copy or exited, and the kernel frees it when the child dies,
    however it dies. Close the fd here once the child has it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_locked(path: Path) -> bool:
    """Whether some open file holds the flock on ``path`` (a missing file is not locked)."""
    if not path.exists():
        return False
    fd = try_lock(path)
    if fd is None:
        return True
    os.close(fd)
    return False


def write_locked(fd: int, data: bytes) -> None:
    """Replace the contents of the file behind a ``try_lock`` fd (who holds the lock)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


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


# Free ports are picked below the kernel's ephemeral range: the kernel hands those out to
# every connect() and bind(0) on the machine, so a port looked at there could be taken by any
# process's outgoing connection before the caller binds it (a busy test suite did exactly that).
# Below the range, only another picker or a fixed service can take it.
PICK_PORTS_FROM = 10_000
EPHEMERAL_PORTS = PROC / "sys" / "net" / "ipv4" / "ip_local_port_range"


def ephemeral_port_floor(path: Path = EPHEMERAL_PORTS) -> int:
    """The lowest port the kernel picks by itself (32768 where it cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def bindable(host: str, port: int) -> bool:
    """Whether ``port`` on ``host`` can be bound now, counting lingering connections."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port free on ``host`` when looked at, chosen at random below the ephemeral range
    (see PICK_PORTS_FROM); the kernel's choice only where that range leaves too little room."""
    floor = ephemeral_port_floor()
    if floor - PICK_PORTS_FROM >= 1_000:
        for _ in range(tries):
            port = random.randrange(PICK_PORTS_FROM, floor)
            if bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1", tries: int = 100) -> int:
    """The first of ``n`` consecutive free ports (a sync address range, one port per ring);
    like :func:`free_port`, free when looked at."""
    for _ in range(tries):
        first = free_port(host)
        socks: list[socket.socket] = []
        try:
            for port in range(first, first + n):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return first
    raise OSError(f"no {n} consecutive free ports on {host}")


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
    """Exited: no such process, or a zombie that nobody has reaped yet, all its threads gone.

    Processes that start-cluster detached are reaped by PID 1, which may take its time. A
    multi-threaded process's main thread (nats-server's) can turn zombie while its other
    threads are still exiting, holding the files they share (the store's lock) a moment
    longer: it is gone once it is the only thread left.
    """
    try:
        return proc.status() == psutil.STATUS_ZOMBIE and proc.num_threads() <= 1
    except psutil.NoSuchProcess:
        return True


def stop_processes(
    procs: Sequence[psutil.Process], *, timeout: float = 15.0
) -> list[psutil.Process]:
    """SIGTERM all, wait up to ``timeout``, then SIGKILL the rest.

    Returns those still running after all that: none, unless a process may not be signalled
    (another user's: AccessDenied, not waited for) or does not die even of SIGKILL.
    """
    denied: list[psutil.Process] = []

    def signal_all(
        targets: Sequence[psutil.Process], send: Callable[[psutil.Process], None]
    ) -> None:
        for proc in targets:
            try:
                send(proc)
            except psutil.NoSuchProcess:
                pass
            except psutil.AccessDenied:
                denied.append(proc)

    signal_all(procs, psutil.Process.terminate)
    waiting = [p for p in procs if p not in denied]
    wait_until(lambda: all(is_gone(p) for p in waiting), timeout=timeout, interval=0.02)
    rest = [p for p in waiting if not is_gone(p)]
    signal_all(rest, psutil.Process.kill)
    rest = [p for p in rest if p not in denied]
    wait_until(lambda: all(is_gone(p) for p in rest), timeout=5.0, interval=0.02)
    return [p for p in procs if not is_gone(p)]


def stop_process(proc: psutil.Process, *, timeout: float = 10.0) -> None:
    stop_processes([proc], timeout=timeout)


def tail(path: Path, lines: int = 20) -> str:
    """The last lines of a log file, for error messages."""
    try:
        data = path.read_bytes()[-16384:]
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])
