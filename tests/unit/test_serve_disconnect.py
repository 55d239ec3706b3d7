"""A completion whose client hangs up frees its slots at once, streamed or not: the real app
under uvicorn on a real socket, its engine stepping a stand-in model that takes a
millisecond a step (what is tested is the serving layer, not the model)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from silentswarm.agent.runtime.tokenizer import ByteTokenizer
from silentswarm.agent.serve.app import Served, create_app
from silentswarm.agent.serve.engine import Engine
from silentswarm.agent.serve.metrics import ServeMetrics
from tests.helpers import wait_for
from tests.unit.test_serve_text import SlowStepper

TOKEN = "serve-token"
LONG = 20_000  # tokens per prompt: 20 s a prompt at a millisecond a step


@pytest.fixture
def server() -> Iterator[tuple[str, Served]]:
    with serving(SlowStepper(slots=2, vocab=256, seq_len=50_000)) as running:  # bytes
        yield running


@contextlib.contextmanager
def serving(model: SlowStepper, max_waiting: int = 4) -> Iterator[tuple[str, Served]]:
    """The real app under uvicorn on a free port, its engine stepping ``model``."""
    engine: Engine | None = None
    metrics = ServeMetrics(model="m", slots=2, kv_cache=True, counts=lambda: engine.counts)
    engine = Engine(model, max_waiting=max_waiting, on_step=metrics.step)
    served = Served(
        name="m",
        seq_len=model.seq_len,
        vocab_size=256,
        tokenizer=ByteTokenizer(),
        engine=engine,
        metrics=metrics,
        token=TOKEN,
        created=0,
    )
    engine.start()
    sock = socket.create_server(("127.0.0.1", 0))
    app = uvicorn.Server(uvicorn.Config(create_app(served), log_level="warning"))
    thread = threading.Thread(target=app.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        wait_for(lambda: app.started, timeout=10, what="uvicorn to serve")
        yield url, served
    finally:
        app.should_exit = True
        thread.join(timeout=10)
        engine.stop()
        sock.close()


def send_request(url: str, body: dict) -> socket.socket:
    """A completion request sent on a socket of its own, left open."""
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_hangs_up_frees_its_slots_and_places_at_once(server, stream):
    url, served = server
    body = {"prompt": ["a", "b", "c", "d"], "max_tokens": LONG, "stream": stream}
    # Four prompts take both slots and two of the four waiting places; generating them would take
    # 40 s. The client hangs up once two run.
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {TOKEN}"}) as client:
        health = lambda: client.get("/health").json()  # noqa: E731
        sock = send_request(url, body)
        try:
            wait_for(lambda: health()["running"] == 2, timeout=10, what="both slots running")
        finally:
            sock.close()
        began = time.monotonic()
        wait_for(
            lambda: health()["running"] == 0 and health()["waiting"] == 0,
            timeout=5,
            what="the slots and waiting places freed",
        )
        assert time.monotonic() - began < 5
        answer = client.post(
            "/v1/completions",
            json={"prompt": ["x", "y", "z"], "max_tokens": 2},
            headers={"authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text  # not 429: the places are free
        closed = served.metrics.requests.labels("client_closed")._value.get()
        assert closed == 1
