"""The wheel's one import package: pyproject's explicit package list names every folder."""

from __future__ import annotations

import tomllib
from pathlib import Path

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
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            if not any(part.startswith((".", "__")) for part in rel):
                found.add(".".join((name, *rel)))
    # A folder mapped on its own (silentswarm.leader) is not also a subpackage of its parent.
    assert set(config["packages"]) == found


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
