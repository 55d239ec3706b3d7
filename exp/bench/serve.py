"""Serving benchmark: tokens/s of ``swarm serve`` for 1 and 8 concurrent streams, with and
without the KV cache, every arm in one invocation.

Two real server processes (``python -m silentswarm.agent.serve``, 8 slots), one with the KV
cache and one without (each token recomputes its window), serve the same model: by default
the speed model of ``pipeline.py`` (4 blocks, d_model 256, seq_len 128, byte vocabulary)
with random weights (speed does not depend on them), or ``--model-dir`` (a glued model).
Each round runs every arm in turn (the order flips every round): ``streams`` clients at
once, each streaming one completion of ``--max-tokens`` tokens after a prompt of
``--prompt-tokens`` bytes, read over HTTP as SSE. An arm's tokens/s is the completion
tokens of all its streams over the wall time from the first request to the last ``[DONE]``;
its time to first token the median over its streams. Figures are medians over rounds;
ratios are medians of per-round ratios (these machines are noisy).

    python exp/bench/serve.py            # the full run (a few minutes)
    python exp/bench/serve.py --quick    # a smoke run

The last line is one JSON object: ``{"bench": "serve", "arms": [{"kv_cache", "streams",
"tokens_per_s", "ttft_s", "per_round"}, ...], "kv_cache_speedup": {"1": .., "8": ..},
"batching_speedup": {"kv_cache": .., "no_kv_cache": ..}, ...}``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
from _common import REPO, emit, load_avg, median  # puts the repo on sys.path

from silentswarm.plan import ModelConfig
from silentswarm.procs import free_port

STREAMS = (1, 8)
SLOTS = 8


def write_model(cfg: ModelConfig, directory: Path) -> Path:
    """A glued model of ``cfg`` with random weights, as ``swarm glue`` lays one out."""
    import keras
    import tensorflow as tf

    import silentswarm
    from silentswarm.agent.runtime.glue.manifest import file_entry
    from silentswarm.agent.runtime.model import GluedTransformer
    from silentswarm.types.manifests import (
        INFERENCE_MANIFEST,
        DataInfo,
        GlueCheck,
        InferenceManifest,
        encode_inference_manifest,
    )

    half = cfg.n_layers // 2
    model = GluedTransformer(cfg, 0, "none", [[0, half], [half, cfg.n_layers]])
    model.build((None, cfg.seq_len))
    directory.mkdir(parents=True, exist_ok=True)
    model.save(directory / "model.keras")
    manifest = InferenceManifest(
        job_id="bench-serve",
        name="bench-serve",
        attempt=1,
        step=0,
        total_steps=None,
        model=cfg,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        seed=0,
        compression="none",
        wire_codec="none",
        bottleneck_dim=None,
        stages=[],
        model_file="model.keras",
        config_file=None,
        files={"model.keras": file_entry(directory / "model.keras")},
        fallback=None,
        max_abs_diff=0.0,
        tolerance=0.0,
        check=GlueCheck(
            batches=0,
            max_abs_diff=0.0,
            tolerance=0.0,
            logit_scale=1.0,
            stage_max_abs_diff=[],
            stage_tolerance=[],
            codec_mismatches=[],
            codec_elements=[],
            reload_max_abs_diff=0.0,
        ),
        val_loss=None,
        chain_val_loss=None,
        pipeline_val_loss=None,
        pipeline_loss=None,
        data=DataInfo(
            patterns=[], override=False, n_tokens=0, sha256="", batch_size=0, val_batches=0
        ),
        keras_version=keras.__version__,
        tensorflow_version=tf.__version__,
        package_version=silentswarm.__version__,
        run_package_version=None,
        run_manifest_sha256="",
        export_dir=str(directory),
        created_at=time.time(),
    )
    (directory / INFERENCE_MANIFEST).write_bytes(encode_inference_manifest(manifest))
    return directory


class Server:
    def __init__(self, model_dir: Path, kv_cache: bool, token: str, log: Path) -> None:
        self.port, self.token, self.kv_cache = free_port(), token, kv_cache
        argv = [sys.executable, "-m", "silentswarm.agent.serve", "--model-dir", str(model_dir)]
        argv += ["--port", str(self.port), "--slots", str(SLOTS)]
        argv += [] if kv_cache else ["--no-kv-cache"]
        env = {**os.environ, "SWARM_SERVE_TOKEN": token, "TF_CPP_MIN_LOG_LEVEL": "3"}
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
            )

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited:\n{self.log.read_text()[-3000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"the server did not come up in {timeout:.0f} s")

    def stream(self, prompt: str, max_tokens: int, seed: int) -> tuple[int, float]:
        """One streamed completion: its tokens, and the seconds to its first piece."""
        began = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "seed": seed}
        body["stream_options"] = {"include_usage": True}
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"Authorization": f"Bearer {self.token}"},
        )
        response = conn.getresponse()
        if response.status != 200:
            raise SystemExit(f"HTTP {response.status}: {response.read()[:300]!r}")
        first, tokens = None, 0
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"]:
                first = time.perf_counter() - began
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        conn.close()
        return tokens, first or 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_arm(server: Server, streams: int, prompt: str, max_tokens: int, round_: int) -> dict:
    results: list[tuple[int, float]] = [(0, 0.0)] * streams
    barrier = threading.Barrier(streams + 1)

    def client(i: int) -> None:
        barrier.wait()
        results[i] = server.stream(prompt, max_tokens, seed=round_ * 100 + i)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - began
    tokens = sum(n for n, _ in results)
    if tokens != streams * max_tokens:
        raise SystemExit(f"got {tokens} tokens, wanted {streams * max_tokens}")
    return {"tokens_per_s": tokens / seconds, "ttft_s": median([t for _, t in results])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--rounds", type=int, help="rounds (default 3, quick 1)")
    parser.add_argument("--model-dir", type=Path, help="a glued model (default: random)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt bytes (default 16)")
    parser.add_argument("--max-tokens", type=int, help="tokens per stream (default 96, quick 16)")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    max_tokens = args.max_tokens or (16 if args.quick else 96)
    prompt_tokens = args.prompt_tokens or 16
    if args.quick:
        cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64)
    else:
        cfg = ModelConfig(n_layers=4, d_model=256, n_heads=8, seq_len=128)
    began = time.monotonic()
    start_load = load_avg()
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        work = Path(tmp)
        model_dir = args.model_dir or write_model(cfg, work / "model")
        if args.model_dir is not None:
            manifest = json.loads((model_dir / "inference_manifest.json").read_text())
            cfg = msgspec.convert(manifest["model"], ModelConfig)
        if prompt_tokens + max_tokens > cfg.seq_len:
            raise SystemExit(f"--prompt-tokens + --max-tokens must fit seq_len {cfg.seq_len}")
        prompt = ("def serve(x):\n" * cfg.seq_len)[:prompt_tokens]
        token = secrets.token_hex(16)
        servers = {
            kv: Server(model_dir, kv, token, work / f"serve-{'kv' if kv else 'window'}.log")
            for kv in (True, False)
        }
        try:
            for server in servers.values():
                server.wait_ready()
            arms = [(kv, n) for kv in (True, False) for n in STREAMS]
            per_round: list[dict] = []
            for r in range(rounds):
                order = arms if r % 2 == 0 else arms[::-1]
                figures = {}
                for kv, n in order:
                    figures[(kv, n)] = run_arm(servers[kv], n, prompt, max_tokens, r)
                    print(
                        f"  round {r + 1}: KV cache {'on ' if kv else 'off'}, {n} stream(s): "
                        f"{figures[(kv, n)]['tokens_per_s']:8.1f} tok/s, first token "
                        f"{figures[(kv, n)]['ttft_s'] * 1000:6.1f} ms",
                        flush=True,
                    )
                per_round.append(figures)
        finally:
            for server in servers.values():
                server.stop()

    def ratio(a, b) -> float:
        return median([f[a]["tokens_per_s"] / f[b]["tokens_per_s"] for f in per_round])

    out_arms = [
        {
            "kv_cache": kv,
            "streams": n,
            "tokens_per_s": median([f[(kv, n)]["tokens_per_s"] for f in per_round]),
            "ttft_s": median([f[(kv, n)]["ttft_s"] for f in per_round]),
            "per_round": [round(f[(kv, n)]["tokens_per_s"], 1) for f in per_round],
        }
        for kv, n in arms
    ]
    cache_speedup = {str(n): ratio((True, n), (False, n)) for n in STREAMS}
    batching = {
        "kv_cache": ratio((True, STREAMS[-1]), (True, 1)),
        "no_kv_cache": ratio((False, STREAMS[-1]), (False, 1)),
    }
    print(
        f"  KV cache speedup: {cache_speedup['1']:.2f}x (1 stream), {cache_speedup['8']:.2f}x "
        f"(8 streams); 8 streams over 1: {batching['kv_cache']:.2f}x with the cache, "
        f"{batching['no_kv_cache']:.2f}x without",
        flush=True,
    )
    emit(
        {
            "bench": "serve",
            "quick": args.quick,
            "model": msgspec.to_builtins(cfg),
            "slots": SLOTS,
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "rounds": rounds,
            "arms": out_arms,
            "kv_cache_speedup": cache_speedup,
            "batching_speedup": batching,
            "seconds": round(time.monotonic() - began, 1),
            "cpu_count": os.cpu_count(),
            "load_avg": {"start": start_load, "end": load_avg()},
        }
    )


if __name__ == "__main__":
    main()
