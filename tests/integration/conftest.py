"""Fixtures the integration tests of more than one module share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def glued_model(tmp_path_factory) -> Path:
    """A real glued model (a tiny export, trained in this process, glued by glue's code)."""
    from silentswarm.agent.runtime.glue import glue
    from tests.unit.test_glue import make_export

    directory = tmp_path_factory.mktemp("export")
    make_export(directory, "none", steps=10)
    return glue(directory, directory / "full_model").out
