"""Fault: two fellows on one host made the host's view flip with every heartbeat.

``/api/v1/nodes`` and ``/api/v1/cluster`` took the freshest fellow's snapshot for the host,
so whatever differed between the two fellows (the GPUs each is pinned to, the operator's
caps) changed with each heartbeat. Here two real agents on this host run with different caps
(``SWARM_FELLOW_MAX_*``; this machine has no GPUs, so the GPU union is unit-tested in
tests/unit/test_registry.py), and every poll across several heartbeats of both must give the
same host view, with both fellows and both fellows' caps.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import Leader, wait_for
from tests.integration.test_jobs import agents, wait_ready

pytestmark = pytest.mark.timeout(120)

GIB = 1024**3
CAPS = {
    "v1": {"SWARM_FELLOW_MAX_MEMORY_GB": "1", "SWARM_FELLOW_MAX_VRAM_GB": "3"},
    "v2": {"SWARM_FELLOW_MAX_MEMORY_GB": "2", "SWARM_FELLOW_MAX_NETWORK_MBPS": "80"},
}
EXPECTED_LIMITS = {
    "v1": {"max_vram_bytes": 3 * GIB, "max_memory_bytes": 1 * GIB, "max_network_bytes_per_s": None},
    "v2": {"max_vram_bytes": None, "max_memory_bytes": 2 * GIB, "max_network_bytes_per_s": 10**7},
}
# What may move between polls: live readings, not what the host is.
LIVE = {"cpu_load_pct", "ram_available_bytes", "net_sent_bytes_per_s", "net_recv_bytes_per_s"}
LIVE_CLUSTER = {*LIVE, "running_jobs"}


def heartbeats(leader: Leader) -> dict[str, int]:
    return {fid: w["heartbeats"] for fid, w in leader.workers().items()}


def test_two_fellows_on_one_host_give_stable_node_views(procs, nats_server, leader):
    for name, env in CAPS.items():
        agents(procs, nats_server, name, **env)
    wait_ready(leader, *CAPS)
    start = heartbeats(leader)
    nodes_seen: list[dict[str, Any]] = []
    clusters_seen: list[dict[str, Any]] = []

    def poll() -> bool:
        [node] = leader.get("/api/v1/nodes")
        nodes_seen.append({k: v for k, v in node.items() if k not in LIVE})
        cluster = leader.get("/api/v1/cluster")
        clusters_seen.append({k: v for k, v in cluster.items() if k not in LIVE_CLUSTER})
        now = heartbeats(leader)
        return len(nodes_seen) >= 20 and all(now[f] >= start[f] + 3 for f in CAPS)

    wait_for(poll, timeout=60, what="three more heartbeats from each fellow")

    first = nodes_seen[0]
    assert first["fellows"] == ["v1", "v2"] and first["online"]
    assert first["limits"] == EXPECTED_LIMITS
    assert set(first["fellow_gpus"]) == {"v1", "v2"}
    assert first["cpu_cores"] >= 1 and first["ram_total_bytes"] > 0
    flips = [i for i, view in enumerate(nodes_seen) if view != first]
    assert not flips, f"poll {flips[0]} differs: {nodes_seen[flips[0]]} != {first}"

    cluster = clusters_seen[0]
    assert cluster["hosts"] == 1 and cluster["fellows"]["ready"] == 2
    assert cluster["cpu_cores"] == first["cpu_cores"]
    assert cluster["ram_total_bytes"] == first["ram_total_bytes"]
    assert cluster["gpus"] == len(first["gpus"])
    flips = [i for i, view in enumerate(clusters_seen) if view != cluster]
    assert not flips, f"poll {flips[0]} differs: {clusters_seen[flips[0]]} != {cluster}"
