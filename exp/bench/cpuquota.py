"""A slow machine on this one: a cgroup v1 CPU group holding its processes to a share of
the cores (``cpu.cfs_quota_us`` over a ``cpu.cfs_period_us`` of 100 ms), as a container's
CPU limit does (Docker ``--cpus``, a Kubernetes limit, systemd ``CPUQuota=``).

The group is made for the caller and removed after; a process enters it through the command
prefix :func:`cpu_quota` yields (:func:`cpu_group` yields the group itself, whose share can
change while its processes run). Needs root and the v1 ``cpu`` controller mounted at
``/sys/fs/cgroup/cpu`` (this machine's hybrid layout); where either is missing they yield
None and the caller decides (a benchmark runs unshaped and says so, a test skips).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


@dataclass(frozen=True)
class CpuGroup:
    path: Path

    @property
    def prefix(self) -> list[str]:
        """The command prefix that starts a process inside the group."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh"]

    def set_share(self, share: float) -> None:
        """Hold the group to ``share`` cores from now on."""
        (self.path / "cpu.cfs_quota_us").write_text(str(int(PERIOD_US * share)))


@contextlib.contextmanager
def cpu_group(
    share: float, *, weight: int | None = None, why: list[str] | None = None
) -> Iterator[CpuGroup | None]:
    """A CPU group holding its processes to ``share`` cores (None where cgroups cannot be
    made; ``why`` then gets the reason); removed after its processes have gone.

    ``weight`` is the group's ``cpu.shares`` against a busy process's 1024: a high weight
    makes the share the group's whatever else runs beside it (a timing-sensitive test on a
    machine busy with others), where the quota alone only caps it."""
    group = CpuGroup(CGROUP_CPU / f"swarm-quota-{uuid.uuid4().hex[:8]}")
    try:
        group.path.mkdir()
        (group.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        group.set_share(share)
        if weight is not None:
            (group.path / "cpu.shares").write_text(str(weight))
    except OSError as exc:
        if why is not None:
            why.append(f"no CPU quota: {exc}")
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
def cpu_quota(share: float, *, why: list[str] | None = None) -> Iterator[list[str] | None]:
    """:func:`cpu_group`'s command prefix: what puts a process in the group (or None)."""
    with cpu_group(share, why=why) as group:
        yield None if group is None else group.prefix
