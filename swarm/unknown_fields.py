"""Fields a newer peer sent that this version's strict types refuse: found and left out.

The job spec's types (:mod:`silentswarm.plan`, :mod:`silentswarm.jobspec`) refuse unknown
fields, so that a typo in a submitted spec is a 400 naming it and a fellow never trains on a
plan it half understands. A job record that a newer leader answers carries its spec, with
the fields that leader added: a CLI of an older version would refuse the whole answer.
:func:`drop_unknown_fields` walks a decoded JSON value beside the type it should decode as
and takes out of it what the type does not know, only from the structs that would refuse it,
so the CLI can show what it does know and say what it left out (silentswarm.cli.client). It
is pure: no I/O, and nothing but the value it is given is changed.

A newer leader may also send a value an enum of this version lacks (a job state it added).
The shared enums are :class:`NewerValues`: while :func:`decode_leniently` decodes, and only
then, such a value becomes a member of its own (its name is the value), so the CLI shows it
as sent; everywhere else (the leader checking a fellow's or a user's input) it is refused
as ever.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import msgspec
import msgspec.inspect as mi

_lenient = contextvars.ContextVar("lenient_enums", default=False)


class NewerValues(enum.StrEnum):
    """A string enum that, while :func:`decode_leniently` decodes a newer peer's answer,
    takes a value it does not know as a member named after it."""

    @classmethod
    def _missing_(cls, value: object) -> Any:
        if not _lenient.get() or not isinstance(value, str):
            return None
        member = str.__new__(cls, value)
        member._name_ = value
        member._value_ = value
        return member

    @classmethod
    def knows(cls, value: str) -> bool:
        """Whether ``value`` is one of this version's members (not a newer peer's)."""
        return value in cls._value2member_map_


@contextlib.contextmanager
def _newer_values_taken() -> Iterator[None]:
    token = _lenient.set(True)
    try:
        yield
    finally:
        _lenient.reset(token)


class Lenient(NamedTuple):
    """A lenient decode: the value, the fields left out, the values of enums this version
    does not know (each its field's path and the value as sent)."""

    value: Any
    dropped: list[str]
    newer_values: list[tuple[str, str]]


def drop_unknown_fields(
    value: Any, kind: Any, newer_values: list[tuple[str, str]] | None = None
) -> list[str]:
    """Remove from ``value`` (JSON decoded to dicts and lists, changed in place) the keys
    that a struct of ``kind`` that forbids unknown fields would refuse; their paths
    (``spec.train.new_field``, ``[2].spec.model.x``, ``pool_limits[gpu].x``: a list's index
    or a mapping's key in brackets), in the order found. Structs encoded as
    arrays (``array_like``) are left as they are (none of the leader's answers has one).
    ``newer_values`` gets each value of an enum this version lacks: (its path, the value)."""
    dropped: list[str] = []
    _walk(value, _type_info(kind), "", _Found(dropped, newer_values))
    return dropped


class _Found(NamedTuple):
    dropped: list[str]
    newer_values: list[tuple[str, str]] | None


@functools.cache
def _type_info(kind: Any) -> mi.Type:
    return mi.type_info(kind)


ARRAYS = (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)


def _walk(value: Any, info: mi.Type | None, path: str, found: _Found) -> None:
    if isinstance(info, mi.Metadata):
        info = info.type
    if isinstance(info, mi.UnionType):
        info = _member(value, info)
    if isinstance(info, mi.StructType):
        if isinstance(value, dict):
            _struct(value, info, path, found)
        return
    if isinstance(info, mi.EnumType):
        _enum_value(value, info, path, found)
        return
    if isinstance(info, mi.DictType) and isinstance(value, dict):
        for key in value:
            _enum_value(key, info.key_type, f"{path}[{key}]", found)
    for item, item_info, item_path in _children(value, info, path):
        _walk(item, item_info, item_path, found)


def _enum_value(value: Any, info: mi.Type, path: str, found: _Found) -> None:
    """Note ``value`` where ``info`` is an enum of this version's that lacks it."""
    if isinstance(info, mi.Metadata):
        info = info.type
    if found.newer_values is None or not isinstance(info, mi.EnumType):
        return
    if isinstance(value, str) and value not in info.cls._value2member_map_:
        found.newer_values.append((path or "value", value))


def _children(value: Any, info: mi.Type | None, path: str) -> list[tuple[Any, mi.Type, str]]:
    """The items of a JSON object or array that ``info`` (a mapping, array or tuple) types."""
    if isinstance(info, mi.DictType) and isinstance(value, dict):
        return [(item, info.value_type, f"{path}[{key}]") for key, item in value.items()]
    if isinstance(info, ARRAYS) and isinstance(value, list):
        return [(item, info.item_type, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(info, mi.TupleType) and isinstance(value, list):
        pairs = zip(value, info.item_types, strict=False)
        return [(item, kind, f"{path}[{i}]") for i, (item, kind) in enumerate(pairs)]
    return []


def _struct(value: dict[str, Any], info: mi.StructType, path: str, found: _Found) -> None:
    known = {f.encode_name: f for f in info.fields}
    for key in list(value):
        field = known.get(key)
        if field is not None:
            _walk(value[key], field.type, _join(path, key), found)
        elif info.forbid_unknown_fields and key != info.tag_field:
            del value[key]
            found.dropped.append(_join(path, key))


def _member(value: Any, info: mi.UnionType) -> mi.Type | None:
    """The member of a union that ``value`` decodes as, where that is a struct or a
    container (what may hold structs) or an enum: by its tag, else the only one of its JSON
    kind (msgspec refuses unions of a struct and a mapping, or of two untagged structs)."""
    members = [m.type if isinstance(m, mi.Metadata) else m for m in info.types]
    if isinstance(value, dict):
        structs = [m for m in members if isinstance(m, mi.StructType)]
        for struct in structs:
            if struct.tag_field is not None and value.get(struct.tag_field) == struct.tag:
                return struct
        if structs:  # a lone one decodes without its tag; of several, none has this tag
            return structs[0] if len(structs) == 1 else None
        dicts = [m for m in members if isinstance(m, mi.DictType)]  # never beside a struct
        return dicts[0] if len(dicts) == 1 else None
    if isinstance(value, list):
        lists = [m for m in members if isinstance(m, (*ARRAYS, mi.TupleType))]
        return lists[0] if len(lists) == 1 else None
    if isinstance(value, str) and not any(isinstance(m, mi.StrType) for m in members):
        enums = [m for m in members if isinstance(m, mi.EnumType)]
        return enums[0] if len(enums) == 1 else None
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def decode_leniently(body: bytes | str, kind: type[Any]) -> Lenient:
    """``body`` (JSON) as ``kind`` with what its strict structs would refuse left out, and
    the values its :class:`NewerValues` enums lack taken as sent. Raises msgspec.DecodeError
    (a ValidationError is one) where it does not decode even so."""
    try:
        raw = msgspec.json.decode(body)
    except RecursionError:  # nesting the typed decode skips over as an unknown field's
        raise msgspec.DecodeError("JSON nested too deeply") from None
    newer_values: list[tuple[str, str]] = []
    dropped = drop_unknown_fields(raw, kind, newer_values)
    # Through JSON again, not msgspec.convert: the same rules as the strict decode's.
    with _newer_values_taken():
        value = msgspec.json.decode(msgspec.json.encode(raw), type=kind)
    return Lenient(value, dropped, newer_values)
