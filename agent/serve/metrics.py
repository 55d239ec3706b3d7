"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own.

Requests by outcome, prompt and completion tokens, time to first token, request duration,
the batch each step ran and how long it took, running and waiting requests, tokens per
second over the last ``RATE_WINDOW_S`` seconds, and the process's own ``process_*``
series.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

RATE_WINDOW_S = 10.0
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServeMetrics:
    def __init__(
        self, *, model: str, slots: int, kv_cache: bool, counts: Callable[[], tuple[int, int]]
    ) -> None:
        """``counts()``: (running, waiting) requests, read at each scrape."""
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        Gauge(
            "swarm_serve_info",
            "The served model (1)",
            ["model", "slots", "kv_cache"],
            registry=registry,
        ).labels(model, str(slots), "on" if kv_cache else "off").set(1)
        self.requests = Counter(
            "swarm_serve_requests_total",
            "Completion requests by outcome (ok, stopped by the client, or the HTTP status)",
            ["outcome"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "swarm_serve_prompt_tokens_total", "Prompt tokens taken", registry=registry
        )
        self.completion_tokens = Counter(
            "swarm_serve_completion_tokens_total", "Tokens generated", registry=registry
        )
        self.first_token = Histogram(
            "swarm_serve_time_to_first_token_seconds",
            "From a request's arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "swarm_serve_request_seconds",
            "From a request's arrival to its last byte (a stream's end included)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.batch = Histogram(
            "swarm_serve_batch_size",
            "Sequences each batched step ran",
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.step_seconds = Histogram(
            "swarm_serve_step_seconds",
            "Seconds of each batched step (one token for every running sequence)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        running = Gauge("swarm_serve_running_requests", "Sequences in a slot", registry=registry)
        waiting = Gauge("swarm_serve_waiting_requests", "Sequences queued", registry=registry)
        running.set_function(lambda: counts()[0])
        waiting.set_function(lambda: counts()[1])
        rate = Gauge(
            "swarm_serve_tokens_per_second",
            f"Tokens generated per second over the last {RATE_WINDOW_S:g} s",
            registry=registry,
        )
        self._made: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        rate.set_function(self.tokens_per_second)

    def step(self, batch: int, seconds: float) -> None:
        """One batched step (the engine's ``on_step``, on its thread)."""
        self.batch.observe(batch)
        self.step_seconds.observe(seconds)
        with self._lock:
            self._made.append((time.monotonic(), batch))

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._made and self._made[0][0] < now - RATE_WINDOW_S:
                self._made.popleft()
            return sum(n for _, n in self._made) / RATE_WINDOW_S
