"""The completion API's request and response types: the OpenAI completions API's shape
(``POST /v1/completions``), so its clients work unchanged.

Supported: ``prompt`` (a string, or a list of strings: one choice each), ``max_tokens``,
``temperature``, ``top_p``, ``top_k`` (an extension, as vLLM's), ``stop`` (up to 4
strings), ``seed``, ``stream`` with ``stream_options.include_usage``, ``model`` (must be
the served one when given), ``user`` (ignored). ``n`` other than 1, ``echo``, ``logprobs``,
``suffix`` and ``best_of`` are refused with a 400 naming them; any other field is ignored,
as the OpenAI API ignores fields it does not know.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from silentswarm.agent.errors import CompletionError

MAX_PROMPTS = 16
MAX_PROMPT_CHARS = 1 << 20
MAX_STOP = 4
MAX_STOP_CHARS = 256

Prompt = Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]
StopText = Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)]


class StreamOptions(msgspec.Struct, kw_only=True, frozen=True):
    include_usage: bool = False


class CompletionRequest(msgspec.Struct, kw_only=True, frozen=True):
    prompt: Prompt | Annotated[list[Prompt], msgspec.Meta(min_length=1, max_length=MAX_PROMPTS)]
    model: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    # An explicit null is the default, as the OpenAI API takes it (some clients send one).
    max_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] | None = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] | None = 0
    stop: StopText | Annotated[list[StopText], msgspec.Meta(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] | None = 1
    echo: Literal[False] | None = False
    logprobs: None = None
    suffix: None = None
    best_of: Annotated[int, msgspec.Meta(ge=1, le=1)] | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None

    def __post_init__(self) -> None:
        for name, default in _NULL_MEANS_DEFAULT.items():
            if getattr(self, name) is None:
                msgspec.structs.force_setattr(self, name, default)

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# The fields whose null is their default (the rest keep null as a value of its own).
_NULL_MEANS_DEFAULT = {
    f.name: f.default
    for f in msgspec.structs.fields(CompletionRequest)
    if f.name in ("max_tokens", "temperature", "top_p", "top_k", "stream", "n", "echo")
}
_AT = re.compile(r"at `\$\.([A-Za-z_]+)")
# Fields of the OpenAI API this server does not do, and what it does instead.
UNSUPPORTED = {
    "n": "n must be 1: send one request per choice, or a list of prompts",
    "best_of": "best_of must be 1 (or left out)",
    "echo": "echo is not supported: the response holds the completion only",
    "logprobs": "logprobs are not supported",
    "suffix": "suffix is not supported",
}


def decode_request(body: bytes) -> CompletionRequest:
    """The request, or CompletionError naming the field that is wrong."""
    try:
        return msgspec.json.decode(body, type=CompletionRequest)
    except msgspec.ValidationError as exc:
        found = _AT.search(str(exc))
        param = found.group(1) if found else None
        if param is None and "missing required field `prompt`" in str(exc):
            param = "prompt"
        message = UNSUPPORTED.get(param or "", f"invalid request: {exc}")
        raise CompletionError(message, param=param) from None
    except msgspec.DecodeError as exc:
        raise CompletionError(f"the body is not JSON: {exc}") from None


class Choice(msgspec.Struct, kw_only=True):
    text: str
    index: int
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The response, and each streamed chunk (``usage`` left out unless set)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "silentswarm"


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorBody(msgspec.Struct, kw_only=True):
    error: ErrorDetail


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def error_body(status: int, message: str, code: str, param: str | None = None) -> ErrorBody:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return ErrorBody(error=ErrorDetail(message=message, type=kind, param=param, code=code))
