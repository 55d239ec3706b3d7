"""The bootstrap wheel is built in a temporary copy: the source checkout gains no files."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest

from silentswarm.leader.bootstrap import build_wheel, copy_project

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*")}


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of this repository's sources to build from (the real one is left alone), with
    the kind of clutter a checkout has: a venv, caches, runs."""
    source = tmp_path / "checkout"
    copy_project(REPO, source)
    (source / ".venv" / "bin").mkdir(parents=True)
    (source / ".venv" / "bin" / "python").write_text("not copied")
    (source / "leader" / "__pycache__").mkdir(exist_ok=True)
    (source / "leader" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (source / "exp" / "runs").mkdir(parents=True)
    (source / "exp" / "runs" / "big.bin").write_bytes(b"\0" * 1024)
    return source


def test_building_the_wheel_writes_nothing_into_the_source(checkout: Path, tmp_path: Path):
    before = _files(checkout)
    out = tmp_path / "cache"
    wheel = build_wheel(checkout, out)
    assert wheel is not None and wheel.is_file(), "the wheel was not built"
    assert _files(checkout) == before
    assert not list(checkout.glob("build")) and not list(checkout.glob("*.egg-info"))
    assert [p.name for p in out.iterdir()] == [wheel.name]
    names = zipfile.ZipFile(wheel).namelist()
    # One import package: the three folders land under silentswarm/ (plus the old layout's
    # agent/main.py, a namespace portion without __init__.py).
    assert (
        "silentswarm/leader/bootstrap.py" in names and "silentswarm/leader/ui/index.html" in names
    )
    assert "silentswarm/__init__.py" in names and "silentswarm/agent/main.py" in names
    assert "agent/main.py" in names and "agent/__init__.py" not in names
    assert not [n for n in names if n.startswith(("swarm/", "leader/"))]
    assert not [n for n in names if "__pycache__" in n or n.startswith(("tests/", "exp/"))]


def test_the_copy_holds_only_what_a_wheel_is_built_from(checkout: Path, tmp_path: Path):
    copy = tmp_path / "copy"
    copy_project(checkout, copy)
    top = {p.name for p in copy.iterdir()}
    assert {"pyproject.toml", "README.md", "leader", "swarm", "agent", "packaging"} <= top
    assert (copy / "packaging" / "legacy" / "agent" / "main.py").is_file()
    assert not (copy / "packaging" / "deb").exists(), "only the mapped folder of packaging/"
    assert not top & {".venv", ".git", "exp", "tests", "docs", "build"}, top
    assert not list(copy.rglob("__pycache__"))


def test_a_failed_build_is_none_and_leaves_the_source_alone(tmp_path: Path):
    source = tmp_path / "broken"
    source.mkdir()
    (source / "pyproject.toml").write_text("this is not toml [")
    shutil.copytree(REPO / "swarm", source / "swarm")
    before = _files(source)
    assert build_wheel(source, tmp_path / "cache") is None
    assert _files(source) == before
