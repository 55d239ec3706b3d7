"""The CPUs this process may really use: its affinity mask and its cgroup's CPU quota.

``os.cpu_count()`` and psutil count the host's cores. A fellow in a container (Docker
``--cpus``, a Kubernetes CPU limit, a Nomad driver's hard limit, systemd's ``CPUQuota=``) or
pinned to a few cores (``taskset``, ``--cpuset-cpus``, ``AllowedCPUs=``) gets far fewer: a
TensorFlow thread pool sized for the host then runs dozens of threads into a quota of two
cores, and the kernel stops the whole group for the rest of every period it overdraws, so
a stage, and the pipeline behind it, stalls. Like the JVM's container support, the budget
here is the affinity mask's size capped by the quota rounded up (a quota of 1.5 cores gets 2
threads: rounding down would leave a third of it unused; docs/performance.md measures both).

The quota is the smallest ``cpu.max`` (cgroup v2) or ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us`` (v1) on the path from this process's cgroup up to its hierarchy's
mount (a parent's limit binds its children: the directories are :mod:`silentswarm.cgroups`').
The parsing is pure; :func:`cpu_budget` reads the cgroup files.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from silentswarm.cgroups import PROC_SELF, CgroupDir, own_cgroup_dirs, read_small

# A quota is read within these many cores (a misread or absurd file must not make every
# figure derived from it divide by almost nothing, nor leave the bounds a heartbeat checks).
MIN_QUOTA_CORES = 0.01
MAX_QUOTA_CORES = 65536.0
DEFAULT_PERIOD_S = 0.1


@dataclass(frozen=True)
class CpuBudget:
    """``cores``: the threads worth running (>= 1); ``quota``: the cgroup's limit in cores
    (None: no limit); ``affinity``: the cores the scheduler may put this process on;
    ``host``: the machine's logical cores."""

    cores: int
    quota: float | None
    affinity: int
    host: int


def budget(host: int, affinity: int, quota: float | None) -> CpuBudget:
    """The threads worth running with ``affinity`` usable cores and a quota of ``quota``
    cores: the affinity capped by the quota rounded up, at least 1."""
    host = max(1, host)
    affinity = max(1, min(affinity, host))
    if quota is not None:
        quota = min(max(MIN_QUOTA_CORES, quota), MAX_QUOTA_CORES)
        cores = min(affinity, math.ceil(quota - 1e-9))
    else:
        cores = affinity
    return CpuBudget(cores=max(1, cores), quota=quota, affinity=affinity, host=host)


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` (``"$MAX $PERIOD"``, ``max`` for none) in cores; None for no
    limit or a file that does not read as one."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return quota_cores(parts[0], parts[1])


def quota_cores(quota_us: str, period_us: str) -> float | None:
    """A quota and period in microseconds as cores; None for -1 (v1's no limit) or junk."""
    try:
        quota, period = int(quota_us.strip()), int(period_us.strip())
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def group_limit(group: CgroupDir, read: Callable[[Path], str | None]) -> tuple[float, float] | None:
    """The quota set on ``group``'s own directory: (cores, its period in seconds); None
    where it sets none (or its files do not read as one)."""
    if group.version == 2:
        text = read(group.path / "cpu.max") or ""
        cores = parse_cpu_max(text)
        period_us = text.split()[-1] if cores is not None else ""
    else:
        period_us = read(group.path / "cpu.cfs_period_us") or ""
        cores = quota_cores(read(group.path / "cpu.cfs_quota_us") or "", period_us)
    return None if cores is None else (cores, int(period_us) / 1e6)


def binding_quota(
    start: CgroupDir, read: Callable[[Path], str | None]
) -> tuple[float, CgroupDir] | None:
    """The smallest quota from ``start``'s directory up to its mount point, and the
    directory that sets it (where the kernel counts the throttling it causes)."""
    found: list[tuple[float, CgroupDir]] = []
    for group in start.up_to_mount():
        limit = group_limit(group, read)
        if limit is not None:
            found.append((limit[0], group))
    return min(found, key=lambda f: f[0]) if found else None


def cgroup_quota(proc: Path = PROC_SELF) -> float | None:
    """This process's CPU quota in cores from its cgroups; None where none limits it or the
    files cannot be read."""
    found = tightest_quota(proc)
    return found[0] if found else None


def tightest_quota(proc: Path = PROC_SELF) -> tuple[float, CgroupDir] | None:
    """The tightest CPU quota over this process's hierarchies, and the directory that sets it
    (the quota files are read each time: an operator may change a limit while it runs)."""
    quotas = [binding_quota(d, read_small) for d in own_cgroup_dirs(proc)]
    found = [q for q in quotas if q is not None]
    return min(found, key=lambda f: f[0]) if found else None


def parse_cpu_stat(text: str, version: int) -> tuple[float, int] | None:
    """(seconds, periods) a group was held back by its quota, from its ``cpu.stat``: v1's
    ``throttled_time`` (ns), v2's ``throttled_usec``, and ``nr_throttled``; None where the
    file lacks them."""
    key, unit = ("throttled_time", 1e-9) if version == 1 else ("throttled_usec", 1e-6)
    fields = dict(line.partition(" ")[::2] for line in text.splitlines())
    try:
        return max(0, int(fields[key])) * unit, max(0, int(fields["nr_throttled"]))
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class ThrottleReading:
    at: float  # time.monotonic()
    throttled_s: float
    periods: int
    quota: float | None = None  # the group's quota then, in cores (it may change)
    period_s: float = DEFAULT_PERIOD_S  # and that quota's period


class ThrottleClock:
    """How long a CPU quota held this process back, from the ``cpu.stat`` of the group whose
    quota is tightest (found once). A stage leaves these seconds out of its busy time: they
    are the quota's, not the work's, and the leader keeps the two apart (balanced
    partitions). Without a quota every interval reads 0.

    The kernel adds a stall to ``throttled_time`` once per CPU the group was throttled on,
    so ``threads`` busy threads count it up to ``threads`` times over: :meth:`held` bounds it
    by the periods the group was throttled in and by what the quota leaves ``threads`` busy
    threads, ``wall x (1 - quota / threads)`` (exact for a process busy all the time)."""

    def __init__(self, threads: int, proc: Path = PROC_SELF) -> None:
        found = tightest_quota(proc)
        self.threads = max(1, threads)
        self.group = found[1] if found else None

    def read(self) -> ThrottleReading:
        """The group's counters and its quota now (an operator may change the quota while
        the process runs: ``docker update --cpus``)."""
        now = time.monotonic()
        if self.group is None:
            return ThrottleReading(now, 0.0, 0)
        text = read_small(self.group.path / "cpu.stat")
        stat = parse_cpu_stat(text, self.group.version) if text is not None else None
        limit = group_limit(self.group, read_small)
        quota, period_s = limit if limit else (None, DEFAULT_PERIOD_S)
        return ThrottleReading(now, *(stat or (0.0, 0)), quota=quota, period_s=period_s)

    def held(self, since: ThrottleReading, now: ThrottleReading | None = None) -> float:
        """Seconds the quota held the process back between two readings (``now``: read now)."""
        now = now or self.read()
        quotas = [q for q in (since.quota, now.quota) if q is not None]
        if self.group is None or not quotas:
            return 0.0
        wall = max(0.0, now.at - since.at)
        counted = max(0.0, now.throttled_s - since.throttled_s)
        periods = max(0, now.periods - since.periods) * now.period_s
        left = wall * max(0.0, 1.0 - min(quotas) / self.threads)
        return min(counted, periods, left)


def affinity_count() -> int:
    """The cores the scheduler may run this process on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_budget() -> CpuBudget:
    """This process's CPU budget, read now (a limit can change while it runs)."""
    return budget(os.cpu_count() or 1, affinity_count(), cgroup_quota())


def usable_cores() -> int:
    """The threads worth running in this process (see the module's docstring)."""
    return cpu_budget().cores
