"""The memory budget: what a cgroup's memory limit leaves a fellow (silentswarm.ram), and what
a stage's death by a signal is called (silentswarm.agent.exitreason)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from silentswarm.agent.exitreason import signal_reason
from silentswarm.cgroups import CgroupDir, cgroup_dirs, read_small
from silentswarm.cli.commands.fellows import ram_text
from silentswarm.errors import ErrorCode
from silentswarm.ram import (
    GroupMemory,
    OomKills,
    budget,
    group_memory,
    memory_budget,
    memory_limit,
    oom_kills,
    parse_bytes,
    path_memory,
    stat_field,
)

GIB = 1 << 30
MIB = 1 << 20
V1_NONE = "9223372036854771712"  # what v1 writes for no limit with 4 KiB pages


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1073741824\n", GIB),
        ("max\n", None),  # v2: none
        (V1_NONE, None),
        ("9223372036854775807", None),  # other page sizes: still near 2**63
        ("0", 0),
        ("-1", None),
        ("", None),
        (None, None),
        ("lots", None),
    ],
)
def test_a_limit_file_reads_as_bytes_or_none(text, value):
    assert parse_bytes(text) == value


def test_stat_fields_are_read_by_name():
    text = "cache 10\ninactive_file 4096\ntotal_inactive_file 8192\noom_kill 3\nbad x\n"
    assert stat_field(text, "inactive_file") == 4096
    assert stat_field(text, "total_inactive_file") == 8192
    assert stat_field(text, "oom_kill") == 3
    assert stat_field(text, "missing") is None
    assert stat_field(text, "bad") is None
    assert stat_field(None, "oom_kill") is None


def write(path: Path, **files: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("_", ".", 1)).write_text(text)


def test_a_v2_group_counts_its_working_set_without_the_cache_it_can_drop(tmp_path):
    write(
        tmp_path,
        memory_max=str(4 * GIB),
        memory_high="max",
        memory_current=str(3 * GIB),
        memory_stat=f"anon 1\ninactive_file {GIB}\n",
    )
    found = group_memory(CgroupDir(2, tmp_path, tmp_path), read_small)
    assert found == GroupMemory(limit=4 * GIB, working_set=2 * GIB)
    assert found.room == 2 * GIB


def test_a_v2_groups_high_mark_is_its_limit_when_lower(tmp_path):
    write(tmp_path, memory_max="max", memory_high=str(GIB), memory_current="0")
    assert group_memory(CgroupDir(2, tmp_path, tmp_path), read_small).limit == GIB


def test_a_v1_group_reads_its_hierarchical_cache(tmp_path):
    write(
        tmp_path,
        memory_limit_in_bytes=str(2 * GIB),
        memory_usage_in_bytes=str(GIB),
        memory_stat=f"inactive_file 1\ntotal_inactive_file {GIB // 4}\n",
    )
    found = group_memory(CgroupDir(1, tmp_path, tmp_path), read_small)
    assert found == GroupMemory(limit=2 * GIB, working_set=3 * GIB // 4)


def test_a_group_without_a_limit_or_its_files_sets_none(tmp_path):
    write(tmp_path / "none", memory_limit_in_bytes=V1_NONE, memory_usage_in_bytes="5")
    assert group_memory(CgroupDir(1, tmp_path / "none", tmp_path), read_small) is None
    assert group_memory(CgroupDir(2, tmp_path / "missing", tmp_path), read_small) is None


def test_more_cache_than_usage_is_no_negative_working_set(tmp_path):
    write(tmp_path, memory_max=str(GIB), memory_current="10", memory_stat="inactive_file 99\n")
    assert group_memory(CgroupDir(2, tmp_path, tmp_path), read_small).working_set == 0


def test_every_limit_on_the_path_up_to_the_mount_counts_and_none_above(tmp_path):
    mount = tmp_path / "mnt"
    write(tmp_path, memory_max="1")  # above the mount: not this hierarchy's
    write(mount, memory_max=str(64 * GIB), memory_current=str(GIB))
    write(mount / "slice", memory_max=str(8 * GIB), memory_current=str(7 * GIB))
    write(mount / "slice" / "fellow", memory_max=str(4 * GIB), memory_current=str(GIB))
    found = path_memory(CgroupDir(2, mount / "slice" / "fellow", mount), read_small)
    assert found == [
        GroupMemory(limit=4 * GIB, working_set=GIB),
        GroupMemory(limit=8 * GIB, working_set=7 * GIB),
        GroupMemory(limit=64 * GIB, working_set=GIB),
    ]
    # The fellow's own limit is the smallest; its parent's room (1 GiB) the least.
    got = budget(32 * GIB, 20 * GIB, found)
    assert (got.total, got.available, got.limit) == (4 * GIB, GIB, 4 * GIB)


@pytest.mark.parametrize(
    ("host_total", "host_available", "groups", "expected"),
    [
        # nothing limits it: the host's figures
        (16 * GIB, 10 * GIB, [], (16 * GIB, 10 * GIB, None)),
        # a container's 4 GiB with 1 GiB in use
        (16 * GIB, 10 * GIB, [GroupMemory(4 * GIB, GIB)], (4 * GIB, 3 * GIB, 4 * GIB)),
        # the host has less left than the limit's room: the host's
        (16 * GIB, GIB, [GroupMemory(4 * GIB, GIB)], (4 * GIB, GIB, 4 * GIB)),
        # a limit above the host's memory limits nothing
        (16 * GIB, 10 * GIB, [GroupMemory(64 * GIB, GIB)], (16 * GIB, 10 * GIB, None)),
        # a group over its limit has no room, never less
        (16 * GIB, 10 * GIB, [GroupMemory(GIB, 2 * GIB)], (GIB, 0, GIB)),
        # psutil's odd answers stay bytes
        (-1, -1, [], (0, 0, None)),
    ],
)
def test_the_budget_takes_the_tighter_of_host_and_cgroup(
    host_total, host_available, groups, expected
):
    got = budget(host_total, host_available, groups)
    assert (got.total, got.available, got.limit) == expected
    assert (got.host_total, got.host_available) == (max(0, host_total), max(0, host_available))


HYBRID_CGROUP = "9:name=systemd:/\n4:memory:/fellow\n1:cpu:/bench\n0::/\n"


def fake_proc(tmp_path: Path, proc_cgroup: str = HYBRID_CGROUP) -> tuple[Path, Path]:
    proc, mount = tmp_path / "proc", tmp_path / "sys" / "memory"
    proc.mkdir()
    (proc / "cgroup").write_text(proc_cgroup)
    (proc / "mountinfo").write_text(
        f"32 31 0:29 / {tmp_path / 'sys' / 'cpu'} rw - cgroup cgroup rw,cpu\n"
        f"35 31 0:32 / {mount} rw - cgroup cgroup rw,memory\n"
        f"41 31 0:38 / {tmp_path / 'unified'} rw - cgroup2 cgroup2 rw\n"
    )
    return proc, mount


def test_the_memory_directories_are_the_memory_controllers():
    mounts = (
        "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    )
    assert cgroup_dirs(HYBRID_CGROUP, mounts, "memory") == [
        CgroupDir(1, Path("/sys/fs/cgroup/memory/fellow"), Path("/sys/fs/cgroup/memory"))
    ]


def test_the_budget_reads_a_whole_tree(tmp_path):
    """From /proc/self's two files to the memory files they point at."""
    proc, mount = fake_proc(tmp_path)
    write(
        mount / "fellow",
        memory_limit_in_bytes=str(3 * GIB),
        memory_usage_in_bytes=str(GIB),
        memory_stat="total_inactive_file 0\n",
    )
    write(mount, memory_limit_in_bytes=V1_NONE, memory_usage_in_bytes=str(9 * GIB))
    got = memory_budget(24 * GIB, 20 * GIB, proc)
    assert (got.total, got.available, got.limit) == (3 * GIB, 2 * GIB, 3 * GIB)
    assert memory_limit(proc) == 3 * GIB
    # An operator changes the limit while it runs (`docker update --memory`): read anew.
    (mount / "fellow" / "memory.limit_in_bytes").write_text(str(2 * GIB))
    assert memory_budget(24 * GIB, 20 * GIB, proc).available == GIB
    nothing = memory_budget(24 * GIB, 20 * GIB, tmp_path / "no-proc")
    assert (nothing.total, nothing.available, nothing.limit) == (24 * GIB, 20 * GIB, None)


def test_out_of_memory_kills_are_read_from_the_own_group_and_the_host(tmp_path):
    proc, mount = fake_proc(tmp_path)
    write(mount / "fellow", memory_oom_control="oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 5\noom_kill 7\n")
    assert oom_kills(proc, vmstat) == OomKills(group=2, host=7)
    assert oom_kills(tmp_path / "no-proc", tmp_path / "no-vmstat") == OomKills(None, None)


NONE = OomKills(group=None, host=None)


@pytest.mark.parametrize(
    ("code", "before", "after", "limit", "words", "error"),
    [
        (0, NONE, NONE, None, None, None),
        (1, OomKills(0, 0), OomKills(1, 1), GIB, None, None),  # an exit, whatever the counts
        (
            -signal.SIGKILL,
            OomKills(0, 5),
            OomKills(1, 6),
            3 * GIB // 2,
            "the fellow's memory cgroup reached its limit of 1.5 GiB",
            ErrorCode.STAGE_OUT_OF_MEMORY,
        ),
        (
            -signal.SIGKILL,
            OomKills(0, 5),
            OomKills(1, 6),
            None,
            "the fellow's memory cgroup reached its limit (",
            ErrorCode.STAGE_OUT_OF_MEMORY,
        ),
        (
            -signal.SIGKILL,
            OomKills(None, 5),
            OomKills(None, 6),
            None,
            "the host ran out of memory",
            ErrorCode.STAGE_OUT_OF_MEMORY,
        ),
        (
            -signal.SIGKILL,
            OomKills(0, 5),
            OomKills(0, 5),
            GIB,
            "killed by SIGKILL from outside the agent",
            ErrorCode.STAGE_FAILED,
        ),
        (
            -signal.SIGKILL,
            NONE,
            NONE,
            None,
            "killed by SIGKILL from outside the agent",
            ErrorCode.STAGE_FAILED,
        ),
        (
            -signal.SIGSEGV,
            OomKills(0, 0),
            OomKills(1, 1),
            GIB,
            "killed by SIGSEGV",
            ErrorCode.STAGE_FAILED,
        ),
        (-200, NONE, NONE, None, "killed by signal 200", ErrorCode.STAGE_FAILED),
    ],
)
def test_a_signals_death_is_named_by_what_the_kernel_counted(
    code, before, after, limit, words, error
):
    got = signal_reason(code, before, after, limit)
    if words is None:
        assert got is None
    else:
        assert words in got[0] and got[1] is error


def test_the_fellows_table_shows_a_limit_beside_the_free_ram():
    assert ram_text(2 * GIB, None) == "2.0G"
    assert ram_text(3 * GIB, 4 * GIB) == "3.0G (limit 4.0G)"
