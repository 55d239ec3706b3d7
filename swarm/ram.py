"""The memory this process may really use: the host's, capped by its cgroup's memory limit.

psutil reads ``/proc/meminfo``: the host's memory. A fellow in a container (Docker
``--memory``, a Kubernetes limit, the Nomad task's ``memory``, systemd's ``MemoryMax=``) is
held to far less, and the kernel's out-of-memory killer ends the container's largest process,
its stage, the moment the group reaches its limit. Offering the host's figure let placement
put a stage there that could never fit. So a fellow offers the tighter of the two:

- the limit: the smallest ``memory.max`` or ``memory.high`` (v2, ``max`` for none) or
  ``memory.limit_in_bytes`` (v1, a value near 2**63 for none) on the path from this process's
  cgroup up to its hierarchy's mount (a parent's limit binds its children);
- the room under it: the limit less the group's working set, its usage less the page cache
  the kernel can drop (``inactive_file`` of its ``memory.stat``; v1's hierarchical
  ``total_inactive_file``), as the kubelet and cAdvisor count it; the tightest over the path.

When the group's out-of-memory killer ends a process, the group's ``oom_kill`` counter
(``memory.events``, v2; ``memory.oom_control``, v1) rises, and the host's (``/proc/vmstat``)
counts every kill on the machine: :func:`oom_kills` reads both, so a supervisor can say why a
child died of SIGKILL. The parsing is pure; the functions at the end read the files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from silentswarm.cgroups import PROC_SELF, CgroupDir, own_cgroup_dirs, read_small

# v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 with 4 KiB pages; other
# page sizes give other values near 2**63): anything from 2**62 up is no limit.
V1_UNLIMITED = 1 << 62
VMSTAT = Path("/proc/vmstat")

Read = Callable[[Path], "str | None"]


@dataclass(frozen=True)
class GroupMemory:
    """One cgroup directory's limit and working set, in bytes."""

    limit: int
    working_set: int

    @property
    def room(self) -> int:
        return max(0, self.limit - self.working_set)


@dataclass(frozen=True)
class MemoryBudget:
    """``total`` and ``available``: what this process may use (the host's, capped by its
    cgroup); ``limit``: the cgroup's limit where one holds it below the host's memory (None:
    none does); ``host_total`` and ``host_available``: the host's."""

    total: int
    available: int
    limit: int | None
    host_total: int
    host_available: int


def parse_bytes(text: str | None) -> int | None:
    """A limit file's value in bytes; None for no limit (``max``, v1's near-2**63) or a file
    that does not read as one."""
    value = (text or "").strip()
    if value == "max":
        return None
    try:
        number = int(value)
    except ValueError:
        return None
    return number if 0 <= number < V1_UNLIMITED else None


def stat_field(text: str | None, key: str) -> int | None:
    """The value of ``key`` in a ``memory.stat``/``memory.events``-style file (one
    ``name value`` per line); None where it is missing or not a count."""
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return max(0, int(value))
            except ValueError:
                return None
    return None


def group_memory(group: CgroupDir, read: Read) -> GroupMemory | None:
    """The limit set on ``group``'s own directory and its working set; None where it sets
    none (or its files do not read as one)."""
    if group.version == 2:
        limits = [parse_bytes(read(group.path / f)) for f in ("memory.max", "memory.high")]
        usage = parse_bytes(read(group.path / "memory.current"))
        cache_key = "inactive_file"
    else:
        limits = [parse_bytes(read(group.path / "memory.limit_in_bytes"))]
        usage = parse_bytes(read(group.path / "memory.usage_in_bytes"))
        cache_key = "total_inactive_file"
    set_limits = [limit for limit in limits if limit is not None]
    if not set_limits:
        return None
    usage = usage or 0
    cache = stat_field(read(group.path / "memory.stat"), cache_key) or 0
    return GroupMemory(limit=min(set_limits), working_set=usage - min(cache, usage))


def path_memory(start: CgroupDir, read: Read) -> list[GroupMemory]:
    """The limits set from ``start``'s directory up to its mount point."""
    found = (group_memory(group, read) for group in start.up_to_mount())
    return [g for g in found if g is not None]


def budget(host_total: int, host_available: int, groups: list[GroupMemory]) -> MemoryBudget:
    """What a process may use on a host with ``host_total`` and ``host_available`` bytes,
    inside cgroups that set ``groups``: the smallest limit and the least room under one."""
    host_total, host_available = max(0, host_total), max(0, host_available)
    limit = min((g.limit for g in groups), default=None)
    room = min((g.room for g in groups), default=host_available)
    return MemoryBudget(
        total=host_total if limit is None else min(host_total, limit),
        available=min(host_available, room),
        limit=limit if limit is not None and limit < host_total else None,
        host_total=host_total,
        host_available=host_available,
    )


def own_memory_groups(proc: Path = PROC_SELF) -> list[GroupMemory]:
    """The memory limits of this process's cgroups, read now (an operator may change one while
    it runs: ``docker update --memory``)."""
    return [g for start in own_cgroup_dirs(proc, "memory") for g in path_memory(start, read_small)]


def memory_limit(proc: Path = PROC_SELF) -> int | None:
    """The smallest memory limit of this process's cgroups; None where none sets one."""
    return min((g.limit for g in own_memory_groups(proc)), default=None)


def memory_budget(host_total: int, host_available: int, proc: Path = PROC_SELF) -> MemoryBudget:
    """This process's memory budget on a host psutil reads as ``host_total`` and
    ``host_available``."""
    return budget(host_total, host_available, own_memory_groups(proc))


@dataclass(frozen=True)
class OomKills:
    """Out-of-memory kills counted so far: in this process's own cgroup (where a child it
    starts runs too), and on the whole host; None where the kernel does not say."""

    group: int | None
    host: int | None


def oom_kills(proc: Path = PROC_SELF, vmstat: Path = VMSTAT) -> OomKills:
    """The out-of-memory kills counted so far in this process's own memory cgroups (the sum
    over its hierarchies' directories) and on the host."""
    counts = []
    for start in own_cgroup_dirs(proc, "memory"):
        name = "memory.events" if start.version == 2 else "memory.oom_control"
        count = stat_field(read_small(start.path / name), "oom_kill")
        if count is not None:
            counts.append(count)
    host = stat_field(read_small(vmstat, 1 << 16), "oom_kill")
    return OomKills(group=sum(counts) if counts else None, host=host)
