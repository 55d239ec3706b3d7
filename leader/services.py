"""What the controllers talk to: one object holding the leader's live services."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from leader.bus import LeaderBus
from leader.jobs import JobManager, JobRecord
from leader.observe import Observability
from leader.orchestrator import Orchestrator
from leader.purges import PurgeBook
from leader.registry import FellowRecord, NodeView, WorkerRegistry
from swarm import __version__
from swarm.errors import NotFoundError
from swarm.protocol import PROTOCOL_VERSION
from swarm.settings import Settings


@dataclass
class LeaderServices:
    settings: Settings
    nats_url: str
    registry: WorkerRegistry
    bus: LeaderBus
    jobs: JobManager
    purges: PurgeBook
    observe: Observability
    orchestrator: Orchestrator
    started_at: float = field(default_factory=time.time)

    def info(self) -> dict[str, object]:
        return {
            "version": __version__,
            "protocol_version": PROTOCOL_VERSION,
            "nats_url": self.nats_url,
            "nats_connected": self.bus.is_connected,
            "subject_prefix": self.settings.subject_prefix,
            "started_at": self.started_at,
            "uptime_s": round(time.time() - self.started_at, 3),
            "heartbeat_interval_s": self.settings.heartbeat_interval_s,
            "offline_after_s": self.settings.offline_after_s,
            "state_loaded": self.orchestrator.loaded.is_set(),
            "fellows": self.registry.counts(),
            "jobs": self.jobs.counts(),
            "nodes": len(self.registry.nodes()),
        }

    def worker(self, fellow_id: str) -> FellowRecord:
        record = self.registry.get(fellow_id)
        if record is None:
            raise NotFoundError(f"no fellow {fellow_id!r} is registered")
        return record

    def workers(self) -> list[FellowRecord]:
        return self.registry.list()

    def nodes(self) -> list[NodeView]:
        return self.registry.nodes()

    def job(self, job_id: str) -> JobRecord:
        self.orchestrator.require_loaded()
        return self.jobs.get(job_id)

    def job_list(self) -> list[JobRecord]:
        self.orchestrator.require_loaded()
        return self.jobs.list()

    def cluster(self) -> dict[str, object]:
        """What the swarm has online (per host, so fellows sharing a host count it once) and
        how its running jobs perform."""
        hosts = [n for n in self.registry.nodes() if n.online]
        gpus = [g for n in hosts for g in n.gpus]
        running = []
        for job in self.jobs.running():
            view = self.observe.metrics(job.job_id)
            running.append(
                {
                    "job_id": job.job_id,
                    "name": job.name,
                    "step": view.step,
                    "total_steps": view.total_steps,
                    "loss": view.loss,
                    "step_time_s": view.step_time_s,
                    "steps_per_min": view.steps_per_min,
                    "tokens_per_s": view.tokens_per_s,
                    "boundaries": view.boundaries,
                    "placement": job.placement,
                }
            )
        return {
            "fellows": self.registry.counts(),
            "hosts": len(hosts),
            "cpu_cores": sum(n.cpu_cores for n in hosts),
            "ram_total_bytes": sum(n.ram_total_bytes for n in hosts),
            "ram_available_bytes": sum(n.ram_available_bytes for n in hosts),
            "gpus": len(gpus),
            "vram_total_bytes": sum(g.memory_total_bytes for g in gpus),
            "vram_free_bytes": sum(g.memory_free_bytes for g in gpus),
            "net_sent_bytes_per_s": round(sum(n.net_sent_bytes_per_s for n in hosts), 1),
            "net_recv_bytes_per_s": round(sum(n.net_recv_bytes_per_s for n in hosts), 1),
            "running_jobs": running,
        }
