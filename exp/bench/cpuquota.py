"""A slow machine on this one: a cgroup v1 CPU group holding its processes to a share of
the cores (``cpu.cfs_quota_us`` over a ``cpu.cfs_period_us`` of 100 ms), as a container's
CPU limit does (Docker ``--cpus``, a Kubernetes limit, systemd ``CPUQuota=``); and a small
one: a memory group holding them to a limit (Docker ``--memory``, systemd ``MemoryMax=``).

The group is made for the caller and removed after; a process enters it through the command
prefix :func:`cpu_quota` yields (:func:`cpu_group` and :func:`memory_group` yield the group
itself, whose share or limit can change while its processes run). Needs root and the v1
``cpu`` or ``memory`` controller mounted under ``/sys/fs/cgroup`` (this machine's hybrid
layout); where either is missing they yield None and the caller decides (a benchmark runs
unshaped and says so, a test skips).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
PERIOD_US = 100_000


@dataclass(frozen=True)
class Group:
    """A cgroup v1 directory made for the caller."""

    path: Path

    @property
    def prefix(self) -> list[str]:
        """The command prefix that starts a process inside the group."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh"]


class CpuGroup(Group):
    def set_share(self, share: float) -> None:
        """Hold the group to ``share`` cores from now on."""
        (self.path / "cpu.cfs_quota_us").write_text(str(int(PERIOD_US * share)))


class MemoryGroup(Group):
    def set_limit(self, limit: int) -> None:
        """Hold the group to ``limit`` bytes from now on."""
        (self.path / "memory.limit_in_bytes").write_text(str(limit))

    def unreclaimable(self) -> int:
        """What the kernel cannot drop to make room (no swap): anonymous memory and tmpfs."""
        text = (self.path / "memory.stat").read_text()
        stat = {name: int(value) for name, value in (line.split() for line in text.splitlines())}
        return stat["total_rss"] + stat["total_shmem"]


G = TypeVar("G", bound=Group)


@contextlib.contextmanager
def _made(group: G, configure: Callable[[G], None], why: list[str] | None) -> Iterator[G | None]:
    """``group`` made and configured (None where that fails; ``why`` then gets the reason),
    removed after its processes have gone."""
    try:
        group.path.mkdir()
        configure(group)
    except OSError as exc:
        if why is not None:
            why.append(f"no {group.path.parent.name} group: {exc}")
        with contextlib.suppress(OSError):
            group.path.rmdir()
        yield None
        return
    try:
        yield group
    finally:
        for _ in range(300):  # a process that just exited may still be listed briefly
            with contextlib.suppress(OSError):
                group.path.rmdir()
                break
            time.sleep(0.1)


@contextlib.contextmanager
def cpu_group(
    share: float, *, weight: int | None = None, why: list[str] | None = None
) -> Iterator[CpuGroup | None]:
    """A CPU group holding its processes to ``share`` cores (None where cgroups cannot be
    made; ``why`` then gets the reason); removed after its processes have gone.

    ``weight`` is the group's ``cpu.shares`` against a busy process's 1024: a high weight
    makes the share the group's whatever else runs beside it (a timing-sensitive test on a
    machine busy with others), where the quota alone only caps it."""

    def configure(group: CpuGroup) -> None:
        (group.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        group.set_share(share)
        if weight is not None:
            (group.path / "cpu.shares").write_text(str(weight))

    group = CpuGroup(CGROUP_CPU / f"swarm-quota-{uuid.uuid4().hex[:8]}")
    with _made(group, configure, why) as made:
        yield made


@contextlib.contextmanager
def cpu_quota(share: float, *, why: list[str] | None = None) -> Iterator[list[str] | None]:
    """:func:`cpu_group`'s command prefix: what puts a process in the group (or None)."""
    with cpu_group(share, why=why) as group:
        yield None if group is None else group.prefix


@contextlib.contextmanager
def memory_group(limit: int, *, why: list[str] | None = None) -> Iterator[MemoryGroup | None]:
    """A memory group holding its processes to ``limit`` bytes, as a container's memory limit
    does (None where it cannot be made: ``why`` says why); removed after its processes have
    gone (tmpfs pages they charged to it move to its parent)."""
    group = MemoryGroup(CGROUP_MEMORY / f"swarm-memory-{uuid.uuid4().hex[:8]}")
    with _made(group, lambda g: g.set_limit(limit), why) as made:
        yield made
