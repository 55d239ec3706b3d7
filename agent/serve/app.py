"""The completion server's Litestar app: thin handlers over :class:`Completions`.

- ``POST /v1/completions``: a completion, or with ``"stream": true`` server-sent events
  (``data: <chunk>`` lines, then ``data: [DONE]``), in the OpenAI API's shape;
- ``GET /v1/models``: the one model served;
- ``GET /health``: 200 once the model is loaded (no token; with it, the model's name and
  the running and waiting requests too);
- ``GET /metrics``: Prometheus.

Every route but ``/health`` needs ``Authorization: Bearer <token>``. Errors are the OpenAI
API's ``{"error": {"message", "type", "param", "code"}}`` with the status of the
:class:`~silentswarm.errors.SwarmError` (400 naming the field, 401, 404, 429); a streamed
request that fails after its first byte ends with such an error event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.response import Stream
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from silentswarm.agent.errors import CompletionError, ServeAuthError
from silentswarm.agent.runtime.tokenizer import Tokenizer
from silentswarm.agent.serve.api import (
    Choice,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    Usage,
    decode_request,
    error_body,
)
from silentswarm.agent.serve.engine import Engine, Finished, Job, Sampling, Token
from silentswarm.agent.serve.metrics import ServeMetrics
from silentswarm.agent.serve.text import TextAssembler
from silentswarm.errors import ErrorCode, NotFoundError, SwarmError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
INTERNAL_MESSAGE = "the server failed on this request (its log has the error)"


@dataclass
class Served:
    """What the handlers serve: the model's name and window, its tokenizer, the engine."""

    name: str
    seq_len: int
    vocab_size: int
    tokenizer: Tokenizer
    engine: Engine
    metrics: ServeMetrics
    token: str
    created: int
    token_bytes: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # ASCII only (main checks it): a header's value is read as latin-1, so a token
        # beyond ASCII could never be matched, and one that does not encode fails every call.
        self.token_bytes = self.token.encode("ascii")


@dataclass
class Piece:
    """A choice's next text (maybe ""), and its finish reason once it is done."""

    index: int
    text: str
    finish_reason: str | None = None


class Completions:
    """One request's prompts run as engine jobs, their tokens turned into text pieces."""

    def __init__(
        self,
        served: Served,
        request: CompletionRequest,
        began: float,
        prompt_ids: list[list[int]],
    ) -> None:
        self.served, self.request, self.began = served, request, began
        self.id = f"cmpl-{secrets.token_hex(12)}"
        self.prompt_ids = prompt_ids
        self.completion_tokens = 0
        self._queue: asyncio.Queue[tuple[int, Token | Finished]] = asyncio.Queue()
        self._jobs: list[Job] = []
        self._first: float | None = None

    @classmethod
    async def of(cls, served: Served, request: CompletionRequest, began: float) -> Completions:
        """The request's prompts checked and encoded (off the event loop: a long prompt takes
        a while); CompletionError naming the field when one cannot run."""
        longest = served.seq_len * served.tokenizer.max_token_bytes
        for text in request.prompts:
            size = len(text.encode("utf-8", errors="replace"))
            if size > longest:  # more tokens than the context for certain: not encoded
                raise CompletionError(
                    f"the prompt is {size} bytes, more than this model's context of "
                    f"{served.seq_len} tokens can hold",
                    param="prompt",
                )
        ids = await asyncio.to_thread(
            lambda: [_prompt_ids(served, request, text) for text in request.prompts]
        )
        return cls(served, request, began, ids)

    @property
    def usage(self) -> Usage:
        prompt = sum(len(ids) for ids in self.prompt_ids)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt + self.completion_tokens,
        )

    def submit(self) -> None:
        """Queue every prompt (ServeBusyError, nothing queued, when the queue is full)."""
        loop = asyncio.get_running_loop()
        request = self.request
        for index, ids in enumerate(self.prompt_ids):
            sampling = Sampling(
                temperature=request.temperature,
                top_k=min(request.top_k, self.served.vocab_size),
                top_p=request.top_p,
                seed=None if request.seed is None else request.seed + index,
            )

            def emit(event: Token | Finished, index: int = index) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: shutting down
                    loop.call_soon_threadsafe(self._queue.put_nowait, (index, event))

            job = Job(ids=ids, max_tokens=request.max_tokens, sampling=sampling, emit=emit)
            try:
                self.served.engine.submit(job)
            except SwarmError:
                self.cancel()
                raise
            self._jobs.append(job)
        self.served.metrics.prompt_tokens.inc(self.usage.prompt_tokens)

    def cancel(self) -> None:
        for job in self._jobs:
            self.served.engine.cancel(job)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Every choice's text as it comes; a choice's last piece carries its finish
        reason. Cancels what still runs when the caller stops listening."""
        texts = [TextAssembler(self.served.tokenizer, self.request.stops) for _ in self._jobs]
        running = set(range(len(self._jobs)))
        try:
            while running:
                index, event = await self._queue.get()
                if index not in running:
                    continue
                text = texts[index]
                if isinstance(event, Token):
                    self._token()
                    piece = text.add(event.id)
                    if text.stopped:
                        self.served.engine.cancel(self._jobs[index])
                        running.discard(index)
                        yield Piece(index, piece, "stop")
                    elif piece:
                        yield Piece(index, piece)
                elif event.reason == "length":
                    running.discard(index)
                    yield Piece(index, text.finish(), "length")
                else:
                    raise SwarmError(f"the generation failed: {event.message or event.reason}")
        finally:
            self.cancel()

    def _token(self) -> None:
        self.completion_tokens += 1
        self.served.metrics.completion_tokens.inc()
        if self._first is None:
            self._first = time.perf_counter()
            self.served.metrics.first_token.observe(self._first - self.began)

    def chunk(self, choices: list[Choice], usage: Usage | None = None) -> Completion:
        return Completion(
            id=self.id,
            object="text_completion",
            created=int(time.time()),
            model=self.served.name,
            choices=choices,
            usage=usage,
        )


def _prompt_ids(served: Served, request: CompletionRequest, text: str) -> list[int]:
    """``text``'s token ids (empty: the start of a document), checked against the model."""
    tokenizer = served.tokenizer
    ids = tokenizer.encode(text.encode("utf-8", errors="replace")) if text else None
    ids = [int(i) for i in (tokenizer.separator if ids is None or not ids.size else ids)]
    if max(ids) >= served.vocab_size:
        raise CompletionError(
            f"the prompt has tokens beyond the model's vocabulary of {served.vocab_size}",
            param="prompt",
        )
    room = served.seq_len - len(ids)
    if request.max_tokens > room:
        raise CompletionError(
            f"this model's context is {served.seq_len} tokens: the prompt has {len(ids)}, "
            f"so max_tokens can be at most {max(room, 0)} (got {request.max_tokens})",
            param="max_tokens" if room > 0 else "prompt",
        )
    return ids


def _served(request: Request) -> Served:
    return request.app.state["served"]


def _authorize(request: Request) -> None:
    """ServeAuthError (401) unless the request carries the server's token."""
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if not header or scheme.lower() != "bearer" or not given.strip():
        raise ServeAuthError("send the API token: 'Authorization: Bearer <token>'")
    sent = given.strip().encode("utf-8", errors="replace")
    if not hmac.compare_digest(sent, _served(request).token_bytes):
        raise ServeAuthError("the API token is wrong")


def _authorized(request: Request) -> bool:
    try:
        _authorize(request)
    except ServeAuthError:
        return False
    return True


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response | Stream:
    began = time.perf_counter()
    served = _served(request)
    _authorize(request)
    body = decode_request(await request.body())
    if body.model is not None and body.model != served.name:
        raise NotFoundError(f"this server serves the model {served.name!r}, not {body.model!r}")
    run = await Completions.of(served, body, began)
    run.submit()
    if body.stream:
        return Stream(_events(run), media_type="text/event-stream", headers=SSE_HEADERS)
    gather = asyncio.ensure_future(_whole(run, len(body.prompts)))
    left = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((gather, left), return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        client_left = not gather.done()  # (or the server stops): free its slots now
        if client_left:
            gather.cancel()
            served.metrics.requests.labels("client_closed").inc()
    if client_left:
        with contextlib.suppress(asyncio.CancelledError):
            await gather
        served.metrics.duration.observe(time.perf_counter() - began)
        return Response(b"", status_code=499)  # nobody reads it
    texts, reasons = gather.result()
    choices = [
        Choice(text=text, index=i, finish_reason=reasons[i])  # type: ignore[arg-type]
        for i, text in enumerate(texts)
    ]
    served.metrics.requests.labels("ok").inc()
    served.metrics.duration.observe(time.perf_counter() - began)
    return Response(
        msgspec.json.encode(run.chunk(choices, run.usage)), media_type="application/json"
    )


async def _whole(run: Completions, n: int) -> tuple[list[str], list[str | None]]:
    """Every prompt's whole text and why it ended (a request that does not stream)."""
    texts = [""] * n
    reasons: list[str | None] = [None] * n
    async for piece in run.pieces():
        texts[piece.index] += piece.text
        reasons[piece.index] = piece.finish_reason or reasons[piece.index]
    return texts, reasons


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone. A handler that does not stream is not cancelled when
    its client leaves (the ASGI server only says so to whoever receives), so a request that
    asked for 16 long completions and hung up would hold its slots, and the queue's places,
    to the end of generation."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(run: Completions) -> AsyncIterator[bytes]:
    served, outcome = run.served, "client_closed"
    try:
        async for piece in run.pieces():
            choice = Choice(text=piece.text, index=piece.index, finish_reason=piece.finish_reason)  # type: ignore[arg-type]
            yield _sse(run.chunk([choice]))
        if run.request.include_usage:
            yield _sse(run.chunk([], run.usage))
        outcome = "ok"
    except SwarmError as exc:
        outcome = str(exc.http_status)
        yield _sse(error_body(exc.http_status, exc.message, str(exc.code)))
    except Exception as exc:  # a bug, after the first byte: no handler sees it any more
        outcome = "500"
        log.error("POST /v1/completions failed while streaming", exc_info=exc)
        yield _sse(error_body(500, INTERNAL_MESSAGE, str(ErrorCode.INTERNAL)))
    finally:
        served.metrics.requests.labels(outcome).inc()
        served.metrics.duration.observe(time.perf_counter() - run.began)
    yield b"data: [DONE]\n\n"


def _sse(body: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


@get("/v1/models")
async def models(request: Request) -> ModelList:
    _authorize(request)
    served = _served(request)
    return ModelList(data=[ModelCard(id=served.name, created=served.created)])


@get("/health")
async def health(request: Request) -> dict[str, object]:
    """Up or not, to anyone (a load balancer's check); what it serves and how busy it is,
    only to a caller with the token."""
    if not _authorized(request):
        return {"status": "ok"}
    served = _served(request)
    running, waiting = served.engine.counts
    return {"status": "ok", "model": served.name, "running": running, "waiting": waiting}


@get("/metrics")
async def metrics(request: Request) -> Response:
    _authorize(request)
    body = generate_latest(_served(request).metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


# What a refused or failed request is told beyond its body: how to authenticate, when to
# come back.
_ERROR_HEADERS = {401: {"WWW-Authenticate": "Bearer"}, 429: {"Retry-After": "1"}}


def _error(request: Request, status: int, body: msgspec.Struct) -> Response:
    """An error answer, counted under its status."""
    _served(request).metrics.requests.labels(str(status)).inc()
    return Response(
        msgspec.json.encode(body),
        status_code=status,
        headers=_ERROR_HEADERS.get(status),
        media_type="application/json",
    )


def _swarm_error(request: Request, exc: SwarmError) -> Response:
    if exc.http_status >= 500:
        log.error("%s: %s", exc.code, exc.message)
    param = getattr(exc, "param", None)
    body = error_body(exc.http_status, exc.message, str(exc.code), param)
    return _error(request, exc.http_status, body)


def _http_error(request: Request, exc: HTTPException) -> Response:
    code = ErrorCode.NOT_FOUND if exc.status_code == 404 else ErrorCode.SWARM_ERROR
    return _error(request, exc.status_code, error_body(exc.status_code, str(exc.detail), str(code)))


def _unexpected(request: Request, exc: Exception) -> Response:
    """A bug: logged with its traceback, answered in the API's shape without its details."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(request, 500, error_body(500, INTERNAL_MESSAGE, str(ErrorCode.INTERNAL)))


def create_app(served: Served) -> Litestar:
    return Litestar(
        route_handlers=[completions, models, health, metrics],
        state=State({"served": served}),
        exception_handlers={
            SwarmError: _swarm_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
        request_max_body_size=MAX_BODY_BYTES,
        openapi_config=None,
    )
