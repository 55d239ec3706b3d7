"""The compile cache's files: whole entries only, published atomically, salvaged from a killed
stage, kept under a limit, refused where another user could write (no TensorFlow here; the
stages that load what it keeps: tests/integration/test_compile_cache.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from silentswarm.agent.runtime import compilecache
from silentswarm.agent.runtime.compilecache import CompileCache, is_whole

HOST = "h"


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


KEY = field(1, b"\x08\x01\x10\x02\x1a\x0bXLA_CPU_JIT")
ENTRY = KEY + field(2, b"h" * 300) + field(3, b"x" * 700)


def entry(directory: Path, name: str, data: bytes = ENTRY, mtime_s: float | None = None) -> Path:
    path = directory / f"xla_compile_cache__{name}__XLA_CPU_JIT.pb"
    path.write_bytes(data)
    if mtime_s is not None:
        os.utime(path, (mtime_s, mtime_s))
    return path


@pytest.mark.parametrize(
    ("data", "whole"),
    [
        (ENTRY, True),
        (b"", False),
        (ENTRY[:-1], False),  # the executable cut short
        (ENTRY[: len(KEY) + 5], False),  # cut inside the HLO module
        (KEY + field(2, b"h" * 300), False),  # cut exactly between fields: no executable
        (KEY + field(2, b"h") + field(3, b""), False),  # an empty executable
        (field(2, b"h") + field(3, b"x"), False),  # no key
        (ENTRY + b"\x08\x01", False),  # a varint field: not what an entry holds
        (ENTRY + b"\x1a", False),  # a tag with no length
        (b"\xff" * 11, False),  # a varint that never ends
        (b"2:1 text { }", False),
    ],
    ids=[
        "whole",
        "empty",
        "cut-in-executable",
        "cut-in-hlo",
        "cut-between-fields",
        "empty-executable",
        "no-key",
        "varint-field",
        "dangling-tag",
        "endless-varint",
        "text",
    ],
)
def test_only_a_whole_entry_is_whole(tmp_path, data, whole):
    assert is_whole(entry(tmp_path, "e", data)) is whole


def test_a_missing_entry_is_not_whole(tmp_path):
    assert not is_whole(tmp_path / "gone.pb")


def test_open_links_whole_entries_drops_broken_ones_and_close_publishes_new_whole_ones(tmp_path):
    root = tmp_path / "cache"
    shared = root / HOST
    shared.mkdir(parents=True, mode=0o700)
    kept = entry(shared, "kept")
    broken = entry(shared, "broken", ENTRY[:-3])
    cache = CompileCache.open(root, 2**30, host=HOST)
    assert cache is not None and cache.work.parent == shared / ".work"
    assert sorted(p.name for p in cache.work.iterdir()) == [kept.name]
    assert os.path.samefile(cache.work / kept.name, kept), "a link, not a copy"
    assert not broken.exists(), "an entry cut short is never handed to TensorFlow"
    assert f"--tf_xla_persistent_cache_directory={cache.work}" in cache.tf_flags()

    new = entry(cache.work, "new")
    partial = entry(cache.work, "partial", ENTRY[:-10])  # TensorFlow still writing it
    assert cache.publish() == 1
    assert os.path.samefile(shared / new.name, new)
    assert not (shared / partial.name).exists()
    assert cache.publish() == 0, "what is published is not published again"
    partial.write_bytes(ENTRY)
    cache.close()
    assert sorted(p.name for p in shared.glob("*.pb")) == sorted(
        [kept.name, new.name, partial.name]
    )
    assert not cache.work.exists()


def test_publishing_never_replaces_an_entry(tmp_path):
    root = tmp_path / "cache"
    cache = CompileCache.open(root, 2**30, host=HOST)
    assert cache is not None
    theirs = entry(cache.shared, "same", KEY + field(2, b"a") + field(3, b"theirs"))
    entry(cache.work, "same", KEY + field(2, b"a") + field(3, b"mine"))
    assert cache.publish() == 0
    assert theirs.read_bytes().endswith(b"theirs")
    cache.close()


def test_a_killed_stages_whole_entries_are_salvaged_and_its_directory_removed(tmp_path):
    root = tmp_path / "cache"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    pid = int(dead.stdout)
    stale = root / HOST / ".work" / f"{pid}-1"
    stale.mkdir(parents=True, mode=0o700)
    (root / HOST).chmod(0o700)
    (root / HOST / ".work").chmod(0o700)
    whole = entry(stale, "whole")
    entry(stale, "cut", ENTRY[:-1])
    cache = CompileCache.open(root, 2**30, host=HOST)
    assert cache is not None
    assert not stale.exists()
    assert sorted(p.name for p in cache.shared.glob("*.pb")) == [whole.name]
    assert (cache.work / whole.name).exists(), "and this stage gets it at once"
    cache.close()


def test_a_live_stages_directory_is_left_alone(tmp_path):
    root = tmp_path / "cache"
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    ) as other:
        try:
            name = compilecache._work_name(other.pid)
            assert name is not None
            theirs = root / HOST / ".work" / name
            theirs.mkdir(parents=True, mode=0o700)
            (root / HOST).chmod(0o700)
            (root / HOST / ".work").chmod(0o700)
            writing = entry(theirs, "writing")
            cache = CompileCache.open(root, 2**30, host=HOST)
            assert cache is not None
            assert writing.exists() and not list(cache.shared.glob("*.pb"))
            cache.close()
            assert writing.exists()
        finally:
            other.communicate(b"")


def test_the_oldest_entries_of_every_host_go_first_beyond_the_limit(tmp_path):
    root = tmp_path / "cache"
    size = len(ENTRY)
    other = root / "old-tensorflow"
    other.mkdir(parents=True, mode=0o700)
    oldest = entry(other, "oldest", mtime_s=1_000)
    cache = CompileCache.open(root, 2 * size, host=HOST)
    assert cache is not None
    old = entry(cache.shared, "old", mtime_s=2_000)
    newer = entry(cache.work, "newer")
    cache.close()
    assert not oldest.exists() and old.exists() and (cache.shared / newer.name).exists()


def test_a_loaded_entry_stays_readable_by_its_stage_when_pruned(tmp_path):
    root = tmp_path / "cache"
    (root / HOST).mkdir(parents=True, mode=0o700)
    entry(root / HOST, "loaded")
    reader = CompileCache.open(root, 2**30, host=HOST)
    assert reader is not None
    another = tmp_path / "another"
    another.mkdir()
    CompileCache(shared=reader.shared, work=another, max_bytes=1).publish()  # prunes it
    assert not list(reader.shared.glob("*.pb"))
    assert is_whole(next(reader.work.glob("*.pb")))
    reader.close(publish=False)


@pytest.mark.parametrize(("where", "mode"), [(HOST, 0o777), (HOST, 0o770), (".", 0o777)])
def test_a_directory_others_may_write_is_not_used(tmp_path, where, mode):
    root = tmp_path / "cache"
    (root / HOST).mkdir(parents=True)
    (root / where).chmod(mode)
    assert CompileCache.open(root, 2**30, host=HOST) is None
    assert not list((root / HOST / ".work").iterdir()), "and it leaves nothing behind"


def test_too_little_free_space_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setattr(compilecache, "MIN_FREE_BYTES", 2**62)
    root = tmp_path / "cache"
    assert CompileCache.open(root, 2**30, host=HOST) is None
    assert not list((root / HOST / ".work").iterdir())


def test_an_unwritable_directory_turns_it_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert compilecache.open_from_env({"SWARM_COMPILE_CACHE": str(blocker / "xla")}) is None


@pytest.mark.parametrize(
    ("environ", "want"),
    [
        ({"SWARM_COMPILE_CACHE": "/c"}, Path("/c")),
        ({"SWARM_COMPILE_CACHE": "off"}, None),
        ({"SWARM_COMPILE_CACHE": "OFF"}, None),
        ({"SWARM_COMPILE_CACHE": "0"}, None),
        ({"XDG_CACHE_HOME": "/x"}, Path("/x/silentswarm/xla")),
        ({"XDG_CACHE_HOME": "relative"}, Path.home() / ".cache" / "silentswarm" / "xla"),
        ({}, Path.home() / ".cache" / "silentswarm" / "xla"),
    ],
)
def test_where_the_cache_is(environ, want):
    assert compilecache.default_root(environ) == want


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("", compilecache.DEFAULT_MAX_BYTES),
        ("1000", 1000),
        ("0", compilecache.DEFAULT_MAX_BYTES),
        ("lots", compilecache.DEFAULT_MAX_BYTES),
    ],
)
def test_the_limit(raw, want):
    assert compilecache.max_bytes({"SWARM_COMPILE_CACHE_MAX_BYTES": raw}) == want


def test_the_host_key_follows_the_xla_flags_but_not_the_caches_own(monkeypatch):
    base = compilecache.host_key({})
    assert compilecache.host_key({"XLA_FLAGS": "--xla_cpu_enable_fast_math=true"}) != base
    cache_flags = (
        "--tf_xla_persistent_cache_directory=/a --tf_xla_persistent_cache_device_types=CPU"
    )
    assert compilecache.host_key({"TF_XLA_FLAGS": cache_flags}) == base
    monkeypatch.setattr(compilecache, "_tensorflow_version", lambda: "tensorflow=9.9")
    assert compilecache.host_key({}) != base, "a new TensorFlow starts a new directory"


def test_enable_keeps_other_xla_flags_and_replaces_an_earlier_cache(tmp_path):
    cache = CompileCache.open(tmp_path / "cache", 2**30, host=HOST)
    assert cache is not None
    environ = {"TF_XLA_FLAGS": "--tf_xla_auto_jit=2 --tf_xla_persistent_cache_directory=/old"}
    compilecache.enable(cache, environ)
    assert environ["TF_XLA_FLAGS"] == f"--tf_xla_auto_jit=2 {cache.tf_flags()}"
    cache.close()


def test_tensorflows_probe_of_an_entry_is_noise_and_nothing_else_is():
    line = (
        "E0000 00:00:1796569575.826342   22769 text_format.cc:378] Error parsing text-format "
        "tensorflow.XlaSerializedCacheEntry: 2:1: Expected identifier, got: 4"
    )
    assert compilecache.is_probe_noise(line)
    assert not compilecache.is_probe_noise("E0000 cuda_platform.cc:52] failed call to cuInit")


AOT_LINE = (
    "E0000 00:00:1796606657.133172   20280 cpu_aot_loader.cc:220] Loading XLA:CPU AOT result. "
    "Target machine feature +{feature} is not  supported on the host machine. Machine type "
    "used for XLA:CPU compilation doesn't match the machine type for execution. Compile "
    "machine features: [+64bit,+avx512f,+prefer-no-scatter,+prefer-no-gather] vs host machine "
    "features: [avx512f,64bit]. This could lead to execution errors such as SIGILL."
)


@pytest.mark.parametrize(
    ("feature", "noise"),
    [
        ("prefer-no-scatter", True),
        ("prefer-no-gather", True),
        ("avx512f", False),
        ("amx-tile", False),
    ],
)
def test_xlas_complaint_of_a_tuning_flag_is_noise_and_of_an_instruction_set_is_not(feature, noise):
    """XLA logs every executable it loads on a CPU whose compiles carry LLVM's tuning flags as
    built for another machine, with a warning of SIGILL (seen in every warm stage's stderr);
    a missing instruction set would be a real mismatch, which the operator must see."""
    assert compilecache.is_probe_noise(AOT_LINE.format(feature=feature)) is noise
