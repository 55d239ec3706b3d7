"""What crosses a boundary is typed all the way down: every Struct of the shared types
(swarm/types: REST bodies, signal arguments, stage events, manifests, views), every NATS
payload (swarm/protocol.py) and every body a leader route answers or decodes holds no
``Any``, no bare ``dict``/``list`` and no ``dict[str, Any]``/``Mapping[str, Any]``, however
deep. A field that is free-form on purpose is named in ``FREE_FORM`` with its reason."""

from __future__ import annotations

import ast
import collections.abc
import enum
import importlib
import inspect
import pkgutil
import types
import typing
from pathlib import Path

import msgspec

import silentswarm.types
from silentswarm import protocol

REPO = Path(__file__).resolve().parents[2]

# "Struct.field": why it may hold anything. Keep it short: each entry is a hole in the types.
FREE_FORM: dict[str, str] = {}

# Types a JSON or msgpack body carries as they are.
LEAVES = (str, int, float, bool, bytes, type(None))
# Route answers that are no JSON body: files, streams (their events are typed Structs of
# swarm/types, checked with the rest), redirects, raw bytes (Prometheus text, the script).
NOT_JSON = ("litestar.response.file.File", "litestar.response.sse.ServerSentEvent")
NOT_JSON += ("litestar.response.redirect.Redirect",)
CONTAINERS = {list, tuple, set, frozenset, dict, collections.abc.Sequence}
CONTAINERS |= {collections.abc.Mapping, collections.abc.MutableMapping}


def untyped(tp: object, where: str, seen: set[type]) -> list[str]:
    """Where ``tp`` (found at ``where``) lets anything through; Structs are walked once."""
    if tp is typing.Any or tp is object:
        return [f"{where}: Any"]
    if isinstance(tp, typing.TypeVar):
        return [f"{where}: an unbound type variable {tp}"]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return untyped(args[0], where, seen)
    if origin is typing.Literal:
        return []
    if origin in (typing.Union, types.UnionType):
        return [bad for arg in args for bad in untyped(arg, where, seen)]
    if tp in CONTAINERS:
        return [f"{where}: a bare {getattr(tp, '__name__', tp)} (of anything)"]
    if origin in CONTAINERS:
        return [bad for arg in args if arg is not Ellipsis for bad in untyped(arg, where, seen)]
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return struct_holes(tp, seen)
    if isinstance(tp, type) and issubclass(tp, (enum.Enum, *LEAVES)):
        return []
    return [f"{where}: {tp!r} is no wire type"]


def struct_holes(cls: type[msgspec.Struct], seen: set[type]) -> list[str]:
    if cls in seen:
        return []
    seen.add(cls)
    holes = []
    for field in msgspec.structs.fields(cls):
        where = f"{cls.__name__}.{field.name}"
        if where not in FREE_FORM:
            holes += untyped(field.type, where, seen)
    return holes


def shared_structs() -> list[type[msgspec.Struct]]:
    """Every Struct defined in swarm/types and swarm/protocol.py."""
    modules = [protocol]
    for info in pkgutil.iter_modules(silentswarm.types.__path__, "silentswarm.types."):
        modules.append(importlib.import_module(info.name))
    return [
        obj
        for module in modules
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and issubclass(obj, msgspec.Struct)
        and obj.__module__ == module.__name__
    ]


def route_handlers() -> list[tuple[str, object]]:
    """(route, the answer's type) of every route the leader's own controllers serve."""
    from silentswarm.leader.app import create_app
    from silentswarm.settings import Settings

    app = create_app(Settings(), nats="nats://127.0.0.1:1")
    out = []
    for route in app.routes:
        for handler in getattr(route, "route_handlers", []):
            if not handler.fn.__module__.startswith("silentswarm.leader."):
                continue  # Litestar's own (OPTIONS, static files)
            methods = ",".join(sorted(handler.http_methods))
            out.append(
                (f"{methods} {route.path}", handler.parsed_fn_signature.return_type.annotation)
            )
    return out


def answer_body(tp: object) -> object | None:
    """The JSON body a route answers with: ``Response[T]`` is T; None when it sends no JSON."""
    if tp is bytes:
        return None
    name = f"{getattr(tp, '__module__', '')}.{getattr(tp, '__qualname__', '')}"
    if name in NOT_JSON:
        return None
    origin = typing.get_origin(tp)
    if origin is not None and origin.__qualname__ == "Response":
        (body,) = typing.get_args(tp)
        return answer_body(body)
    return tp


def request_bodies() -> list[tuple[str, object]]:
    """The types the controllers decode request bodies into (``decode_strict(body, T)``,
    ``decode_job_spec``), found in their source and resolved in their modules."""
    from silentswarm.jobspec import JobSpec

    out = []
    for path in sorted((REPO / "leader" / "api").glob("*.py")):
        module = importlib.import_module(f"silentswarm.leader.api.{path.stem}")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            if node.func.id == "decode_strict" and isinstance(node.args[1], ast.Name):
                out.append((f"{path.name}:{node.lineno}", getattr(module, node.args[1].id)))
            elif node.func.id == "decode_job_spec":
                out.append((f"{path.name}:{node.lineno}", JobSpec))
    return out


def test_the_walk_finds_what_it_must_refuse():
    class Loose(msgspec.Struct):
        a: dict[str, typing.Any]
        b: dict
        c: list[typing.Mapping[str, object]] | None
        d: dict[str, int]  # typed: fine

    holes = struct_holes(Loose, set())
    assert holes == [
        "Loose.a: Any",
        "Loose.b: a bare dict (of anything)",
        "Loose.c: Any",
    ]


def test_every_shared_struct_is_typed_all_the_way_down():
    structs = shared_structs()
    names = {cls.__name__ for cls in structs}
    # The walk saw the REST bodies, the signal arguments, the stage events and the payloads.
    assert {"JobRecord", "LeaderInfo", "StartArgs", "StepEvent", "Heartbeat"} <= names
    seen: set[type] = set()
    assert [hole for cls in structs for hole in struct_holes(cls, seen)] == []


def test_every_route_answers_a_typed_body():
    routes = route_handlers()
    assert len(routes) >= 30
    holes = []
    for route, answer in routes:
        body = answer_body(answer)
        if body is not None:
            holes += untyped(body, route, set())
    assert holes == []


def test_every_request_body_a_route_decodes_is_typed():
    bodies = request_bodies()
    assert len(bodies) >= 8  # submit, release, update, purge retry, the four onboarding ones
    holes = [hole for where, tp in bodies for hole in untyped(tp, where, set())]
    assert holes == []


def test_every_free_form_field_still_exists():
    """An allow-list entry for a field that is gone is a stale hole: remove it."""
    fields = {f"{c.__name__}.{f.name}" for c in shared_structs() for f in msgspec.structs.fields(c)}
    assert set(FREE_FORM) <= fields
