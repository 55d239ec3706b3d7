"""Sweeps and benchmark suites, pure logic: expansion, ids, resumability, numbers, the run
loop over a fake leader, suite decoding and dry-run findings (the plot: test_sweep_plot.py)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from silentswarm.cli.experiments import job_numbers, runner, sweep
from silentswarm.cli.experiments import suite as suites
from silentswarm.errors import ConfigError
from silentswarm.types.jobs import JobRecord
from tests.fakes import fellow_record, gpu, job_record, node_view, placed_stage

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30

TINY = {
    "model": {"vocab_size": 256, "seq_len": 32, "n_layers": 2, "d_model": 32, "n_heads": 2},
    "batch_size": 8,
    "steps": 5,
}


def config(grid, base=None, name="s"):
    doc = {"name": name, "base": TINY if base is None else base, "grid": grid}
    return sweep.decode_sweep_config(json.dumps(doc).encode(), source="s.json")


def test_expansion_is_the_cartesian_product_of_validated_specs():
    s = sweep.expand(
        config({"compression": ["none", "fixed_int8"], "micro_batches": [2, 4], "stages": [2]}),
        source="s.json",
    )
    assert len(s.points) == 4
    assert s.axes == ["compression", "micro_batches", "stages"]
    assert {(p.spec.compression, p.spec.micro_batches) for p in s.points} == {
        ("none", 2),
        ("none", 4),
        ("fixed_int8", 2),
        ("fixed_int8", 4),
    }
    assert all(p.spec.stages == 2 and p.spec.model.d_model == 32 for p in s.points)
    assert all(p.spec.name == f"s-{p.point_id}" for p in s.points)
    assert json.loads(s.points[0].spec_json)["compression"] == "none"


def test_dotted_axes_set_nested_fields_and_keep_the_rest():
    s = sweep.expand(config({"model.d_model": [32, 64]}), source="s.json")
    assert [p.spec.model.d_model for p in s.points] == [32, 64]
    assert all(p.spec.model.n_heads == 2 for p in s.points)


def test_an_empty_grid_is_the_base_alone():
    assert len(sweep.expand(config({}), source="s.json").points) == 1


def test_point_ids_are_stable_and_order_free():
    a = sweep.point_id({"compression": "fp16", "stages": 2})
    assert a == sweep.point_id({"stages": 2, "compression": "fp16"})
    assert a != sweep.point_id({"compression": "fp16", "stages": 4})
    first = sweep.expand(config({"stages": [1, 2]}), source="s.json")
    again = sweep.expand(config({"stages": [1, 2]}), source="s.json")
    assert [p.point_id for p in first.points] == [p.point_id for p in again.points]
    assert first.sweep_id == again.sweep_id and first.sweep_id.startswith("s-")


def test_the_sweep_id_changes_with_the_content_and_the_overrides():
    a = sweep.expand(config({"stages": [1, 2]}), source="s.json")
    b = sweep.expand(config({"stages": [1, 2]}), source="elsewhere.json")
    assert a.sweep_id == b.sweep_id
    c = sweep.expand(config({"stages": [1]}), source="s.json")
    d = sweep.expand(config({"stages": [1]}), source="s.json", overrides={"partition": "weighted"})
    assert len({a.sweep_id, c.sweep_id, d.sweep_id}) == 3
    assert all(p.spec.partition == "weighted" for p in d.points)
    named = sweep.expand(config({"stages": [1]}), source="s.json", sweep_id_override="mine")
    assert named.sweep_id == "mine"


def test_an_override_narrows_a_grid_axis_to_its_value_and_says_so():
    grid = {"partition": ["equal", "weighted"], "stages": [1, 2]}
    full = sweep.expand(config(grid), source="s.json")
    s = sweep.expand(config(grid), source="s.json", overrides={"partition": "weighted"})
    assert s.axes == ["partition", "stages"], "the axis stays a CSV column"
    assert [p.values for p in s.points] == [
        {"partition": "weighted", "stages": 1},
        {"partition": "weighted", "stages": 2},
    ]
    assert all(p.spec.partition == "weighted" for p in s.points)
    weighted = [p.point_id for p in full.points if p.values["partition"] == "weighted"]
    assert [p.point_id for p in s.points] == weighted, "the same ids as in the full grid"
    assert s.sweep_id != full.sweep_id
    assert s.overridden == {"partition": ["equal", "weighted"]}
    assert sweep.override_notes(s, sweep.grid_size(config(grid)), {"partition": "--partition"}) == [
        "--partition weighted overrides the grid's partition axis (equal, weighted): 2 of 4 points"
    ]
    assert sweep.override_notes(full, 4, {}) == []


def test_an_override_may_not_collapse_a_nested_axis():
    with pytest.raises(ConfigError, match=r"s.json: grid.model.d_model: .* 'model'"):
        sweep.expand(
            config({"model.d_model": [32, 64]}),
            source="s.json",
            overrides={"model": {"d_model": 16}},
        )


@pytest.mark.parametrize(
    ("grid", "expected"),
    [
        ({"micro_batches": [2, 3]}, r"s.json: point [0-9a-f]{10} \{\"micro_batches\":3\}: "),
        ({"model.nheads": [2]}, r"s.json: point .*: model.nheads: unknown field"),
        ({"stages": ["two"]}, r"s.json: point .*: stages: Expected `int \| null`"),
        ({"compression": ["zip"]}, r"s.json: point .*compression 'zip' is not one of"),
    ],
)
def test_a_bad_point_names_the_file_the_point_and_the_field(grid, expected):
    with pytest.raises(ConfigError, match=expected):
        sweep.expand(config(grid), source="s.json")


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (b"{", r"s.json: not valid JSON"),
        (b'{"grid": {}}', r"s.json: sweep config: Object missing required field `name`"),
        (b'{"name": "a", "grid": {"stages": []}}', r"s.json: grid.stages: needs at least one"),
        (b'{"name": "a", "grid": {"stages": [1, 1]}}', r"s.json: grid.stages: has a value twice"),
        (b'{"name": "a", "grid": {"bad axis": [1]}}', r"s.json: grid.bad axis: not a job spec"),
        (b'{"name": "a", "gird": {}}', r"unknown field `gird`"),
    ],
)
def test_a_bad_sweep_config_names_the_file_and_the_field(doc, expected):
    with pytest.raises(ConfigError, match=expected):
        sweep.decode_sweep_config(doc, source="s.json")


def test_resume_skips_recorded_points_and_retries_failed_ones_on_request():
    s = sweep.expand(config({"stages": [1, 2], "micro_batches": [2, 4]}), source="s.json")
    a, b, c, _ = s.points
    rows = [
        {"point_id": a.point_id, "state": "COMPLETED"},
        {"point_id": b.point_id, "state": "FAILED"},
        {"point_id": "gone-from-grid", "state": "COMPLETED"},
    ]
    assert [p.point_id for p in sweep.pending_points(s, rows)] == [p.point_id for p in s.points[2:]]
    retried = sweep.pending_points(s, rows, retry_failed=True)
    assert [p.point_id for p in retried] == [b.point_id, *(p.point_id for p in s.points[2:])]
    merged = sweep.merge_row(rows, {"point_id": b.point_id, "state": "COMPLETED"})
    assert [r["point_id"] for r in merged] == [a.point_id, b.point_id, "gone-from-grid"]
    assert merged[1]["state"] == "COMPLETED"
    appended = sweep.merge_row(merged, {"point_id": c.point_id, "state": "FAILED"})
    assert appended[-1]["point_id"] == c.point_id


def finished_job(*, compression="none", stages=2, steps=10, sent_per_stage=(1000, 1000)):
    spec = {**TINY, "compression": compression, "steps": steps}
    return job_record(
        job_id="s-abc-123456",
        state="COMPLETED",
        spec=spec,
        placement={"stages": [placed_stage(i) for i in range(stages)], "transport": "auto"},
        progress=[
            {
                "stage": i,
                "fellow_id": f"f{i}",
                "step": steps,
                "loss": 2.0 - i,
                "tokens_per_s": 1000.0 + i,
                "step_time_s": 0.5 + i,
                "bytes_sent": sent_per_stage[i],
            }
            for i in range(stages)
        ],
        final_loss=1.5,
        final_val_loss=1.6,
        reason="",
    )


def finished_as(**changes) -> JobRecord:
    """The finished job with some fields changed."""
    return job_record(**{**msgspec.to_builtins(finished_job()), **changes})


def test_bytes_per_step_per_boundary_and_the_compression_ratio():
    job = finished_job(sent_per_stage=(4096, 4096))
    assert job_numbers.bytes_per_step_per_boundary(job) == 8192 / 10 / 1
    fp32 = 2 * 8 * 32 * 32 * 4
    assert job_numbers.fp32_bytes_per_step_per_boundary(job.spec) == fp32
    assert job_numbers.compression_ratio(job) == pytest.approx(fp32 / 819.2)
    single = finished_job(stages=1, sent_per_stage=(5,))
    assert job_numbers.bytes_per_step_per_boundary(single) is None
    assert job_numbers.nominal_compression_ratio("none", 128) == 1
    assert job_numbers.nominal_compression_ratio("fixed_int8", 128) == 4
    assert job_numbers.nominal_compression_ratio("learned_dim32_int4", 128) == 32


def test_a_result_row_has_the_grid_values_and_the_numbers():
    s = sweep.expand(config({"compression": ["none"], "stages": [2]}), source="s.json")
    [p] = s.points
    row = sweep.result_row(s, p, finished_job())
    assert list(row) == s.columns
    assert row["compression"] == "none" and row["stages"] == "2"
    assert row["state"] == "COMPLETED" and row["final_val_loss"] == "1.6"
    assert row["tokens_per_s"] == "1001" and row["step_time_s"] == "1.5"
    assert row["bytes_per_step_per_boundary"] == "200"
    refused = sweep.result_row(s, p, None, reason="submit refused: NO: nope")
    assert refused["state"] == "FAILED" and refused["reason"].startswith("submit refused")
    assert refused["final_loss"] == ""


def bundled_sweep(name: str, **overrides) -> sweep.Sweep:
    path = REPO / "exp" / "configs" / f"{name}.json"
    parsed = sweep.decode_sweep_config(path.read_bytes(), source=str(path))
    return sweep.expand(parsed, source=str(path), overrides=overrides)


@pytest.mark.parametrize(
    ("name", "points"),
    [("exp_full_sweep_unlimited_v1", 64), ("exp_large_unlimited_compute_v1", 72)],
)
def test_the_bundled_sweeps_expand_are_gpu_only_and_take_partition(name, points):
    """As the README runs them: with and without --partition; both are meant for GPUs."""
    s = bundled_sweep(name)
    assert set(s.axes) >= {"compression", "partition", "stages", "micro_batches"}
    assert len(s.points) == len({p.point_id for p in s.points}) == points
    assert sweep.gpu_only_points(s) == s.points, "configs meant for GPUs say allow_cpu: false"
    weighted = bundled_sweep(name, partition="weighted")
    assert len(weighted.points) == points // 2
    assert {p.spec.partition for p in weighted.points} == {"weighted"}


def node(host="h1", online=True, gpus=0, tf=None, fellows=("f1",), warning=None):
    return node_view(
        host,
        online=online,
        fellows=list(fellows),
        gpus=[gpu(i) for i in range(gpus)],
        tf_gpu_count=tf,
        gpu_warning=warning,
    )


GPU_ONLY = {**TINY, "allow_cpu": False}


@pytest.mark.parametrize(
    ("base", "nodes", "refused"),
    [
        pytest.param(TINY, [node()], None, id="cpu-allowed-on-cpu"),
        pytest.param(GPU_ONLY, [node(gpus=1, tf=1)], None, id="gpu-only-with-a-gpu"),
        pytest.param(
            GPU_ONLY,
            [node(), node("h2", fellows=("f2", "f3"))],
            "but the swarm has 2 online host(s) with 3 fellow(s) and no GPU; ",
            id="gpu-only-on-cpu",
        ),
        pytest.param(GPU_ONLY, [], "has 0 online host(s) with 0 fellow(s)", id="empty-swarm"),
        pytest.param(
            GPU_ONLY,
            [node(gpus=2, tf=0, warning="TensorFlow sees none")],
            "and 2 GPU(s), none that TensorFlow can use (h1: TensorFlow sees none); ",
            id="gpus-tensorflow-cannot-use",
        ),
        pytest.param(
            GPU_ONLY,
            [node(gpus=1, tf=1, online=False), node("h2")],
            "1 online host(s) with 1 fellow(s) and no GPU",
            id="the-gpu-host-is-offline",
        ),
    ],
)
def test_a_gpu_only_sweep_is_refused_on_a_swarm_without_usable_gpus(base, nodes, refused):
    s = sweep.expand(config({"stages": [1, 2]}, base=base), source="s.json")
    reason = sweep.gpu_refusal(s, nodes)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and refused in reason
        assert reason.startswith(f"sweep {s.sweep_id} needs GPUs (2 of 2 point(s) have allow_cpu")
        assert reason.endswith(
            "or set allow_cpu: true in the config's base to let CPU fellows run it"
        )


def test_the_dry_run_report_lists_the_points_to_run_and_the_verdict(tmp_path):
    s = sweep.expand(config({"stages": [1, 2]}), source="s.json")
    done = [{"point_id": s.points[0].point_id, "state": "COMPLETED"}]
    value, text = sweep.plan_report(s, done, tmp_path, None)
    assert value["to_run"] == [{"point_id": s.points[1].point_id, "values": {"stages": 2}}]
    assert text.splitlines() == [
        f"sweep {s.sweep_id}: 2 point(s), 1 to run; results in {tmp_path}",
        f"  {s.points[1].point_id} stages=2",
        "the swarm can run it",
    ]
    value, text = sweep.plan_report(s, [], tmp_path, "no GPU")
    assert value["refusal"] == "no GPU" and text.endswith("refused: no GPU")


# --- suites ---------------------------------------------------------------------------------

SUITE_PATH = REPO / "exp" / "configs" / "benchmarks" / "multinode_training_v1.json"


def bundled_suite() -> suites.Suite:
    return suites.decode_suite(SUITE_PATH.read_bytes(), source=str(SUITE_PATH))


def worker(fid, host="vm", gpus_free_gb=(), status="ready"):
    gpus = [gpu(i, free_bytes=int(g * GIB)) for i, g in enumerate(gpus_free_gb)]
    return fellow_record(fid, hostname=host, status=status, gpus=gpus)


def test_the_bundled_suite_decodes_with_its_profiles():
    suite = bundled_suite()
    names = [s.name for s in suite.scenarios]
    assert names[:2] == ["single_gpu_baseline", "two_gpu_one_node"]
    assert "constrained-network" in names and len(names) == 4
    by = {s.name: s for s in suite.scenarios}
    assert by["two_gpu_one_node"].spec.max_gpus_per_worker == 2
    assert by["constrained-network"].network.enforcement == "external"
    assert by["constrained-network"].network.target_bandwidth_mbps
    assert any(s.infra.hosts == 2 and s.name != "constrained-network" for s in suite.scenarios)
    # The scenario ids operators know; the two-node ones cap no fellow's GPUs.
    assert {"single_gpu_baseline", "two_gpu_one_node", "constrained-network"} <= set(names)
    two_node = [s for s in suite.scenarios if s.infra.hosts == 2]
    assert len(two_node) == 2 and all(s.spec.max_gpus_per_worker is None for s in two_node)
    for s in suite.scenarios:  # the default stress profile
        assert s.job_profile == "stress"
        assert s.spec.shard_push_to_leader and s.spec.shard_push_interval_steps == 20
        assert s.repeats >= 2


def test_a_scenario_merges_base_profile_and_its_own_fields():
    doc = {
        "name": "t",
        "base": {"model": {"n_layers": 4, "d_model": 64, "n_heads": 4}, "steps": 10},
        "job_profiles": {"p": {"steps": 20}},
        "default_job_profile": "p",
        "infra_profiles": {"cpu": {"fellows": 2}},
        "scenarios": [{"name": "a", "infra": "cpu", "job": {"model": {"d_model": 32}}}],
    }
    [s] = suites.decode_suite(json.dumps(doc).encode(), source="t.json").scenarios
    assert s.spec.steps == 20 and s.spec.model.d_model == 32 and s.spec.model.n_layers == 4
    assert s.repeats == 1 and s.spec.name == "t-a"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"scenarios": [{"name": "a", "infra": "nope"}]}, r"t.json: scenarios.a.infra: no infra"),
        (
            {"scenarios": [{"name": "a", "infra": "cpu", "job": {"stages": "x"}}]},
            r"t.json: scenarios.a.job: stages: Expected",
        ),
        (
            {"scenarios": [{"name": "a", "infra": "cpu", "job": {"stages": 3}}]},
            r"scenarios.a.job: stages \(3\) needs more fellows",
        ),
        ({"infra_profiles": {"cpu": {"fellows": 1, "hosts": 2}}}, r"infra_profiles.cpu: hosts"),
        ({"default_job_profile": "zzz"}, r"t.json: default_job_profile: no job profile 'zzz'"),
        ({"scenarios": [{"name": "a", "infra": "cpu", "x": 1}]}, r"unknown field `x`"),
    ],
)
def test_a_bad_suite_names_the_file_the_scenario_and_the_field(change, expected):
    doc = {
        "name": "t",
        "base": {"model": {"n_layers": 4}},
        "infra_profiles": {"cpu": {"fellows": 2}},
        "scenarios": [{"name": "a", "infra": "cpu"}],
        **change,
    }
    with pytest.raises(ConfigError, match=expected):
        suites.decode_suite(json.dumps(doc).encode(), source="t.json")


def test_dry_run_on_cpu_fellows_says_what_is_missing():
    findings = suites.dry_run(bundled_suite(), [worker("f1"), worker("f2")])
    assert not any(f.ok for f in findings)
    first = findings[0].message
    assert first == (
        "single_gpu_baseline: needs 1 fellow with 1 GPU with >= 20 GiB free; "
        "have 2 fellows (2 ready) on 1 host, 0 GPUs"
    )


def test_dry_run_checks_free_vram_hosts_and_status():
    workers = [
        worker("a", "host-a", (40, 40)),
        worker("b", "host-b", (10,)),  # too little free
        worker("c", "host-a", (40,)),  # same host as a
        worker("d", "host-d", (40,), status="offline"),
    ]
    by = {f.scenario: f for f in suites.dry_run(bundled_suite(), workers)}
    assert by["single_gpu_baseline"].ok and by["single_gpu_baseline"].fellows == ["a"]
    assert by["two_gpu_one_node"].ok and by["two_gpu_one_node"].fellows == ["a"]
    assert not by["two_node_pipeline"].ok
    assert "on 2 hosts" in by["two_node_pipeline"].message
    assert "(2 with >= 20 GiB free)" not in by["two_node_pipeline"].message
    assert "3 ready" in by["two_node_pipeline"].message
    workers[1] = worker("b", "host-b", (24,))
    by = {f.scenario: f for f in suites.dry_run(bundled_suite(), workers)}
    assert by["two_node_pipeline"].ok and sorted(by["two_node_pipeline"].fellows) == ["a", "b"]
    assert "enforcement: external" in by["constrained-network"].message


def test_busy_jobs_and_run_results():
    jobs = [
        job_record(job_id="a", state="COMPLETED"),
        job_record(job_id="b", state="RUNNING"),
        job_record(job_id="c", state="PENDING"),
    ]
    assert suites.busy_jobs(jobs) == ["b", "c"]
    results = suites.run_results(finished_job(sent_per_stage=(100, 300)))
    assert results["state"] == "COMPLETED" and results["final_val_loss"] == 1.6
    assert results["bytes_sent"] == 400 and results["bytes_per_step_per_boundary"] == 40
    assert results["stages"] == 2 and results["fellows"] == ["f0", "f1"]


class FakeLeader:
    """Answers submit/job/cancel like the leader: the first point is refused, the second
    fails, the third never ends (and is cancelled), the rest complete."""

    def __init__(self) -> None:
        self.submitted: list[dict] = []
        self.cancelled: list[str] = []

    def submit(self, spec_json: bytes) -> JobRecord:
        from silentswarm.errors import LeaderResponseError

        spec = json.loads(spec_json)
        self.submitted.append(spec)
        if len(self.submitted) == 1:
            raise LeaderResponseError("no fellow can take it", code="JOB_INVALID")
        return job_record(job_id=f"j{len(self.submitted)}", name=spec["name"])

    def job(self, job_id: str) -> JobRecord:
        n = int(job_id[1:])
        if n == 2:
            return finished_as(job_id=job_id, state="FAILED", reason="f1 died")
        if n == 3:
            state = "CANCELLED" if job_id in self.cancelled else "RUNNING"
            return finished_as(job_id=job_id, state=state, reason="by operator")
        return finished_as(job_id=job_id)

    def jobs(self) -> list[JobRecord]:
        return []

    def cancel(self, job_id: str) -> JobRecord:
        self.cancelled.append(job_id)
        return self.job(job_id)


def test_run_sweep_records_failures_goes_on_and_resumes(tmp_path):
    s = sweep.expand(config({"stages": [1, 2], "micro_batches": [2, 4]}), source="s.json")
    lines: list[str] = []
    fake = FakeLeader()
    rows = runner.run_sweep(
        fake, s, tmp_path, progress=lines.append, poll_s=0.0, point_timeout_s=0.0
    )
    assert [r["state"] for r in rows] == ["FAILED", "FAILED", "CANCELLED", "COMPLETED"]
    assert rows[0]["reason"] == "submit refused: JOB_INVALID: no fellow can take it"
    assert rows[1]["reason"] == "f1 died" and rows[1]["job_id"] == "j2"
    assert rows[2]["reason"].startswith("timed out") and fake.cancelled == ["j3"]
    assert runner.read_rows(tmp_path / "results.csv") == rows
    assert (tmp_path / "val_loss_vs_bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert lines[0].endswith("0 already in " + str(tmp_path / "results.csv") + ", 4 to run")

    again = FakeLeader()
    runner.run_sweep(again, s, tmp_path, progress=lines.append, poll_s=0.0)
    assert again.submitted == []
    retry = FakeLeader()
    retry.submitted = [{}]  # its next submission is accepted and completes
    retry.job = lambda job_id: finished_as(job_id=job_id)
    rows = runner.run_sweep(retry, s, tmp_path, progress=lines.append, poll_s=0, retry_failed=True)
    assert len(retry.submitted) == 4 and [r["state"] for r in rows] == ["COMPLETED"] * 4


def test_summary_keeps_mean_and_spread_of_completed_repeats():
    summary = suites.summarize(
        {
            "a": [
                {"state": "COMPLETED", "final_loss": 1.0, "tokens_per_s": None},
                {"state": "COMPLETED", "final_loss": 3.0},
                {"state": "FAILED", "final_loss": 9.0},
            ],
            "b": [{"state": "REFUSED"}],
        }
    )
    assert summary["a"]["repeats"] == 3 and summary["a"]["completed"] == 2
    assert summary["a"]["final_loss"] == {"mean": 2.0, "min": 1.0, "max": 3.0}
    assert "tokens_per_s" not in summary["a"]
    assert summary["b"] == {"repeats": 1, "completed": 0}


class InterruptedLeader:
    """Ctrl-C arrives while the sweep waits on its first job, or inside its submit."""

    def __init__(self, during_submit: bool = False) -> None:
        self.during_submit = during_submit
        self.cancelled: list[str] = []
        self.polls = 0
        self.name = ""

    def submit(self, spec_json: bytes) -> JobRecord:
        self.name = json.loads(spec_json)["name"]
        if self.during_submit:  # the leader made the job; its id never came back
            raise KeyboardInterrupt
        return job_record(job_id="j1")

    def job(self, job_id: str) -> JobRecord:
        self.polls += 1
        if self.polls == 2:
            raise KeyboardInterrupt
        return job_record(job_id=job_id, state="RUNNING", progress=[])

    def jobs(self) -> list[JobRecord]:
        return [
            job_record(job_id="old", name=self.name, state="CANCELLED"),
            job_record(job_id="j9", name=self.name, state="PENDING"),
            job_record(job_id="other", name="someone-else", state="RUNNING"),
        ]

    def cancel(self, job_id: str) -> JobRecord:
        self.cancelled.append(job_id)
        return job_record(job_id=job_id, state="CANCELLED")


@pytest.mark.parametrize(("during_submit", "cancelled"), [(False, ["j1"]), (True, ["j9"])])
def test_ctrl_c_cancels_the_job_the_sweep_started_and_records_no_row(
    tmp_path, during_submit, cancelled
):
    s = sweep.expand(config({"stages": [1, 2]}), source="s.json")
    fake = InterruptedLeader(during_submit=during_submit)
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        runner.run_sweep(fake, s, tmp_path, progress=lines.append, poll_s=0.0)
    assert fake.cancelled == cancelled
    assert lines[-1] == (
        f"[1/2] {s.points[0].point_id} interrupted: cancelled {cancelled[0]} "
        "(it runs again on resume)"
    )
    assert runner.read_rows(tmp_path / "results.csv") == [], "the point runs again on resume"
