"""A stage's failure carries its code: the runtime's error event, then the fellow's outcome."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from silentswarm.agent.errors import PeerTimeoutError
from silentswarm.agent.runtime.main import failure, stage_failed
from silentswarm.agent.supervisor import StageRun
from silentswarm.errors import ErrorCode
from silentswarm.plan import ModelConfig, StagePlan, TrainConfig
from silentswarm.protocol import StageResult
from silentswarm.types.stage import ErrorEvent, decode_event, encode_event

PLAN = StagePlan(
    job_id="j",
    stage=0,
    n_stages=1,
    layer_start=0,
    layer_end=4,
    model=ModelConfig(n_layers=4, d_model=64, n_heads=4),
    train=TrainConfig(),
)


def test_a_failed_stage_says_its_code_in_its_error_event(capsysbinary):
    error = PeerTimeoutError("boundary 0 (a -> b): nothing received for 60s")
    with pytest.raises(SystemExit) as exited:
        stage_failed(0, str(error), error.code, None)
    assert exited.value.code == 1
    line = capsysbinary.readouterr().out.strip()
    assert decode_event(line) == ErrorEvent(
        stage=0, message=str(error), code=ErrorCode.PEER_TIMEOUT
    )


def test_an_error_event_without_a_code_still_decodes():
    assert decode_event(b'{"event": "error", "stage": 0, "message": "m"}').code == ""
    line = encode_event(ErrorEvent(stage=0, message="m", code="FROM_A_NEWER_RUNTIME"))
    assert decode_event(line).code == "FROM_A_NEWER_RUNTIME"


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("PEER_TIMEOUT", ErrorCode.PEER_TIMEOUT),
        ("FROM_A_NEWER_RUNTIME", "FROM_A_NEWER_RUNTIME"),
        ("", None),
    ],
)
def test_the_fellows_outcome_carries_the_error_events_code(tmp_path: Path, code, expected):
    async def outcome():
        run = StageRun(PLAN, tmp_path, lambda _event: None)
        run._remember(ErrorEvent(stage=0, message="boundary 0: gone", code=code))
        return run._outcome(1)

    ended = asyncio.run(outcome())
    assert ended.result is StageResult.FAILED and ended.message == "boundary 0: gone (exit 1)"
    assert ended.code == expected


def test_a_device_out_of_memory_is_its_own_code():
    """TensorFlow's allocator out of memory (a GPU's VRAM) and Python's MemoryError say
    STAGE_OUT_OF_MEMORY, which the leader remembers against the fellow; others keep theirs."""
    import tensorflow as tf

    oom = tf.errors.ResourceExhaustedError(
        None, None, "OOM when allocating tensor with shape[8,128,50257]\nmore"
    )
    message, code = failure(oom)
    assert code is ErrorCode.STAGE_OUT_OF_MEMORY
    assert message == (
        "the stage ran out of device memory (ResourceExhaustedError: OOM when allocating "
        "tensor with shape[8,128,50257])"
    )
    assert failure(MemoryError())[1] is ErrorCode.STAGE_OUT_OF_MEMORY
    assert failure(ValueError("bad")) == ("ValueError: bad", ErrorCode.STAGE_FAILED)
    timeout = PeerTimeoutError("nothing received for 60s")
    assert failure(timeout)[1] is ErrorCode.PEER_TIMEOUT
