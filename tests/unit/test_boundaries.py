"""Architecture invariants: no TensorFlow in the leader or swarm/, imports point down only."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def layer(module: str) -> str:
    """The part of the one package a module is in (``leader``, ``agent`` or ``swarm``, the
    shared core and CLI), or the top-level name of anything else (``tensorflow``)."""
    parts = module.split(".")
    if parts[0] != "silentswarm":
        return parts[0]
    return parts[1] if len(parts) > 1 and parts[1] in ("leader", "agent") else "swarm"


def _assert_loads_none_of(setup: str, forbidden: set[str]) -> None:
    """Run ``setup`` in a fresh interpreter; fail if anything of a ``forbidden`` layer (or
    third-party package) got imported."""
    code = (
        "import sys\n"
        f"{setup}\n"
        f"{inspect.getsource(layer)}\n"
        f"bad = sorted(m for m in sys.modules if layer(m) in {sorted(forbidden)!r})\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr


def test_leader_swarm_and_agent_runner_never_import_tensorflow():
    _assert_loads_none_of(
        "import silentswarm.leader.main, silentswarm.leader.app\n"
        "import silentswarm.leader.bus, silentswarm.leader.registry\n"
        "import silentswarm.cli.app, silentswarm.natsd, silentswarm.natsconn\n"
        "import silentswarm.protocol, silentswarm.subjects\n"
        "import silentswarm.agent.main, silentswarm.agent.runner, silentswarm.agent.hardware\n"
        "from silentswarm.leader.app import create_app\n"
        "from silentswarm.settings import Settings\n"
        "create_app(Settings(), nats='nats://127.0.0.1:1')",
        {"tensorflow", "keras"},
    )


def _imports(package: str) -> dict[str, set[str]]:
    """The layers (see :func:`layer`) each module imports (absolute imports only)."""
    return {file: {layer(name) for name in names} for file, names in _import_names(package).items()}


def test_nothing_imports_the_old_top_level_names():
    """One import package: ``swarm``, ``leader`` and ``agent`` are folders, not import names
    (an import of them from a checkout would load a second copy of every module)."""
    offenders = {}
    for folder in ("swarm", "leader", "agent", "tests", "exp", "packaging"):
        for file, names in _import_names(folder).items():
            old = {n for n in names if n.split(".")[0] in ("swarm", "leader", "agent")}
            if old:
                offenders[file] = old
    assert offenders == {}


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("swarm", {"leader", "agent", "tensorflow", "keras"}),
        ("leader", {"agent", "tensorflow", "keras", "matplotlib"}),
        ("agent", {"leader", "matplotlib"}),
    ],
)
def test_imports_point_down_only(package, forbidden):
    offenders = {f: r & forbidden for f, r in _imports(package).items() if r & forbidden}
    assert offenders == {}


def test_experiments_and_plotting_stay_on_the_cli_side():
    """Sweeps, suites and their plot serve the CLI and exp/: the leader and the agent never
    import them, and the CLI loads matplotlib only to draw (so ``swarm`` starts fast)."""
    for package in ("leader", "agent"):
        for file, names in _import_names(package).items():
            assert not {n for n in names if n.startswith("silentswarm.cli.experiments")}, file
    _assert_loads_none_of("import silentswarm.cli.app", {"matplotlib"})


def _import_names(package: str) -> dict[str, set[str]]:
    return {str(path.relative_to(REPO)): _names_in(path) for path in (REPO / package).rglob("*.py")}


def _names_in(path: Path) -> set[str]:
    """The modules one file imports (absolute imports only)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


# What the pipe may take from the rest of SilentSwarm: the codec table, the shared error
# hierarchy, the agent's error module and the link measurements' types, all standard-library
# and msgspec only (so the pipe stays a leaf that a benchmark or a bare stage can load).
PIPE_MAY_IMPORT = {
    "silentswarm.compression",
    "silentswarm.errors",
    "silentswarm.agent.errors",
    "silentswarm.types.links",
}


def test_the_pipe_imports_only_the_codec_table_and_errors_of_ours_and_no_tensorflow():
    allowed_third_party = {"numpy", "msgspec", "zmq", "nats"}
    offenders = {}
    for file, names in _import_names("agent/pipe").items():
        bad = {
            n
            for n in names
            if not n.startswith("silentswarm.agent.pipe")
            and n not in PIPE_MAY_IMPORT
            and n.split(".")[0] not in allowed_third_party
            and n.split(".")[0] not in sys.stdlib_module_names
        }
        if bad:
            offenders[file] = bad
    assert offenders == {}
    for module in PIPE_MAY_IMPORT:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None, module
        path = Path(spec.origin)
        ours = {
            n
            for n in _names_in(path)
            if n.split(".")[0] not in sys.stdlib_module_names and n != "msgspec"
        }
        assert ours <= PIPE_MAY_IMPORT, (module, ours)
    _assert_loads_none_of(
        "import silentswarm.agent.pipe.link, silentswarm.agent.pipe.wire",
        {"tensorflow", "keras", "leader"},
    )


def test_the_runtime_traces_only_through_graph_function():
    """``tf.function`` is called in one place, ``tfsetup.graph_function`` (no AutoGraph), so a
    new traced function cannot bring AutoGraph's tracing cost back unnoticed."""
    offenders = []
    for path in sorted((REPO / "agent").rglob("*.py")):
        if path.name == "tfsetup.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "function"
                and isinstance(node.value, ast.Name)
                and node.value.id == "tf"
            ):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, f"tf.function outside tfsetup.graph_function: {offenders}"
