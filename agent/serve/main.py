"""The completion server's process: ``python -m silentswarm.agent.serve``.

``--model-dir DIR [--adapter DIR] [--host 127.0.0.1] [--port 8000] [--slots 8] [--no-kv-cache]
[--max-waiting 64] [--name NAME]``; the API token comes from ``SWARM_SERVE_TOKEN`` (``swarm
serve`` sets it from ``--token``, ``--token-file`` or a fresh one it prints: never on this
process's command line, where ``ps`` shows it). ``DIR`` is a glued model (``swarm glue``'s
output, or the export directory holding it), checked against its manifest before it is loaded;
``--adapter`` merges a LoRA adapter's export into it, refused unless the adapter was trained on
this very model. The model is traced before the port opens (one prompt and one step), so the
first request does not pay for it; then one line on stdout says where it serves. ``--port 0``
takes a free port (the line names it). Exit 2 for a bad argument, model directory or missing
token (``serve: error: ...``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from silentswarm.agent.errors import GenerateError, ServeError
from silentswarm.agent.runtime.tfsetup import require_tensorflow
from silentswarm.agent.runtime.tool import ToolParser, exit_with, first_line
from silentswarm.errors import ExtraMissingError
from silentswarm.plan import ModelConfig
from silentswarm.ram import memory_budget

PROG = "serve"
TOKEN_ENV = "SWARM_SERVE_TOKEN"
MAX_SLOTS = 256
KV_MEMORY_SHARE = 0.8  # of the memory available at start, the most the KV cache may take

log = logging.getLogger(__name__)


def parse(argv: Sequence[str] | None):
    parser = ToolParser(prog=PROG, description="Serve a glued SilentSwarm model over HTTP.")
    parser.add_argument("--model-dir", required=True, type=Path, help="the glued model")
    parser.add_argument("--adapter", type=Path, help="a LoRA adapter's export, for this model")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="0: a free port")
    parser.add_argument("--slots", type=int, default=8, help="sequences batched at once")
    parser.add_argument("--max-waiting", type=int, default=64, help="queued requests (429 above)")
    parser.add_argument("--no-kv-cache", action="store_true", help="recompute each window")
    parser.add_argument("--name", help="the model's name in the API (default: the job's)")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port must be in 0..65535, got {args.port}")
    if not 1 <= args.slots <= MAX_SLOTS:
        raise ServeError(f"--slots must be in 1..{MAX_SLOTS}, got {args.slots}")
    if args.max_waiting < 1:
        raise ServeError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    return args


def listen(host: str, port: int) -> socket.socket:
    try:
        sock = socket.create_server((host, port), family=_family(host), reuse_port=False)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def one_line(exc: BaseException) -> str:
    """An unexpected error as one line: its type, its message's first line and where it was
    raised (what a bug report needs, without a traceback on the operator's terminal)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{first_line(exc)}{where}"


def checked_token(value: str) -> str:
    """The API token from the environment; ServeError if there is none or it cannot be sent.
    A client sends it in a header, whose value is read as latin-1: a token of anything but
    visible ASCII could never match, and every request would get a 401 without a hint."""
    token = value.strip()
    if not token:
        raise ServeError(
            f"no API token: set {TOKEN_ENV} (swarm serve sets it from --token, "
            "--token-file or a fresh one it prints)"
        )
    if not all("!" <= ch <= "~" for ch in token):
        raise ServeError(
            f"the API token in {TOKEN_ENV} has characters a client cannot send in a header: "
            "use visible ASCII only (no spaces)"
        )
    return token


def kv_cache_bytes(model: ModelConfig, slots: int) -> int:
    """The KV cache's float32 keys and values: every block's, every slot's whole window."""
    head_dim = model.d_model // model.n_heads
    return 2 * model.n_layers * slots * model.seq_len * model.kv_heads * head_dim * 4


def kv_step_bytes(model: ModelConfig, slots: int) -> int:
    """What a step of every slot holds beside the cache, at its peak: one block's keys and
    values gathered for the batch (a copy of its share of the cache), repeated for the query
    heads they serve (grouped queries) and transposed for the attention."""
    per_block = kv_cache_bytes(model, slots) // model.n_layers
    return per_block * (1 + 2 * model.n_heads // model.kv_heads)


def check_cache_fits(model: ModelConfig, slots: int, available: int) -> None:
    """ServeError (exit 2) unless the KV cache of ``slots``, with a full step's working set,
    takes at most KV_MEMORY_SHARE of the ``available`` memory (the process's: its cgroup's
    limit where one holds it). A cache the machine cannot hold ends the process, and a
    service manager restarts it into the same end."""
    need = kv_cache_bytes(model, slots) + kv_step_bytes(model, slots)
    if need > KV_MEMORY_SHARE * available:
        raise ServeError(
            f"--slots {slots}: the KV cache and a full step need {need / 2**30:.1f} GiB, more "
            f"than {KV_MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB of memory this "
            "process may use; serve fewer slots, or run with --no-kv-cache"
        )


def serve(args, token: str) -> None:
    from silentswarm.agent.runtime.generate import load_model

    try:  # the files are checked before TensorFlow is imported
        loaded = load_model(args.model_dir, args.adapter)
    except GenerateError as exc:
        raise ServeError(exc.message) from None
    import psutil
    import tensorflow as tf
    import uvicorn

    from silentswarm.agent.serve.app import Served, create_app
    from silentswarm.agent.serve.engine import Engine
    from silentswarm.agent.serve.kvcache import CachedStepper, WindowStepper
    from silentswarm.agent.serve.metrics import ServeMetrics

    manifest = loaded.manifest
    name = args.name or manifest.name or manifest.job_id
    if not args.no_kv_cache and not tf.config.list_physical_devices("GPU"):
        # (on a GPU the cache is in the GPU's memory: the full warm-up step below meets a
        # cache too large there before the port opens)
        host = psutil.virtual_memory()
        budget = memory_budget(host.total, host.available)
        check_cache_fits(loaded.model.cfg, args.slots, budget.available)
    kind = WindowStepper if args.no_kv_cache else CachedStepper
    stepper = kind(loaded.model, args.slots)
    # The tokenizer's byte table (built on the first request's event loop otherwise).
    log.debug("the longest token is %d bytes", loaded.tokenizer.max_token_bytes)
    # Trace both calls before the port opens, the step over every slot at once: what a full
    # batch needs is allocated now, not under the first busy minute's traffic.
    stepper.start(0, [0])
    every = list(range(args.slots))
    stepper.step(every, [0] * args.slots, [1 if manifest.seq_len > 1 else 0] * args.slots)
    engine: Engine
    metrics = ServeMetrics(
        model=name,
        slots=args.slots,
        kv_cache=not args.no_kv_cache,
        counts=lambda: engine.counts,
    )
    engine = Engine(stepper, max_waiting=args.max_waiting, on_step=metrics.step)
    served = Served(
        name=name,
        seq_len=manifest.seq_len,
        vocab_size=manifest.vocab_size,
        tokenizer=loaded.tokenizer,
        engine=engine,
        metrics=metrics,
        token=token,
        created=int(manifest.created_at),
    )
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    engine.start()
    config = uvicorn.Config(
        create_app(served),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    cache = "off" if args.no_kv_cache else "on"
    print(
        f"serving {name!r} on http://{_url_host(host)}:{port}/v1 "
        f"({args.slots} slots, KV cache {cache}, context {manifest.seq_len} tokens)",
        flush=True,
    )
    # uvicorn re-raises the SIGTERM it caught once it has shut down; with this handler that
    # is a clean exit (0) that still stops the engine below.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.stop()


def _exit_cleanly(signum: int, _frame: object) -> None:
    raise SystemExit(0)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    began = time.monotonic()
    try:
        args = parse(argv)
        token = checked_token(os.environ.get(TOKEN_ENV, ""))
        require_tensorflow("the completion server")
        serve(args, token)
    except (ServeError, ExtraMissingError) as exc:
        exit_with(PROG, exc.message, 2)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # TensorFlow, Keras, memory: one line, not a traceback
        exit_with(PROG, one_line(exc), 1)
    log.info("stopped after %.0f s", time.monotonic() - began)
    return 0


if __name__ == "__main__":
    sys.exit(main())
