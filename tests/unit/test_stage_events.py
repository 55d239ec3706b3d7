"""The stage runtime's JSON lines, typed (swarm/types/stage.py), and how the agent reads
them (agent/supervisor.py): events handed on as Structs, a bad line logged and counted."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from silentswarm.agent import supervisor
from silentswarm.agent.runtime.control import parse_command
from silentswarm.agent.supervisor import STAGE_OOM_SCORE_ADJ, StageRun, stage_preexec
from silentswarm.plan import ModelConfig, TrainConfig, single_process_plan
from silentswarm.protocol import StageResult
from silentswarm.types.stage import (
    CheckpointEvent,
    CheckpointRequest,
    DoneEvent,
    ErrorEvent,
    LinksEvent,
    PlacementEvent,
    StageEvent,
    StepEvent,
    decode_event,
    encode_command,
    encode_event,
)

STEP = StepEvent(
    stage=1,
    step=0,
    loss=None,
    lr=0.001,
    step_time_s=0.02,
    tokens_per_s=25600.0,
    wait_s=0.01,
    up_boundary=0,
    up_bytes_sent=10,
    up_bytes_received=20,
    relay_dropped=0,
)
DONE = DoneEvent(
    stage=0,
    steps=4,
    loss=2.5,
    val_loss=2.75,
    step_time_s=0.02,
    tokens_per_s=25600.0,
    params=1234,
    dropped_frames=0,
    down_boundary=0,
    down_bytes_sent=30,
    down_bytes_received=40,
    relay_dropped=2,
    relay_dropped_by_reason={"forged": 2},
)
EVENTS: list[StageEvent] = [
    PlacementEvent(stage=0, devices={"block_0": "/job:localhost/replica:0/task:0/device:CPU:0"}),
    LinksEvent(stage=1, up="p2p", down=None),
    STEP,
    msgspec.structs.replace(STEP, loss=3.0, val_loss=3.25),
    CheckpointEvent(stage=0, id="c1", step=2, path="/ck/step-2", final=False, ok=True),
    CheckpointEvent(stage=0, id="c2", step=4, path=None, final=True, ok=False, message="disk"),
    DONE,
    ErrorEvent(stage=1, message="boundary 0: the peer went away"),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_round_trips_through_its_line(event):
    line = encode_event(event)
    assert b"\n" not in line
    assert decode_event(line) == event
    assert json.loads(line)["event"] == type(event).__struct_config__.tag


def test_a_line_says_only_what_it_says():
    step = json.loads(encode_event(STEP))
    assert step["loss"] is None, "a required None is written: no loss on this stage"
    assert "val_loss" not in step and "down_bytes_sent" not in step, "not validated, no down"
    assert step["up_bytes_received"] == 20 and step["relay_dropped"] == 0
    written = json.loads(encode_event(EVENTS[4]))
    assert written == {
        "event": "checkpoint",
        "stage": 0,
        "id": "c1",
        "step": 2,
        "path": "/ck/step-2",
        "final": False,
        "ok": True,
    }
    assert json.loads(encode_event(EVENTS[5]))["message"] == "disk"


def test_traffic_sums_both_boundaries():
    assert (STEP.bytes_sent, STEP.bytes_received) == (10, 20)
    assert (DONE.bytes_sent, DONE.bytes_received) == (30, 40)


def test_a_diverged_loss_is_written_as_null():
    line = encode_event(msgspec.structs.replace(STEP, loss=float("nan")))
    assert json.loads(line)["loss"] is None and decode_event(line).loss is None


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b'{"event": "reboot", "stage": 0}',
        b'{"stage": 0, "message": "no tag"}',
        b'{"event": "error", "stage": 0}',
        b'{"event": "step", "stage": -1}',
        b'{"event": "error", "stage": 0, "message": "' + b"x" * 9000 + b'"}',
        b"[1, 2]",
    ],
)
def test_a_line_that_is_no_event_fails_to_decode(line):
    with pytest.raises(msgspec.DecodeError):
        decode_event(line)


def test_unknown_fields_are_ignored():
    line = b'{"event": "error", "stage": 0, "message": "m", "added_later": [1]}'
    assert decode_event(line) == ErrorEvent(stage=0, message="m")


@pytest.mark.parametrize(
    "command", [CheckpointRequest("c1"), CheckpointRequest("c2", 40)], ids=["now", "at-40"]
)
def test_the_agents_commands_are_what_the_runtime_parses(command):
    line = encode_command(command)
    assert line.endswith(b"\n") and json.loads(line)["cmd"] == "checkpoint"
    assert parse_command(line.rstrip(b"\n")) == command


# --- the agent's reader -----------------------------------------------------------------------

FAKE_RUNTIME = r"""
import sys
lines = [
    '{"event": "links", "stage": 0, "up": null, "down": null}',
    'TensorFlow says hello',
    '{"event": "step", "stage": 0, "step": 0, "loss": 4.5, "lr": 0.01, "step_time_s": 0.1,'
    ' "tokens_per_s": 10.0, "wait_s": 0.0, "relay_dropped": 0}',
    '{"event": "step", "stage": 0, "step": "one"}',
    '{"event": "reboot", "stage": 0}',
    '{not json',
    '{"event": "step", "stage": 0, "step": 1, "loss": 4.25, "lr": 0.01, "step_time_s": 0.1,'
    ' "tokens_per_s": 10.0, "wait_s": 0.0, "relay_dropped": 0}',
]
for line in lines:
    print(line, flush=True)
sys.stderr.write(sys.argv[1] + "\n")
sys.exit(int(sys.argv[2]))
"""


def _read_fake_runtime(tmp_path: Path, last_words: str, code: int, done: bool = False):
    plan = single_process_plan(
        job_id="j1",
        model=ModelConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2),
        train=TrainConfig(steps=2, batch_size=4, micro_batches=2),
    )
    events: list[StageEvent] = []
    output: list[tuple[str, str]] = []
    script = FAKE_RUNTIME
    if done:
        script = script.replace(
            "for line in lines:",
            "lines.append('" + encode_event(DONE).decode() + "')\nfor line in lines:",
        )

    async def scenario():
        run = StageRun(plan, tmp_path, events.append, lambda *line: output.append(line))
        run.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            script,
            last_words,
            str(code),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        run._stderr_reader = asyncio.create_task(run._read_stderr())
        await run._read()
        return run, await run.finished

    run, outcome = asyncio.run(scenario())
    return run, outcome, events, output


def test_the_agent_hands_on_events_and_counts_the_lines_that_are_not(tmp_path, caplog):
    run, outcome, events, output = _read_fake_runtime(tmp_path, "Traceback: boom", 1)
    assert [type(e) for e in events] == [LinksEvent, StepEvent, StepEvent]
    assert run.malformed_events == 3
    assert sum("malformed event" in r.getMessage() for r in caplog.records) == 3
    assert ("stdout", "TensorFlow says hello") in output
    assert ("stderr", "Traceback: boom") in output
    assert run.last_step == events[-1] and run.done is None
    assert outcome.result is StageResult.FAILED
    assert (outcome.step, outcome.loss, outcome.val_loss) == (2, 4.25, None)
    assert outcome.message == "Traceback: boom (exit 1)"


def test_a_run_that_says_done_and_exits_0_completed(tmp_path):
    run, outcome, events, _ = _read_fake_runtime(tmp_path, "", 0, done=True)
    assert events[-1] == DONE == run.done
    assert outcome.result is StageResult.COMPLETED
    assert (outcome.step, outcome.loss, outcome.val_loss) == (4, 2.5, 2.75)


def test_tensorflows_probes_of_compile_cache_entries_are_neither_kept_nor_shipped(tmp_path):
    noise = (
        "E0000 00:00:1796569575.826342   22769 text_format.cc:378] Error parsing text-format "
        "tensorflow.XlaSerializedCacheEntry: 2:1: Expected identifier, got: 4"
    )
    tuning = (
        "E0000 00:00:1796606657.133172   20280 cpu_aot_loader.cc:220] Loading XLA:CPU AOT "
        "result. Target machine feature +prefer-no-scatter is not  supported on the host "
        "machine. ... This could lead to execution errors such as SIGILL."
    )
    stderr = f"Traceback: boom\n{noise}\n{tuning}"
    run, outcome, _, output = _read_fake_runtime(tmp_path, stderr, 1)
    assert ("stderr", "Traceback: boom") in output
    assert not [line for _, line in output if "XlaSerializedCacheEntry" in line or "SIGILL" in line]
    kept = run.stderr_path.read_text()
    assert "XlaSerializedCacheEntry" not in kept and "SIGILL" not in kept
    assert outcome.message == "Traceback: boom (exit 1)", "the cause, not TensorFlow's probe"


def test_a_runtime_is_the_first_the_out_of_memory_killer_takes(tmp_path):
    """Its oom_score_adj is raised to 500 (never lowered: one already higher stays)."""
    read = ["cat", "/proc/self/oom_score_adj"]
    started = subprocess.run(read, preexec_fn=stage_preexec(lambda: None), capture_output=True)
    assert started.stdout.strip() == str(STAGE_OOM_SCORE_ADJ).encode()

    def already_higher() -> None:
        Path("/proc/self/oom_score_adj").write_text("700")
        stage_preexec(lambda: None)()

    higher = subprocess.run(read, preexec_fn=already_higher, capture_output=True)
    assert higher.stdout.strip() == b"700"


def test_a_stderr_line_past_the_pipes_limit_neither_stops_the_reading_nor_fills_the_disk(
    tmp_path, monkeypatch
):
    """A stage logs what peers send it: a line longer than the reader's limit (64 KiB here,
    16 MiB in a fellow) comes in pieces and the lines after it are read (before, the reader
    died and the runtime blocked on its next write); stage.err stops at its bound."""
    monkeypatch.setattr(supervisor, "STDERR_FILE_MAX_BYTES", 50_000)
    huge = "x" * 100_000  # an argument of the fake runtime: under the kernel's 128 KiB
    stderr = "\n".join(["first words", huge, "Traceback: boom"])
    run, outcome, _, output = _read_fake_runtime(tmp_path, stderr, 1)
    assert ("stderr", "Traceback: boom") in output, "the lines after it were read"
    assert sum(len(line) for stream, line in output if stream == "stderr") > len(huge)
    kept = run.stderr_path.read_bytes()
    assert kept.startswith(b"first words\n") and len(kept) <= 50_000
    assert kept.endswith(b"the rest is not kept here]\n")
    assert outcome.result is StageResult.FAILED
    assert outcome.message == "Traceback: boom (exit 1)", "the last line, not the file's note"


def test_read_lines_gives_every_byte_in_order_past_the_limit():
    async def lines() -> list[bytes]:
        reader = asyncio.StreamReader(limit=16)
        reader.feed_data(b"short\n" + b"y" * 100 + b"\nafter\nlast")
        reader.feed_eof()
        return [line async for line in supervisor.read_lines(reader)]

    got = asyncio.run(lines())
    assert got[0] == b"short\n" and got[-2:] == [b"after\n", b"last"]
    assert b"".join(got) == b"short\n" + b"y" * 100 + b"\nafter\nlast"
