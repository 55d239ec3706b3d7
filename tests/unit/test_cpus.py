"""The CPU budget: what a quota and an affinity mask leave a fellow (silentswarm.cpus)."""

from __future__ import annotations

from pathlib import Path

import pytest

from silentswarm.cli.commands.fellows import cores_text
from silentswarm.cpus import (
    CgroupDir,
    ThrottleClock,
    budget,
    cgroup_dirs,
    cgroup_quota,
    parse_cpu_max,
    parse_mount,
    parse_throttled,
    quota_cores,
    quota_on_path,
    read_small,
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
    assert quota_on_path(CgroupDir(1, mount / "slice" / "job", mount), read_small) == 1.5


def test_the_tightest_quota_on_the_path_wins_and_nothing_above_the_mount_counts(tmp_path):
    """v2: a child's limit below its parent's; a file above the mount point is not read."""
    write(tmp_path, cpu_max="10000 100000")  # above the mount: not this hierarchy
    mount = tmp_path / "cg"
    write(mount / "a", cpu_max="400000 100000")
    write(mount / "a" / "b", cpu_max="max 100000")
    write(mount / "a" / "b" / "c", cpu_max="250000 100000")
    assert quota_on_path(CgroupDir(2, mount / "a" / "b" / "c", mount), read_small) == 2.5
    assert quota_on_path(CgroupDir(2, mount / "a" / "b", mount), read_small) == 4.0
    assert quota_on_path(CgroupDir(2, mount, mount), read_small) is None


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
    ("text", "version", "seconds"),
    [
        ("nr_periods 10\nnr_throttled 4\nthrottled_time 1500000000\n", 1, 1.5),
        ("usage_usec 9\nnr_throttled 2\nthrottled_usec 250000\n", 2, 0.25),
        ("throttled_usec 250000\n", 1, None),  # v1 has no such key
        ("throttled_time x\n", 1, None),
        ("", 2, None),
    ],
)
def test_throttled_seconds_from_cpu_stat(text, version, seconds):
    assert parse_throttled(text, version) == seconds


def test_the_throttle_clock_reads_the_tightest_quotas_group(tmp_path):
    proc, mount = tmp_path / "proc", tmp_path / "cpu"
    proc.mkdir()
    (proc / "cgroup").write_text("3:cpu:/slice/fellow\n")
    (proc / "mountinfo").write_text(f"32 31 0:29 / {mount} rw - cgroup cgroup rw,cpu\n")
    write(mount / "slice", cpu_cfs_quota_us="50000", cpu_cfs_period_us="100000")
    write(mount / "slice" / "fellow", cpu_cfs_quota_us="200000", cpu_cfs_period_us="100000")
    (mount / "slice" / "cpu.stat").write_text("throttled_time 2000000000\n")
    (mount / "slice" / "fellow" / "cpu.stat").write_text("throttled_time 7\n")
    clock = ThrottleClock(proc)
    assert clock.group is not None and clock.group.path == mount / "slice"
    assert clock.seconds() == 2.0
    (mount / "slice" / "cpu.stat").write_text("throttled_time 3500000000\n")
    assert clock.seconds() == 3.5
    assert ThrottleClock(tmp_path / "none").seconds() == 0.0
