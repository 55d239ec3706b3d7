"""UPDATE for a fellow that fellow.sh installed: the bootstrap's install step, run again.

The fellow downloads the leader's current package, checks the sha256 the leader announced
(nothing is installed otherwise), and installs it into the venv it runs from with the pip
arguments fellow.sh was given (an offline site's mirror); the agent then re-executes itself
and registers with the new version.
"""

from __future__ import annotations

import hashlib
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

from silentswarm.agent.errors import UpdateError
from silentswarm.types.signals import PackageRef

PIP_TIMEOUT_S = 600


def reinstall(package: PackageRef, prefix: Path, pip_args: str) -> str:
    """Download, verify and install ``package`` into this venv; returns pip's last line."""
    if "/" in package.file or not package.file.endswith(".whl"):
        raise UpdateError(f"the leader named {package.file!r}, which is not a wheel file name")
    dist = prefix / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(package.url, timeout=300) as response:
            data = response.read()
    except OSError as exc:
        raise UpdateError(f"cannot download {package.url}: {exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != package.sha256:
        raise UpdateError(
            f"sha256 of {package.file} is {digest}, the leader announced {package.sha256}: "
            "nothing was installed"
        )
    wheel = dist / package.file
    wheel.write_bytes(data)
    base = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]
    extra = shlex.split(pip_args)
    # The first install brings new dependencies; the second replaces a same-version build.
    for argv in (
        [*base, *extra, str(wheel)],
        [*base, "--force-reinstall", "--no-deps", *extra, str(wheel)],
    ):
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise UpdateError(f"pip could not install {package.file}: {done.stderr[-1500:]}")
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else f"installed {package.file}"
