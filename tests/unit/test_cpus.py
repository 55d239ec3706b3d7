"""The CPU budget: what a quota and an affinity mask leave a fellow (silentswarm.cpus)."""

from __future__ import annotations

from pathlib import Path

import pytest

from silentswarm.cgroups import CgroupDir, cgroup_dirs, parse_mount, read_small
from silentswarm.cli.commands.fellows import cores_text
from silentswarm.cpus import (
    ThrottleClock,
    ThrottleReading,
    binding_quota,
    budget,
    cgroup_quota,
    parse_cpu_max,
    parse_cpu_stat,
    quota_cores,
)


@pytest.mark.parametrize(
    ("host", "affinity", "quota", "cores"),
    [
        (64, 64, None, 64),  # nothing limits it
        (64, 4, None, 4),  # pinned to four cores
        (64, 64, 2.0, 2),  # a container's --cpus=2
        (64, 64, 1.5, 2),  # rounded up: one thread would leave a third unused
        (64, 64, 0.5, 1),  # at least one
        (64, 2, 8.0, 2),  # the mask is tighter than the quota
        (2, 2, 2.0000001, 2),  # a quota a hair above whole cores is those cores (float noise)
        (0, 0, None, 1),  # a host that reports nothing still gets one
    ],
)
def test_budget_takes_the_tighter_of_affinity_and_quota(host, affinity, quota, cores):
    assert budget(host, affinity, quota).cores == cores


def test_budget_keeps_the_quota_and_bounds_absurd_ones():
    assert budget(8, 8, 0.5).quota == 0.5
    assert budget(8, 8, 1e-9).quota == pytest.approx(0.01)
    assert budget(8, 8, 1e12) == budget(8, 8, 65536.0)  # within what a heartbeat may carry
    assert budget(8, 16, None).affinity == 8


@pytest.mark.parametrize(
    ("text", "cores"),
    [
        ("max 100000\n", None),
        ("50000 100000\n", 0.5),
        ("200000 100000", 2.0),
        ("150000 50000", 3.0),
        ("garbage", None),
        ("-1 100000", None),
        ("", None),
    ],
)
def test_cpu_max_reads_as_cores(text, cores):
    assert parse_cpu_max(text) == cores


@pytest.mark.parametrize(
    ("quota", "period", "cores"),
    [("50000\n", "100000\n", 0.5), ("-1", "100000", None), ("x", "1", None), ("1", "0", None)],
)
def test_v1_quota_reads_as_cores(quota, period, cores):
    assert quota_cores(quota, period) == cores


# This machine's hybrid layout: v1 controllers, and an unnamed v2 hierarchy beside them.
HYBRID_CGROUP = "9:name=systemd:/\n4:memory:/api/x\n2:cpuacct:/\n1:cpu:/bench\n0::/\n"
HYBRID_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
# A container without a cgroup namespace: its v1 hierarchies are mounted at its own group.
DOCKER_V1_CGROUP = "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n"
DOCKER_V1_MOUNTS = (
    "700 690 0:40 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
)
# cgroup v2 alone, inside a cgroup namespace (Docker's default on v2 hosts).
V2_CGROUP = "0::/\n"
V2_MOUNTS = "800 790 0:41 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
# A v2 host seen from outside any namespace: the process sits deep in a slice.
V2_HOST_CGROUP = "0::/system.slice/silentswarm-fellow.service\n"


@pytest.mark.parametrize(
    ("proc_cgroup", "mounts", "expected"),
    [
        (
            HYBRID_CGROUP,
            HYBRID_MOUNTS,
            [
                CgroupDir(1, Path("/sys/fs/cgroup/cpu/bench"), Path("/sys/fs/cgroup/cpu")),
                CgroupDir(2, Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/unified")),
            ],
        ),
        (
            DOCKER_V1_CGROUP,
            DOCKER_V1_MOUNTS,
            [CgroupDir(1, Path("/sys/fs/cgroup/cpu,cpuacct"), Path("/sys/fs/cgroup/cpu,cpuacct"))],
        ),
        (V2_CGROUP, V2_MOUNTS, [CgroupDir(2, Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup"))]),
        (
            V2_HOST_CGROUP,
            V2_MOUNTS,
            [
                CgroupDir(
                    2,
                    Path("/sys/fs/cgroup/system.slice/silentswarm-fellow.service"),
                    Path("/sys/fs/cgroup"),
                )
            ],
        ),
        ("1:cpu:/elsewhere\n", DOCKER_V1_MOUNTS, []),  # outside what is mounted
        ("", HYBRID_MOUNTS, []),
        (HYBRID_CGROUP, "", []),
        ("junk\n::\n", "junk line\n1 2 3 - x\n", []),
    ],
)
def test_cgroup_dirs_finds_the_cpu_limits_directory(proc_cgroup, mounts, expected):
    assert cgroup_dirs(proc_cgroup, mounts) == expected


def test_mount_points_with_spaces_are_unescaped():
    line = r"32 31 0:29 / /mnt/cg\040cpu rw - cgroup cgroup rw,cpu"
    assert parse_mount(line) == ("cgroup", "/", "/mnt/cg cpu", {"rw", "cpu"})


def quota_on_path(start: CgroupDir) -> float | None:
    """The smallest quota from ``start`` up to its mount point."""
    found = binding_quota(start, read_small)
    return None if found is None else found[0]


def write(path: Path, **files: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("cpu_", "cpu.", 1)).write_text(text)


def test_a_parents_quota_binds_its_children(tmp_path):
    """v1: the process's own group has no limit, its parent one of 1.5 cores, the root none."""
    mount = tmp_path / "cpu"
    write(mount, cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    write(mount / "slice", cpu_cfs_quota_us="150000", cpu_cfs_period_us="100000")
    write(mount / "slice" / "job", cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    assert quota_on_path(CgroupDir(1, mount / "slice" / "job", mount)) == 1.5


def test_the_tightest_quota_on_the_path_wins_and_nothing_above_the_mount_counts(tmp_path):
    """v2: a child's limit below its parent's; a file above the mount point is not read."""
    write(tmp_path, cpu_max="10000 100000")  # above the mount: not this hierarchy
    mount = tmp_path / "cg"
    write(mount / "a", cpu_max="400000 100000")
    write(mount / "a" / "b", cpu_max="max 100000")
    write(mount / "a" / "b" / "c", cpu_max="250000 100000")
    assert quota_on_path(CgroupDir(2, mount / "a" / "b" / "c", mount)) == 2.5
    assert quota_on_path(CgroupDir(2, mount / "a" / "b", mount)) == 4.0
    assert quota_on_path(CgroupDir(2, mount, mount)) is None


def test_cgroup_quota_reads_a_whole_tree(tmp_path):
    """From /proc/self's two files to the cgroup files they point at."""
    proc, mount = tmp_path / "proc", tmp_path / "sys" / "cpu"
    proc.mkdir()
    (proc / "cgroup").write_text("3:cpu,cpuacct:/fellow\n0::/\n")
    (proc / "mountinfo").write_text(
        f"32 31 0:29 / {mount} rw - cgroup cgroup rw,cpu,cpuacct\n"
        f"41 31 0:38 / {tmp_path / 'unified'} rw - cgroup2 cgroup2 rw\n"
    )
    write(mount / "fellow", cpu_cfs_quota_us="75000", cpu_cfs_period_us="100000")
    assert cgroup_quota(proc) == 0.75
    assert cgroup_quota(tmp_path / "no-proc") is None


def test_the_fellows_table_shows_a_quota_beside_the_cores():
    assert cores_text(8, None) == "8"
    assert cores_text(1, 0.5) == "1 (quota 0.5)"
    assert cores_text(2, 1.5) == "2 (quota 1.5)"


@pytest.mark.parametrize(
    ("text", "version", "stat"),
    [
        ("nr_periods 10\nnr_throttled 4\nthrottled_time 1500000000\n", 1, (1.5, 4)),
        ("usage_usec 9\nnr_throttled 2\nthrottled_usec 250000\n", 2, (0.25, 2)),
        ("nr_throttled 2\nthrottled_usec 250000\n", 1, None),  # v1 has no such key
        ("nr_throttled 1\nthrottled_time x\n", 1, None),
        ("throttled_time 5\n", 1, None),  # no period count
        ("", 2, None),
    ],
)
def test_cpu_stat(text, version, stat):
    assert parse_cpu_stat(text, version) == stat


def fake_group(tmp_path: Path, *, quota_us: int, period_us: int = 100_000) -> tuple[Path, Path]:
    """A /proc/self and a v1 hierarchy: the process in slice/fellow, the quota on slice."""
    proc, mount = tmp_path / "proc", tmp_path / "cpu"
    proc.mkdir()
    (proc / "cgroup").write_text("3:cpu:/slice/fellow\n")
    (proc / "mountinfo").write_text(f"32 31 0:29 / {mount} rw - cgroup cgroup rw,cpu\n")
    write(mount / "slice", cpu_cfs_quota_us=str(quota_us), cpu_cfs_period_us=str(period_us))
    write(mount / "slice" / "fellow", cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    (mount / "slice" / "fellow" / "cpu.stat").write_text("nr_throttled 0\nthrottled_time 0\n")
    return proc, mount / "slice"


def stat(group: Path, seconds: float, periods: int) -> None:
    (group / "cpu.stat").write_text(
        f"nr_periods {periods}\nnr_throttled {periods}\nthrottled_time {int(seconds * 1e9)}\n"
    )


def test_the_throttle_clock_reads_the_tightest_quotas_group(tmp_path):
    proc, group = fake_group(tmp_path, quota_us=50_000)
    stat(group, 2.0, 40)
    clock = ThrottleClock(threads=1, proc=proc)
    assert clock.group is not None and clock.group.path == group
    start = clock.read()
    assert (start.throttled_s, start.periods, start.quota) == (2.0, 40, 0.5)
    stat(group, 2.3, 50)
    (group / "cpu.cfs_quota_us").write_text("25000")  # the operator tightens it
    later = clock.read()
    assert (later.throttled_s, later.periods) == pytest.approx((2.3, 50))
    assert later.quota == 0.25


@pytest.mark.parametrize(
    ("quota_us", "threads", "wall", "counted", "periods", "held"),
    [
        # One thread in half a core, busy all the time: held half the wall clock.
        (50_000, 1, 1.0, 0.5, 10, 0.5),
        # Two threads in 1.5 cores: the kernel counts each CPU's stall, 0.5 s for 0.25 s;
        # what 1.5 cores leave two busy threads bounds it.
        (150_000, 2, 1.0, 0.5, 10, 0.25),
        # Throttled in 2 periods of 100 ms: no more than 0.2 s, whatever was counted.
        (50_000, 1, 1.0, 0.9, 2, 0.2),
        # A quota as large as the threads cannot hold them back.
        (200_000, 2, 1.0, 0.3, 5, 0.0),
    ],
)
def test_held_seconds_are_bounded_by_what_the_quota_can_take(
    tmp_path, quota_us, threads, wall, counted, periods, held
):
    proc, group = fake_group(tmp_path, quota_us=quota_us)
    stat(group, 0.0, 0)
    clock = ThrottleClock(threads=threads, proc=proc)
    start = clock.read()
    stat(group, counted, periods)
    now = clock.read()
    now = ThrottleReading(start.at + wall, now.throttled_s, now.periods)
    assert clock.held(start, now) == pytest.approx(held)


def test_without_a_quota_nothing_is_held(tmp_path):
    clock = ThrottleClock(threads=4, proc=tmp_path / "none")
    assert clock.group is None
    start = clock.read()
    assert clock.held(start) == 0.0


def test_a_cgroup_outside_the_namespace_is_not_followed():
    """The kernel writes a cgroup outside the reader's namespace as /..; nothing is read."""
    assert cgroup_dirs("0::/../../x\n", V2_MOUNTS) == []
    assert cgroup_dirs("1:cpu:/../y\n", HYBRID_MOUNTS) == []
