"""Control-plane benchmark: how a real leader copes with N fellows heartbeating at 1 Hz.

Why: the soak test proves that 200 fellows lose nothing; it says nothing about how far the
leader scales. The operator-facing promise is about what people see: a heartbeat shows up in
the API quickly, and the API stays responsive while thousands of fellows talk to the leader.
This bench measures exactly that, against the real processes, for N = 100, 1,000 and 5,000.

Set-up per N (everything fresh, in a temp dir):

- nats-server (``silentswarm.natsd``, JetStream on, dev mode: no users);
- the leader (``python -m silentswarm.leader.main``), pinned to core 0 with ``taskset -c 0``
  when taskset exists, so its CPU share is one core's worth;
- worker processes (multiprocessing), each running a slice of the fellows over one shared
  NATS connection: every fellow registers by request/reply on ``swarm.register.<id>`` and then
  publishes a ``Heartbeat`` on ``swarm.hb.<id>`` once a second, phases spread over the second.
  The leader's work does not depend on how many client connections carry those messages;
- a probe process that owns a few of the N fellows: each of its heartbeats carries
  ``step = seq`` and ``sent_at``, and it polls ``GET /api/v1/workers/{id}`` (5 ms, doubling to
  50 ms) until the record shows that step. Visibility = response received - ``sent_at``: an
  upper bound that includes one API round trip.

Everything but the leader runs on the other cores when there are any. Over the measuring
window the bench itself sends ``GET /api/v1/workers`` and ``GET /api/v1/info`` alternately, one
at a time, every ``--api-interval`` seconds, and times them. The leader's CPU % (of one core)
covers the window, serving those requests included.

Target: 5,000 fellows with API p99 < 100 ms and visibility p99 < 1 s. The bench reports
met / not met and never fails on it. The last stdout line is one JSON object of figures.

    python exp/bench/control_plane.py                  # N = 100, 1,000, 5,000
    python exp/bench/control_plane.py --fellows 1000   # one N
    python exp/bench/control_plane.py --quick          # N = 50, ~10 s window: a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import multiprocessing as mp
import os
import resource
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import nats  # noqa: E402
import psutil  # noqa: E402

from silentswarm import subjects as topics  # noqa: E402
from silentswarm.natsd import start_nats_server  # noqa: E402
from silentswarm.procs import die_with_parent, free_port, spawn, stop_processes, tail  # noqa: E402
from silentswarm.protocol import (  # noqa: E402
    FellowIdentity,
    FellowStatus,
    HardwareSnapshot,
    Heartbeat,
    RegisterRequest,
)

PREFIX = "swarm"
TARGET_FELLOWS = 5000
TARGET_API_P99_MS = 100.0
TARGET_VISIBILITY_P99_S = 1.0
FELLOWS_PER_HOST = 8
VISIBILITY_TIMEOUT_S = 10.0
REGISTER_CONCURRENCY = 100


# --- simulated fellows (run inside worker processes) ---------------------------------------


@dataclass(frozen=True)
class Slice:
    """The fellows one worker process simulates: indices [start, stop) of one run."""

    url: str
    run: str
    start: int
    stop: int
    cpus: tuple[int, ...]


def identity(run: str, index: int) -> FellowIdentity:
    return FellowIdentity(
        fellow_id=f"bench-{index:05d}",
        instance_id=f"{run}-{index:05d}",
        hostname=f"bench-host-{index // FELLOWS_PER_HOST:04d}",
        version="bench",
        pid=os.getpid(),
    )


def hardware(ident: FellowIdentity) -> HardwareSnapshot:
    return HardwareSnapshot(
        hostname=ident.hostname,
        cpu_cores=8,
        ram_total_bytes=32 << 30,
        ram_available_bytes=24 << 30,
    )


def heartbeat(ident: FellowIdentity, hw: HardwareSnapshot, seq: int, sent_at: float) -> bytes:
    """Heartbeat ``seq``; its ``step`` is ``seq`` too, so the API shows which one arrived."""
    hb = Heartbeat(
        fellow=ident, seq=seq, step=seq, status=FellowStatus.READY, hardware=hw, sent_at=sent_at
    )
    return topics.encode(hb)


async def register(nc: Any, ident: FellowIdentity, hw: HardwareSnapshot) -> None:
    subject = topics.REGISTER.subject(PREFIX, fellow=ident.fellow_id)
    payload = topics.encode(RegisterRequest(fellow=ident, hardware=hw))
    for attempt in range(5):
        # The leader answers only in the sender's own inbox, and simulated fellows share
        # connections: each asks with a reply subject under its own inbox.
        inbox = f"{topics.inbox_prefix(ident.fellow_id)}.r{attempt}"
        sub = await nc.subscribe(inbox, max_msgs=1)
        try:
            await nc.publish(subject, payload, reply=inbox)
            reply = await sub.next_msg(timeout=10)
        except (TimeoutError, nats.errors.TimeoutError):
            await sub.unsubscribe()
            await asyncio.sleep(0.5 * (attempt + 1))
            continue
        answer = topics.REGISTER.decode_reply(reply.data)
        if not answer.accepted:
            raise RuntimeError(f"{ident.fellow_id} refused: {answer.code} {answer.message}")
        return
    raise RuntimeError(f"{ident.fellow_id}: no answer to its register request")


async def register_all(nc: Any, fellows: list[FellowIdentity]) -> None:
    gate = asyncio.Semaphore(REGISTER_CONCURRENCY)

    async def one(ident: FellowIdentity) -> None:
        async with gate:
            await register(nc, ident, hardware(ident))

    await asyncio.gather(*(one(f) for f in fellows))


async def heartbeat_loop(nc: Any, fellows: list[FellowIdentity], stop: Any) -> int:
    """Every fellow once a second, phases spread evenly; returns how many were sent."""
    hws = [hardware(f) for f in fellows]
    n, sent, start = len(fellows), 0, time.monotonic()
    subjects = [topics.HEARTBEAT.subject(PREFIX, fellow=f.fellow_id) for f in fellows]
    while not stop.is_set():
        delay = start + sent / n - time.monotonic()
        if delay > 0.005:
            await asyncio.sleep(min(delay, 0.1))
            continue
        i = sent % n
        await nc.publish(subjects[i], heartbeat(fellows[i], hws[i], sent // n + 1, time.time()))
        sent += 1
        if sent % 100 == 0:
            await asyncio.sleep(0)  # let the client's flusher run
    await nc.flush()
    return sent


async def connect(url: str) -> Any:
    """A worker's NATS connection. It reconnects on its own and logs nothing: what a broken
    connection costs shows in the figures (heartbeats lost, fellows offline)."""

    async def quiet(exc: Exception) -> None:
        pass

    return await nats.connect(url, max_reconnect_attempts=-1, pending_size=64 << 20, error_cb=quiet)


def worker_setup(cpus: tuple[int, ...]) -> None:
    """A worker dies with the bench, leaves Ctrl-C to it, and stays off the leader's core."""
    parent = mp.parent_process()
    die_with_parent(parent=parent.pid if parent else os.getppid())()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cpus:
        os.sched_setaffinity(0, cpus)


def fellow_worker(part: Slice, ready: Any, stop: Any, results: Any) -> None:
    worker_setup(part.cpus)
    results.put(("sent", asyncio.run(_fellows(part, ready, stop))))


async def _fellows(part: Slice, ready: Any, stop: Any) -> int:
    nc = await connect(part.url)
    try:
        fellows = [identity(part.run, i) for i in range(part.start, part.stop)]
        await register_all(nc, fellows)
        ready.put(len(fellows))
        return await heartbeat_loop(nc, fellows, stop)
    finally:
        await nc.close()


# --- the probe process: heartbeat, then poll the API until it shows ------------------------


def probe_worker(part: Slice, api: tuple[str, str], ready: Any, stop: Any, results: Any) -> None:
    worker_setup(part.cpus)
    results.put(("visibility", asyncio.run(_probes(part, api, ready, stop))))


async def _probes(part: Slice, api: tuple[str, str], ready: Any, stop: Any) -> tuple[int, list]:
    url, token = api
    nc = await connect(part.url)
    headers = {"authorization": f"Bearer {token}"}
    samples: list[tuple[float, float]] = []
    try:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as client:
            fellows = [identity(part.run, i) for i in range(part.start, part.stop)]
            await register_all(nc, fellows)
            ready.put(len(fellows))
            n = len(fellows)
            loops = [probe_loop(nc, client, f, i / n, stop, samples) for i, f in enumerate(fellows)]
            sent = sum(await asyncio.gather(*loops))
            await nc.flush()
    finally:
        await nc.close()
    return sent, samples


async def probe_loop(
    nc: Any, client: Any, ident: FellowIdentity, phase: float, stop: Any, samples: list
) -> int:
    """One probe fellow's heartbeats, each timed until the API shows it; returns how many."""
    hw, seq = hardware(ident), 0
    subject = topics.HEARTBEAT.subject(PREFIX, fellow=ident.fellow_id)
    await asyncio.sleep(phase)
    pending: set[asyncio.Task] = set()
    while not stop.is_set():
        seq += 1
        tick = time.monotonic()
        sent_at = time.time()
        await nc.publish(subject, heartbeat(ident, hw, seq, sent_at))
        task = asyncio.create_task(visible_after(client, ident.fellow_id, seq, sent_at))
        task.add_done_callback(lambda t, at=sent_at: samples.append((at, t.result())))
        pending.add(task)
        task.add_done_callback(pending.discard)
        await asyncio.sleep(max(0.0, tick + 1.0 - time.monotonic()))
    await asyncio.gather(*pending)
    return seq


async def visible_after(client: Any, fellow_id: str, seq: int, sent_at: float) -> float:
    """Seconds from ``sent_at`` to an API answer that shows heartbeat ``seq`` (inf: never)."""
    delay = 0.005
    while True:
        await asyncio.sleep(delay)
        with contextlib.suppress(httpx.HTTPError):
            response = await client.get(f"/api/v1/workers/{fellow_id}")
            if response.status_code == 200 and (response.json().get("step") or 0) >= seq:
                return time.time() - sent_at
        if time.time() - sent_at > VISIBILITY_TIMEOUT_S:
            return math.inf
        delay = min(delay * 2, 0.05)


# --- the real processes: nats-server and the leader ----------------------------------------


def other_cpus() -> tuple[int, ...]:
    """Every core but 0 (the leader's), or () on a one-core machine."""
    cpus = sorted(os.sched_getaffinity(0))
    return tuple(c for c in cpus if c != 0) if len(cpus) > 1 else ()


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def leader_env(nats_url: str, port: int, state: Path, token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    env.update(
        PYTHONUNBUFFERED="1",
        SWARM_DEV="1",
        SWARM_NATS_URL=nats_url,
        SWARM_LEADER_PORT=str(port),
        SWARM_STATE_DIR=str(state),
        SWARM_API_TOKEN=token,
    )
    return env


def start_leader(stack: contextlib.ExitStack, work: Path, nats_url: str) -> tuple[Any, str, str]:
    """The leader, pinned to core 0; returns (its psutil.Process, URL, token)."""
    port, token = free_port(), secrets.token_urlsafe(16)
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    log = work / "leader.log"
    proc = spawn(
        [*pin, sys.executable, "-m", "silentswarm.leader.main"],
        log_path=log,
        env=leader_env(nats_url, port, work / "leader-state", token),
        detach=True,  # its own session: Ctrl-C reaches the bench, which stops it last
        tie_to_parent=True,
        cwd=REPO,
    )
    leader = psutil.Process(proc.pid)

    def stop() -> None:
        stop_processes([leader], timeout=10)
        proc.wait()

    stack.callback(stop)
    url = f"http://127.0.0.1:{port}"
    wait_leader(url, token, proc, log)
    return leader, url, token


def wait_leader(url: str, token: str, proc: Any, log: Path, timeout: float = 60.0) -> None:
    headers = {"authorization": f"Bearer {token}"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        with contextlib.suppress(httpx.HTTPError, ValueError):
            info = httpx.get(f"{url}/api/v1/info", headers=headers, timeout=2).json()
            if info.get("state_loaded") and info.get("nats_connected"):
                return
        time.sleep(0.1)
    raise RuntimeError(f"the leader did not come up; log {log}:\n{tail(log)}")


def start_nats(stack: contextlib.ExitStack, work: Path) -> str:
    server = start_nats_server(
        host="127.0.0.1",
        port=0,
        store_dir=work / "nats",
        log_path=work / "nats.log",
        detach=True,
        tie_to_parent=True,
    )
    stack.callback(server.stop)
    if other_cpus():
        with contextlib.suppress(psutil.Error):
            psutil.Process(server.pid).cpu_affinity(list(other_cpus()))
    return server.url


# --- the fleet: worker processes and the probe process ------------------------------------


class Fleet:
    """The worker and probe processes of one run; ``close`` stops and reaps them all."""

    def __init__(self, fellows: int, workers: int, probes: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.ready, self.results = self.ctx.Queue(), self.ctx.Queue()
        self.stop_event = self.ctx.Event()
        self.fellows, self.workers, self.probes = fellows, workers, probes
        self.procs: list[Any] = []

    def start(self, nats_url: str, api: tuple[str, str]) -> None:
        run, cpus = secrets.token_hex(4), other_cpus()
        probe = Slice(nats_url, run, 0, self.probes, cpus)
        self._spawn(probe_worker, probe, api)
        bounds = [
            self.probes + (self.fellows - self.probes) * w // self.workers
            for w in range(self.workers + 1)
        ]
        for lo, hi in itertools.pairwise(bounds):
            if hi > lo:
                self._spawn(fellow_worker, Slice(nats_url, run, lo, hi, cpus))

    def _spawn(self, target: Any, part: Slice, *extra: Any) -> None:
        args = (part, *extra, self.ready, self.stop_event, self.results)
        proc = self.ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)

    def wait_registered(self, timeout: float) -> None:
        deadline, registered = time.monotonic() + timeout, 0
        while registered < self.fellows:
            left = deadline - time.monotonic()
            if left <= 0 or any(p.exitcode not in (None, 0) for p in self.procs):
                raise RuntimeError(f"only {registered} of {self.fellows} fellows registered")
            with contextlib.suppress(Exception):
                registered += self.ready.get(timeout=min(left, 1.0))

    def stop(self, timeout: float = 30.0) -> tuple[int, list[tuple[float, float]]]:
        """Stop heartbeating; returns (heartbeats sent, visibility samples)."""
        self.stop_event.set()
        sent, samples = 0, []
        for _ in self.procs:
            kind, value = self.results.get(timeout=timeout)
            if kind == "visibility":
                value, samples = value
            sent += value
        return sent, samples

    def close(self) -> None:
        self.stop_event.set()
        for proc in self.procs:
            proc.join(timeout=5)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


# --- measuring ------------------------------------------------------------------------------


def percentile(values: list[float], q: float, digits: int = 4) -> float | None:
    """Nearest-rank percentile, rounded; None (JSON null) for no values or only timeouts."""
    if not values:
        return None
    ordered = sorted(values)
    value = ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
    return round(value, digits) if math.isfinite(value) else None


def sample_api(url: str, token: str, duration: float, interval: float) -> dict[str, list[float]]:
    """Alternate GET /workers and GET /info, one at a time; seconds per request by path."""
    paths = ["/api/v1/workers", "/api/v1/info"]
    latencies: dict[str, list[float]] = {p: [] for p in paths}
    headers = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        end, i = time.monotonic() + duration, 0
        while time.monotonic() < end:
            path = paths[i % len(paths)]
            begin = time.perf_counter()
            client.get(path).raise_for_status()
            latencies[path].append(time.perf_counter() - begin)
            i += 1
            time.sleep(max(0.0, interval - (time.perf_counter() - begin)))
    return latencies


def worst(*values: float | None) -> float | None:
    """The largest; None when any is unknown."""
    return None if None in values else max(v for v in values if v is not None)


def cpu_seconds(proc: Any) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def wait_api_count(url: str, token: str, fellows: int, timeout: float) -> None:
    headers = {"authorization": f"Bearer {token}"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = httpx.get(f"{url}/api/v1/info", headers=headers, timeout=30).json()
        if sum(info["fellows"].values()) >= fellows:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the API never showed {fellows} fellows")


def fleet_tally(url: str, token: str) -> dict[str, int]:
    """Accepted heartbeats, fellows offline and the /workers body size, from the API."""
    headers = {"authorization": f"Bearer {token}"}
    response = httpx.get(f"{url}/api/v1/workers", headers=headers, timeout=60)
    records = response.json()
    return {
        "accepted": sum(r["heartbeats"] for r in records),
        "offline": sum(1 for r in records if r["status"] == "offline"),
        "workers_body_kib": len(response.content) // 1024,
    }


@dataclass(frozen=True)
class Plan:
    warmup_s: float
    window_s: float
    api_interval_s: float
    workers: int | None


def probe_count(fellows: int) -> int:
    return max(1, min(10, fellows // 10))


def worker_count(fellows: int, asked: int | None) -> int:
    return asked or max(1, min(4, math.ceil(fellows / 1500)))


def run_once(fellows: int, plan: Plan) -> dict[str, Any]:
    """One N: fresh nats-server and leader, register, warm up, measure, tear down."""
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        nats_url = start_nats(stack, work)
        leader, url, token = start_leader(stack, work, nats_url)
        fleet = Fleet(fellows, worker_count(fellows, plan.workers), probe_count(fellows))
        stack.callback(fleet.close)
        began = time.monotonic()
        fleet.start(nats_url, (url, token))
        fleet.wait_registered(timeout=60 + fellows / 20)
        wait_api_count(url, token, fellows, timeout=60)
        registered_s = time.monotonic() - began
        time.sleep(plan.warmup_s)
        window = measure(leader, url, token, plan)
        during = fleet_tally(url, token)
        sent, samples = fleet.stop()
        time.sleep(1.5)  # let the last heartbeats land
        counts = {**during, "sent": sent, "accepted": fleet_tally(url, token)["accepted"]}
        return summarize(fellows, fleet, registered_s, window, samples, counts)


def measure(leader: Any, url: str, token: str, plan: Plan) -> dict[str, Any]:
    cpu0, wall0, t0 = cpu_seconds(leader), time.monotonic(), time.time()
    latencies = sample_api(url, token, plan.window_s, plan.api_interval_s)
    cpu1, wall1 = cpu_seconds(leader), time.monotonic()
    return {
        "start": t0,
        "end": time.time(),
        "cpu_pct": 100 * (cpu1 - cpu0) / (wall1 - wall0),
        "latencies": latencies,
        "leader_cores": len(leader.cpu_affinity()),
        "load_1m": os.getloadavg()[0],  # other work on this machine skews the figures
    }


def summarize(
    fellows: int,
    fleet: Fleet,
    registered_s: float,
    window: dict[str, Any],
    samples: list[tuple[float, float]],
    counts: dict[str, int],
) -> dict[str, Any]:
    seen = [v for at, v in samples if window["start"] <= at <= window["end"]]
    workers_ms = [1000 * s for s in window["latencies"]["/api/v1/workers"]]
    info_ms = [1000 * s for s in window["latencies"]["/api/v1/info"]]
    return {
        "fellows": fellows,
        "worker_processes": fleet.workers,
        "probes": fleet.probes,
        "register_s": round(registered_s, 2),
        "window_s": round(window["end"] - window["start"], 2),
        "leader_cpu_pct": round(window["cpu_pct"], 1),
        "visibility_p50_s": percentile(seen, 50),
        "visibility_p99_s": percentile(seen, 99),
        "visibility_timeouts": sum(1 for v in seen if not math.isfinite(v)),
        "visibility_samples": len(seen),
        "api_p99_ms": worst(percentile(workers_ms, 99, 2), percentile(info_ms, 99, 2)),
        "workers_p50_ms": percentile(workers_ms, 50, 2),
        "workers_p99_ms": percentile(workers_ms, 99, 2),
        "info_p99_ms": percentile(info_ms, 99, 2),
        "api_requests": len(workers_ms) + len(info_ms),
        "heartbeats_sent": counts["sent"],
        "heartbeats_lost": max(0, counts["sent"] - counts["accepted"]),
        "offline_at_end": counts["offline"],
        "workers_body_kib": counts["workers_body_kib"],
        "leader_cores": window["leader_cores"],
        "load_1m": round(window["load_1m"], 2),
    }


# --- reporting ------------------------------------------------------------------------------

COLUMNS = [
    ("fellows", "fellows", "{:>7}"),
    ("leader_cpu_pct", "leader CPU %", "{:>12.1f}"),
    ("visibility_p50_s", "vis p50 s", "{:>9.3f}"),
    ("visibility_p99_s", "vis p99 s", "{:>9.3f}"),
    ("workers_p99_ms", "/workers p99 ms", "{:>15.1f}"),
    ("info_p99_ms", "/info p99 ms", "{:>12.1f}"),
    ("register_s", "register s", "{:>10.1f}"),
    ("heartbeats_lost", "hb lost", "{:>7}"),
    ("offline_at_end", "offline", "{:>7}"),
    ("load_1m", "load 1m", "{:>7.2f}"),
]


def print_table(runs: list[dict[str, Any]]) -> None:
    header = "  ".join(f"{title:>{len(fmt.format(0))}}" for _, title, fmt in COLUMNS)
    print(header)
    for run in runs:
        print("  ".join(cell(fmt, run[key]) for key, _, fmt in COLUMNS))


def cell(fmt: str, value: Any) -> str:
    width = len(fmt.format(0))
    return f"{'-':>{width}}" if value is None else fmt.format(value)


def meets_target(run: dict[str, Any]) -> bool:
    api, seen = run["api_p99_ms"], run["visibility_p99_s"]
    return (
        api is not None
        and seen is not None
        and api < TARGET_API_P99_MS
        and seen < TARGET_VISIBILITY_P99_S
    )


def verdict(runs: list[dict[str, Any]]) -> str:
    target = [r for r in runs if r["fellows"] >= TARGET_FELLOWS]
    what = (
        f"target ({TARGET_FELLOWS:,} fellows: API p99 < {TARGET_API_P99_MS:.0f} ms, "
        f"visibility p99 < {TARGET_VISIBILITY_P99_S:.0f} s)"
    )
    if not target:
        return f"{what}: not measured (no run with {TARGET_FELLOWS:,} fellows)"
    met = all(meets_target(r) for r in target)
    return f"{what}: {'met' if met else 'not met'}"


# --- command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fellows", default="100,1000,5000", help="comma-separated N values")
    parser.add_argument("--quick", action="store_true", help="N = 50, short window")
    parser.add_argument("--window", type=float, default=20.0, help="measuring window, s")
    parser.add_argument("--warmup", type=float, default=5.0, help="after registration, s")
    parser.add_argument("--api-interval", type=float, default=0.1, help="between API GETs, s")
    parser.add_argument("--workers", type=int, default=None, help="fellow processes per run")
    return parser.parse_args(argv)


def plan_from(args: argparse.Namespace) -> tuple[list[int], Plan]:
    if args.quick:
        return [50], Plan(2.0, 8.0, args.api_interval, args.workers)
    sizes = [int(s.replace("_", "")) for s in args.fellows.split(",") if s.strip()]
    return sizes, Plan(args.warmup, args.window, args.api_interval, args.workers)


def interrupt_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every ``finally`` stops what it started."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes, plan = plan_from(args)
    interrupt_on_sigterm()
    raise_fd_limit()
    if other_cpus():
        os.sched_setaffinity(0, other_cpus())
    runs = []
    for fellows in sizes:
        print(f"== {fellows} fellows", flush=True)
        started = time.monotonic()
        runs.append(run_once(fellows, plan))
        print(f"   done in {time.monotonic() - started:.0f} s: {runs[-1]}", flush=True)
    print()
    print_table(runs)
    print(verdict(runs))
    print(json.dumps({"bench": "control_plane", "runs": runs}), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; everything it started is stopped", file=sys.stderr)
        sys.exit(130)
