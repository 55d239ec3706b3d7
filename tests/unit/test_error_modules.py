"""The error house keeps its shape: three error modules, every code an ErrorCode member.

Parsed, not imported, so a module that would pull in TensorFlow is checked too.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterator
from pathlib import Path

import pytest

from silentswarm.errors import ErrorCode, LeaderResponseError, SwarmError, received_code

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("leader", "agent", "swarm")
ERROR_MODULES = {"swarm/errors.py", "leader/errors.py", "agent/errors.py"}
CODES = {member.value for member in ErrorCode}


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            yield str(path.relative_to(REPO)), ast.parse(path.read_text(), str(path))


MODULES = dict(_modules())


def _base_names(node: ast.ClassDef) -> set[str]:
    names = set()
    for base in node.bases:
        if isinstance(base, ast.Name):
            names.add(base.id)
        elif isinstance(base, ast.Attribute):
            names.add(base.attr)
    return names


def _exception_classes() -> dict[str, str]:
    """Every class in leader/, agent/ and swarm/ that derives from an exception, by name, with
    the module that defines it (a fixpoint over base names: builtins and our own)."""
    known = {
        n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
    }
    classes = [
        (file, node)
        for file, tree in MODULES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]
    found: dict[str, str] = {}
    grew = True
    while grew:
        grew = False
        for file, node in classes:
            if node.name not in found and _base_names(node) & (known | set(found)):
                found[node.name] = file
                grew = True
    return found


def test_every_error_class_lives_in_one_of_the_three_error_modules():
    classes = _exception_classes()
    assert {"SwarmError", "LinkError", "GlueError", "NotReadyError"} <= set(classes)
    stray = {name: file for name, file in classes.items() if file not in ERROR_MODULES}
    assert stray == {}


def test_every_swarm_error_has_a_code_of_its_own_kind():
    from silentswarm import errors as swarm_errors
    from silentswarm.agent import errors as agent_errors
    from silentswarm.leader import errors as leader_errors

    seen = set()
    for module in (swarm_errors, leader_errors, agent_errors):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, SwarmError):
                assert isinstance(value.code, ErrorCode), value
                seen.add(value)
    assert len(seen) > 30


def _string_codes(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """String literals that are codes: ``code="..."`` arguments, ``code = "..."`` in a class
    body, and any literal equal to an ErrorCode value (a docstring is no literal here)."""
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "code":
            if isinstance(node.value, ast.Constant | ast.JoinedStr):
                yield node.lineno, ast.unparse(node.value)
        elif isinstance(node, ast.ClassDef):  # an error class's ``code = "..."``, not a field
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "code" for t in stmt.targets)
                    and isinstance(stmt.value, ast.Constant | ast.JoinedStr)
                ):
                    yield stmt.lineno, ast.unparse(stmt.value)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in CODES
            and id(node) not in docstrings
        ):
            yield node.lineno, node.value


def test_no_code_is_a_free_string():
    offenders = {
        f"{file}:{line}": text
        for file, tree in MODULES.items()
        if file != "swarm/errors.py"
        for line, text in _string_codes(tree)
    }
    assert offenders == {}


def test_no_two_codes_share_a_value():
    values = [member.value for member in ErrorCode]
    assert len(values) == len(set(values))
    assert all(member.name == member.value for member in ErrorCode)


def test_a_code_from_a_stranger_is_kept_as_it_came():
    assert received_code("FELLOW_BUSY") is ErrorCode.FELLOW_BUSY
    assert received_code("FROM_A_NEWER_LEADER") == "FROM_A_NEWER_LEADER"
    error = LeaderResponseError("m", code="FROM_A_NEWER_LEADER")
    assert error.code == "FROM_A_NEWER_LEADER"
    assert error.to_dict() == {"code": "FROM_A_NEWER_LEADER", "message": "m"}
    assert LeaderResponseError("m", code="JOB_INVALID").code is ErrorCode.JOB_INVALID


@pytest.mark.parametrize("member", list(ErrorCode))
def test_a_code_is_its_wire_string(member):
    assert str(member) == member.value and f"{member}" == member.value


def test_every_signal_kind_has_its_invalid_arguments_code():
    from silentswarm.agent.decide import INVALID_ARGS
    from silentswarm.protocol import SignalKind

    assert set(INVALID_ARGS) == {kind.value for kind in SignalKind}
    assert all(code == f"{kind}_INVALID" for kind, code in INVALID_ARGS.items())


@pytest.mark.parametrize(
    ("module", "allowed"),
    [("swarm/errors.py", set()), ("leader/errors.py", {"swarm"}), ("agent/errors.py", {"swarm"})],
)
def test_an_error_module_imports_only_the_shared_one_of_ours(module, allowed):
    ours = set()
    for node in ast.walk(MODULES[module]):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in PACKAGES:
                ours.add(node.module)
        elif isinstance(node, ast.Import):
            ours |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
    assert ours <= {"silentswarm.errors"} and {m.split(".")[0] for m in ours} <= allowed
