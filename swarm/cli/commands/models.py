"""A trained job's model: ``glue`` (its shards into one Keras model), ``generate`` (text
from it) and ``serve`` (completions over HTTP). Each is a TensorFlow tool run in a process of
its own: the CLI never imports TensorFlow."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import cyclopts
from cyclopts import Parameter

from silentswarm.cli.context import Ctx
from silentswarm.cli.options import JSON, JsonOptions
from silentswarm.errors import ConfigError

# agent/serve/main.py's TOKEN_ENV (the token never goes on a command line, where ps shows it).
SERVE_TOKEN_ENV = "SWARM_SERVE_TOKEN"
SERVE_TOKEN_PREFIX = "sws_"  # a fresh serve token, told apart from the operator's at a glance


def glue(
    export_dir: Annotated[Path, Parameter(help="A job's export directory (run_manifest.json)")],
    *,
    out: Annotated[
        Path | None, Parameter(help="Where to write (default: EXPORT_DIR/full_model)")
    ] = None,
    base: Annotated[
        Path | None,
        Parameter(help="For a LoRA adapter's export: the export it adapts (merged in)"),
    ] = None,
    options: JsonOptions = JSON,
    ctx: Ctx,
) -> None:
    """Assemble a job's pushed shards into one Keras model, checked against the pipeline."""
    argv = ["--export-dir", str(export_dir), *(["--out", str(out)] if out else [])]
    argv += ["--base", str(base)] if base else []
    run_runtime("silentswarm.agent.runtime.glue", [*argv, *(["--json"] if ctx.json else [])])


def generate(
    *,
    model_dir: Annotated[Path, Parameter(help="A glued model (full_model/ or its export dir)")],
    adapter: Annotated[
        Path | None, Parameter(help="A LoRA adapter's export, trained on this model")
    ] = None,
    prompt: Annotated[str, Parameter(help="The text to continue")],
    max_new_tokens: Annotated[int, Parameter(help="How many tokens to generate")] = 100,
    temperature: Annotated[float, Parameter(help="0: greedy")] = 0.8,
    top_k: Annotated[int, Parameter(help="Sample from the k likeliest (0: all)")] = 40,
    seed: Annotated[int, Parameter(help="Sampling seed")] = 0,
) -> None:
    """Sample text from a glued model."""
    run_runtime(
        "silentswarm.agent.runtime.generate",
        [
            "--model-dir",
            str(model_dir),
            *(["--adapter", str(adapter)] if adapter else []),
            "--prompt",
            prompt,
            "--max-new-tokens",
            str(max_new_tokens),
            "--temperature",
            str(temperature),
            "--top-k",
            str(top_k),
            "--seed",
            str(seed),
        ],
    )


def serve(
    *,
    model_dir: Annotated[Path, Parameter(help="A glued model (full_model/ or its export dir)")],
    adapter: Annotated[
        Path | None, Parameter(help="A LoRA adapter's export, trained on this model")
    ] = None,
    host: Annotated[str, Parameter(help="The address to listen on")] = "127.0.0.1",
    port: Annotated[int, Parameter(help="The port (0: a free one, printed)")] = 8000,
    token: Annotated[
        str | None,
        Parameter(
            help="The API token clients send (any local user sees it in ps: prefer "
            "SWARM_SERVE_TOKEN or --token-file; default: a fresh one, printed once)"
        ),
    ] = None,
    token_file: Annotated[
        Path | None, Parameter(help="A file whose first line is the API token clients send")
    ] = None,
    slots: Annotated[int, Parameter(help="Requests generated together, batched")] = 8,
    kv_cache: Annotated[bool, Parameter(help="Cache keys and values (off: recompute)")] = True,
    name: Annotated[str | None, Parameter(help="The model's name (default: the job's)")] = None,
    ctx: Ctx,
) -> None:
    """Serve a glued model: OpenAI-style completions at /v1/completions (SSE when streamed)."""
    secret = token or read_token_file(token_file) or os.environ.get(SERVE_TOKEN_ENV, "").strip()
    if not secret:
        # Never the operator's token: the server's clients would hold the whole swarm's key.
        secret = SERVE_TOKEN_PREFIX + secrets.token_urlsafe(24)
        print(f"serve: clients send this API token (shown once): {secret}", file=sys.stderr)
    argv = ["--model-dir", str(model_dir), "--host", host, "--port", str(port)]
    argv += ["--adapter", str(adapter)] if adapter else []
    argv += ["--slots", str(slots), *([] if kv_cache else ["--no-kv-cache"])]
    run_runtime(
        "silentswarm.agent.serve",
        [*argv, *(["--name", name] if name else [])],
        env={SERVE_TOKEN_ENV: secret},
    )


def read_token_file(path: Path | None) -> str | None:
    """The first line of ``path`` (None: no file); ConfigError naming it when unreadable."""
    if path is None:
        return None
    try:
        lines = path.read_text().splitlines()  # a pipe too: <(pass show serve-token)
        line = lines[0].strip() if lines else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--token-file {path}: cannot read it ({exc})") from None
    if not line:
        raise ConfigError(f"--token-file {path}: its first line is empty")
    return line


def run_runtime(module: str, argv: list[str], env: dict[str, str] | None = None) -> None:
    """A TensorFlow tool in its own process: its output and its exit status are the
    command's."""
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        **(env or {}),
    }
    try:
        code = subprocess.call([sys.executable, "-m", module, *argv], env=env)
    except KeyboardInterrupt:
        code = 130
    if code:
        raise SystemExit(code)


def register(app: cyclopts.App) -> None:
    app.command(glue)
    app.command(generate)
    app.command(serve)
