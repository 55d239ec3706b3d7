"""Fixtures that start real components: nats-server on a free port with JetStream in a temp
dir, the leader and fellow agents as real processes. Nothing outlives its test.

Every test under the folders in :data:`INTEGRATION_DIRS` is marked ``integration``, so
``pytest -m "not integration"`` is the fast subset: the unit tests, less those that mark
themselves (they train TensorFlow models or start stage processes)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from silentswarm.agent.pipe.zmq import ZmqLink
from silentswarm.agent.runtime import compilecache, forkserver
from silentswarm.natsauth import NatsAuthority
from silentswarm.natsd import NatsServer, start_nats_server
from silentswarm.procs import free_port
from tests.helpers import Leader, Processes, child_env, wait_for

TESTS = Path(__file__).resolve().parent
_compile_cache = pytest.StashKey[str]()
INTEGRATION_DIRS = ("integration", "faults", "hostile", "ui")


# Under pytest-xdist (the README's ``-n 2``, ``--dist loadgroup`` in pyproject.toml) tests run
# two at a time. These must not run beside each other: they create network namespaces and
# veths (exp/bench/linkemu.py), check that none is left and remove stale ones.
NETNS_MODULES = (
    "integration/test_linkemu.py",
    "integration/test_calibration.py",
    "integration/test_public_access.py",
)
NETNS_TESTS = (
    "integration/test_benchmarks.py::test_wan_",
    "integration/test_link_probes.py::test_a_shaped_",
    "integration/test_link_probes.py::test_idle_fellows_",
    "integration/test_link_probes.py::test_a_boasting_",
    "integration/test_link_probes.py::test_probed_links_",
    "integration/test_link_probes.py::test_probes_run_side_by_side_",
    "integration/test_link_probes.py::test_probed_links_keep_each_",
)
# The slowest first (minutes each, measured): xdist hands work out in collection order, and a
# long test started last keeps one worker busy alone at the end.
SLOW_FIRST = (
    "integration/test_deb.py",
    "integration/test_benchmarks.py",
    "integration/test_replicas_elastic.py",
    "integration/test_replicas_membership.py",
    "integration/test_replicas_runtime.py",
    "integration/test_adapters.py",
    "integration/test_pipeline.py",
    "integration/test_calibration.py",
    "integration/test_overlap.py",
    "unit/test_glue.py",  # its export fixture's group, ~50 s: not at the end
)


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C at its default in the suite and so in every process it starts (a child inherits
    an ignored signal): a suite started in the background (``cmd &`` in a script) runs with
    SIGINT ignored, and a test that sends a process SIGINT expects a terminal's Ctrl-C."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # One compile cache (agent/runtime/compilecache.py) for every stage the suite starts,
    # never ~/.cache: made here, before xdist starts its workers, which inherit it.
    # Stages that run_plans starts are forked from a process that imported TensorFlow once
    # (agent/runtime/forkserver.py): 4-5 s of CPU less each (TensorFlow's import).
    # SWARM_STAGE_FORKSERVER=0 starts every one from scratch, as a fellow's agent does.
    os.environ.setdefault(forkserver.ENV_NAME, "1")
    if not hasattr(config, "workerinput") and compilecache.CACHE_ENV not in os.environ:
        config.stash[_compile_cache] = tempfile.mkdtemp(prefix="swarm-test-xla-")
        os.environ[compilecache.CACHE_ENV] = config.stash[_compile_cache]


def pytest_unconfigure(config: pytest.Config) -> None:
    directory = config.stash.get(_compile_cache, None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark by location: what lives under an integration folder starts real processes.
    For xdist: group what must run on one worker, and put the slowest first.

    First among the hooks: xdist's worker turns each ``xdist_group`` mark into the suffix of
    the test's id that ``--dist loadgroup`` schedules by, in its own hook of this name; run
    after it, the marks came too late and no group held (a module's fixtures were built on
    both workers, the namespace makers could run side by side)."""
    for item in items:
        path = item.path.resolve()
        if path.is_relative_to(TESTS) and path.relative_to(TESTS).parts[0] in INTEGRATION_DIRS:
            item.add_marker(pytest.mark.integration)
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=slow_rank)  # stable: the rest keeps its order


@pytest.hookimpl
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """On the xdist controller, once a worker has collected: the namespace makers carry their
    group in their ids, or the groups silently do not hold (pytest-xdist 3.8 on pytest 9.2
    writes the suffix where pytest no longer reads it, pytest-dev/pytest-xdist#1386) and
    they could run side by side: the run stops, saying why (xdist's own way to stop: an
    exception raised here ends it as "no tests ran")."""
    if node.config.getoption("dist") != "loadgroup":
        return  # another --dist, asked for on the command line: no groups are expected
    loose = [i for i in ids if makes_namespaces(i.removeprefix("tests/"))]
    loose = [i for i in loose if not i.endswith("@netns")]
    if loose:
        dsession = node.config.pluginmanager.getplugin("dsession")
        dsession.shouldstop = (
            f"--dist loadgroup does not group here ({loose[0]} has no @netns suffix): "
            "see pytest-dev/pytest-xdist#1386 and the pytest pin in pyproject.toml"
        )


def makes_namespaces(test_id: str) -> bool:
    """Whether the test ``folder/test_x.py::test_name`` makes network namespaces (group
    ``netns``)."""
    return test_id.startswith(NETNS_MODULES + NETNS_TESTS)


def _test_id(item: pytest.Item) -> str:
    """``folder/test_x.py::test_name[...]``, relative to the tests folder."""
    return item.nodeid.removeprefix("tests/")


def xdist_group(item: pytest.Item) -> str | None:
    """The group of tests ``item`` must run with on one worker: the namespace makers
    together; a module's tests together where they share a module-scoped fixture (a second
    worker would build it again)."""
    test_id = _test_id(item)
    if makes_namespaces(test_id):
        return "netns"
    info = getattr(item, "_fixtureinfo", None)
    defs = [] if info is None else [d for ds in info.name2fixturedefs.values() for d in ds]
    ours = [d for d in defs if getattr(d.func, "__module__", "").startswith("tests.")]
    if any(d.scope in ("module", "package") for d in ours):
        return test_id.split("::")[0]
    return None


def slow_rank(item: pytest.Item) -> int:
    test_id = _test_id(item)
    for rank, module in enumerate(SLOW_FIRST):
        if test_id.startswith(module):
            return rank
    return len(SLOW_FIRST)


@pytest.fixture(autouse=True)
def _own_caches_and_state(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Every test's token caches (agent/runtime/data.py) go to a temporary directory of its
    own, never ~/.cache, and its default state directory is an empty one; ``child_env``
    passes both on to the processes a test starts. Not under
    ``tmp_path``, where a test's own corpus globs would find the cache files."""
    directory = tmp_path_factory.mktemp("token-cache")
    monkeypatch.setenv("SWARM_DATA_CACHE", str(directory))
    # Nor the repository's own state (./.swarm, where a quickstart leaves its leader's token):
    # a process a test starts without a state dir of its own gets an empty one.
    monkeypatch.setenv("SWARM_STATE_DIR", str(tmp_path_factory.mktemp("default-state")))
    return directory


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    log_dir = tmp_path / "proc-logs"
    log_dir.mkdir()
    group = Processes(log_dir)
    try:
        yield group
    finally:
        group.cleanup()


class NatsControl:
    """A real nats-server that a test can stop and start again on the same port and store;
    with an ``authority`` it admits only that authority's users."""

    def __init__(self, tmp_path: Path, authority: NatsAuthority | None = None) -> None:
        self.store_dir = tmp_path / "nats-store"
        self.log_path = tmp_path / "nats.log"
        self.authority = authority
        # An authenticated server also listens for NATS over WebSocket (ws://).
        self.websocket_port = free_port() if authority else None
        self.server: NatsServer | None = self._start(0)
        self.port = self.server.port
        self.url = self.server.url

    def _start(self, port: int) -> NatsServer:
        return start_nats_server(
            host="127.0.0.1",
            port=port,
            store_dir=self.store_dir,
            log_path=self.log_path,
            config=self.authority.server_config_path if self.authority else None,
            websocket_port=self.websocket_port,
            tie_to_parent=True,
        )

    @property
    def websocket_url(self) -> str:
        assert self.websocket_port is not None, "only an authenticated server has one"
        return f"ws://127.0.0.1:{self.websocket_port}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def start(self) -> None:
        assert self.server is None, "already running"
        self.server = self._start(self.port)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsControl]:
    """A real nats-server, JetStream on, store in a temp dir, on a free port."""
    control = NatsControl(tmp_path)
    try:
        yield control
    finally:
        control.stop()


@pytest.fixture
def zmq_pair() -> Iterator[tuple[ZmqLink, ZmqLink]]:
    """A bound and a connected ZmqLink on a free loopback port: (binder, connector)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    binder = ZmqLink(name="b", bind=address)
    connector = ZmqLink(name="c", connect=address)
    try:
        yield binder, connector
    finally:
        binder.close()
        connector.close()


@pytest.fixture
def nats_authority(tmp_path: Path) -> NatsAuthority:
    """The keys of an authenticated swarm (what ``swarm nats-auth init`` makes)."""
    return NatsAuthority.load_or_create(tmp_path / "nats-auth")


@pytest.fixture
def secure_nats(tmp_path: Path, nats_authority: NatsAuthority) -> Iterator[NatsControl]:
    """A real nats-server that admits only ``nats_authority``'s users."""
    control = NatsControl(tmp_path, nats_authority)
    try:
        yield control
    finally:
        control.stop()


@pytest.fixture
def leader(procs: Processes, nats_server: NatsControl, tmp_path: Path) -> Iterator[Leader]:
    """A real leader process joined to ``nats_server`` (dev mode: no NATS users)."""
    yield from leader_process(procs, nats_server, tmp_path)


@pytest.fixture
def secure_leader(
    procs: Processes, secure_nats: NatsControl, nats_authority: NatsAuthority, tmp_path: Path
) -> Iterator[Leader]:
    """A real leader on ``secure_nats`` with its own NATS user, minting one per fellow."""
    yield from leader_process(procs, secure_nats, tmp_path, **secure_env(nats_authority))


def secure_env(authority: NatsAuthority) -> dict[str, str]:
    """A leader's environment for an authenticated swarm."""
    return {
        "SWARM_DEV": "0",
        "SWARM_NATS_CREDS": str(authority.leader_creds_path),
        "SWARM_NATS_AUTH_DIR": str(authority.dir),
    }


def leader_process(
    procs: Processes, nats: NatsControl, tmp_path: Path, **extra: str
) -> Iterator[Leader]:
    """A real leader process (for fixtures: yields its client, waits until it serves)."""
    port = free_port()
    token = secrets.token_urlsafe(16)
    env = child_env(
        SWARM_NATS_URL=nats.url,
        SWARM_LEADER_PORT=str(port),
        SWARM_STATE_DIR=str(tmp_path / "leader-state"),
        SWARM_API_TOKEN=token,
        **extra,
    )
    proc = procs.python("leader", "silentswarm.leader.main", env=env)
    client = Leader(f"http://127.0.0.1:{port}", token=token)
    try:
        try:
            wait_for(
                lambda: proc.poll() is None and client.get("/api/v1/info")["state_loaded"],
                timeout=20,
                what="the leader to serve with its state loaded",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nleader log:\n{procs.log(proc)}") from None
        yield client
    finally:
        client.close()


def start_agent(
    procs: Processes, nats_url: str, name: str, *, prefix: list[str] | None = None, **env: str
):
    """A real fellow agent; its state under the test's temp dir, its own data and sync
    ports; ``prefix`` goes in front of its command line (a CPU quota, an affinity mask)."""
    env.setdefault("SWARM_STATE_DIR", str(agent_state_dir(procs)))
    env.setdefault("SWARM_DATA_ADDRESS", f"tcp://127.0.0.1:{free_port()}")
    env.setdefault("SWARM_SYNC_ADDRESS", f"tcp://127.0.0.1:{free_port()}")
    # Declared, not probed: the probe trains a block for seconds (pass "" to probe).
    env.setdefault("SWARM_FELLOW_COMPUTE_SPEED", "1")
    argv = [sys.executable, "-m", "silentswarm.agent.main", "--nats-url", nats_url, "--name", name]
    return procs.start(f"agent-{name}", [*(prefix or []), *argv], child_env(**env))


def agent_state_dir(procs: Processes) -> Path:
    return procs.log_dir.parent / "agents"


class RestartableLeader:
    """A real leader process a test can kill and start again on the same port and state."""

    def __init__(self, procs: Processes, nats_url: str, state_dir: Path) -> None:
        self.procs = procs
        self.port = free_port()
        # No SWARM_API_TOKEN: the leader generates one in its state directory, and keeps it
        # across restarts.
        self.env = child_env(
            SWARM_NATS_URL=nats_url,
            SWARM_LEADER_PORT=str(self.port),
            SWARM_STATE_DIR=str(state_dir),
        )
        self.state_dir = state_dir
        self.client = Leader(f"http://127.0.0.1:{self.port}")
        self.proc = None

    def start(self):
        self.proc = self.procs.python("leader", "silentswarm.leader.main", env=self.env)
        wait_for(
            lambda: self.client.get("/api/v1/info")["state_loaded"],
            timeout=20,
            what="the leader to serve with its state loaded",
        )
        # The token the leader generated (the same after a restart): the client sends it.
        self.client.token = (self.state_dir / "api-token").read_text().strip()
        self.client.http.headers["authorization"] = f"Bearer {self.client.token}"
        return self.proc

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def restartable_leader(procs: Processes, nats_server: NatsControl, tmp_path: Path):
    leader = RestartableLeader(procs, nats_server.url, tmp_path / "leader-state")
    try:
        yield leader
    finally:
        leader.client.close()
