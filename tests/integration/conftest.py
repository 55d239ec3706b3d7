"""Fixtures the integration tests of more than one module share."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def glued_model(tmp_path_factory) -> Path:
    """A real glued model (a tiny export, trained in this process, glued by glue's code),
    made once per test run: the xdist workers share it through their common temporary root,
    the first to ask makes it under a lock and the others wait and read it. Read-only."""
    from silentswarm.agent.runtime.glue import glue
    from tests.unit.test_glue import make_export

    # Each xdist worker's temporary root is a folder of the run's; without xdist the run's
    # root is the session's own (its parent holds every earlier run's too).
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    directory = root / "shared-glued-model"
    done = directory / "made"
    with open(root / "shared-glued-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            directory.mkdir(exist_ok=True)
            make_export(directory, "none", steps=10)
            done.write_text(str(glue(directory, directory / "full_model").out))
    return Path(done.read_text())
