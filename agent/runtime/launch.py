"""Run a chain of ``swarm-stage`` processes on this machine and collect their JSON lines.

For tests, benchmarks and quick local experiments; imports no TensorFlow itself. Every
process is killed if any fails or the time runs out, and gets SIGTERM when its caller dies
(even by SIGKILL), so nothing outlives a run. With ``SWARM_STAGE_FORKSERVER=1`` (the test
suite's setting) the stages are forked from a process that imported TensorFlow once
(:mod:`~silentswarm.agent.runtime.forkserver`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from silentswarm.agent.errors import ForkServerError, StageFailedError
from silentswarm.agent.runtime import compilecache, forkserver
from silentswarm.plan import StagePlan
from silentswarm.procs import die_with_parent

log = logging.getLogger("launch")
Started = subprocess.Popen[bytes] | forkserver.ForkedProcess


def write_plans(plans: list[StagePlan], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for plan in plans:
        path = directory / f"plan-{_name(plan)}.json"
        path.write_bytes(msgspec.json.encode(plan))
        paths.append(path)
    return paths


def stage_command(plan_path: Path, *, control_stdin: bool = False) -> list[str]:
    """The command line of one ``swarm-stage`` process for ``plan_path``."""
    argv = [sys.executable, "-m", "silentswarm.agent.runtime.main", "--plan", str(plan_path)]
    return [*argv, "--control-stdin"] if control_stdin else argv


def stage_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without SWARM_* (but the compile cache's settings), plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SWARM_") or k in compilecache.ENV_NAMES
    }
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _prefix(
    prefixes: Mapping[int | tuple[int, int], Sequence[str]], plan: StagePlan
) -> Sequence[str]:
    """What goes in front of ``plan``'s command line: its (replica, stage)'s, else its
    stage's."""
    return prefixes.get((plan.replica, plan.stage), prefixes.get(plan.stage, ()))


def run_plans(
    plans: list[StagePlan],
    directory: Path,
    *,
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    command_prefixes: Mapping[int | tuple[int, int], Sequence[str]] | None = None,
) -> list[list[dict[str, Any]]]:
    """Start one process per stage, wait for all; each stage's events, in stage order
    (replicas: replica by replica, each in stage order).

    Stage stdout goes to ``<directory>/stage-<job>-<i>.out`` (a replica r > 0's to
    ``stage-<job>-r<r>-<i>.out``) and stderr to ``.err``.
    ``on_event`` sees every event of every stage as it is written (live progress).
    ``command_prefixes[i]`` goes in front of stage i's command line (for example
    ``ip netns exec NS``: the link emulator's far side), ``command_prefixes[(r, i)]`` in front
    of replica r's stage i's (before ``[i]``).
    """
    tails: dict[Path, int] = {}
    paths = write_plans(plans, directory)
    running: list[tuple[StagePlan, Started, Path]] = []
    try:
        for plan, path in reversed(list(zip(plans, paths, strict=True))):
            out = directory / f"stage-{_name(plan)}.out"
            with open(out, "wb") as stdout, open(out.with_suffix(".err"), "wb") as stderr:
                proc = _start(
                    _prefix(command_prefixes or {}, plan), path, stage_env(env), stdout, stderr
                )
            running.append((plan, proc, out))
        deadline = time.monotonic() + timeout
        while any(proc.poll() is None for _, proc, _ in running):
            failed = [(plan, proc, out) for plan, proc, out in running if proc.poll()]
            if failed:
                break  # the first failure is the cause; the others would only time out
            if time.monotonic() >= deadline:
                raise StageFailedError(f"stages still running after {timeout:.0f}s")
            _follow(running, tails, on_event)
            time.sleep(0.1)
        _follow(running, tails, on_event)
        failed = [(plan, proc, out) for plan, proc, out in running if proc.poll()]
        if failed:
            plan, proc, out = min(failed, key=lambda f: f[2].with_suffix(".err").stat().st_mtime)
            err = out.with_suffix(".err").read_text(errors="replace")[-3000:]
            raise StageFailedError(f"stage {plan.stage} exited {proc.returncode}:\n{err}")
    finally:
        for _, proc, _ in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = {(plan.replica, plan.stage): _events(out) for plan, _, out in running}
    return [results[key] for key in sorted(results)]


def _start(
    prefix: Sequence[str], path: Path, env: dict[str, str], stdout: IO[bytes], stderr: IO[bytes]
) -> Started:
    """One stage process: forked by this process's fork server where it is on
    (:mod:`~silentswarm.agent.runtime.forkserver`) and the command has no prefix, else
    started from scratch. Either way a killed caller takes its stages along."""
    command = [*prefix, *stage_command(path)]
    if not prefix and forkserver.enabled():
        try:
            server = forkserver.server_for(env)
            if server is not None:
                with open(os.devnull, "rb") as stdin:
                    return server.spawn(
                        command,
                        env=env,
                        stdin=stdin.fileno(),
                        stdout=stdout.fileno(),
                        stderr=stderr.fileno(),
                    )
        except ForkServerError as exc:
            log.warning("%s; starting the stage as a process of its own", exc)
    return subprocess.Popen(
        command, stdout=stdout, stderr=stderr, env=env, preexec_fn=die_with_parent()
    )


def _name(plan: StagePlan) -> str:
    """``<job>-<stage>``, and ``<job>-r<replica>-<stage>`` for a replica after the first."""
    if plan.replica == 0:
        return f"{plan.job_id}-{plan.stage}"
    return f"{plan.job_id}-r{plan.replica}-{plan.stage}"


def _follow(
    running: list[tuple[StagePlan, Started, Path]],
    offsets: dict[Path, int],
    on_event: Callable[[dict[str, Any]], None] | None,
) -> None:
    """Hand the complete lines written since the last call to ``on_event``."""
    if on_event is None:
        return
    for _, _, out in running:
        with open(out, "rb") as handle:
            handle.seek(offsets.get(out, 0))
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]
        offsets[out] = offsets.get(out, 0) + len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith("{"):
                on_event(json.loads(line))


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "step"]


def done(events: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e for e in events if e["event"] == "done")


def links(events: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e for e in events if e["event"] == "links")
