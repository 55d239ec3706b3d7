"""Split one staged venv into the two .debs' trees (run by packaging/build.sh).

build.sh installs the base package into the venv, records what is there (``snapshot``),
installs the ``fellow`` extra into the same venv (pip keeps what is installed when it
satisfies TensorFlow, so both halves come from one resolution), then ``move`` takes every
distribution the extra added out of the venv into the fellow package's tree:
``site-packages/...`` to ``<fellow>/site-packages/...`` and ``bin/...`` (its console
scripts) to ``<fellow>/bin/...``. A distribution of the base whose version the extra
changed is an error: the base package would no longer be what was tested alone.

    python venvsplit.py snapshot SITE OUT.json
    python venvsplit.py move SITE SNAPSHOT.json FELLOW_DIR
    python venvsplit.py freeze SITE [SITE...]     (name==version lines: pip constraints)
    python venvsplit.py modes DIR [DIR...]        (execute bits: programs' alone)

Some wheels ship plain files with execute bits (protobuf's modules, a ``top_level.txt``):
``modes`` takes them off every regular file under DIR that is neither an ELF object nor a
``#!`` script (Debian policy 10.9; lintian's executable-not-elf-or-script).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
from importlib import metadata
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def versions(*sites: Path) -> dict[str, str]:
    """Every distribution installed in ``sites``: canonical name -> version."""
    return {
        canonical(d.metadata["Name"]): d.version
        for d in metadata.distributions(path=[str(s) for s in sites])
    }


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What of ``before`` is gone from ``after`` or has another version there."""
    return sorted(
        f"{name} {version} -> {after.get(name, 'removed')}"
        for name, version in before.items()
        if after.get(name) != version
    )


def destination(path: Path, site: Path, fellow: Path) -> Path:
    """Where a file of a moved distribution goes: below ``fellow``, at the place it had below
    the site directory or the venv (``bin/``)."""
    venv = site.parents[2]  # <venv>/lib/pythonX.Y/site-packages
    if path.is_relative_to(site):
        return fellow / "site-packages" / path.relative_to(site)
    if path.is_relative_to(venv):
        return fellow / path.relative_to(venv)
    raise SystemExit(f"venvsplit: {path} is outside the venv {venv}")


def move(site: Path, before: dict[str, str], fellow: Path) -> list[str]:
    """Move what was installed after ``before`` from ``site``'s venv below ``fellow``;
    returns the moved distributions' names."""
    moved = []
    for dist in metadata.distributions(path=[str(site)]):
        name = canonical(dist.metadata["Name"])
        if name in before:
            continue
        for file in dist.files or []:
            source = Path(os.path.normpath(site / file))
            if not source.exists():
                continue  # a byte-code entry of a build that compiled nothing
            target = destination(source, site, fellow)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(source, target)
        moved.append(name)
    prune_empty_dirs(site)
    return sorted(moved)


def prune_empty_dirs(root: Path) -> None:
    for folder, _subdirs, _files in os.walk(root, topdown=False):
        if folder != str(root) and not os.listdir(folder):
            os.rmdir(folder)


PROGRAM_MAGIC = (b"\x7fELF", b"#!")
ANY_EXECUTE = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH


def is_program(path: Path) -> bool:
    """An ELF object or a ``#!`` script: what may carry execute bits."""
    with path.open("rb") as head:
        return head.read(4).startswith(PROGRAM_MAGIC)


def clear_stray_execute_bits(root: Path) -> list[Path]:
    """Take the execute bits off the regular files below ``root`` that are no programs;
    returns those files."""
    cleared = []
    for folder, _subdirs, files in os.walk(root):
        for name in files:
            path = Path(folder, name)
            mode = path.lstat().st_mode
            if stat.S_ISREG(mode) and mode & ANY_EXECUTE and not is_program(path):
                path.chmod(stat.S_IMODE(mode) & ~ANY_EXECUTE)
                cleared.append(path)
    return cleared


def main(argv: list[str]) -> None:
    match argv:
        case ["snapshot", site, out]:
            Path(out).write_text(json.dumps(versions(Path(site)), indent=1, sort_keys=True))
        case ["move", site, snapshot, fellow]:
            before = json.loads(Path(snapshot).read_text())
            broken = changed(before, versions(Path(site)))
            if broken:
                raise SystemExit(
                    "venvsplit: the fellow extra changed the base package's dependencies "
                    f"(pin them in pyproject.toml): {', '.join(broken)}"
                )
            moved = move(Path(site), before, Path(fellow))
            print(f"venvsplit: {len(moved)} distributions moved to {fellow}")
        case ["freeze", *sites] if sites:
            found = versions(*(Path(s) for s in sites))
            print("\n".join(f"{name}=={version}" for name, version in sorted(found.items())))
        case ["modes", *roots] if roots:
            cleared = [path for root in roots for path in clear_stray_execute_bits(Path(root))]
            print(f"venvsplit: execute bits taken off {len(cleared)} files that are no programs")
        case _:
            raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
