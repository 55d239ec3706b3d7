"""The Python half of ``exp/bench/gpu_check.sh`` (see there for usage): NVML, heartbeat, placement.

It runs in an environment where ``silentswarm`` and its services' dependencies are installed
(no TensorFlow needed) and checks, with real processes:

1. NVML read directly (pynvml, none of the project's code): every GPU's UUID, total and free
   VRAM, utilisation.
2. A real nats-server (random port), a real leader and a real fellow agent, each a process of
   its own. The fellow's heartbeats carry ``agent/hardware.py``'s snapshot; the leader's REST
   API (``/api/v1/workers/{id}``) must show the same GPUs as the direct read (UUIDs, totals
   equal; free VRAM and utilisation within a tolerance: they move on a busy GPU).
3. The placement of a one-stage job on that fellow, computed by the leader's own functions
   (``leader.decide.candidate`` then ``leader.placement.place``, the path of the job loop's
   ``_schedule``) from the record the leader serves, with the leader's placement defaults,
   and the stage plan START would carry (``jobspec.stage_plans``: its ``gpu_slots`` must be
   the placement's).
   Twice: from the telemetry as received, and, where NVML sees GPUs, as if TensorFlow saw
   them all (a machine without TensorFlow has a fellow whose TensorFlow probe fails, and the
   leader rightly offers none of its GPUs: ``gpu_warning`` says so).

Every wait has a deadline; every process it starts is stopped at the end (fellow first, so it
deregisters) and checked gone. The last line on stdout is one JSON object; the exit status
is 0 only when every check passed (without a GPU only with ``--allow-no-gpu``).

    python exp/bench/gpu_check.py --work DIR [--allow-no-gpu] [--deadline S]
    python exp/bench/gpu_check.py --requirements   # the services' dependencies, one a line
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
FELLOW = "gpu-check-fellow"
GIB = 1024**3
# A direct NVML read and the leader's copy of the fellow's snapshot are taken up to a
# heartbeat apart: free memory and utilisation may move in between on a GPU in use.
FREE_TOLERANCE_BYTES = GIB
UTIL_TOLERANCE_PCT = 25.0
# Dependencies of the whole package that the leader and the agent's NATS session never
# import: the stage runtime's (TensorFlow), which cannot be installed on the GPU machine.
NOT_FOR_SERVICES = {"tensorflow"}


def log(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def requirements() -> list[str]:
    """pyproject's dependencies less TensorFlow: what a leader and a fellow's session need."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    out = []
    for req in project["dependencies"]:
        name = req.split(";")[0].split("[")[0]
        for sep in "<>=!~ ":
            name = name.split(sep)[0]
        if name.lower() not in NOT_FOR_SERVICES:
            out.append(req)
    return out


# --- NVML, read directly ----------------------------------------------------------------------


def nvml_direct() -> dict[str, Any]:
    """What NVML itself says: {nvml_ok, nvml_error, driver_version, gpus}."""
    try:
        import pynvml
    except ImportError as exc:
        return {"nvml_ok": False, "nvml_error": f"pynvml not installed: {exc}", "gpus": []}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        what = "no NVIDIA driver" if isinstance(exc, pynvml.NVMLError_LibraryNotFound) else "NVML"
        return {"nvml_ok": False, "nvml_error": f"{what}: {exc}", "gpus": []}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                util: float | None = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except pynvml.NVMLError:
                util = None
            gpus.append(
                {
                    "index": index,
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "total_bytes": int(mem.total),
                    "free_bytes": int(mem.free),
                    "utilization_pct": util,
                }
            )
        return {"nvml_ok": True, "nvml_error": None, "driver_version": _text(driver), "gpus": gpus}
    except pynvml.NVMLError as exc:
        return {"nvml_ok": False, "nvml_error": f"NVML read failed: {exc}", "gpus": []}
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def compare_gpus(direct: list[dict], served: list[dict]) -> list[str]:
    """Differences between NVML's GPUs and the leader's copy beyond the tolerances."""
    problems = []
    by_uuid = {g["uuid"]: g for g in served}
    if sorted(by_uuid) != sorted(g["uuid"] for g in direct):
        problems.append(
            f"GPU UUIDs differ: NVML {[g['uuid'] for g in direct]}, leader {sorted(by_uuid)}"
        )
    for gpu in direct:
        other = by_uuid.get(gpu["uuid"])
        if other is None:
            continue
        if other["total_bytes"] != gpu["total_bytes"]:
            problems.append(f"{gpu['uuid']}: total {other['total_bytes']} != {gpu['total_bytes']}")
        if abs(other["free_bytes"] - gpu["free_bytes"]) > FREE_TOLERANCE_BYTES:
            problems.append(f"{gpu['uuid']}: free {other['free_bytes']} vs {gpu['free_bytes']}")
        a, b = other["utilization_pct"], gpu["utilization_pct"]
        if (a is None) != (b is None) or (a is not None and abs(a - b) > UTIL_TOLERANCE_PCT):
            problems.append(f"{gpu['uuid']}: utilisation {a} vs {b}")
    return problems


# --- real processes ---------------------------------------------------------------------------


class Services:
    """nats-server, the leader and the fellow, as processes of their own, tied to this one
    (PR_SET_PDEATHSIG), so not even a SIGKILL of this process leaves them behind."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: dict[str, Any] = {}  # name -> Popen
        self.seen: set[int] = set()  # every pid started, and their children seen alive
        self.nats: Any = None

    def start_nats(self) -> str:
        from silentswarm.natsd import start_nats_server

        self.nats = start_nats_server(
            host="127.0.0.1",
            port=0,
            store_dir=self.work / "nats-store",
            log_path=self.work / "nats.log",
            tie_to_parent=True,
        )
        self.procs["nats-server"] = self.nats.process
        self.seen.add(self.nats.pid)
        return self.nats.url

    def start(self, name: str, module: str, *args: str, env: dict[str, str]) -> Any:
        from silentswarm.procs import spawn

        full = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
        full.update(PYTHONUNBUFFERED="1", SWARM_DEV="1", **env)
        proc = spawn(
            [sys.executable, "-m", module, *args],
            log_path=self.work / f"{name}.log",
            env=full,
            tie_to_parent=True,
        )
        self.procs[name] = proc
        self.seen.add(proc.pid)
        return proc

    def note_children(self) -> None:
        import psutil

        for proc in self.procs.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                self.seen.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))

    def died(self) -> str | None:
        """Why a wait should stop early: a service that exited."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return f"{name} exited with {proc.returncode}; log: {self.tail(name)}"
        return None

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.work / ("nats.log" if name == "nats-server" else f"{name}.log")
        try:
            return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> list[int]:
        """Stop everything, fellow first; the pids still alive afterwards (none, normally)."""
        import psutil

        from silentswarm.procs import stop_processes

        self.note_children()
        for name in ("fellow", "leader"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    stop_processes([psutil.Process(proc.pid)], timeout=15)
                proc.wait(timeout=5)
        if self.nats is not None:
            self.nats.stop()
        return [pid for pid in sorted(self.seen) if _alive(pid)]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(
    what: str, predicate: Callable[[], T | None], deadline: float, abort: Callable[[], str | None]
) -> T:
    """Poll ``predicate`` until it gives a value; RuntimeError at ``deadline`` or on abort."""
    from silentswarm.procs import wait_until

    value = wait_until(predicate, timeout=max(0.0, deadline - time.monotonic()), abort=abort)
    if value is None:
        why = abort() or f"not within the deadline ({time.monotonic() - START:.0f}s in)"
        raise RuntimeError(f"waiting for {what}: {why}")
    return value


# --- the leader's side ------------------------------------------------------------------------


def placements(record_json: bytes, min_free_gb: float) -> dict[str, Any]:
    """The placement of a one-stage job on the fellow, as the leader's job loop computes it."""
    import msgspec

    from silentswarm.jobspec import JobSpec, stage_plans
    from silentswarm.leader.decide import candidate
    from silentswarm.leader.placement import PlacementDefaults, Unplaceable, place
    from silentswarm.plan import ModelConfig
    from silentswarm.types.fleet import FellowRecord

    record = msgspec.json.decode(record_json, type=FellowRecord)
    defaults = PlacementDefaults(min_gpu_free_gb=min_free_gb)

    def one(rec: FellowRecord, allow_cpu: bool) -> dict[str, Any]:
        spec = JobSpec(
            name="gpu-check", model=ModelConfig(n_layers=4), stages=1, allow_cpu=allow_cpu
        )
        result = place(spec, [candidate(rec)], defaults)
        if isinstance(result, Unplaceable):
            return {"placed": False, "reason": result.reason}
        stage = result.stages[0]
        # What START would carry to the fellow: the plan's slots are the placement's.
        (plan,) = stage_plans(
            job_id="gpu-check", attempt=1, spec=spec, placement=result, subject_prefix="swarm"
        )
        return {
            "placed": True,
            "fellow_id": stage.fellow_id,
            "layers": [stage.layer_start, stage.layer_end],
            "device": "gpu" if stage.gpu_slots else "cpu",
            "gpu_slots": msgspec.to_builtins(stage.gpu_slots),
            "plan_gpu_slots_match": plan.gpu_slots == stage.gpu_slots,
            "memory_estimate_bytes": stage.memory_estimate_bytes,
            "memory_offered_bytes": stage.memory_offered_bytes,
        }

    out: dict[str, Any] = {"as_received": one(record, allow_cpu=True)}
    hw = record.hardware
    if hw.gpus:
        assumed = msgspec.structs.replace(hw, tf_gpu_count=len(hw.gpus), tf_probe_error=None)
        out["if_tensorflow_saw_all"] = one(
            msgspec.structs.replace(record, hardware=assumed), allow_cpu=False
        )
    return out


def served_gpus(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "index": g["index"],
            "uuid": g["uuid"],
            "name": g["name"],
            "total_bytes": g["memory_total_bytes"],
            "free_bytes": g["memory_free_bytes"],
            "utilization_pct": g.get("utilization_pct"),
        }
        for g in record["hardware"]["gpus"]
    ]


def services_import_tensorflow() -> list[str]:
    """The TensorFlow-family modules that importing the leader and the agent pulls in."""
    import silentswarm.agent.main
    import silentswarm.leader.main  # noqa: F401

    heavy = {"tensorflow", "keras", "tf_keras"}
    return sorted({m.split(".")[0] for m in sys.modules} & heavy)


def run_check(work: Path, deadline: float, out: dict[str, Any]) -> None:
    """Fill ``out`` with what was found; raise RuntimeError on the first hard failure."""
    import httpx

    from silentswarm.procs import free_port

    out.update(nvml_direct())
    log(f"NVML: {out['nvml_error'] or str(len(out['gpus'])) + ' GPU(s)'}")
    out["tf_imported_by_services"] = services_import_tensorflow()
    services = Services(work)
    out["_services"] = services
    url = services.start_nats()
    log(f"nats-server {url} (pid {services.nats.pid})")
    port = free_port()
    token = secrets.token_urlsafe(16)
    services.start(
        "leader",
        "silentswarm.leader.main",
        env={
            "SWARM_NATS_URL": url,
            "SWARM_LEADER_HOST": "127.0.0.1",
            "SWARM_LEADER_PORT": str(port),
            "SWARM_STATE_DIR": str(work / "leader-state"),
            "SWARM_API_TOKEN": token,
        },
    )
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"authorization": f"Bearer {token}"},
        timeout=5.0,
    )

    def get(path: str) -> Any:
        try:
            response = http.get(path)
        except httpx.HTTPError:
            return None
        return response if response.status_code == 200 else None

    wait_for(
        "the leader to serve with its state loaded",
        lambda: (r := get("/api/v1/info")) is not None and r.json().get("state_loaded"),
        deadline,
        services.died,
    )
    log(f"leader on port {port}")
    services.start(
        "fellow",
        "silentswarm.agent.main",
        "--nats-url",
        url,
        "--name",
        FELLOW,
        env={
            "SWARM_STATE_DIR": str(work / "fellow-state"),
            "SWARM_DATA_ADDRESS": f"tcp://127.0.0.1:{free_port()}",
        },
    )

    def settled() -> Any:
        """The record once a heartbeat came after registration and the TF probe answered."""
        r = get(f"/api/v1/workers/{FELLOW}")
        if r is None:
            return None
        rec = r.json()
        hw = rec["hardware"]
        probing = bool(hw["gpus"]) and hw["tf_gpu_count"] is None and not hw["tf_probe_error"]
        return r if rec["status"] == "ready" and rec["heartbeats"] >= 2 and not probing else None

    response = wait_for("the fellow's heartbeats at the leader", settled, deadline, services.died)
    services.note_children()
    record = response.json()
    # The direct read right after the leader's copy: as close in time as they can be.
    direct_again = nvml_direct()
    hw = record["hardware"]
    out["heartbeat_ok"] = True
    out["heartbeats"] = record["heartbeats"]
    out["leader_nvml_error"] = hw["nvml_error"]
    out["tf_gpu_count"] = hw["tf_gpu_count"]
    out["tf_probe_error"] = hw["tf_probe_error"]
    out["leader_gpus"] = served_gpus(record)
    out["gpus_match_problems"] = compare_gpus(direct_again["gpus"], out["leader_gpus"])
    out["gpus_match"] = not out["gpus_match_problems"]
    node = next((n for n in get("/api/v1/nodes").json() if FELLOW in n["fellows"]), {})
    out["gpu_warning"] = node.get("gpu_warning")
    info = get("/api/v1/info").json()
    out["leader_version"] = info.get("version")
    min_free = float(os.environ.get("SWARM_PLACEMENT_MIN_GPU_FREE_GB", "4"))
    out["placement"] = placements(response.content, min_free)
    chosen = out["placement"].get("if_tensorflow_saw_all") or out["placement"]["as_received"]
    out["gpu_slots"] = chosen.get("gpu_slots", [])
    out["placement_ok"] = all(
        p["placed"] and p["plan_gpu_slots_match"] for p in out["placement"].values()
    )
    http.close()


START = time.monotonic()


def verdict(out: dict[str, Any], allow_no_gpu: bool) -> list[str]:
    """Why the check failed; empty when it passed."""
    failures = []
    if not out.get("nvml_ok") or not out.get("gpus"):
        if not allow_no_gpu:
            failures.append(f"no GPU verified ({out.get('nvml_error') or 'NVML sees no GPU'})")
    elif not out.get("gpus_match"):
        failures.append(
            "leader's GPUs differ from NVML's: " + "; ".join(out["gpus_match_problems"])
        )
    elif not out.get("gpu_slots"):
        failures.append("no gpu_slots in the placement")
    if not out.get("heartbeat_ok"):
        failures.append("no heartbeat reached the leader")
    if not out.get("placement_ok"):
        failures.append(f"placement failed: {out.get('placement')}")
    if out.get("tf_imported_by_services"):
        failures.append(f"the services import {out['tf_imported_by_services']}")
    if out.get("leftover_pids"):
        failures.append(f"processes left behind: {out['leftover_pids']}")
    return failures


def summarize(out: dict[str, Any]) -> None:
    """The result in words, on stderr; stdout's last line stays the JSON object."""
    gib = lambda n: f"{n / GIB:.1f} GiB"  # noqa: E731
    log(f"NVML: {'ok' if out.get('nvml_ok') else out.get('nvml_error')}")
    for gpu in out.get("gpus", []):
        log(
            f"  GPU {gpu['index']} {gpu['name']} {gpu['uuid']}: {gib(gpu['free_bytes'])} free of "
            f"{gib(gpu['total_bytes'])}, utilisation {gpu['utilization_pct']}%"
        )
    log(f"heartbeat at the leader: {out.get('heartbeat_ok')} ({out.get('heartbeats', 0)} seen)")
    log(f"leader's GPUs match NVML's: {out.get('gpus_match')} {out.get('gpus_match_problems', '')}")
    log(f"TensorFlow probe: {out.get('tf_gpu_count')} GPU(s), error {out.get('tf_probe_error')}")
    log(f"leader's gpu_warning: {out.get('gpu_warning')}")
    for basis, placed in (out.get("placement") or {}).items():
        log(f"placement ({basis}): {placed}")
    log(f"left behind: {out.get('leftover_pids')}; {out['seconds']}s; ok {out['ok']}")
    for failure in out["failures"]:
        log(f"FAILED: {failure}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="a scratch folder for logs and stores")
    parser.add_argument("--allow-no-gpu", action="store_true", help="pass without a GPU")
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds for it all")
    parser.add_argument("--requirements", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.requirements:
        print("\n".join(requirements()))
        return 0
    if args.work is None:
        parser.error("--work is needed")
    args.work.mkdir(parents=True, exist_ok=True)
    # SIGTERM (the shell's trap, a timeout) unwinds through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deadline = START + args.deadline
    out: dict[str, Any] = {
        "check": "gpu",
        "python": sys.version.split()[0],
        "python_path": sys.executable,
        # hardware.py hides the GPUs CUDA would not see; the direct read does not.
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "heartbeat_ok": False,
        "placement_ok": False,
    }
    try:
        run_check(args.work, deadline, out)
    except RuntimeError as exc:
        out["error"] = str(exc)
        log(str(exc))
    finally:
        services = out.pop("_services", None)
        if services is not None:
            out["pids"] = sorted(services.seen)
            out["leftover_pids"] = services.stop()
    out["failures"] = verdict(out, args.allow_no_gpu)
    if out.get("error"):
        out["failures"].insert(0, out["error"])
    out["ok"] = not out["failures"]
    out["install"] = os.environ.get("GPU_CHECK_INSTALL", "existing")
    out["seconds"] = round(time.monotonic() - START, 1)
    summarize(out)
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
