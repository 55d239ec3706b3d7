"""Stage processes forked from a process that has imported TensorFlow already.

A stage process spends 4-5 s of CPU importing TensorFlow, Keras and the runtime before it
does any work: half of what a short stage of the test suite or of a benchmark's smoke run
costs in all. :func:`run_plans <silentswarm.agent.runtime.launch.run_plans>` can instead ask a
fork server, started once per launching process, to fork each stage: the server imports
what a stage imports and nothing runs (TensorFlow's runtime is not initialised, no thread of
its own is started), then forks a child per request that becomes the stage exactly as
``swarm-stage`` would: its argv, its environment, its working directory, the stdin, stdout
and stderr the launcher passed over the socket (``SCM_RIGHTS``), and a parent-death signal
tied to the server, which is tied to the launcher.

Only what TensorFlow reads while it is imported must agree between the server and a stage
(``TF_*``, ``XLA_*``, ``CUDA_*``, thread-pool and Python variables: :func:`import_key`); a
launch whose values differ gets a server of its own. Everything else a stage reads, it reads
after the fork, from the environment its request carried.

It is off unless ``SWARM_STAGE_FORKSERVER=1`` (the test suite sets it): a fellow's agent
starts its stages as processes of their own, and the benchmarks that time a stage's start
measure that.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence

import msgspec

from silentswarm.agent.errors import ForkServerError
from silentswarm.procs import die_with_parent

log = logging.getLogger("forkserver")

ENV_NAME = "SWARM_STAGE_FORKSERVER"
# What TensorFlow, its libraries and Python read at import: a stage whose values of these
# differ from a server's gets another server.
IMPORT_PREFIXES = ("TF_", "XLA_", "CUDA_", "NVIDIA_", "OMP_", "MKL_", "KMP_", "OPENBLAS_")
IMPORT_PREFIXES += ("PYTHON", "LD_", "MALLOC_", "GLIBC_")
PRELOAD = ("silentswarm.agent.runtime.main", "silentswarm.agent.runtime.stage")
_PR_SET_NAME = 15
MAX_MESSAGE_BYTES = 1 << 20  # one request: an argv and an environment
START_TIMEOUT_S = 120.0  # the server's imports, on a loaded machine


class ForkRequest(msgspec.Struct, tag="fork"):
    """Fork a stage: ``argv`` as ``swarm-stage``'s (``[python, -m, module, args...]``); the
    three descriptors that come with the message become its 0, 1 and 2."""

    argv: list[str]
    env: dict[str, str]
    cwd: str


class Ready(msgspec.Struct, tag="ready"):
    """The server imported everything and may fork."""

    pid: int


class Forked(msgspec.Struct, tag="forked"):
    pid: int


class Refused(msgspec.Struct, tag="refused"):
    message: str


class Exited(msgspec.Struct, tag="exited"):
    """A child ended: ``returncode`` as :class:`subprocess.Popen` has it (-N: signal N)."""

    pid: int
    returncode: int


Reply = Ready | Forked | Refused | Exited
_replies = msgspec.json.Decoder(Reply)
_requests = msgspec.json.Decoder(ForkRequest)


def enabled(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ENV_NAME) == "1"


def import_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_PREFIXES)))


# --- the launcher's side --------------------------------------------------------------------


class ForkedProcess:
    """A stage forked by the server: the part of :class:`subprocess.Popen` that launchers use.

    It is the server's child, not ours: the server reports its exit, and signals go through a
    pidfd, which cannot reach another process that took the pid over."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._server = server
        self._ended = threading.Event()
        self._pidfd: int | None = None
        with contextlib.suppress(OSError):  # already gone and reaped: its exit is on the way
            self._pidfd = os.pidfd_open(pid)

    def _exited(self, returncode: int) -> None:
        self.returncode = returncode
        self._ended.set()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        if not self._ended.is_set() and not self._server.alive():
            self._exited(-signal.SIGKILL)  # the server is gone, and its children with it
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout) and self.poll() is None:
            raise subprocess.TimeoutExpired(f"stage {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        fd = self._pidfd
        if fd is None or self._ended.is_set():
            return
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(fd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One fork server process and the socket to it; :meth:`spawn` is thread-safe."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.key = import_key(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()
        self._replies: list[Reply] = []
        self._arrived = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before their Forked was read
        self._closed = False
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        finally:
            theirs.close()
        self._reader = threading.Thread(target=self._read, name="forkserver", daemon=True)
        self._reader.start()
        ready = self._next_reply(START_TIMEOUT_S)
        if not isinstance(ready, Ready):
            self.close()
            raise ForkServerError(f"the stage fork server did not start: {ready}")

    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdout: int,
        stderr: int,
        stdin: int,
        cwd: str | None = None,
    ) -> ForkedProcess:
        request = ForkRequest(argv=list(argv), env=dict(env), cwd=cwd or os.getcwd())
        with self._lock:
            if not self.alive():
                raise ForkServerError("the stage fork server is gone")
            try:
                socket.send_fds(self._sock, [msgspec.json.encode(request)], [stdin, stdout, stderr])
            except OSError as exc:
                raise ForkServerError(f"the stage fork server is gone: {exc}") from None
            reply = self._next_reply(30.0)
            if isinstance(reply, Refused):
                raise ForkServerError(f"the stage fork server refused: {reply.message}")
            if not isinstance(reply, Forked):
                raise ForkServerError(f"the stage fork server answered {reply!r}")
            child = ForkedProcess(reply.pid, self)
            with self._arrived:
                self._children[reply.pid] = child
                early = self._early.pop(reply.pid, None)
            if early is not None:
                child._exited(early)
            return child

    def _next_reply(self, timeout: float) -> Reply | None:
        with self._arrived:
            if not self._arrived.wait_for(lambda: self._replies or self._closed, timeout):
                return None
            return self._replies.pop(0) if self._replies else None

    def _read(self) -> None:
        try:
            while True:
                data = self._sock.recv(MAX_MESSAGE_BYTES)
                if not data:
                    break
                reply = _replies.decode(data)
                with self._arrived:
                    if isinstance(reply, Exited):
                        child = self._children.pop(reply.pid, None)
                        if child is None:
                            self._early[reply.pid] = reply.returncode
                        else:
                            child._exited(reply.returncode)
                    else:
                        self._replies.append(reply)
                    self._arrived.notify_all()
        except (OSError, msgspec.DecodeError):
            pass
        with self._arrived:
            self._closed = True
            children, self._children = list(self._children.values()), {}
            self._arrived.notify_all()
        for child in children:  # they die with the server
            child._exited(-signal.SIGKILL)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._sock.close()


_servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
_servers_lock = threading.Lock()


def server_for(env: Mapping[str, str]) -> ForkServer | None:
    """This process's fork server for stages of environment ``env``: started on first use,
    again if it died. None off the main thread: the server's parent-death signal follows the
    thread that started it (Linux's ``PR_SET_PDEATHSIG``), and a thread's end must not take
    the server, and the stages of other threads, along."""
    if threading.current_thread() is not threading.main_thread():
        return None
    key = import_key(env)
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive():
            server = _servers[key] = ForkServer(env)
        return server


@atexit.register
def _close_servers() -> None:
    for server in list(_servers.values()):
        server.close()


# --- the server -----------------------------------------------------------------------------


def serve(fd: int) -> None:
    """Import what a stage imports, say Ready, then fork a stage per request and report each
    child's exit, until the launcher closes its end."""
    import importlib

    from silentswarm.agent.runtime.tfsetup import before_import

    before_import()
    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    own = [wake_r, wake_w]
    sock.send(msgspec.json.encode(Ready(pid=os.getpid())))
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap(sock)
        if sock not in readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 3)
        except OSError:
            return
        if not data:
            return  # the launcher is gone; the children follow by their parent-death signal
        try:
            request = _requests.decode(data)
            if len(fds) != 3:
                raise ValueError(f"{len(fds)} descriptors, not 3")
        except (msgspec.DecodeError, ValueError) as exc:
            for extra in fds:
                os.close(extra)
            sock.send(msgspec.json.encode(Refused(message=str(exc))))
            continue
        pid = os.fork()
        if pid == 0:
            _become_stage(request, fds, [sock.detach(), *own])
        for passed in fds:
            os.close(passed)
        sock.send(msgspec.json.encode(Forked(pid=pid)))


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            sock.send(msgspec.json.encode(Exited(pid=pid, returncode=code)))


def _become_stage(request: ForkRequest, fds: list[int], own: list[int]) -> None:
    """In the child: the stage's descriptors, environment, directory and argv, then its main,
    and the interpreter's exit (threads joined, atexit run, streams flushed)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in own:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request.env)
        os.chdir(request.cwd)
        die_with_parent(signal.SIGTERM, parent=os.getppid())()
        _name_process(request.argv)
        code = _run_main(request.argv)
        with contextlib.suppress(Exception):
            threading._shutdown()  # type: ignore[attr-defined]  # what interpreter exit does
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _name_process(argv: list[str]) -> None:
    """The name ``ps -o comm``, ``pgrep`` and ``top`` show: the module's last part (``main``
    is ``swarm-stage``'s); its command line stays the server's, as a fork's does."""
    name = "swarm-stage" if argv[2:3] == ["silentswarm.agent.runtime.main"] else argv[2]
    name = name.rsplit(".", 1)[-1]
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _run_main(argv: list[str]) -> int:
    """``[python, -m, module, args...]``: the module's ``main()`` with ``args`` as sys.argv."""
    import importlib

    if len(argv) < 3 or argv[1] != "-m":
        raise ValueError(f"not a module command line: {argv[:3]}")
    sys.argv = [argv[2], *argv[3:]]
    try:
        importlib.import_module(argv[2]).main()
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    serve(int(sys.argv[1]))
