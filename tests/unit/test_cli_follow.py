"""The CLI's one voice, its pure parts: what the follow view (``swarm watch``, ``swarm submit
--watch``) prints for a change, usage errors as one line, leader URLs, help texts as written.
Table tests; the runs against a real leader are in tests/integration/test_cli.py."""

from __future__ import annotations

import io
import subprocess
import sys

import msgspec
import pytest
from cyclopts import UnknownCommandError
from rich.console import Console

from silentswarm.cli.app import app, usage_message
from silentswarm.cli.options import leader_url_problem
from silentswarm.cli.watch import LineView, Snapshot, changed_lines, view_lines
from silentswarm.types.metrics import FellowMetrics, JobMetrics
from tests.helpers import REPO, child_env


def metrics(step: int, *, total: int | None = 10, loss: float | None = None) -> JobMetrics:
    return JobMetrics(
        job_id="j",
        attempt=1,
        step=step,
        total_steps=total,
        loss=loss,
        val_loss=None,
        lr=None,
        steps_per_min=None,
        step_time_s=None,
        tokens_per_s=None,
        eta_s=None,
        bytes_sent=0,
        bytes_received=0,
        boundaries=[],
        fellows=[FellowMetrics(fellow_id="f1", stage=0, step=step)],
        updated_at=None,
    )


PENDING = Snapshot("j", "PENDING", "waiting for 2 ready fellows; 1 available")
STARTING = Snapshot("j", "RUNNING", "stages starting on f1")


@pytest.mark.parametrize(
    ("snap", "want"),
    [
        (PENDING, {"job": "j PENDING waiting for 2 ready fellows; 1 available"}),
        (STARTING, {"job": "j RUNNING stages starting on f1"}),
        (Snapshot("j", "RUNNING"), {"job": "j RUNNING"}),
        (
            Snapshot("j", "RUNNING", metrics=metrics(5, loss=2.5)),
            {
                "job": "j RUNNING [###############...............] 5/10  50%",
                "summary": "  loss 2.5000  val -  - tok/s  - s/step  - steps/min  ETA -",
                "fellow:f1": "  stage 0 f1               step      5  sent 0 B/s  recv 0 B/s",
            },
        ),
        (
            Snapshot("j", "RUNNING", metrics=metrics(0, total=None)),
            {
                "job": "j RUNNING [                              ]",
                "summary": "  loss -  val -  - tok/s  - s/step  - steps/min  ETA -",
                "fellow:f1": "  stage 0 f1               step      0  sent 0 B/s  recv 0 B/s",
            },
        ),
    ],
)
def test_the_lines_of_a_view(snap, want):
    assert view_lines(snap) == want


RUN5 = view_lines(Snapshot("j", "RUNNING", metrics=metrics(5, loss=2.5)))
RUN6 = view_lines(Snapshot("j", "RUNNING", metrics=metrics(6, loss=2.5)))


@pytest.mark.parametrize(
    ("printed", "now", "want"),
    [
        ({}, view_lines(PENDING), [view_lines(PENDING)["job"]]),
        # The same reason again (the record polled every 0.5 s): nothing.
        (view_lines(PENDING), view_lines(PENDING), []),
        (view_lines(PENDING), view_lines(STARTING), ["j RUNNING stages starting on f1"]),
        ({}, RUN5, list(RUN5.values())),
        # A step later the loss is the same: the summary is not printed again.
        (RUN5, RUN6, [RUN6["job"], RUN6["fellow:f1"]]),
        (RUN6, RUN6, []),
    ],
)
def test_a_change_prints_the_lines_that_changed_and_only_those(printed, now, want):
    assert changed_lines(printed, now) == want


def test_a_pipe_never_gets_a_line_twice_in_a_row():
    out = io.StringIO()
    view = LineView(out, every_s=0.0)
    for snap in [PENDING, PENDING, PENDING, STARTING, STARTING]:
        view.show(snap)
    for step in (1, 1, 2, 2, 3):
        view.show(Snapshot("j", "RUNNING", metrics=metrics(step, loss=3.0)))
    view.show(Snapshot("j", "COMPLETED", metrics=metrics(3, loss=3.0)), force=True)
    lines = out.getvalue().splitlines()
    assert lines[:2] == [
        "j PENDING waiting for 2 ready fellows; 1 available",
        "j RUNNING stages starting on f1",
    ]
    assert lines[-1] == "j COMPLETED [#########.....................] 3/10  30%"
    assert len(lines) == len(set(lines)), lines
    assert sum("loss 3.0000" in line for line in lines) == 1


def test_between_changes_a_pipe_gets_a_line_at_most_every_interval():
    out = io.StringIO()
    view = LineView(out, every_s=3600.0)
    view.show(Snapshot("j", "RUNNING", metrics=metrics(1)))
    view.show(Snapshot("j", "RUNNING", metrics=metrics(2)))  # too soon: nothing
    assert "1/10" in out.getvalue() and "2/10" not in out.getvalue()
    view.show(Snapshot("j", "FAILED", metrics=metrics(2)))  # a new state: at once
    assert "j FAILED" in out.getvalue()


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://127.0.0.1:8080", None),
        ("https://leader.example.org/", None),
        ("http://[::1]:8080", None),
        ("notaurl", "is not an http:// or https:// URL"),
        ("ftp://host", "is not an http:// or https:// URL"),
        ("http://", "has no host"),
        ("http://host:port", "is not a URL"),
        ("http://host/?x=1", "no query or fragment"),
    ],
)
def test_leader_urls(url, problem):
    found = leader_url_problem(url)
    assert (found is None) if problem is None else (problem in found)


@pytest.mark.parametrize(
    ("token", "want"),
    [
        ("jbos", "unknown command 'jbos'; did you mean 'jobs'?"),
        ("fellow", "unknown command 'fellow'; did you mean 'fellows'?"),
        ("xyzzy", "unknown command 'xyzzy' (see swarm --help)"),
    ],
)
def test_an_unknown_command_is_one_line_with_the_closest_name(token, want):
    assert usage_message(UnknownCommandError(unused_tokens=[token], app=app)) == want


def swarm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "silentswarm.cli.app", *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def help_text(*argv: str) -> str:
    """What ``swarm ARGV`` (ending in --help) prints, wide enough not to wrap."""
    out = io.StringIO()
    with pytest.raises(SystemExit) as done:
        app.meta(list(argv), console=Console(file=out, width=200))
    assert done.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (("nats-auth", "init", "--help"), "default <state>/nats-auth"),
        (("nats-auth", "fellow", "--help"), "default <state>/nats-auth"),
        (("release", "--help"), "local state (<state>/fellows/<id>)"),
        (("jobs", "--help"), "Also archived jobs"),
    ],
)
def test_help_shows_its_texts_as_written(argv, shown):
    assert shown in help_text(*argv)


@pytest.mark.parametrize(
    ("argv", "listed", "absent"),
    [
        (("fellows", "--help"), ["--leader-url", "--json"], []),
        (("logs", "--help"), ["--leader-url", "--json", "FELLOW-ID"], []),
        (("nats-auth", "init", "--help"), ["--json"], ["--leader-url"]),
        (("stop-cluster", "--help"), ["--json"], ["--leader-url"]),
        (("generate", "--help"), [], ["--leader-url", "--json"]),
        (("serve", "--help"), [], ["--leader-url", "--json"]),
    ],
)
def test_shared_options_are_listed_where_they_apply(argv, listed, absent):
    out = help_text(*argv)
    assert all(flag in out for flag in listed), out
    assert not any(flag in out for flag in absent), out


def test_usage_errors_are_one_line_and_exit_2():
    for argv, needle in [
        (("jbos",), "unknown command 'jbos'; did you mean 'jobs'?"),
        (("fellows", "--bogus"), "--bogus"),
        (("logs",), "requires an argument"),
        (("--leader-url", "notaurl", "fellows"), "'notaurl' is not an http:// or https:// URL"),
        (("jobs", "--leader-url", "http://"), "has no host"),
    ]:
        result = swarm(*argv)
        assert result.returncode == 2, (argv, result)
        assert result.stdout == ""
        assert result.stderr.startswith("swarm: error: ") and result.stderr.count("\n") == 1
        assert needle in result.stderr, result.stderr


def test_the_json_of_a_watched_end_keeps_its_fields():
    from silentswarm.cli.watch import WatchedEnd

    end = WatchedEnd(job_id="j", state="COMPLETED", reason="", final_loss=1.0, final_val_loss=None)
    assert msgspec.to_builtins(end)["export_error"] is None
