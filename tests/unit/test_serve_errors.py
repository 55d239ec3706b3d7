"""What the completion server tells a client when something fails, and what it counts: the
real app under uvicorn (test_serve_disconnect's ``serving``) over stand-in models and
tokenizers that fail on purpose."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from silentswarm.agent.errors import ServeError
from silentswarm.agent.runtime.tokenizer import ByteTokenizer
from silentswarm.agent.serve.app import Served
from silentswarm.agent.serve.main import (
    check_cache_fits,
    checked_token,
    kv_cache_bytes,
    kv_step_bytes,
    one_line,
)
from silentswarm.plan import ModelConfig
from tests.unit.test_serve_disconnect import TOKEN, serving
from tests.unit.test_serve_text import SlowStepper

AUTH = {"authorization": f"Bearer {TOKEN}"}
SECRET = "/srv/models/secret-path"


class FailingStepper(SlowStepper):
    """A model whose every step fails with a message naming a path of this machine."""

    def step(self, slots, tokens, positions) -> np.ndarray:
        raise RuntimeError(f"OOM when allocating tensor on {SECRET}")


class FailingTokenizer(ByteTokenizer):
    def encode(self, data: bytes) -> np.ndarray:
        raise RuntimeError(f"cannot read {SECRET}")


class MidStreamFailingTokenizer(ByteTokenizer):
    """Encodes prompts, then fails on the first generated token's bytes: a bug after the
    stream's first byte, where no exception handler sees it any more."""

    def token_bytes(self, token: int) -> bytes:
        raise RuntimeError(f"cannot read {SECRET}")


def counted(served, status: str) -> float:
    return served.metrics.requests.labels(status)._value.get()


def test_health_says_only_up_to_a_stranger_and_how_busy_to_the_tokens_holder():
    with serving(SlowStepper(slots=2, vocab=256)) as (url, _):
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        wrong = {"authorization": "Bearer nope"}
        assert httpx.get(f"{url}/health", headers=wrong).json() == {"status": "ok"}
        told = httpx.get(f"{url}/health", headers=AUTH).json()
        assert told == {"status": "ok", "model": "m", "running": 0, "waiting": 0}


def test_a_failing_model_is_a_500_that_names_no_detail_of_the_machine():
    with serving(FailingStepper(slots=2, vocab=256)) as (url, served):
        body = {"prompt": "abc", "max_tokens": 3}
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30)
        assert answer.status_code == 500, answer.text
        message = answer.json()["error"]["message"]
        assert "the model failed" in message and "RuntimeError" in message
        assert SECRET not in answer.text and "OOM" not in answer.text
        assert counted(served, "500") == 1


class Kept(logging.Handler):
    """The records of one logger, kept (Litestar reconfigures the root logger, and with it
    pytest's caplog handler, when it makes an app)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def failing_server(tokenizer: ByteTokenizer) -> Iterator[tuple[str, Served, Kept]]:
    """A server whose tokenizer is ``tokenizer``, and what its app module logged."""
    kept, logger = Kept(), logging.getLogger("silentswarm.agent.serve.app")
    logger.addHandler(kept)
    try:
        with serving(SlowStepper(slots=2, vocab=256)) as (url, served):
            served.tokenizer = tokenizer
            yield url, served, kept
    finally:
        logger.removeHandler(kept)


def secret_logged(kept: Kept) -> list[logging.LogRecord]:
    return [r for r in kept.records if r.exc_info and SECRET in str(r.exc_info[1])]


def test_a_bug_in_a_handler_is_logged_and_answered_in_the_apis_shape():
    with failing_server(FailingTokenizer()) as (url, served, kept):
        body = {"prompt": "abc", "max_tokens": 3}
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30)
        assert answer.status_code == 500, answer.text
        error = answer.json()["error"]
        assert error["code"] == "INTERNAL" and "log has the error" in error["message"]
        assert SECRET not in answer.text
        assert counted(served, "500") == 1
    logged = secret_logged(kept)
    assert logged and "POST /v1/completions failed" in logged[0].getMessage()


def test_a_bug_in_the_middle_of_a_stream_ends_it_with_an_error_event_and_done():
    with failing_server(MidStreamFailingTokenizer()) as (url, served, kept):
        body = {"prompt": "abc", "max_tokens": 3, "stream": True}
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30)
        assert answer.status_code == 200  # the headers went before the failure
        events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", answer.text
        error = json.loads(events[-2])["error"]
        assert error["code"] == "INTERNAL" and SECRET not in answer.text
        assert counted(served, "500") == 1 and counted(served, "client_closed") == 0
    assert secret_logged(kept)


def test_refusals_by_the_framework_are_counted_and_a_full_queue_says_when_to_retry():
    with serving(SlowStepper(slots=2, vocab=256, seq_len=50_000), max_waiting=1) as running:
        url, served = running
        big = b"x" * (5 << 20)
        answer = httpx.post(f"{url}/v1/completions", content=big, headers=AUTH, timeout=30)
        assert answer.status_code == 413 and "error" in answer.json()
        assert counted(served, "413") == 1
        # Four long prompts: two run, one waits, the fourth finds no place (all rolled back).
        body = {"prompt": ["a", "b", "c", "d"], "max_tokens": 20_000}
        busy = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert counted(served, "429") == 1


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("", "no API token"),
        ("   ", "no API token"),
        ("pässwort-of-the-server", "visible ASCII"),
        ("two words", "visible ASCII"),
        ("tab\tinside", "visible ASCII"),
    ],
)
def test_a_token_no_client_could_send_is_refused_at_start(value, needle):
    with pytest.raises(ServeError, match=needle):
        checked_token(value)


def test_a_token_is_taken_without_its_surrounding_whitespace():
    assert checked_token("  s3cret-Token_~!\n") == "s3cret-Token_~!"


LLAMA = ModelConfig(family="llama", n_layers=4, d_model=256, n_heads=8, n_kv_heads=2, seq_len=1024)


@pytest.mark.parametrize(
    ("model", "slots", "expected"),
    [
        # 2 (keys, values) x layers x slots x seq_len x kv_heads x head_dim x 4 bytes
        (
            ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32),
            8,
            2 * 2 * 8 * 32 * 4 * 16 * 4,
        ),
        (LLAMA, 1, 2 * 4 * 1 * 1024 * 2 * 32 * 4),  # grouped queries: 2 kv heads, not 8
        (LLAMA, 256, 256 * 2 * 4 * 1024 * 2 * 32 * 4),
    ],
)
def test_the_kv_cache_bytes_are_every_blocks_keys_and_values_of_every_slots_window(
    model, slots, expected
):
    assert kv_cache_bytes(model, slots) == expected


def test_a_full_steps_working_set_is_one_blocks_share_gathered_repeated_and_transposed():
    cache = kv_cache_bytes(LLAMA, 256)
    # one block's quarter of the cache, copied once and, for 8 query heads over 2 kv
    # heads, repeated 4 times for keys and for values
    assert kv_step_bytes(LLAMA, 256) == cache // 4 * (1 + 2 * 4)


def test_a_kv_cache_the_memory_cannot_hold_is_refused_at_start_naming_the_way_out():
    need = kv_cache_bytes(LLAMA, 256) + kv_step_bytes(LLAMA, 256)  # 1.625 GiB
    check_cache_fits(LLAMA, 256, available=need * 2)
    pattern = r"--slots 256: the KV cache and a full step need 1\.6 GiB"
    with pytest.raises(ServeError, match=pattern) as refused:
        check_cache_fits(LLAMA, 256, available=need)
    assert "fewer slots" in refused.value.message and "--no-kv-cache" in refused.value.message


def test_an_unexpected_start_up_error_is_one_line_saying_where():
    def load() -> None:
        raise ValueError("shapes (8, 4) and (2, 16) not aligned\nmore detail")

    try:
        load()
    except ValueError as exc:
        line = one_line(exc)
    assert line.startswith("ValueError: shapes (8, 4) and (2, 16) not aligned (at ")
    assert "test_serve_errors.py:" in line and "\n" not in line
