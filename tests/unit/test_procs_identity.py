"""Process identity that a wall-clock step cannot fool (``/proc/<pid>/stat`` start ticks and
the boot id), the pure rules around it, and file locks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from silentswarm.cli.cluster import legacy_owned
from silentswarm.natsd import choose_port
from silentswarm.procs import (
    PICK_PORTS_FROM,
    ProcessIdentity,
    ProcStat,
    bindable,
    die_with_parent,
    ephemeral_port_floor,
    free_port,
    identity_of,
    is_gone,
    is_locked,
    parse_proc_stat,
    same_process,
    try_lock,
    wait_until,
)

# A real line (fields 3..52) after "<pid> (<comm>)"; field 22 (starttime) is 5555.
_REST = (
    "S 1 1234 1234 0 -1 4194560 2841 0 0 0 10 3 0 0 20 0 1 0 5555 12943360 2304 "
    "18446744073709551615 1 1 0 0 0 0 0 16781312 2 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0"
)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (f"1234 (python) {_REST}\n", ProcStat("S", 5555)),
        (f"1234 (tmux: server) {_REST}", ProcStat("S", 5555)),
        (f"1234 (a (b) c) {_REST}", ProcStat("S", 5555)),
        # comm is the process's to choose: one that mimics fields must not shift them.
        (f"1234 (x) Z 1 2 3) {_REST}", ProcStat("S", 5555)),
        (f"1234 ()) {_REST}", ProcStat("S", 5555)),
        (f"1234 () {_REST}", ProcStat("S", 5555)),
        (f"1234 (nats-server) {_REST.replace('S ', 'Z ', 1)}", ProcStat("Z", 5555)),
        (f"7 (kworker/0:1-events) {_REST.replace(' 5555 ', ' 0 ')}", ProcStat("S", 0)),
    ],
)
def test_parse_proc_stat(line, expected):
    assert parse_proc_stat(line) == expected


@pytest.mark.parametrize(
    "line",
    [
        "",
        "1234 python S 1 2 3",  # no parentheses
        f"1234 python) {_REST}",  # no opening parenthesis
        "1234 (python) S 1 2 3",  # too short
        f"1234 (python) {_REST.replace(' 5555 ', ' 55x5 ')}",
        f"1234 (python) {_REST.replace(' 5555 ', ' -5 ')}",
        f"1234 (python) {_REST.replace('S ', 'SS ', 1)}",
    ],
)
def test_parse_proc_stat_rejects_what_is_not_a_stat_line(line):
    with pytest.raises(ValueError):
        parse_proc_stat(line)


def test_identity_is_the_boot_relative_start_tick_count():
    me = identity_of(os.getpid())
    assert me is not None
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    assert me.start_ticks == int(fields[19])
    # psutil's create_time() is the same count plus the wall-clock boot time (which a clock
    # step moves); the identity keeps only the count.
    since_boot = psutil.Process().create_time() - psutil.boot_time()
    assert me.start_ticks / os.sysconf("SC_CLK_TCK") == pytest.approx(since_boot, abs=0.02)
    assert me.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert identity_of(os.getpid()) == me, "stable over time"


def test_same_process_matches_start_ticks_and_boot_not_just_the_pid():
    me = identity_of(os.getpid())
    assert me is not None
    found = same_process(me)
    assert found is not None and found.pid == os.getpid()
    assert same_process(ProcessIdentity(me.pid, me.start_ticks + 1, me.boot_id)) is None
    assert same_process(ProcessIdentity(me.pid, me.start_ticks, "another-boot")) is None


# The main thread exits alone (pthread_exit): the process lives on in another thread, as a
# multi-threaded server's does for a moment while it dies (its lock still held).
_MAIN_THREAD_EXITS_FIRST = """
import ctypes, sys, threading
release = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), release.set())).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_zombie_main_thread_is_not_gone_while_another_thread_runs():
    child = subprocess.Popen(
        [sys.executable, "-c", _MAIN_THREAD_EXITS_FIRST],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        proc = psutil.Process(child.pid)
        assert wait_until(lambda: proc.status() == psutil.STATUS_ZOMBIE, timeout=30)
        assert proc.num_threads() == 2 and not is_gone(proc)
        child.communicate("go\n", timeout=30)  # the last thread ends: the process exits
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0


# A caller whose child, between fork and exec, waits until the caller is gone before it asks
# to die with it: the window a SIGKILL can fall into, held open.
_CALLER_DIES_BEFORE_THE_REQUEST = """
import os, subprocess, sys, time
from silentswarm.procs import die_with_parent

caller = os.getpid()
tie = die_with_parent()


def late_tie():
    deadline = time.monotonic() + 30
    while os.getppid() == caller and time.monotonic() < deadline:
        time.sleep(0.01)
    tie()


subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=late_tie)
time.sleep(120)
"""


def test_a_child_whose_parent_died_before_it_asked_to_die_with_it_exits():
    caller = subprocess.Popen([sys.executable, "-c", _CALLER_DIES_BEFORE_THE_REQUEST])
    children: list[psutil.Process] = []
    try:
        assert wait_until(lambda: psutil.Process(caller.pid).children(), timeout=30)
        children = psutil.Process(caller.pid).children()
        caller.kill()
        caller.wait(timeout=10)
        assert wait_until(lambda: all(is_gone(child) for child in children), timeout=30)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def test_a_child_whose_parent_lives_keeps_running_after_the_request():
    child = subprocess.Popen(
        [sys.executable, "-c", "print('ran')"], stdout=subprocess.PIPE, preexec_fn=die_with_parent()
    )
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and out == b"ran\n"


@pytest.mark.parametrize(
    ("parent", "returncode"), [("os.getppid()", 0), ("os.getppid() + 1", 128 + 15)]
)
def test_a_child_that_ties_itself_names_the_parent_it_expects(parent, returncode):
    tie = (
        "import os; from silentswarm.procs import die_with_parent; "
        f"die_with_parent(parent={parent})()"
    )
    child = subprocess.run([sys.executable, "-c", tie], timeout=60, check=False)
    assert child.returncode == returncode


def test_an_exited_process_and_a_zombie_are_not_the_same_process():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = identity_of(child.pid)
    assert identity is not None or child.poll() is not None
    # Not reaped yet: a zombie, which is no running process.
    assert wait_until(lambda: is_gone(psutil.Process(child.pid)), timeout=30)
    assert identity_of(child.pid) is None
    if identity is not None:
        assert same_process(identity) is None
    child.wait()
    assert identity_of(child.pid) is None


@pytest.mark.parametrize(
    ("role", "name", "cmdline", "environ", "owned"),
    [
        ("nats", "nats", ["/v/bin/nats-server", "--store_dir", "/s/nats"], None, True),
        ("nats", "nats", ["/v/bin/nats-server", "--store_dir", "/s/nats/"], None, True),
        ("nats", "nats", ["/v/bin/nats-server", "--store_dir", "/other/nats"], None, False),
        ("nats", "nats", ["/v/bin/nats-server"], None, False),
        ("nats", "nats", ["/bin/sleep", "--store_dir", "/s/nats"], None, False),
        (
            "leader",
            "leader",
            ["python", "-m", "silentswarm.leader.main"],
            {"SWARM_STATE_DIR": "/s"},
            True,
        ),
        (
            "leader",
            "leader",
            ["python", "-m", "silentswarm.leader.main"],
            {"SWARM_STATE_DIR": "/s/"},
            True,
        ),
        (
            "leader",
            "leader",
            ["python", "-m", "silentswarm.leader.main"],
            {"SWARM_STATE_DIR": "/t"},
            False,
        ),
        ("leader", "leader", ["python", "-m", "silentswarm.leader.main"], {}, False),
        # A manifest from before 0.2 names processes of the old layout's modules.
        ("leader", "leader", ["python", "-m", "leader.main"], {"SWARM_STATE_DIR": "/s"}, True),
        ("leader", "leader", ["python", "-m", "leader.mainx"], {"SWARM_STATE_DIR": "/s"}, False),
        (
            "fellow",
            "fellow-1",
            ["python", "-m", "agent.main", "--name", "fellow-1"],
            {"SWARM_STATE_DIR": "/s"},
            True,
        ),
        ("leader", "leader", ["python", "-m", "silentswarm.leader.main"], None, False),
        (
            "leader",
            "leader",
            ["python", "-m", "silentswarm.agent.main"],
            {"SWARM_STATE_DIR": "/s"},
            False,
        ),
        ("leader", "leader", ["vim", "silentswarm.leader.main"], {"SWARM_STATE_DIR": "/s"}, False),
        (
            "fellow",
            "fellow-1",
            ["python", "-m", "silentswarm.agent.main", "--name", "fellow-1"],
            {"SWARM_STATE_DIR": "/s"},
            True,
        ),
        (
            "fellow",
            "fellow-1",
            ["python", "-m", "silentswarm.agent.main", "--name", "fellow-2"],
            {"SWARM_STATE_DIR": "/s"},
            False,
        ),
        (
            "fellow",
            "fellow-1",
            ["python", "-m", "silentswarm.agent.main"],
            {"SWARM_STATE_DIR": "/s"},
            False,
        ),
        (
            "ghost",
            "x",
            ["python", "-m", "silentswarm.leader.main"],
            {"SWARM_STATE_DIR": "/s"},
            False,
        ),
        ("leader", "leader", [], {"SWARM_STATE_DIR": "/s"}, False),
    ],
)
def test_a_record_without_identity_is_ours_by_command_and_state_dir(
    role, name, cmdline, environ, owned
):
    got = legacy_owned(role=role, name=name, state_dir="/s", cmdline=cmdline, environ=environ)
    assert got is owned


def test_a_record_without_identity_and_without_state_dir_is_never_ours():
    assert not legacy_owned(
        role="leader",
        name="leader",
        state_dir="",
        cmdline=["python", "-m", "silentswarm.leader.main"],
        environ={"SWARM_STATE_DIR": ""},
    )


@pytest.mark.parametrize(
    ("requested", "pinned", "port"),
    [(0, None, 0), (0, 4300, 4300), (4400, 4300, 4400), (4400, None, 4400)],
)
def test_choose_port_keeps_the_stores_port_for_any(requested, pinned, port):
    assert choose_port(requested, pinned) == port


def test_try_lock_is_exclusive_until_closed(tmp_path):
    path = tmp_path / "x.lock"
    assert not is_locked(path)
    fd = try_lock(path)
    assert fd is not None
    try:
        assert try_lock(path) is None
        assert is_locked(path)
    finally:
        os.close(fd)
    assert not is_locked(path)
    again = try_lock(path)
    assert again is not None
    os.close(again)


def test_a_free_port_is_below_the_kernels_ephemeral_range_and_bindable():
    """The kernel gives ephemeral ports to other processes' connections at any moment; a port
    picked below that range cannot be taken that way between the pick and the bind."""
    floor = ephemeral_port_floor()
    ports = {free_port() for _ in range(20)}
    assert all(PICK_PORTS_FROM <= port < floor for port in ports)
    assert len(ports) > 1
    assert all(bindable("127.0.0.1", port) for port in ports)


def test_a_listening_port_is_not_bindable():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        assert not bindable("127.0.0.1", sock.getsockname()[1])


@pytest.mark.parametrize(
    "text, floor", [("32768\t60999\n", 32768), ("1024 65535", 1024), ("", 32768), ("x", 32768)]
)
def test_the_ephemeral_floor_is_read_from_the_kernels_range(tmp_path, text, floor):
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    assert ephemeral_port_floor(path) == floor
    assert ephemeral_port_floor(tmp_path / "missing") == 32768
