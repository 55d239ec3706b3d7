"""Real stages and the compile cache (agent/runtime/compilecache.py): a stage loads what an
earlier one compiled and trains bit for bit the same; what a stage killed after its first
step compiled is kept."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from silentswarm.agent.runtime.compilecache import is_whole
from silentswarm.agent.runtime.launch import (
    done,
    run_plans,
    stage_command,
    stage_env,
    steps,
    write_plans,
)
from silentswarm.plan import ModelConfig, TrainConfig, single_process_plan

pytestmark = pytest.mark.integration

TINY = ModelConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2)
PROBE = "XlaSerializedCacheEntry"  # what TensorFlow logs as it reads an entry


def plan(steps: int):
    config = TrainConfig(
        steps=steps, batch_size=4, micro_batches=2, max_data_bytes=100_000, val_batches=2
    )
    return single_process_plan(job_id="cc", model=TINY, train=config)


def entries(cache: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in cache.glob("*/*.pb")}


def test_a_stage_loads_what_an_earlier_one_compiled_and_trains_the_same(tmp_path, monkeypatch):
    cache = tmp_path / "xla"
    monkeypatch.setenv("SWARM_COMPILE_CACHE", str(cache))
    (first,) = run_plans([plan(3)], tmp_path / "first")
    kept = entries(cache)
    assert kept, "the first stage's executables are kept"
    assert all(is_whole(p) for p in cache.glob("*/*.pb"))
    assert not list(cache.glob("*/.work/*")), "its own directory goes when it ends"
    assert PROBE not in (tmp_path / "first" / "stage-cc-0.err").read_text()

    (second,) = run_plans([plan(3)], tmp_path / "second")
    assert entries(cache) == kept, "nothing compiled anew"
    probes = (tmp_path / "second" / "stage-cc-0.err").read_text().count(PROBE)
    assert probes >= len(kept), "every executable was read from the cache"
    assert [s["loss"] for s in steps(second)] == [s["loss"] for s in steps(first)]
    assert done(second)["val_loss"] == done(first)["val_loss"]

    monkeypatch.setenv("SWARM_COMPILE_CACHE", "off")
    run_plans([plan(3)], tmp_path / "off")
    assert PROBE not in (tmp_path / "off" / "stage-cc-0.err").read_text()


def test_what_a_stage_killed_after_its_first_step_compiled_is_kept(tmp_path, monkeypatch):
    cache = tmp_path / "xla"
    monkeypatch.setenv("SWARM_COMPILE_CACHE", str(cache))
    (path,) = write_plans([plan(100_000)], tmp_path)
    with subprocess.Popen(
        stage_command(path), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=stage_env()
    ) as stage:
        try:
            assert stage.stdout is not None
            for line in stage.stdout:
                if line.startswith(b"{") and json.loads(line)["event"] == "step":
                    break
            else:
                pytest.fail("the stage ended before its first step")
        finally:
            stage.kill()
    kept = entries(cache)
    assert kept and all(is_whole(p) for p in cache.glob("*/*.pb"))
    (left,) = cache.glob("*/.work/*")  # the killed stage's own, until the next stage opens

    run_plans([plan(3)], tmp_path / "next")
    assert not left.exists(), "the next stage salvaged and removed it"
    assert kept.items() <= entries(cache).items()
