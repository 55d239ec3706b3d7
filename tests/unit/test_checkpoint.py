"""The stage's control channel (parsing, queueing, EOF, ring commands) and its checkpoints (write,
read, restore).

The checkpoint tests train a tiny single-stage model in this process on the CPU.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import msgspec
import numpy as np
import pytest

from silentswarm.agent.runtime.control import (
    MAX_LINE_BYTES,
    CheckpointRequest,
    ControlChannel,
    parse_command,
)
from silentswarm.plan import (
    ModelConfig,
    Peer,
    RingChange,
    StagePlan,
    SyncRing,
    TrainConfig,
    single_process_plan,
)
from silentswarm.types.stage import (
    CheckpointEvent,
    DoneEvent,
    PlacementEvent,
    RingCommand,
    StageEvent,
    encode_command,
)

REPO = Path(__file__).resolve().parents[2]
TINY = ModelConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2)

# --- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "want"),
    [
        ('{"cmd": "checkpoint", "id": "c1", "at_step": 5}', CheckpointRequest("c1", 5)),
        ('{"cmd": "checkpoint", "id": "c1", "at_step": 0}', CheckpointRequest("c1", 0)),
        ('{"cmd": "checkpoint", "id": "c1", "at_step": null}', CheckpointRequest("c1", None)),
        (b'{"cmd": "checkpoint", "id": "c1"}', CheckpointRequest("c1", None)),
        ('{"id": "c1", "cmd": "checkpoint", "extra": 1}', CheckpointRequest("c1", None)),
    ],
)
def test_a_checkpoint_command_parses(line, want):
    assert parse_command(line) == want


@pytest.mark.parametrize(
    "line",
    [
        "{not json",
        "[1, 2]",
        '"checkpoint"',
        '{"cmd": "explode", "id": "x"}',
        '{"id": "x", "at_step": 1}',
        '{"cmd": "checkpoint"}',
        '{"cmd": "checkpoint", "id": ""}',
        '{"cmd": "checkpoint", "id": 7}',
        '{"cmd": "checkpoint", "id": "x", "at_step": -1}',
        '{"cmd": "checkpoint", "id": "x", "at_step": 2.5}',
        '{"cmd": "checkpoint", "id": "x", "at_step": true}',
        '{"cmd": "checkpoint", "id": "x", "at_step": "3"}',
    ],
)
def test_a_malformed_or_unknown_command_is_a_warning_only(line, caplog):
    with caplog.at_level(logging.WARNING, logger="silentswarm.agent.runtime.control"):
        assert parse_command(line) is None
    assert "ignoring control line" in caplog.text


@pytest.mark.parametrize(
    ("at_step", "steps_done", "total", "due"),
    [
        (None, 1, 10, True),  # now: at the next boundary
        (5, 4, 10, False),
        (5, 5, 10, True),
        (5, 7, 10, True),  # arrived late: honoured at the next boundary
        (0, 1, 10, True),
        (10, 9, 10, False),
        (10, 10, 10, True),
        (99, 9, 10, False),
        (99, 10, 10, True),  # beyond the run: after the last step
    ],
)
def test_when_a_request_is_due(at_step, steps_done, total, due):
    assert CheckpointRequest("r", at_step).is_due(steps_done, total) is due


# --- the channel --------------------------------------------------------------------------------


def _channel() -> tuple[ControlChannel, list[str]]:
    eofs: list[str] = []
    return ControlChannel(on_eof=lambda: eofs.append("eof")), eofs


def _line(id: str, at_step: int | None = None) -> bytes:
    return json.dumps({"cmd": "checkpoint", "id": id, "at_step": at_step}).encode() + b"\n"


def test_requests_are_taken_when_due_and_only_once():
    channel, _ = _channel()
    for line in (_line("late", 3), _line("now"), b"garbage\n", b"\n", _line("end", 50)):
        channel.feed_line(line)
    assert channel.due_checkpoints(1, 10) == [CheckpointRequest("now")]
    assert channel.due_checkpoints(2, 10) == []
    assert channel.due_checkpoints(4, 10) == [CheckpointRequest("late", 3)]
    assert channel.due_checkpoints(10, 10) == [CheckpointRequest("end", 50)]
    assert channel.due_checkpoints(10, 10) == []


def test_close_hands_back_what_is_pending_and_drops_what_comes_later(caplog):
    channel, eofs = _channel()
    channel.feed_line(_line("a", 7))
    assert channel.close() == [CheckpointRequest("a", 7)]
    with caplog.at_level(logging.WARNING, logger="silentswarm.agent.runtime.control"):
        channel.feed_line(_line("b"))
    assert "the run has ended" in caplog.text
    assert channel.due_checkpoints(100, 10) == []
    channel.feed_chunks([])
    assert eofs == [], "EOF after the end of the run is harmless"


def test_lines_split_across_chunks_and_a_last_line_without_newline():
    channel, eofs = _channel()
    channel.feed_chunks(
        [b'{"cmd": "check', b'point", "id": "a"}\n{"cmd": "checkpoint",', b' "id": "b"}']
    )
    assert [r.id for r in channel.due_checkpoints(1, 5)] == ["a", "b"]
    assert eofs == ["eof"]


def test_an_overlong_line_is_dropped_and_a_long_one_is_taken(caplog):
    """A ring change of a stage in many rings is a long line (hundreds of KiB); one past
    MAX_LINE_BYTES is no command of ours."""
    channel, _ = _channel()
    junk = b'{"cmd": "checkpoint", "id": "' + b"x" * (MAX_LINE_BYTES + 100_000) + b'"}\n'
    long = b'{"cmd": "checkpoint", "id": "y"' + b" " * 300_000 + b"}\n"  # valid, long
    with caplog.at_level(logging.WARNING, logger="silentswarm.agent.runtime.control"):
        lines = junk + long + _line("ok")
        channel.feed_chunks([lines[i : i + 65536] for i in range(0, len(lines), 65536)])
    assert [r.id for r in channel.due_checkpoints(1, 5)] == ["y", "ok"]
    assert "longer than" in caplog.text


def test_the_reader_thread_reads_a_pipe_and_reports_its_end():
    ended = threading.Event()
    channel = ControlChannel(on_eof=ended.set)
    read_end, write_end = os.pipe()
    try:
        thread = channel.start_reader(read_end)
        os.write(write_end, _line("p", 2))
        assert not ended.wait(0.2), "the pipe is still open"
        os.close(write_end)
        write_end = -1
        assert ended.wait(5), "EOF was noticed"
        thread.join(5)
        assert channel.due_checkpoints(2, 5) == [CheckpointRequest("p", 2)]
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def _ring(epoch: int, members: list[int], **kw) -> RingChange:
    many = len(members) > 1
    peer = Peer(fellow_id="f", data_address="tcp://127.0.0.1:1") if many else None
    ring = SyncRing(layer_start=0, layer_end=2, prev=peer, next=peer)
    fields = {"at_step": 5, "donor": members[0], "rings": [ring], **kw}
    return RingChange(epoch=epoch, members=members, **fields)


def _ring_line(change: RingChange) -> bytes:
    return encode_command(RingCommand(change=change))


def test_ring_commands_are_queued_beside_checkpoints_and_taken_once():
    channel, _ = _channel()
    first, second = _ring(1, [0, 2]), _ring(2, [0, 1, 2], joining=[1], at_step=9)
    for line in (_ring_line(first), _line("c", 3), _ring_line(second)):
        channel.feed_line(line)
    assert parse_command(_ring_line(first)) == RingCommand(change=first)
    assert channel.take_ring_changes(0, 0) == [first, second]
    assert channel.take_ring_changes(0, 2) == []
    assert channel.due_checkpoints(3, 10) == [CheckpointRequest("c", 3)], "checkpoints unchanged"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (_ring(1, [1, 2]), "replica 0 is not in 'members'"),
        (_ring(1, [0, 2], donor=2, joining=[2]), "'donor' 2 must be a member"),
        (_ring(1, [2, 0]), "sorted"),
        (RingChange(epoch=1, at_step=3, members=[0, 1], donor=0), "must cut the stage's layers"),
        (
            RingChange(
                epoch=1,
                at_step=3,
                members=[0, 1],
                donor=0,
                rings=[SyncRing(layer_start=0, layer_end=2)],
            ),
            "needs 'prev' and 'next'",
        ),
        (_ring(3, [0, 1]), "not above epoch 3"),  # the ring in force is epoch 3
    ],
)
def test_a_ring_command_this_member_cannot_take_is_a_warning_only(change, why, caplog):
    channel, eofs = _channel()
    with caplog.at_level(logging.WARNING, logger="silentswarm.agent.runtime.control"):
        channel.feed_line(_ring_line(change))
        assert channel.take_ring_changes(0, 3 if change.epoch == 3 else 0) == []
    assert why in caplog.text and "ignoring ring command" in caplog.text
    assert eofs == []


def test_a_duplicate_ring_command_is_dropped_even_before_its_ring_is_in_force(caplog):
    channel, _ = _channel()
    change = _ring(4, [0, 1])
    channel.feed_line(_ring_line(change))
    channel.feed_line(_ring_line(change))  # the agent's retry
    with caplog.at_level(logging.WARNING, logger="silentswarm.agent.runtime.control"):
        assert channel.take_ring_changes(0, 0) == [change]
        channel.feed_line(_ring_line(_ring(3, [0, 1])))  # overtaken
        assert channel.take_ring_changes(0, 0) == []
    assert caplog.text.count("a duplicate or overtaken") == 2


def test_a_joining_stage_waits_for_the_change_that_lists_it_as_joining():
    channel, _ = _channel()
    assert channel.wait_joining(1, 0, 0.05) is None, "nothing came: the timeout"
    not_joining = _ring(1, [0, 1])
    joining = _ring(2, [0, 1], joining=[1], at_step=7)
    later = _ring(3, [0, 1], at_step=9)
    channel.feed_line(_ring_line(not_joining))

    def send() -> None:
        channel.feed_line(_ring_line(joining))
        channel.feed_line(_ring_line(later))

    timer = threading.Timer(0.2, send)
    timer.start()
    try:
        assert channel.wait_joining(1, 0, 10.0) == joining
    finally:
        timer.cancel()
    assert channel.take_ring_changes(1, 2) == [later], "what came after it stays queued"


def test_ring_commands_after_the_end_are_dropped(caplog):
    channel, _ = _channel()
    channel.feed_line(_ring_line(_ring(1, [0, 1])))
    assert channel.close() == []
    with caplog.at_level(logging.WARNING, logger="silentswarm.agent.runtime.control"):
        channel.feed_line(_ring_line(_ring(2, [0, 1])))
    assert "ignoring ring epoch 2" in caplog.text
    assert channel.take_ring_changes(0, 0) == []


def test_control_and_checkpoint_meta_need_no_tensorflow():
    code = (
        "import sys\n"
        "import silentswarm.agent.runtime.control, silentswarm.agent.runtime.checkpoint\n"
        "sys.exit(1 if {'tensorflow', 'keras'} & {m.split('.')[0] for m in sys.modules} else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr


def _stored(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    np.savez(path, **arrays)
    return path


def test_a_savez_file_reads_back_exactly(tmp_path):
    from silentswarm.agent.runtime.checkpoint import read_arrays

    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.array(7)}
    got = read_arrays(_stored(tmp_path / "a.npz", arrays))
    assert set(got) == {"w", "step"}
    assert all(np.array_equal(got[k], v) and got[k].dtype == v.dtype for k, v in arrays.items())


def test_a_strangers_arrays_never_inflate_past_the_file(tmp_path):
    """A pushed shard is a stranger's file: a deflated member (190 KB of zeros inflate to
    200 MB), or a header that declares more than its member holds, is refused before any
    array is made."""
    from silentswarm.agent.runtime.checkpoint import read_arrays

    bomb = tmp_path / "bomb.npz"
    np.savez_compressed(bomb, w=np.zeros(1 << 20, dtype=np.float32))
    assert bomb.stat().st_size < 10_000
    with pytest.raises(ValueError, match="compressed"):
        read_arrays(bomb)

    honest = _stored(tmp_path / "honest.npz", {"w": np.zeros(16, dtype=np.float32)})
    with zipfile.ZipFile(honest) as archive:
        member = archive.read("w.npy")
    lying = tmp_path / "lying.npz"
    with zipfile.ZipFile(lying, "w", zipfile.ZIP_STORED) as archive:
        # the header now claims 99 floats where the member stores 16
        archive.writestr("w.npy", member.replace(b"(16,)", b"(99,)"))
    with pytest.raises(ValueError, match="does not match its size"):
        read_arrays(lying)
    # A stage reading such a checkpoint fails with the checkpoint named, not a traceback.
    from silentswarm.agent.errors import CheckpointError
    from silentswarm.agent.runtime.checkpoint import FORMAT_VERSION, load_checkpoint

    meta = tmp_path / "stage0.json"
    meta.write_text(json.dumps({"format": FORMAT_VERSION, "npz": bomb.name, "arrays": []}))
    with pytest.raises(CheckpointError, match=r"cannot read its arrays .*compressed"):
        load_checkpoint(meta)


# --- checkpoints --------------------------------------------------------------------------------


def _plan(checkpoint_dir: Path | None, steps: int = 4) -> StagePlan:
    train = TrainConfig(
        steps=steps, batch_size=4, micro_batches=2, max_data_bytes=60_000, val_batches=1
    )
    plan = single_process_plan(job_id="ckpt", model=TINY, train=train)
    return msgspec.structs.replace(
        plan, checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir)
    )


def _runner(plan: StagePlan, emit=None, control: ControlChannel | None = None):
    from silentswarm.agent.runtime.stage import StageRunner

    return StageRunner(plan, emit or (lambda event: None), control)


def _values(runner) -> dict[str, np.ndarray]:
    from silentswarm.agent.runtime.checkpoint import stage_arrays

    return stage_arrays(runner.model)


@pytest.mark.integration  # trains a TensorFlow stage
def test_a_checkpoint_round_trips_and_training_continues_identically(tmp_path):
    from silentswarm.agent.runtime.checkpoint import load_checkpoint, restore_into, save_stage

    plan = _plan(tmp_path)
    trained = _runner(plan)
    for step in range(2):
        trained.train_step(step)
    directory = save_stage(tmp_path, trained.model, trained.data, steps_done=2)
    assert directory == tmp_path / "ckpt" / "attempt-1" / "step-2"
    assert sorted(p.name for p in directory.iterdir()) == ["stage-0.json", "stage-0.npz"]

    checkpoint = load_checkpoint(directory / "stage-0.json")
    meta = checkpoint.meta
    assert (meta["job_id"], meta["attempt"], meta["stage"], meta["n_stages"]) == ("ckpt", 1, 0, 1)
    assert (meta["layer_start"], meta["layer_end"], meta["steps_done"]) == (0, 2, 2)
    assert meta["total_steps"] == 4 and meta["final"] is False
    assert meta["data"] == {"epoch": 0, "index": 8}
    assert meta["model"] == msgspec.to_builtins(TINY)
    assert {a["name"] for a in meta["arrays"]} == set(checkpoint.arrays)
    assert any(n.startswith("optimizer/") and n.endswith("iteration") for n in checkpoint.arrays)

    fresh = _runner(_plan(tmp_path))
    before = _values(fresh)
    restore_into(fresh.model, fresh.data, checkpoint)
    want, got = _values(trained), _values(fresh)
    assert [n.split(":")[0] for n in got] == [n.split(":")[0] for n in want]
    for (name, a), b in zip(want.items(), got.values(), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert int(fresh.model.optimizer.iterations.numpy()) == 2
    assert any(not np.array_equal(before[n], want[n]) for n in want), "training changed weights"
    assert fresh.data.state() == trained.data.state()

    a, b = trained.train_step(2), fresh.train_step(2)
    assert a.loss == b.loss and a.lr == b.lr


@pytest.mark.integration  # trains a TensorFlow stage
def test_restoring_into_another_stage_is_refused(tmp_path):
    from silentswarm.agent.errors import CheckpointError
    from silentswarm.agent.runtime.checkpoint import load_checkpoint, restore_into, save_stage

    runner = _runner(_plan(tmp_path))
    directory = save_stage(tmp_path, runner.model, runner.data, steps_done=0)
    other = msgspec.structs.replace(
        _plan(tmp_path), model=msgspec.structs.replace(TINY, d_model=64)
    )
    with pytest.raises(CheckpointError, match="model"):
        restore_into(_runner(other).model, None, load_checkpoint(directory / "stage-0.json"))


def _last_of_two(tmp_path: Path, **changes) -> StagePlan:
    """Stage 1 of 2 (it reads no data), told of data that does not exist on its machine."""
    from silentswarm.plan import chain_plans

    first = _plan(tmp_path)
    train = msgspec.structs.replace(first.train, data=[str(tmp_path / "nowhere" / "*.txt")])
    plan = chain_plans(
        job_id="ckpt", model=TINY, train=train, addresses=[None, "tcp://127.0.0.1:1"]
    )[1]
    return msgspec.structs.replace(plan, checkpoint_dir=str(tmp_path), **changes)


@pytest.mark.integration  # builds a TensorFlow stage
def test_a_stage_after_the_first_checkpoints_and_resumes_without_a_data_position(tmp_path):
    from silentswarm.agent.errors import CheckpointError
    from silentswarm.agent.runtime.checkpoint import load_checkpoint, restore_into, save_stage

    runner = _runner(_last_of_two(tmp_path))
    assert runner.data is None, "only stage 0 reads data"
    directory = save_stage(tmp_path, runner.model, runner.data, steps_done=3)
    path = directory / "stage-1.json"
    assert load_checkpoint(path).meta["data"] is None

    resumed = _runner(_last_of_two(tmp_path, resume_from=str(path)))
    assert resumed.start_step == 3 and resumed.data is None
    for (name, a), b in zip(_values(runner).items(), _values(resumed).values(), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)

    dataset = _runner(_plan(tmp_path)).data  # a stage that reads data needs a position
    with pytest.raises(CheckpointError, match="no data position"):
        restore_into(resumed.model, dataset, load_checkpoint(path))


@pytest.mark.integration  # trains a TensorFlow stage
def test_the_stage_loop_answers_requests_at_step_boundaries(tmp_path):
    channel, _ = _channel()
    for line in (_line("two", 2), _line("now"), _line("end", 99)):
        channel.feed_line(line)
    events: list[StageEvent] = []

    def emit(event: StageEvent) -> None:
        events.append(event)
        if isinstance(event, CheckpointEvent) and event.id == "end":
            channel.feed_line(_line("after-the-last-step"))

    _runner(_plan(tmp_path, steps=4), emit, channel).run()
    kinds = [
        (type(e).__struct_config__.tag, getattr(e, "step", None), getattr(e, "id", None))
        for e in events
        if not isinstance(e, PlacementEvent)
    ]
    assert kinds == [
        ("links", None, None),
        ("step", 0, None),
        ("checkpoint", 1, "now"),
        ("step", 1, None),
        ("checkpoint", 2, "two"),
        ("step", 2, None),
        ("step", 3, None),
        ("checkpoint", 4, "end"),
        ("checkpoint", 4, "after-the-last-step"),
        ("done", None, None),
    ]
    checkpoints = [e for e in events if isinstance(e, CheckpointEvent)]
    assert all(e.ok and e.stage == 0 and e.path for e in checkpoints)
    assert [e.final for e in checkpoints] == [False, False, True, True]
    assert checkpoints[2].path == checkpoints[3].path, "the final state is written once"
    for event in checkpoints:
        meta = json.loads((Path(str(event.path)) / "stage-0.json").read_text())
        assert meta["steps_done"] == event.step
    assert channel.close() == []


@pytest.mark.integration  # trains a TensorFlow stage
@pytest.mark.parametrize("where", ["none", "a-file"])
def test_a_checkpoint_that_cannot_be_written_is_reported_and_training_goes_on(tmp_path, where):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    channel, _ = _channel()
    channel.feed_line(_line("x", 1))
    events: list[StageEvent] = []
    _runner(_plan(None if where == "none" else blocker, steps=2), events.append, channel).run()
    (event,) = [e for e in events if isinstance(e, CheckpointEvent)]
    assert event.ok is False and event.path is None and event.step == 1
    assert event.message
    assert isinstance(events[-1], DoneEvent)
