"""``swarm serve``: a glued model behind OpenAI-style completions, for real.

The model is the run's shared glued model (``glued_model``, tests/integration/conftest.py:
a real export, trained with the stage loop's arithmetic as tests/unit/test_glue.py makes
them, glued by the glue command's code); the server is a real ``python -m
silentswarm.agent.serve`` process on a free port, read with plain HTTP clients.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from silentswarm.procs import free_port
from tests.helpers import REPO, Processes, child_env, run_swarm, wait_for

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

TOKEN = "serve-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = ["def ", "import ", "class A", "for i in", "return ", "    if x", "# a", "print("]


class Server:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], procs: Processes) -> None:
        self.url, self.proc, self.procs = url, proc, procs
        self.client = httpx.Client(base_url=url, timeout=60)

    def complete(self, token: str | None = TOKEN, **body) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return self.client.post("/v1/completions", json=body, headers=headers)

    def text(self, prompt: str, **body) -> str:
        response = self.complete(prompt=prompt, **body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def server(glued_model, tmp_path_factory):
    procs = Processes(tmp_path_factory.mktemp("serve-logs"))
    port = free_port()
    try:
        proc = procs.python(
            "serve",
            "silentswarm.agent.serve",
            "--model-dir",
            str(glued_model),
            "--port",
            str(port),
            "--slots",
            "4",
            env=child_env(SWARM_SERVE_TOKEN=TOKEN, TF_CPP_MIN_LOG_LEVEL="3"),
        )
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, procs.log(proc)
            return httpx.get(f"{url}/health", timeout=2).status_code == 200

        wait_for(up, timeout=90, what="the server's /health")
        served = Server(url, proc, procs)
        yield served
        served.client.close()
    finally:
        procs.cleanup()


def sse(port_url: str, body: dict, token: str = TOKEN) -> tuple[list[dict], bool]:
    """A streamed completion read with http.client: the chunks, and whether [DONE] came."""
    host, port = port_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({**body, "stream": True}),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    response = conn.getresponse()
    assert response.status == 200, response.read()
    assert response.getheader("Content-Type", "").startswith("text/event-stream")
    chunks, done = [], False
    for raw in response:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            break
        chunks.append(json.loads(data))
    conn.close()
    return chunks, done


def test_a_completion_has_the_openai_shape_and_counts_its_tokens(server):
    response = server.complete(prompt="def ", max_tokens=12, temperature=0)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "tiny"
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["text"].encode()) >= 1
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}
    models = server.client.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]


def test_a_streamed_completion_is_the_same_text_read_by_a_plain_http_client(server):
    want = server.text("import ", max_tokens=20, temperature=0)
    chunks, done = sse(server.url, {"prompt": "import ", "max_tokens": 20, "temperature": 0})
    assert done
    assert len(chunks) > 2  # streamed piece by piece, not in one go
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1
    usage, _ = sse(
        server.url,
        {"prompt": "x", "max_tokens": 3, "stream_options": {"include_usage": True}},
    )
    assert usage[-1]["choices"] == [] and usage[-1]["usage"]["completion_tokens"] == 3


def test_eight_concurrent_streams_each_get_their_own_text(server):
    # Sampled, each with its own seed: the same request gives the same text.
    alone = {p: server.text(p, max_tokens=16, seed=i) for i, p in enumerate(PROMPTS)}
    assert len(set(alone.values())) == len(PROMPTS)
    barrier = threading.Barrier(len(PROMPTS))

    def stream(i: int) -> str:
        barrier.wait(timeout=30)
        chunks, done = sse(server.url, {"prompt": PROMPTS[i], "max_tokens": 16, "seed": i})
        assert done
        return "".join(c["choices"][0]["text"] for c in chunks)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = dict(zip(PROMPTS, pool.map(stream, range(len(PROMPTS))), strict=True))
    assert together == alone
    # They were batched: some steps ran more than one sequence (4 slots, 8 streams).
    metrics = server.client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    single = _sample(metrics, 'swarm_serve_batch_size_bucket{le="1.0"}')
    total = _sample(metrics, "swarm_serve_batch_size_count")
    assert total > single
    assert _sample(metrics, "swarm_serve_time_to_first_token_seconds_count") >= len(PROMPTS)
    assert _sample(metrics, "process_resident_memory_bytes") > 0


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def test_a_stop_sequence_ends_the_text_before_it(server):
    free = server.text("def ", max_tokens=24, seed=3)
    stop = free[5:7]
    assert len(stop) == 2 and free.index(stop) > 0
    body = server.complete(prompt="def ", max_tokens=24, seed=3, stop=[stop]).json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == free[: free.index(stop)]
    chunks, _ = sse(server.url, {"prompt": "def ", "max_tokens": 24, "seed": 3, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_requests_without_the_token_are_refused(server):
    for token in (None, "wrong"):
        response = server.complete(token=token, prompt="x")
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert TOKEN not in response.text
    assert server.client.get("/metrics").status_code == 401
    assert server.client.get("/v1/models").status_code == 401
    assert server.client.get("/health").json() == {"status": "ok"}  # up, and nothing more
    assert server.client.get("/health", headers=AUTH).json()["running"] == 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 32}, 400, "max_tokens"),  # 1 + 32 > the 32 of context
        ({"prompt": "x" * 40, "max_tokens": 1}, 400, "prompt"),
        ({"prompt": "x", "n": 2}, 400, "n"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "x", "model": "another"}, 404, None),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_field(server, body, status, param):
    response = server.complete(**body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    not_json = server.client.post(
        "/v1/completions", content=b"{", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]


def test_a_client_that_leaves_frees_its_slot(server):
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "a", "max_tokens": 31, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b"data: " not in received:  # the headers, then the first event
            piece = sock.recv(4096)
            assert piece, received
            received += piece
    wait_for(
        lambda: server.client.get("/health", headers=AUTH).json()["running"] == 0,
        timeout=30,
        what="the slot to be freed",
    )
    assert server.text("a", max_tokens=2, temperature=0)  # and the server goes on


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_kv_cache_generates_what_the_whole_window_generates(glued_model, family):
    """Token for token at temperature 0, through the engine, against ``generate``'s path."""
    from silentswarm.agent.runtime.generate import Sampler, load_model, pick
    from silentswarm.agent.runtime.model import GluedTransformer
    from silentswarm.agent.serve.kvcache import CachedStepper, WindowStepper
    from silentswarm.plan import ModelConfig

    loaded = load_model(glued_model)
    if family == "llama":  # grouped-query attention and rotary positions
        cfg = ModelConfig(
            family="llama",
            vocab_size=256,
            seq_len=32,
            n_layers=2,
            d_model=32,
            n_heads=4,
            n_kv_heads=2,
        )
        loaded.model = GluedTransformer(cfg, 5, "fixed_int8", [[0, 1], [1, 2]])
        for weight in loaded.model.weights:  # peaked logits: argmax ties would hide nothing
            weight.assign(weight * 8.0)
    prompts = [[int(b) for b in p.encode()] for p in PROMPTS]
    sampler = Sampler(loaded)
    want = []
    for ids in prompts:
        context = list(ids)
        for _ in range(20):
            context.append(pick(sampler.logits(context), temperature=0, top_k=0, rng=None))
        want.append(context[len(ids) :])

    for stepper in (CachedStepper(loaded.model, 3), WindowStepper(loaded.model, 3)):
        assert greedy_through_engine(stepper, prompts, 20) == want, type(stepper).__name__


def greedy_through_engine(stepper, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's ``n`` greedy tokens, every prompt submitted at once (more prompts than
    slots: some wait, and the batches change as sequences end and start)."""
    from silentswarm.agent.serve.engine import Engine, Finished, Job, Sampling, Token

    got: list[list[int]] = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def emit(event, i: int) -> None:
        if isinstance(event, Token):
            got[i].append(event.id)
        elif isinstance(event, Finished):
            done.release()

    engine = Engine(stepper)
    engine.start()
    try:
        for i, ids in enumerate(prompts):
            job = Job(
                ids=ids,
                max_tokens=n,
                sampling=Sampling(temperature=0),
                emit=lambda event, i=i: emit(event, i),
            )
            engine.submit(job)
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        engine.stop()
    return got


def test_serve_refuses_a_bad_model_dir_or_no_token(tmp_path):
    no_model = subprocess.run(
        [sys.executable, "-m", "silentswarm.agent.serve", "--model-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env=child_env(SWARM_SERVE_TOKEN=TOKEN),
    )
    assert no_model.returncode == 2 and no_model.stderr.startswith("serve: error: "), (
        no_model.stderr
    )
    assert "inference_manifest.json" in no_model.stderr
    # Without a token of its own the server never takes the operator's: a fresh one, shown once.
    env = child_env(SWARM_STATE_DIR=str(tmp_path / "state"), SWARM_API_TOKEN="operator-secret")
    env.pop("SWARM_SERVE_TOKEN", None)
    fresh = run_swarm("serve", "--model-dir", str(tmp_path), env=env)
    assert fresh.returncode == 2 and "inference_manifest.json" in fresh.stderr, fresh.stderr
    assert re.search(r"clients send this API token \(shown once\): sws_\S{32}\n", fresh.stderr)
    assert "operator-secret" not in fresh.stderr and "Traceback" not in fresh.stderr
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    no_token = run_swarm("serve", "--model-dir", str(tmp_path), "--token-file", str(empty))
    assert no_token.returncode != 0 and "--token-file" in no_token.stderr, no_token.stderr
    assert "Traceback" not in no_token.stderr
