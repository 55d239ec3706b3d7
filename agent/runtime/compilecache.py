"""A fellow's XLA compile cache: what one stage compiled, loaded by the next that runs the
same program instead of compiled again.

A stage's first step compiles each of its fused XLA functions; at the quickstart's size that
is about as long as TensorFlow's import, and every attempt, resume, replacement and replica
that joins pays it again. TensorFlow can keep the executables on disk
(``--tf_xla_persistent_cache_directory``), but on terms a directory shared by many stages
cannot take as they are: it writes an entry in place (a stage that reads it half-written, or
reads one a full disk or a crash cut short, fails its compile: ``OutOfRangeError``), and it
keys an entry by the program alone (an executable built for one CPU's instruction set would
be loaded on another that shares the directory). So:

- ``<cache>/<host>/`` holds the published entries; ``<host>`` is a digest of TensorFlow's
  version, the CPU (model, instruction-set flags) and the XLA flags in force;
- :meth:`CompileCache.open` hard-links every whole published entry into a directory of the
  stage's own (``<cache>/<host>/.work/<pid>-<start time>/``), where TensorFlow reads and
  writes (CPU executables only: a GPU's depend on which GPU, which the key does not say);
- :meth:`CompileCache.publish` (after the stage's first step, and when it ends) hands on what
  TensorFlow wrote there that is new and whole (:func:`is_whole`): fsync, then a hard link
  under its name, which is atomic and never replaces an entry. A stage killed before that
  leaves its directory behind; the next one to open takes its whole entries and removes it;
- the published entries are kept under ``SWARM_COMPILE_CACHE_MAX_BYTES`` (default 2 GiB),
  the oldest written removed first; a running stage's links keep what it loaded readable.

``SWARM_COMPILE_CACHE`` names the directory (default ``$XDG_CACHE_HOME/silentswarm/xla``, else
``~/.cache/silentswarm/xla``; ``off`` turns the cache off). Nothing here imports TensorFlow:
the fellow's agent uses :func:`is_probe_noise` on its stages' stderr.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import psutil

from silentswarm.agent.runtime.cachedirs import byte_limit, user_cache_dir

log = logging.getLogger(__name__)

CACHE_ENV = "SWARM_COMPILE_CACHE"
MAX_BYTES_ENV = "SWARM_COMPILE_CACHE_MAX_BYTES"
ENV_NAMES = frozenset({CACHE_ENV, MAX_BYTES_ENV})  # what a stage's launcher passes on
DEFAULT_MAX_BYTES = 2 * 2**30
# Below this much free space the cache is not used: TensorFlow fails a compile whose entry it
# cannot write, and a stage on a nearly full disk should train, not stop for a cache.
MIN_FREE_BYTES = 512 * 2**20
OFF_VALUES = frozenset({"off", "0", "false", "no", "none"})
ENTRY_SUFFIX = ".pb"
WORK_DIR = ".work"
# What TensorFlow logs each time it loads an entry: it tries the file as a text proto before
# it reads it as the binary one it is (tensorflow ReadTextOrBinaryProto). Noise, not an error.
PROBE_NOISE = "Error parsing text-format tensorflow.XlaSerializedCacheEntry"
# What XLA logs, at ERROR and with a warning of SIGILL, for every loaded executable on a CPU
# where it compiles with LLVM's tuning flags (``+prefer-no-gather``, ``+prefer-no-scatter``):
# it counts them among the compile machine's features, which the host's never name. They
# select instructions, they are none, so the line says nothing of a real mismatch; one that
# names an instruction set (``+avx512f``) is not noise. (This cache keys its entries by the
# CPU's model and flags, so an entry compiled elsewhere is never loaded.)
TUNING_FLAG_NOISE = "Target machine feature +prefer-"
_AOT_LOADER = "cpu_aot_loader"
_DEVICE_TYPES = "CPU"  # the device, not the XLA one its entries name (XLA_CPU_JIT)
_CACHE_FLAGS = ("--tf_xla_persistent_cache_directory", "--tf_xla_persistent_cache_device_types")
# XlaSerializedCacheEntry: key = 1, hlo_module = 2, executable = 3, all length-delimited.
_KEY_FIELD, _EXECUTABLE_FIELD = 1, 3
_LENGTH_DELIMITED = 2


def is_probe_noise(line: str) -> bool:
    """Whether a line of a stage's stderr is one TensorFlow writes, harmless, as it loads a
    cache entry: its text-proto probe (:data:`PROBE_NOISE`), or XLA's complaint of a
    tuning flag taken for a missing CPU feature (:data:`TUNING_FLAG_NOISE`)."""
    return PROBE_NOISE in line or (_AOT_LOADER in line and TUNING_FLAG_NOISE in line)


def _varint(handle: BinaryIO) -> int | None:
    value = shift = 0
    for _ in range(10):
        byte = handle.read(1)
        if not byte:
            return None
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
        shift += 7
    return None


def is_whole(path: Path) -> bool:
    """Whether the entry at ``path`` is complete: its top-level fields (the key, the HLO
    module, the executable) are length-delimited, end exactly where the file does, and carry a
    key and a non-empty executable. A file cut short anywhere fails; a few bytes a field are
    read, not the file."""
    fields: set[int] = set()
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            while handle.tell() < size:
                tag = _varint(handle)
                if tag is None or tag & 7 != _LENGTH_DELIMITED:
                    return False
                length = _varint(handle)
                end = handle.tell() + (length or 0)
                if length is None or end > size:
                    return False
                if length:
                    fields.add(tag >> 3)
                handle.seek(end)
    except OSError:
        return False
    return {_KEY_FIELD, _EXECUTABLE_FIELD} <= fields


def host_key(environ: Mapping[str, str] | None = None) -> str:
    """A digest of what an executable is built for beyond its program: TensorFlow's version,
    the machine and CPU (model name and instruction-set flags) and the XLA flags (other
    than the cache's own)."""
    env = os.environ if environ is None else environ
    parts = [_tensorflow_version(), platform.machine(), *_cpu_identity()]
    for name in ("XLA_FLAGS", "TF_XLA_FLAGS"):
        parts.append(f"{name}={' '.join(_other_flags(env.get(name, '')))}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _other_flags(flags: str) -> list[str]:
    """The flags of an XLA flags variable but the cache's own."""
    return [f for f in flags.split() if not f.startswith(_CACHE_FLAGS)]


def _tensorflow_version() -> str:
    for dist in ("tensorflow", "tensorflow-cpu", "tf-nightly"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist}={importlib.metadata.version(dist)}"
    return "tensorflow=unknown"


def _cpu_identity() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return [platform.processor()]
    wanted = ("model name", "flags", "Features", "CPU part")
    found: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in wanted and name not in found:
            found[name] = " ".join(sorted(value.split()))
    return [f"{k}={found[k]}" for k in wanted if k in found]


def default_root(environ: Mapping[str, str] | None = None) -> Path | None:
    """``$SWARM_COMPILE_CACHE`` (None when it says ``off``), else
    ``$XDG_CACHE_HOME/silentswarm/xla``, else ``~/.cache/silentswarm/xla``."""
    env = os.environ if environ is None else environ
    explicit = env.get(CACHE_ENV, "").strip()
    if explicit.lower() in OFF_VALUES:
        return None
    if explicit:
        return Path(explicit).expanduser()
    return user_cache_dir("xla", env)


def max_bytes(environ: Mapping[str, str] | None = None) -> int:
    """``SWARM_COMPILE_CACHE_MAX_BYTES``, else :data:`DEFAULT_MAX_BYTES` (also for a value
    that is no positive integer, with a warning)."""
    limit = byte_limit(MAX_BYTES_ENV, f"the limit is {DEFAULT_MAX_BYTES}", environ)
    return DEFAULT_MAX_BYTES if limit is None else limit


def _work_name(pid: int) -> str | None:
    """``<pid>-<start time in centiseconds>`` of a live process, None when there is none."""
    try:
        return f"{pid}-{round(psutil.Process(pid).create_time() * 100)}"
    except (psutil.Error, OSError):
        return None


def _others_may_write(directory: Path) -> str | None:
    """Why another user could put an entry in ``directory`` (or under it, or swap it for
    one of theirs), None if no one can: it, the cache's root above it and the directory of
    the stages' own must be this user's, writable by it alone."""
    for path in (directory.parent, directory, directory / WORK_DIR):
        stat = path.stat()
        if stat.st_uid != os.getuid():
            return f"{path} belongs to uid {stat.st_uid}"
        if stat.st_mode & 0o022:
            return f"{path} is writable by others (mode {stat.st_mode & 0o777:o})"
    return None


def _entries(directory: Path) -> list[Path]:
    return [p for p in directory.glob(f"*{ENTRY_SUFFIX}") if p.is_file()]


def _link(source: Path, target: Path) -> bool:
    """Hard-link ``source`` as ``target``; False where either is gone or ``target`` exists."""
    try:
        os.link(source, target)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class CompileCache:
    """One stage's view of the cache: ``shared`` holds the published entries, ``work`` is
    where its TensorFlow reads and writes."""

    shared: Path
    work: Path
    max_bytes: int

    @classmethod
    def open(cls, root: Path, limit: int, *, host: str | None = None) -> CompileCache | None:
        """Make this process's directory with every whole entry linked in; None (and a
        warning) where the cache cannot be used: no room, or a directory it cannot write."""
        shared = root / (host or host_key())
        name = _work_name(os.getpid())
        if name is None:
            return None
        work = shared / WORK_DIR / name
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            for directory in (shared, shared / WORK_DIR):
                directory.mkdir(exist_ok=True, mode=0o700)
            work.mkdir(mode=0o700)
            free = shutil.disk_usage(work).free
            # What it holds is machine code this process would run.
            why = _others_may_write(shared)
        except OSError as exc:
            log.warning("compile cache %s not used: %s", root, exc.strerror or exc)
            return None
        if why is None and free < MIN_FREE_BYTES:
            why = f"{free >> 20} MiB free, below {MIN_FREE_BYTES >> 20}"
        if why is not None:
            log.warning("compile cache %s not used: %s", root, why)
            shutil.rmtree(work, ignore_errors=True)
            return None
        cache = cls(shared=shared, work=work, max_bytes=limit)
        cache._salvage()
        for entry in _entries(shared):
            if is_whole(entry):
                _link(entry, work / entry.name)
            else:  # cut short before this scheme, or by hand: never handed to TensorFlow
                with contextlib.suppress(OSError):
                    entry.unlink()
        return cache

    def tf_flags(self) -> str:
        """What goes into ``TF_XLA_FLAGS`` for TensorFlow to read and write ``work``."""
        return f"{_CACHE_FLAGS[0]}={self.work} {_CACHE_FLAGS[1]}={_DEVICE_TYPES}"

    def publish(self) -> int:
        """Hand on the entries written in ``work`` since it was opened that are whole; then
        keep the cache under its limit. The number handed on; a cache that cannot be
        written any more is logged, never the stage's failure."""
        try:
            published = self._publish_from(self.work)
            self._prune()
        except OSError as exc:
            log.warning("compile cache %s: nothing published: %s", self.shared, exc)
            return 0
        return published

    def close(self, *, publish: bool = True) -> None:
        """Publish (unless told not to) and remove ``work``."""
        if publish:
            self.publish()
        shutil.rmtree(self.work, ignore_errors=True)

    def _publish_from(self, directory: Path) -> int:
        published = 0
        for entry in _entries(directory):
            try:
                if entry.stat().st_nlink > 1 or not is_whole(entry):
                    continue  # linked from the cache already, or still being written
                with open(entry, "rb") as handle:
                    os.fsync(handle.fileno())
            except OSError:
                continue
            published += _link(entry, self.shared / entry.name)
        return published

    def _salvage(self) -> None:
        """Publish the whole entries of directories whose stage is gone, and remove them."""
        for directory in (self.shared / WORK_DIR).glob("*"):
            pid, _, _ = directory.name.partition("-")
            alive = pid.isdigit() and _work_name(int(pid)) == directory.name
            if directory == self.work or alive:
                continue
            self._publish_from(directory)
            shutil.rmtree(directory, ignore_errors=True)

    def _prune(self) -> None:
        """Remove the oldest written entries, of every host's directory, until the rest fit
        under ``max_bytes``."""
        found = []
        for entry in self.shared.parent.glob(f"*/*{ENTRY_SUFFIX}"):
            with contextlib.suppress(OSError):
                stat = entry.stat()
                found.append((stat.st_mtime_ns, stat.st_size, entry))
        total = sum(size for _, size, _ in found)
        for _, size, entry in sorted(found):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                entry.unlink()
                total -= size


def open_from_env(environ: Mapping[str, str] | None = None) -> CompileCache | None:
    """The stage's cache where ``SWARM_COMPILE_CACHE`` allows one, else None."""
    root = default_root(environ)
    if root is None:
        return None
    try:
        return CompileCache.open(root, max_bytes(environ))
    except OSError as exc:  # a directory that vanished or cannot be read: compile, as before
        log.warning("compile cache %s not used: %s", root, exc)
        return None


def enable(cache: CompileCache, environ: MutableMapping[str, str] | None = None) -> None:
    """Point TensorFlow at ``cache`` (``TF_XLA_FLAGS``); before TensorFlow's first compile."""
    env = os.environ if environ is None else environ
    env["TF_XLA_FLAGS"] = " ".join([*_other_flags(env.get("TF_XLA_FLAGS", "")), cache.tf_flags()])
