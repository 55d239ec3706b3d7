"""Where this process's cgroup limits live: its cgroup directory in each mounted hierarchy.

A fellow in a container (Docker, Kubernetes, a Nomad driver, a systemd unit) is held to the
limits its cgroups set, which ``os.cpu_count()`` and psutil do not see. The CPU budget
(:mod:`silentswarm.cpus`) and the memory budget (:mod:`silentswarm.ram`) read them from the
directories found here: for each hierarchy ``/proc/self/mountinfo`` shows mounted with the
controller asked for (v1) or the unified one (v2), the process's cgroup directory from
``/proc/self/cgroup``, and the mount point, up to which a parent's limit binds its children.
The parsing is pure; :func:`own_cgroup_dirs` reads the two files.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

PROC_SELF = Path("/proc/self")


@dataclass(frozen=True)
class CgroupDir:
    """A directory of this process's cgroup (or an ancestor's) in one hierarchy."""

    version: int  # 1 or 2
    path: Path
    mount: Path  # where its hierarchy is mounted: limits are read from path up to here

    def up_to_mount(self) -> list[CgroupDir]:
        """This directory and each parent up to the hierarchy's mount point, nearest first."""
        out, here = [], self.path
        for _ in range(len(self.path.relative_to(self.mount).parts) + 1):
            out.append(CgroupDir(self.version, here, self.mount))
            here = here.parent
        return out


def cgroup_dirs(proc_cgroup: str, mountinfo: str, controller: str = "cpu") -> list[CgroupDir]:
    """The directories that hold this process's limits of ``controller``: for each hierarchy
    with that controller (v1) or the unified one (v2) that ``mountinfo`` shows mounted, the
    process's cgroup directory (``proc_cgroup`` is ``/proc/self/cgroup``)."""
    v1_paths: dict[str, str] = {}
    v2_path: str | None = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = path
        else:
            for name in controllers.split(","):
                v1_paths[name] = path
    dirs: list[CgroupDir] = []
    for line in mountinfo.splitlines():
        mount = parse_mount(line)
        if mount is None:
            continue
        fstype, root, point, options = mount
        if fstype == "cgroup2" and v2_path is not None:
            inside = relative_to_root(v2_path, root)
            if inside is not None:
                dirs.append(CgroupDir(2, Path(point, inside), Path(point)))
        elif fstype == "cgroup" and controller in options and controller in v1_paths:
            inside = relative_to_root(v1_paths[controller], root)
            if inside is not None:
                dirs.append(CgroupDir(1, Path(point, inside), Path(point)))
    return dirs


def parse_mount(line: str) -> tuple[str, str, str, set[str]] | None:
    """(fstype, root, mount point, super options) of a ``/proc/self/mountinfo`` line."""
    fields = line.split()
    if "-" not in fields:
        return None
    sep = fields.index("-")
    if sep < 5 or len(fields) < sep + 4:
        return None
    root, point = unescape(fields[3]), unescape(fields[4])
    return fields[sep + 1], root, point, set(fields[sep + 3].split(","))


def unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def relative_to_root(path: str, root: str) -> str | None:
    """A cgroup path as seen from a mount of the hierarchy at ``root``: "" for the mount
    itself; None when the cgroup lies outside what is mounted (or outside the process's
    cgroup namespace, which the kernel writes as ``/..``: what lies there is not known)."""
    p, r = PurePosixPath(path), PurePosixPath(root)
    if ".." in p.parts or ".." in r.parts:
        return None
    try:
        inside = p.relative_to(r)
    except ValueError:
        return None
    return "" if str(inside) == "." else str(inside)


def read_small(path: Path, limit: int = 4096) -> str | None:
    """A kernel file's text, at most ``limit`` characters (mountinfo on a host with many
    mounts runs long: it is read with a larger limit); None where it cannot be read."""
    try:
        with path.open() as f:
            return f.read(limit)
    except OSError:
        return None


@functools.cache
def own_cgroup_dirs(proc: Path = PROC_SELF, controller: str = "cpu") -> tuple[CgroupDir, ...]:
    """The process's cgroup directories for ``controller``, found once: mountinfo runs to
    hundreds of KiB on a host with many mounts, and the agent asks at every heartbeat."""
    proc_cgroup = read_small(proc / "cgroup", 1 << 16)
    mountinfo = read_small(proc / "mountinfo", 1 << 20)
    if proc_cgroup is None or mountinfo is None:
        return ()
    return tuple(cgroup_dirs(proc_cgroup, mountinfo, controller))
