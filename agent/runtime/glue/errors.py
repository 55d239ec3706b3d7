"""Glue's two failures: the input is wrong (exit 2), or the glued model is (exit 1)."""

from __future__ import annotations

from swarm.errors import ConfigError, SwarmError


class GlueError(ConfigError):
    """The export cannot be glued: a bad manifest, a missing or corrupt file, no data."""

    code = "GLUE_INVALID"


class GlueMismatchError(SwarmError):
    """The glued model does not compute what the pipeline computed."""

    code = "GLUE_MISMATCH"
    exit_code = 1
