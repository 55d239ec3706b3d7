"""Export directories stay under the export root, and writes there never follow a symlink
(real files and symlinks in a temp dir; the leader's side is in tests/hostile/)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from silentswarm.errors import FieldError
from silentswarm.leader.artifacts import (
    EXPORT_DIR_FIELD,
    ExportStore,
    export_dir,
    resolve_export_dir,
)
from silentswarm.leader.errors import ExportPathError
from tests.unit.test_artifacts import chunks, placed_job, send_shard


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "exports"
    root.mkdir()
    return root.resolve()


@pytest.mark.parametrize(
    ("configured", "inside"),
    [
        ("run-1", "run-1"),
        ("team/run-1", "team/run-1"),
        ("./run-1/", "run-1"),
        ("{root}/abs/run", "abs/run"),
    ],
)
def test_paths_inside_the_root_resolve_under_it(root, configured, inside):
    assert resolve_export_dir(root, configured.format(root=root)) == root / inside
    assert export_dir(root, "j-1", configured.format(root=root)) == root / inside


@pytest.mark.parametrize(
    ("configured", "why"),
    [
        ("/etc/silentswarm", "outside the export root"),
        ("{root}/../elsewhere", "'..'"),
        ("../elsewhere", "'..'"),
        ("a/../../elsewhere", "'..'"),
        ("{root}", "the export root itself"),
        (".", "the export root itself"),
        ("link/run", "symlink"),
        ("inner-link/run", "symlink"),
        ("file/run", "not a directory"),
        ("nul\x00byte", "NUL"),
    ],
)
def test_paths_that_lead_out_are_a_400_naming_the_field(root, tmp_path, configured, why):
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    (root / "real").mkdir()
    (root / "inner-link").symlink_to(root / "real")  # even one that stays inside
    (root / "file").write_text("x")
    with pytest.raises(FieldError) as err:
        resolve_export_dir(root, configured.format(root=root))
    assert err.value.field == EXPORT_DIR_FIELD == "artifact_paths.model_export_dir"
    assert err.value.message.startswith(EXPORT_DIR_FIELD) and why in err.value.message
    assert err.value.http_status == 400


def test_an_alias_of_the_root_is_the_root(tmp_path, root):
    alias = tmp_path / "alias"
    alias.symlink_to(root)
    assert resolve_export_dir(root, str(alias / "run")) == root / "run"


def test_the_default_directory_is_per_job_under_the_root(root):
    assert export_dir(root, "j-1", None) == root / "j-1" / "model_export"


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    return outside


@pytest.mark.parametrize(
    "planted",
    [
        "run",  # the export directory itself
        "run/shards",
        "run/shards/step-5",
        "run/.incoming",
    ],
)
def test_a_symlink_planted_below_the_root_is_refused_not_followed(root, tmp_path, planted):
    outside = _outside(tmp_path)
    target = root / planted
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(outside)
    store = ExportStore(root=root)
    with pytest.raises(ExportPathError) as err:
        send_shard(store, root / "run", stage=0, step=5)
    assert "symlink" in str(err.value)
    assert list(outside.iterdir()) == [], "nothing was written through the symlink"


@pytest.mark.parametrize("name", ["stage-0.npz.sha256", "stage-0.npz"])
def test_a_symlinked_file_in_a_step_is_replaced_never_written_through(root, tmp_path, name):
    outside = _outside(tmp_path) / "victim"
    outside.write_bytes(b"precious")
    step = root / "run" / "shards" / "step-5"
    step.mkdir(parents=True)
    (step / name).symlink_to(outside)
    send_shard(ExportStore(root=root), root / "run", stage=0, step=5)
    assert outside.read_bytes() == b"precious"
    assert not (step / name).is_symlink()


def test_a_symlinked_incoming_file_is_not_truncated(root, tmp_path):
    victim = _outside(tmp_path) / "victim"
    victim.write_bytes(b"precious")
    incoming = root / "run" / ".incoming"
    incoming.mkdir(parents=True)
    [first, *rest] = chunks("stage-0.npz", b"0123456789", stage=0, step=5)
    (incoming / "f1-a1-s5-stage-0.npz").symlink_to(victim)
    store = ExportStore(root=root)
    store.receive(root / "run", first, 2)
    for chunk in rest:
        store.receive(root / "run", chunk, 2)
    assert victim.read_bytes() == b"precious"


def test_a_directory_outside_the_root_is_refused(root, tmp_path):
    outside = _outside(tmp_path)
    with pytest.raises(ExportPathError):
        send_shard(ExportStore(root=root), outside / "run", stage=0, step=5)
    assert list(outside.iterdir()) == []


def test_the_manifest_is_not_written_through_a_symlink(root, tmp_path):
    victim = _outside(tmp_path) / "victim"
    victim.write_bytes(b"precious")
    run = root / "run"
    run.mkdir()
    (run / "run_manifest.json").symlink_to(victim)
    store = ExportStore(root=root)
    for stage in (0, 1):
        send_shard(store, run, stage=stage, step=30)
    written = store.write_manifest(run, placed_job())
    assert written == run / "run_manifest.json" and b'"step": 30' in written.read_bytes()
    assert victim.read_bytes() == b"precious"
    assert not written.is_symlink()


def test_reads_skip_symlinks(root, tmp_path):
    store = ExportStore(root=root)
    for stage in (0, 1):
        send_shard(store, root / "run", stage=stage, step=5)
    assert store.file_path(root / "run", 5, "stage-0.npz") is not None
    secret = _outside(tmp_path) / "secret"
    secret.write_text("leader-only")
    step = root / "run" / "shards" / "step-5"
    os.unlink(step / "stage-0.npz")
    (step / "stage-0.npz").symlink_to(secret)
    assert store.file_path(root / "run", 5, "stage-0.npz") is None
    assert store.complete_steps(root / "run", 2) == []


def test_pruning_does_not_reach_through_a_symlinked_shards_directory(root, tmp_path):
    outside = _outside(tmp_path)
    for step in (1, 2, 3):
        (outside / f"step-{step}").mkdir()
    run = root / "run"
    run.mkdir()
    (run / "shards").symlink_to(outside)
    store = ExportStore(root=root)
    store.drop_after(run, 0)
    store.prune(run, 1)
    assert sorted(p.name for p in outside.iterdir()) == ["step-1", "step-2", "step-3"]
