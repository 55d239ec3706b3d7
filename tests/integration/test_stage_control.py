"""Real ``swarm-stage --control-stdin`` processes: checkpoint commands on stdin, and the exit when
the supervising agent (the holder of stdin) goes away."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from silentswarm.agent.runtime.checkpoint import load_checkpoint
from silentswarm.agent.runtime.control import EXIT_SUPERVISOR_GONE
from silentswarm.agent.runtime.launch import stage_command, stage_env, write_plans
from silentswarm.plan import ModelConfig, StagePlan, TrainConfig, Transport, chain_plans
from silentswarm.procs import free_port
from tests.helpers import REPO, kill_tree

pytestmark = pytest.mark.integration

TINY = ModelConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2)
EVENT_TIMEOUT_S = 120.0  # generous: two TensorFlow imports and compiles on a busy machine


class Stage:
    """One stage process with stdin and stdout as pipes; a thread queues its JSON events."""

    def __init__(self, plan: StagePlan, plan_path: Path) -> None:
        self.plan = plan
        self.err_path = plan_path.with_suffix(".err")
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                stage_command(plan_path, control_stdin=True),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=stage_env(),
                cwd=REPO,
            )
        self.seen: list[dict[str, Any]] = []
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(b"{"):
                self._events.put(json.loads(line))
        self._events.put(None)

    def send(self, line: bytes | dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        data = line if isinstance(line, bytes) else json.dumps(line).encode() + b"\n"
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def wait_event(self, predicate: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        """The next event that matches; fails on an ``error`` event, EOF or the time-out."""
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while True:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"stage {self.plan.stage}: no {what}\n{self.log_tail()}"
                ) from None
            if event is None or event["event"] == "error":
                raise AssertionError(f"stage {self.plan.stage} ended before {what}: {event}")
            self.seen.append(event)
            if predicate(event):
                return event

    def log(self) -> str:
        """The stage's whole stderr: its warnings come first, and TensorFlow's lines (a
        loaded compile cache entry's can run to kilobytes) after them."""
        return self.err_path.read_text(errors="replace")

    def log_tail(self) -> str:
        """The end of its stderr, for a failure's message."""
        return self.log()[-3000:]

    def kill(self) -> None:
        kill_tree(self.proc.pid)
        self.proc.wait(timeout=10)


@pytest.fixture
def start_stages(tmp_path: Path) -> Iterator[Callable[[list[StagePlan]], list[Stage]]]:
    """Start stage processes, downstream first; every one is killed when the test ends."""
    started: list[Stage] = []

    def start(plans: list[StagePlan]) -> list[Stage]:
        paths = write_plans(plans, tmp_path / "plans")
        for plan, path in reversed(list(zip(plans, paths, strict=True))):
            started.append(Stage(plan, path))
        return sorted(started[-len(plans) :], key=lambda s: s.plan.stage)

    try:
        yield start
    finally:
        for stage in started:
            stage.kill()


def two_stages(job_id: str, steps: int, checkpoint_dir: Path | None = None) -> list[StagePlan]:
    train = TrainConfig(
        steps=steps, batch_size=4, micro_batches=2, max_data_bytes=100_000, val_batches=1
    )
    plans = chain_plans(
        job_id=job_id,
        model=TINY,
        train=train,
        addresses=[None, f"tcp://127.0.0.1:{free_port()}"],
        transport=Transport.P2P,
        intra_op_threads=1,
        peer_timeout_s=60.0,
    )
    where = None if checkpoint_dir is None else str(checkpoint_dir)
    return [msgspec.structs.replace(plan, checkpoint_dir=where) for plan in plans]


def is_checkpoint(request_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "checkpoint" and e["id"] == request_id


def test_both_stages_checkpoint_at_the_requested_step_and_at_the_end(start_stages, tmp_path):
    root = tmp_path / "checkpoints"
    stages = start_stages(two_stages("ctl", 40, root))
    for stage in stages:
        stage.send(b"this is not json\n")
        stage.send({"cmd": "reboot", "id": "x"})
        stage.send({"cmd": "checkpoint", "id": "mid", "at_step": 20})
        stage.send({"cmd": "checkpoint", "id": "end", "at_step": 1000})

    for stage in stages:
        i = stage.plan.stage
        mid = stage.wait_event(is_checkpoint("mid"), "checkpoint 'mid'")
        end = stage.wait_event(is_checkpoint("end"), "checkpoint 'end'")
        stage.wait_event(lambda e: e["event"] == "done", "done")
        want_dir = root / "ctl" / "attempt-1"
        assert mid == {
            "event": "checkpoint",
            "stage": i,
            "id": "mid",
            "step": 20,
            "path": str(want_dir / "step-20"),
            "final": False,
            "ok": True,
        }
        assert (end["step"], end["final"], end["ok"]) == (40, True, True)
        assert end["path"] == str(want_dir / "step-40")
        steps_before = [e["step"] for e in stage.seen if e["event"] == "step"]
        assert steps_before == list(range(40)), "the step after a checkpoint is there too"
        order = [(e["event"], e.get("step")) for e in stage.seen]
        assert order.index(("checkpoint", 20)) == order.index(("step", 19)) + 1
        assert not any(e["event"] == "checkpoint" and e["id"] == "x" for e in stage.seen)

        for event, steps_done in ((mid, 20), (end, 40)):
            checkpoint = load_checkpoint(Path(event["path"]) / f"stage-{i}.json")
            meta = checkpoint.meta
            assert (meta["stage"], meta["steps_done"], meta["total_steps"]) == (i, steps_done, 40)
            assert (meta["layer_start"], meta["layer_end"]) == (i, i + 1)
            assert meta["final"] is (steps_done == 40)
            # batch 4, one epoch; stage 1 reads no data, so keeps no position
            want = {"epoch": 0, "index": 4 * steps_done} if i == 0 else None
            assert meta["data"] == want
            assert checkpoint.arrays and {a["name"] for a in meta["arrays"]} == set(
                checkpoint.arrays
            )
        log = stage.log()
        assert "ignoring control line" in log and "unknown or missing cmd 'reboot'" in log, log[
            :3000
        ]

    for stage in stages:  # the agent may close the pipe once it has seen 'done': still exit 0
        stage.close_stdin()
    for stage in stages:
        assert stage.proc.wait(timeout=30) == 0, stage.log_tail()


def test_a_closed_stdin_ends_a_stage_at_once_even_while_it_waits_for_its_peer(start_stages):
    first, last = start_stages(two_stages("gone", 100_000))
    last.wait_event(lambda e: e["event"] == "step", "a training step")
    first.proc.send_signal(signal.SIGSTOP)  # the last stage now blocks in a ZeroMQ receive
    time.sleep(0.2)  # not waiting for an event: give it time to reach that receive

    last.close_stdin()
    closed_at = time.monotonic()
    assert last.proc.wait(timeout=10) == EXIT_SUPERVISOR_GONE
    assert time.monotonic() - closed_at < 5.0
    assert "supervising agent is gone" in last.log()

    first.proc.send_signal(signal.SIGCONT)
    first.close_stdin()
    assert first.proc.wait(timeout=10) == EXIT_SUPERVISOR_GONE
    assert "Traceback" not in first.log()
