"""Decoding an experiment's JSON config (a sweep's, a suite's) with errors that name the file."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgspec

from silentswarm.errors import ConfigError, FieldError
from silentswarm.jobspec import JobSpec, decode_job_spec

T = TypeVar("T")


def decode_config(data: bytes, kind: type[T], *, source: str, what: str) -> T:
    """A JSON config file as ``kind``; ConfigError naming the file, the field and the reason."""
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid JSON ({exc})") from None


def spec_of(doc: dict[str, Any], *, where: str) -> tuple[JobSpec, bytes]:
    """A job document (a sweep point, a suite scenario) as the JobSpec the leader would
    accept, and its canonical JSON; ConfigError naming ``where`` and the spec's field."""
    spec_json = json.dumps(doc, sort_keys=True).encode()
    try:
        return decode_job_spec(spec_json), spec_json
    except FieldError as exc:
        reason = exc.message.removeprefix(exc.field + ": ")
        raise ConfigError(f"{where}: {exc.field}: {reason}") from None
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
