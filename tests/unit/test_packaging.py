"""The wheel's one import package (pyproject's explicit package list names every folder),
the install profiles (the base package runs without TensorFlow; a fellow without it says
what to install) and the sdist's contents."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


def setuptools_config() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_package_list_names_every_package_folder_under_its_mapped_name():
    config = setuptools_config()
    mapped: dict[str, str] = config["package-dir"]
    found = set()
    for name, folder in mapped.items():
        root = REPO / folder
        if not (root / "__init__.py").is_file():
            found.add(name)  # a namespace portion (the old layout's agent/main.py)
            continue
        # Every folder Python could import, code or data (the Ops UI, the bootstrap script):
        # setuptools warns of one it was not told of, and would leave its files out.
        for folder in (root, *(p for p in root.rglob("*") if p.is_dir())):
            rel = folder.relative_to(root).parts
            named = all(part.isidentifier() and not part.startswith("__") for part in rel)
            if named and any(f.is_file() for f in folder.iterdir()):  # not a stale folder
                found.add(".".join((name, *rel)))
    # A folder mapped on its own (silentswarm.leader) is not also a subpackage of its parent.
    assert set(config["packages"]) == found
    assert set(config["package-data"]) <= found


def test_one_import_package_and_the_old_agent_entry_point_only():
    config = setuptools_config()
    tops = {name.split(".")[0] for name in config["packages"]}
    assert tops == {"silentswarm", "agent"}
    legacy = REPO / config["package-dir"]["agent"]
    assert sorted(p.name for p in legacy.iterdir() if p.suffix == ".py") == ["main.py"]
    assert not (legacy / "__init__.py").exists(), "a namespace portion never shadows a package"


def test_the_console_scripts_point_into_the_one_package():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert all(target.startswith("silentswarm.") for target in scripts.values()), scripts


# --- install profiles: the base package runs without TensorFlow ---------------------------


def requirement_closure(roots: list[str]) -> set[str]:
    """The installed distributions ``roots`` (requirement strings) pull in, transitively."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        for line in dist.requires or []:
            dep = Requirement(line)
            extras = req.extras or {""}
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in extras):
                todo.append(dep)
    return {name for name, _extras in seen}


def top_level_modules(dist_name: str) -> set[str]:
    files = metadata.distribution(dist_name).files or []
    return {
        f.parts[0].removesuffix(".py")
        for f in files
        if f.parts[0] != ".."
        and not f.parts[0].endswith((".dist-info", ".data", ".pth"))
        and not f.parts[0].startswith("__")
    }


def fellow_only_modules() -> set[str]:
    """What only the ``fellow`` extra installs (TensorFlow and what it alone brings: numpy,
    keras, h5py, ...), as top-level import names."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = requirement_closure(project["dependencies"])
    fellow = requirement_closure(project["optional-dependencies"]["fellow"]) - base
    assert "tensorflow" in fellow and "numpy" in fellow, fellow
    return set().union(*(top_level_modules(name) for name in fellow)) - {"", "bin"}


def run_without_tensorflow(code: str, env: dict[str, str] | None = None):
    """``code`` in a fresh interpreter that behaves like a host with the base package only:
    every module the ``fellow`` extra alone installs is None in sys.modules (``import`` raises
    ImportError, ``find_spec`` answers None)."""
    blocked = sorted(fellow_only_modules())
    setup = f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
    return subprocess.run(
        [sys.executable, "-c", setup + code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def test_the_base_package_has_no_tensorflow_and_the_extras_bring_it():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.match(r"[A-Za-z0-9_.-]+", d)[0].lower() for d in project["dependencies"]}
    assert not names & {"tensorflow", "keras", "tf-keras"}, names
    extras = project["optional-dependencies"]
    assert any(d.startswith("tensorflow>=") for d in extras["fellow"])
    assert any(d.startswith("tensorflow[and-cuda]") for d in extras["gpu"])
    assert extras["cuda"] == ["silentswarm[gpu]"]  # its older name
    assert "silentswarm[fellow]" in extras["dev"], "the tests train models"


def test_the_cli_and_the_leader_never_import_tensorflow():
    code = (
        "import sys\n"
        "import silentswarm.cli.app, silentswarm.leader.main, silentswarm.leader.app\n"
        "print(sorted(m for m in ('tensorflow', 'keras', 'numpy') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_the_commands_of_the_base_package_run_without_the_fellow_extra():
    code = (
        "import silentswarm.cli.app, silentswarm.leader.main, silentswarm.agent.main\n"
        "mains = (silentswarm.cli.app.main, silentswarm.leader.main.main,"
        " silentswarm.agent.main.main)\n"
        "for main in mains:\n"
        "    sys.argv = ['prog', '--help']\n"
        "    try:\n"
        "        main()\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code in (0, None), exc.code\n"
        "print('ok')\n"
    )
    done = run_without_tensorflow(code)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.parametrize(
    ("module", "argv", "prog", "exit_code"),
    [
        ("silentswarm.agent.main", ["--nats-url", "nats://127.0.0.1:1"], "swarm-agent", 1),
        ("silentswarm.agent.runtime.main", ["--plan", "/nonexistent.json"], "swarm-stage", 1),
        ("silentswarm.agent.serve.main", ["--model-dir", "/nonexistent"], "serve", 2),
    ],
)
def test_a_fellow_without_tensorflow_says_what_to_install_in_one_line(
    module, argv, prog, exit_code
):
    code = (
        f"import runpy\nsys.argv = ['{prog}', *{argv!r}]\n"
        f"runpy.run_module('{module}', run_name='__main__')\n"
    )
    done = run_without_tensorflow(code, {"SWARM_SERVE_TOKEN": "t0ken"})
    assert done.returncode == exit_code, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith(f"{prog}: error: "), lines
    assert "needs TensorFlow" in lines[0] and "pip install 'silentswarm[fellow]'" in lines[0]
    assert "silentswarm-fellow" in lines[0], "the Debian package's name too"


# --- the sdist ---------------------------------------------------------------------------

# What a checkout holds that is no source (environments, caches, build output).
NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    ".swarm",
)


def test_the_sdist_holds_the_license_the_docs_and_the_tests(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(REPO, copy, ignore=NOT_SOURCE, symlinks=True)
    code = (
        "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=copy,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sdist = tmp_path / "out" / done.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        root = tar.getnames()[0].split("/")[0]
        names = {n.removeprefix(f"{root}/") for n in tar.getnames()}
        pkg_info = tar.extractfile(f"{root}/PKG-INFO").read().decode()
    for path in (
        "LICENSE",
        "pyproject.toml",
        "docs/deploy/debian.md",
        "tests/unit/test_packaging.py",
        "tests/integration/test_deb.py",
        "packaging/build.sh",
        "systemd/swarm-leader.service",
        "swarm/cli/app.py",
    ):
        assert path in names, path
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert (copy / "LICENSE").read_text() == (REPO / "LICENSE").read_text()
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert "License-Expression: Apache-2.0" in pkg_info and "License-File: LICENSE" in pkg_info
