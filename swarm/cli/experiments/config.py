"""Decoding an experiment's JSON config (a sweep's, a suite's) with errors that name the file."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from silentswarm.errors import ConfigError

T = TypeVar("T")


def decode_config(data: bytes, kind: type[T], *, source: str, what: str) -> T:
    """A JSON config file as ``kind``; ConfigError naming the file, the field and the reason."""
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid JSON ({exc})") from None
