"""Benchmark suites: scenarios with the infrastructure they need, checked before they run.

A suite names **infra profiles** (how many fellows, on how many hosts, each with how many
GPUs with at least how much free VRAM), **job profiles** (job spec fields a scenario adds, the
default one for every scenario that names none), a **base** job spec and its **scenarios**.
A scenario's job is ``base`` + its job profile + its own ``job`` fields (nested objects merge),
validated as the leader validates it.

:func:`dry_run` compares the connected fellows (``GET /api/v1/workers`` records) with each
scenario's infra profile and says precisely what is missing. Network conditions are recorded,
never enforced here (``"enforcement": "external"``: shape the link with tc/netem yourself).

Everything here is pure: decoding and decisions, no I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from silentswarm.cli.experiments import job_numbers
from silentswarm.cli.experiments.config import decode_config, spec_of
from silentswarm.errors import ConfigError
from silentswarm.jobspec import JobSpec
from silentswarm.types.fleet import FellowRecord
from silentswarm.types.jobs import JobRecord

GIB = 2**30
USABLE_STATUSES = frozenset({"ready"})
BUSY_JOB_STATES = frozenset({"PENDING", "RUNNING"})


class InfraProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    fellows: int = 1
    # Distinct host names the fellows must span (2: a two-node scenario).
    hosts: int = 1
    gpus_per_fellow: int = 0  # 0: CPU-only fellows do
    min_free_vram_gb: float = 0.0  # per GPU
    description: str = ""


class NetworkProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    target_bandwidth_mbps: float | None = None
    target_latency_ms: float | None = None
    # "external": recorded with the results, shaped by the operator (tc/netem), not by us.
    enforcement: Literal["external"] = "external"
    notes: str = ""


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    infra: str
    job_profile: str | None = None  # None: the suite's default_job_profile
    job: dict[str, Any] = msgspec.field(default_factory=dict)
    repeats: int | None = None  # None: the suite's repeats
    network: NetworkProfile | None = None
    description: str = ""


class SuiteConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str = ""
    repeats: int = 1
    base: dict[str, Any] = msgspec.field(default_factory=dict)
    infra_profiles: dict[str, InfraProfile]
    job_profiles: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    default_job_profile: str | None = None
    scenarios: list[Scenario]


class ResolvedScenario(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    infra: InfraProfile
    infra_name: str
    job_profile: str | None
    repeats: int
    network: NetworkProfile | None
    spec: JobSpec
    spec_json: bytes


class Suite(msgspec.Struct, frozen=True, kw_only=True):
    config: SuiteConfig
    scenarios: list[ResolvedScenario]


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    scenario: str
    ok: bool
    message: str
    fellows: list[str] = msgspec.field(default_factory=list)  # those that qualify


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it; nested objects merge, everything else replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def decode_suite(data: bytes, *, source: str) -> Suite:
    """The suite with every scenario's job resolved and validated; ConfigError naming the
    file, the scenario and the field otherwise."""
    config = decode_config(data, SuiteConfig, source=source, what="suite")
    if config.repeats < 1:
        raise ConfigError(f"{source}: repeats: must be >= 1")
    for name, infra in config.infra_profiles.items():
        problems = infra_problems(infra)
        if problems:
            raise ConfigError(f"{source}: infra_profiles.{name}: {'; '.join(problems)}")
    if config.default_job_profile and config.default_job_profile not in config.job_profiles:
        raise ConfigError(
            f"{source}: default_job_profile: no job profile {config.default_job_profile!r}"
        )
    names = [s.name for s in config.scenarios]
    if len(set(names)) != len(names):
        raise ConfigError(f"{source}: scenarios: a scenario name is used twice")
    resolved = [_resolve(config, s, source) for s in config.scenarios]
    return Suite(config=config, scenarios=resolved)


def infra_problems(infra: InfraProfile) -> list[str]:
    out = []
    if infra.fellows < 1:
        out.append("fellows must be >= 1")
    if not 1 <= infra.hosts <= max(infra.fellows, 1):
        out.append("hosts must be between 1 and fellows")
    if infra.gpus_per_fellow < 0:
        out.append("gpus_per_fellow must be >= 0")
    if infra.min_free_vram_gb < 0:
        out.append("min_free_vram_gb must be >= 0")
    return out


def _resolve(config: SuiteConfig, scenario: Scenario, source: str) -> ResolvedScenario:
    where = f"{source}: scenarios.{scenario.name}"
    infra = config.infra_profiles.get(scenario.infra)
    if infra is None:
        raise ConfigError(f"{where}.infra: no infra profile {scenario.infra!r}")
    profile_name = scenario.job_profile or config.default_job_profile
    profile: dict[str, Any] = {}
    if profile_name is not None:
        if profile_name not in config.job_profiles:
            raise ConfigError(f"{where}.job_profile: no job profile {profile_name!r}")
        profile = config.job_profiles[profile_name]
    repeats = scenario.repeats if scenario.repeats is not None else config.repeats
    if repeats < 1:
        raise ConfigError(f"{where}.repeats: must be >= 1")
    doc = deep_merge(deep_merge(config.base, profile), scenario.job)
    doc.setdefault("name", f"{config.name}-{scenario.name}")
    spec, spec_json = spec_of(doc, where=f"{where}.job")
    if spec.stages is not None and spec.stages > infra.fellows:
        raise ConfigError(
            f"{where}.job: stages ({spec.stages}) needs more fellows than infra "
            f"{scenario.infra!r} has ({infra.fellows})"
        )
    return ResolvedScenario(
        name=scenario.name,
        infra=infra,
        infra_name=scenario.infra,
        job_profile=profile_name,
        repeats=repeats,
        network=scenario.network,
        spec=spec,
        spec_json=spec_json,
    )


# --- dry run ----------------------------------------------------------------------------------


def qualifying_gpus(fellow: FellowRecord, min_free_gb: float) -> int:
    """GPUs of the fellow with at least ``min_free_gb`` GiB free."""
    need = min_free_gb * GIB
    return sum(1 for g in fellow.hardware.gpus if g.memory_free_bytes >= need)


def fellow_qualifies(fellow: FellowRecord, infra: InfraProfile) -> bool:
    if fellow.status not in USABLE_STATUSES:
        return False
    return qualifying_gpus(fellow, infra.min_free_vram_gb) >= infra.gpus_per_fellow


def pick_fellows(fellows: Sequence[FellowRecord], infra: InfraProfile) -> list[str] | None:
    """Fellows that satisfy the profile (spanning ``hosts`` host names), or None.

    One fellow per new host first, then the rest by id: a greedy pick is exact here, since
    every qualifying fellow is interchangeable apart from its host.
    """
    good = sorted((f for f in fellows if fellow_qualifies(f, infra)), key=lambda f: f.fellow_id)
    picked: list[FellowRecord] = []
    seen: set[str] = set()
    for f in good:
        if len(seen) < infra.hosts and f.hostname not in seen:
            picked.append(f)
            seen.add(f.hostname)
    for f in good:
        if len(picked) >= infra.fellows:
            break
        if f not in picked:
            picked.append(f)
    if len(seen) < infra.hosts or len(picked) < infra.fellows:
        return None
    return [f.fellow_id for f in picked[: infra.fellows]]


def describe_need(infra: InfraProfile) -> str:
    """``2 fellows on 2 hosts, each with 1 GPU with >= 20 GiB free``."""
    fellows = f"{infra.fellows} fellow{'s' if infra.fellows != 1 else ''}"
    hosts = f" on {infra.hosts} hosts" if infra.hosts > 1 else ""
    if infra.gpus_per_fellow == 0:
        return f"{fellows}{hosts} (CPU is enough)"
    each = " with" if infra.fellows == 1 else ", each with"
    gpus = f"{infra.gpus_per_fellow} GPU{'s' if infra.gpus_per_fellow != 1 else ''}"
    return f"{fellows}{hosts}{each} {gpus} with >= {infra.min_free_vram_gb:g} GiB free"


def describe_have(fellows: Sequence[FellowRecord], infra: InfraProfile) -> str:
    """``have 2 fellows (2 ready) on 1 host, 0 GPUs (0 with >= 20 GiB free)``."""
    ready = [f for f in fellows if f.status in USABLE_STATUSES]
    hosts = {f.hostname for f in ready}
    gpus = sum(len(f.hardware.gpus) for f in ready)
    roomy = sum(qualifying_gpus(f, infra.min_free_vram_gb) for f in ready)
    text = (
        f"have {len(fellows)} fellow{'s' if len(fellows) != 1 else ''} ({len(ready)} ready) "
        f"on {len(hosts)} host{'s' if len(hosts) != 1 else ''}, "
        f"{gpus} GPU{'s' if gpus != 1 else ''}"
    )
    if infra.gpus_per_fellow and gpus:
        text += f" ({roomy} with >= {infra.min_free_vram_gb:g} GiB free)"
    return text


def dry_run(suite: Suite, fellows: Sequence[FellowRecord]) -> list[Finding]:
    """Per scenario: can it run on these fellows, and if not, exactly what is missing."""
    findings = []
    for s in suite.scenarios:
        need = describe_need(s.infra)
        picked = pick_fellows(fellows, s.infra)
        network = ""
        if s.network is not None:
            parts = []
            if s.network.target_bandwidth_mbps is not None:
                parts.append(f"{s.network.target_bandwidth_mbps:g} Mbit/s")
            if s.network.target_latency_ms is not None:
                parts.append(f"{s.network.target_latency_ms:g} ms")
            network = f"; network {' / '.join(parts) or 'as found'} (enforcement: external)"
        if picked is None:
            findings.append(
                Finding(
                    scenario=s.name,
                    ok=False,
                    message=f"{s.name}: needs {need}; {describe_have(fellows, s.infra)}",
                )
            )
        else:
            findings.append(
                Finding(
                    scenario=s.name,
                    ok=True,
                    message=f"{s.name}: ok: {need}: {', '.join(picked)} x{s.repeats}{network}",
                    fellows=picked,
                )
            )
    return findings


def busy_jobs(jobs: Sequence[JobRecord]) -> list[str]:
    """Ids of jobs that would share the fellows with a benchmark (PENDING or RUNNING)."""
    return [j.job_id for j in jobs if j.state in BUSY_JOB_STATES]


def run_results(job: JobRecord) -> dict[str, Any]:
    """results.json of one repeat: state, losses, throughput and bytes on the wire."""
    view = job.current_view()
    return {
        "job_id": job.job_id,
        "state": job.state.value,
        "reason": job.reason,
        "final_loss": job.final_loss,
        "final_val_loss": job.final_val_loss,
        "tokens_per_s": view.tokens_per_s,
        "step_time_s": view.step_time_s,
        "steps": view.step or 0,
        "stages": job_numbers.n_boundaries(job) + 1 if job.placement is not None else None,
        "bytes_sent": view.bytes_sent,
        "bytes_per_step_per_boundary": job_numbers.bytes_per_step_per_boundary(job),
        "compression_ratio_vs_fp32": job_numbers.compression_ratio(job),
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "fellows": view.fellows,
    }


SUMMARY_FIELDS = job_numbers.RESULT_FIELDS


def summarize(results: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Per scenario: how many repeats completed and the mean, min and max of each number over
    the completed ones (repeats exist to show the spread, so it is kept)."""
    out: dict[str, Any] = {}
    for scenario, repeats in results.items():
        done = [r for r in repeats if r.get("state") == "COMPLETED"]
        stats: dict[str, Any] = {}
        for field in SUMMARY_FIELDS:
            values = [float(r[field]) for r in done if r.get(field) is not None]
            if values:
                stats[field] = {
                    "mean": sum(values) / len(values),
                    "min": min(values),
                    "max": max(values),
                }
        out[scenario] = {"repeats": len(repeats), "completed": len(done), **stats}
    return out
