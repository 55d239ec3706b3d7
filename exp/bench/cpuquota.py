"""A slow machine on this one: a cgroup v1 CPU group holding its processes to a share of
the cores (``cpu.cfs_quota_us`` over a ``cpu.cfs_period_us`` of 100 ms), as a container's
CPU limit does (Docker ``--cpus``, a Kubernetes limit, systemd ``CPUQuota=``).

The group is made for the caller and removed after; a process enters it through the command
prefix :func:`cpu_quota` yields. Needs root and the v1 ``cpu`` controller mounted at
``/sys/fs/cgroup/cpu`` (this machine's hybrid layout); where either is missing it yields
None and the caller decides (a benchmark runs unshaped and says so, a test skips).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


@contextlib.contextmanager
def cpu_quota(share: float, *, why: list[str] | None = None) -> Iterator[list[str] | None]:
    """A CPU group holding its processes to ``share`` cores: yields the command prefix that
    puts a process in it (None where cgroups cannot be made; ``why`` then gets the reason);
    the group is removed after its processes have gone."""
    group = CGROUP_CPU / f"swarm-quota-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(int(PERIOD_US * share)))
    except OSError as exc:
        if why is not None:
            why.append(f"no CPU quota: {exc}")
        with contextlib.suppress(OSError):
            group.rmdir()
        yield None
        return
    procs = group / "cgroup.procs"
    try:
        yield ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh"]
    finally:
        for _ in range(300):  # a process that just exited may still be listed briefly
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            time.sleep(0.1)
