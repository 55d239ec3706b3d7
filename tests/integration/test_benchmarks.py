"""The benchmarks under exp/bench run: each --quick mode exits 0 and ends with its JSON line.

Only the shape of the figures is checked (keys present, numbers positive), never the
targets: timings on a shared machine are not a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import BENCH, REPO, bench_module, child_env, shaped_paths_unavailable

pytestmark = pytest.mark.integration


def run_script(script: Path, *args: str, timeout: float) -> list[str]:
    """``script args`` run to its end; its stdout's lines. Its temporary files (a
    benchmark's work folder, which it keeps for a user to read) go to a folder of the test's,
    removed after; a run that fails or outlasts ``timeout`` says what its stages last wrote."""
    with tempfile.TemporaryDirectory(prefix="bench-", ignore_cleanup_errors=True) as scratch:
        try:
            out = subprocess.run(
                [sys.executable, str(script), *args],
                cwd=REPO,
                env=child_env(TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=scratch),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            printed = exc.stdout or b""  # bytes whatever ``text`` says (subprocess.run)
            if isinstance(printed, bytes):
                printed = printed.decode(errors="replace")
            printed = printed[-2000:]
            pytest.fail(
                f"{script.name} still running after {timeout:.0f}s; it printed:\n{printed}"
                f"{stage_tails(Path(scratch))}"
            )
        assert out.returncode == 0, (
            f"{script.name} exited {out.returncode}:\n{out.stderr[-3000:]}"
            f"{stage_tails(Path(scratch))}"
        )
    return out.stdout.strip().splitlines()


def stage_tails(scratch: Path, chars: int = 1500) -> str:
    """The end of each stage's stderr under ``scratch`` (run_plans' ``stage-*.err``)."""
    tails = [
        f"\n--- {err.relative_to(scratch)}:\n{err.read_text(errors='replace')[-chars:]}"
        for err in sorted(scratch.rglob("stage-*.err"))
    ]
    return "".join(tails)


def run_quick(name: str, *args: str, timeout: float = 240.0) -> dict[str, Any]:
    """Run ``exp/bench/<name>.py --quick [args]``; its last stdout line, parsed."""
    lines = run_script(BENCH / f"{name}.py", "--quick", *args, timeout=timeout)
    assert lines, f"{name} printed nothing"
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict)
    return figures


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and value > 0


@pytest.mark.timeout(300)
def test_link_benchmark_quick():
    figures = run_quick("link")
    assert figures["bench"] == "link" and figures["quick"] is True
    for kind in ("tcp", "zmq", "nats", "relay"):
        for size in ("64KiB", "1MiB", "4MiB"):
            row = figures["transports"][kind][size]
            assert all(positive(row[k]) for k in ("gb_per_s", "p50_ms", "p99_ms")), (kind, size)
    assert positive(figures["zmq_vs_tcp_4mib"]) and positive(figures["relay_vs_nats_4mib"])
    assert set(figures["targets"]) == {"zmq_vs_tcp_4mib_ge_0.90", "relay_vs_nats_4mib_ge_0.80"}


@pytest.mark.timeout(300)
def test_pipeline_benchmark_quick():
    # every forward of a step ahead on stage 0 (m = 4): the ceiling child follows the window;
    # and the 2-stage pipeline with recompute beside the tape's, in the same round
    # and the compression section's reference spec alone (the codecs: the compression test)
    figures = run_quick(
        "pipeline", "--in-flight", "4", "--compare-recompute", "--specs", "none", timeout=280
    )
    assert figures["bench"] == "pipeline"
    speed = figures["speed"]
    assert speed["in_flight"] == 4 and speed["micro_batches"] == 4
    assert speed["recompute"] is False
    other = speed["recompute_vs_tape"]
    assert other["tape_tokens_per_s"] == speed["pipeline_tokens_per_s"]
    assert positive(other["recompute_tokens_per_s"]) and positive(other["ratio"]), other
    keys = ("single_tokens_per_s", "speedup", "ideal_speedup", "ceiling_tokens_per_s")
    assert all(positive(speed[k]) for k in (*keys, "fraction_of_ceiling")), speed
    assert all(positive(speed["p3"][k]) for k in ("speedup", "ideal_speedup")), speed["p3"]
    assert set(speed["targets"]) == {"fraction_of_ideal_ge_0.85", "fraction_of_ceiling_ge_0.95"}
    for stage in speed["ceiling_stage_ops_ms"]:  # every stage's ops were timed
        assert positive(stage["forward"]) and stage["backward"] >= 0 and stage["apply"] >= 0
    rows = figures["sweep"]["rows"]
    assert {row["stages"] for row in rows} == {2, 3}
    for row in rows:
        assert all(positive(row[k]) for k in ("speedup", "ideal_speedup", "fraction_of_ideal"))
    specs = figures["compression"]["specs"]
    assert "none" in specs and all(positive(s["bytes_per_step"]) for s in specs.values())


@pytest.mark.timeout(300)
def test_compression_benchmark_quick():
    figures = run_quick("compression")
    assert figures["bench"] == "compression"
    specs = figures["specs"]
    assert {"none", "fixed_int8"} <= set(specs)
    assert any(spec.startswith("learned_dim") for spec in specs)
    for row in specs.values():
        assert all(positive(row[k]) for k in ("bytes_per_step", "val_loss", "bytes_vs_none"))
    assert specs["fixed_int8"]["bytes_vs_none"] < 1.0, "int8 sends fewer bytes than fp32"
    assert set(figures["targets"]) == {
        "fixed_int8_bytes_le_0.26",
        "fixed_int8_loss_within_1pct",
        "learned_bytes_le_0.04_loss_within_3pct",
    }


@pytest.mark.timeout(300)
def test_overhead_benchmark_quick():
    figures = run_quick("overhead")
    assert figures["bench"] == "overhead"
    assert all(positive(figures["step_ms"][v]) for v in ("runtime", "plain_xla", "plain"))
    assert isinstance(figures["overhead_vs_plain_xla"], float)
    assert set(figures["overhead"]) == {"plain_xla", "plain"}
    # the runtime and the hand-written loop train the same numbers: the same workload
    assert figures["final_loss_gap_vs_plain_xla"] < 1e-3, figures["final_loss"]


@pytest.mark.timeout(480)
@pytest.mark.skipif(
    (why := shaped_paths_unavailable()) is not None, reason=f"no shaped paths here: {why}"
)
def test_wan_benchmark_quick(tmp_path):
    png = tmp_path / "wan.png"
    figures = run_quick(
        "wan",
        "--profiles",
        "wan100",
        "--specs",
        "none",
        "--transports",
        "p2p",
        "tunnel",
        "--png",
        str(png),
        timeout=420,
    )
    assert figures["bench"] == "wan" and figures["quick"] is True
    arms = {(a["profile"], a["transport"]): a for a in figures["arms"]}
    # the references (loopback, none), added for each transport
    assert set(arms) == {(p, t) for p in ("loopback", "wan100") for t in ("p2p", "tunnel")}
    keys = {
        "profile",
        "compression",
        "transport",
        "schedule",
        "micro_batches",
        "tokens_per_s",
        "retention",
        "bytes_per_step",
        "val_loss",
        "val_loss_vs_reference",
    }
    for arm in arms.values():
        assert keys <= set(arm), sorted(keys - set(arm))
        assert (arm["compression"], arm["schedule"]) == ("none", "1f1b")
        assert positive(arm["tokens_per_s"]) and positive(arm["bytes_per_step"])
    for transport in ("p2p", "tunnel"):
        ref, slow = arms["loopback", transport], arms["wan100", transport]
        assert ref["retention"] == 1.0 and ref["val_loss_vs_reference"] == 0.0
        # The same frames cross both links: the same bytes, and one loss run for both.
        assert slow["bytes_per_step"] == ref["bytes_per_step"]
        assert slow["val_loss"] == ref["val_loss"]
    relay = {r["profile"]: r["ratio"] for r in figures["tunnel_vs_p2p"]}
    assert set(relay) == {"loopback", "wan100"} and all(positive(r) for r in relay.values())
    assert set(figures["targets"]) == {"wan100_tunnel_within_5pct_of_p2p"}
    assert figures["profiles"]["wan100"]["forward"] == {
        "rate_bit_s": 100e6,
        "delay_s": 0.025,
        "jitter_s": 0.0,
    }
    assert figures["png"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(480)
@pytest.mark.skipif(
    (why := shaped_paths_unavailable()) is not None, reason=f"no shaped paths here: {why}"
)
def test_wan_benchmark_compares_the_overlap_schedule_with_its_synchronous_twin(tmp_path):
    figures = run_quick(
        "wan", "--profiles", "wan100", "--specs", "none", "--schedules", "overlap", timeout=420
    )
    arms = {(a["profile"], a["schedule"]): a for a in figures["arms"]}
    # each overlap arm's reference (loopback, overlap) and synchronous twin, added
    assert set(arms) == {(p, s) for p in ("loopback", "wan100") for s in ("1f1b", "overlap")}
    for prof in ("loopback", "wan100"):
        over, sync = arms[prof, "overlap"], arms[prof, "1f1b"]
        assert positive(over["speedup_vs_sync"])
        assert over["val_loss_vs_sync"] == over["val_loss"] / sync["val_loss"] - 1.0
        assert over["val_loss"] != sync["val_loss"], "the delayed update is other math"
        assert "speedup_vs_sync" not in sync
    assert arms["wan100", "overlap"]["val_loss"] == arms["loopback", "overlap"]["val_loss"]


def test_sampling_benchmark_quick():
    figures = run_quick("sampling", "--vocab", "256", "32000", timeout=60)
    assert figures["bench"] == "sampling" and figures["quick"] is True
    assert set(figures["ms_per_token"]) == {"256", "32000"}
    for row in figures["ms_per_token"].values():
        assert set(row) == {"plain", "top_k_40", "top_p_0.9"} and all(map(positive, row.values()))


@pytest.mark.timeout(120)
def test_tokenizer_benchmark_quick():
    figures = run_quick("tokenizer", timeout=100)
    assert figures["bench"] == "tokenizer" and set(figures["arms"]) == {"byte", "bpe_512"}
    byte, bpe = figures["arms"]["byte"], figures["arms"]["bpe_512"]
    assert byte["bytes_per_token"] == 1.0 and bpe["bytes_per_token"] > 1.5
    assert positive(bpe["train_s"]) and positive(bpe["encode_mb_per_s"])


@pytest.mark.timeout(240)
def test_stagestart_benchmark_quick():
    figures = run_quick("stagestart", timeout=220)
    assert figures["bench"] == "stagestart" and figures["same_losses"] is True
    for arm in ("off", "cold", "warm"):
        assert 0 < figures[f"{arm}_first_step_s"] <= figures[f"{arm}_total_s"]
    assert set(figures["warm_vs_off"]) == {"first_step_s", "total_s"}
    assert figures["cache_bytes"] > 0, "the cold arm filled the cache"


def run_codec_loss(*args: str, timeout: float) -> list[dict[str, Any]]:
    """``exp/codec_loss.py --quick [args]``: its stdout's JSON lines."""
    lines = run_script(REPO / "exp" / "codec_loss.py", "--quick", *args, timeout=timeout)
    return [json.loads(line) for line in lines]


@pytest.mark.timeout(200)
def test_codec_fidelity_experiment_quick():
    """--fidelity: each arm's gradients against the unrounded ones, no trajectory: the
    unrounded arm is exact, fp16 far closer than int8, and a rounding of the gradients alone
    leaves stage 1's untouched."""
    arms = ["none/none", "fp16/fp16", "row/row", "row/e5m2"]
    result = run_codec_loss("--fidelity", "2", "--arms", *arms, timeout=180)[-1]
    assert result["experiment"] == "codec_fidelity"
    got = result["arms"]
    assert got["none/none"]["stage0_rel_err"] == 0.0 and got["none/none"]["stage0_cosine"] > 0.999
    assert 0 < got["fp16/fp16"]["stage0_rel_err"] < got["row/row"]["stage0_rel_err"] < 0.2
    assert got["row/e5m2"]["stage1_rel_err"] == got["row/row"]["stage1_rel_err"], "fwd only"
    assert all(0.9 < arm["adam_sign_agreement"] <= 1.0 for arm in got.values())


@pytest.mark.timeout(300)
def test_codec_loss_experiment_quick():
    """exp/codec_loss.py runs each arm per seed against its seed's unrounded arm (one seed here)."""
    arms = ["none/none", "row/e4m3", "block32/stochastic"]
    lines = run_codec_loss("--seeds", "0", "--arms", *arms, timeout=280)
    rows, summary = lines[:-1], lines[-1]
    assert len(rows) == 3 and all(positive(r["val_loss"]) for r in rows)
    assert summary["experiment"] == "codec_loss"
    by_arm = summary["summary"]
    assert by_arm["none/none"]["vs_none"] == [0.0]
    for arm in ("row/e4m3", "block32/stochastic"):
        assert len(by_arm[arm]["vs_none"]) == 1
    # A quick run's validation loss can round to the same float32 mean with
    # and without rounding (it did once, int8 both ways); the training losses say
    # whether the rounding reached the training.
    unrounded = {r["seed"]: r for r in rows if r["fwd"] == "none"}
    for row in rows:
        if row["fwd"] != "none":
            base = unrounded[row["seed"]]
            assert row["train_loss_last20"] != base["train_loss_last20"], row
            assert abs(row["val_loss"] / base["val_loss"] - 1) < 0.01, row


@pytest.mark.timeout(200)
def test_overlap_loss_experiment_quick():
    """exp/overlap_loss.py: the delayed update and the predicted one each against ``sync``
    of the same rate and seed; all three train differently from the same start."""
    lines = run_script(REPO / "exp" / "overlap_loss.py", "--quick", timeout=180)
    *rows, summary = [json.loads(line) for line in lines]
    losses = {r["mode"]: r["val_loss"] for r in rows}
    assert sorted(losses) == ["delay", "predict", "sync"] and all(map(positive, losses.values()))
    assert len(set(losses.values())) == 3, losses
    vs_sync = {row["mode"]: row["per_seed"] for row in summary["vs_sync"]}
    for mode in ("delay", "predict"):
        assert vs_sync[mode] == [pytest.approx(losses[mode] / losses["sync"] - 1)]


def test_serve_benchmark_quick():
    figures = run_quick("serve")
    assert figures["bench"] == "serve"
    arms = {(a["kv_cache"], a["streams"]): a for a in figures["arms"]}
    assert set(arms) == {(True, 1), (True, 8), (False, 1), (False, 8)}
    assert all(positive(a["tokens_per_s"]) and positive(a["ttft_s"]) for a in arms.values())
    assert set(figures["kv_cache_speedup"]) == {"1", "8"}
    assert set(figures["batching_speedup"]) == {"kv_cache", "no_kv_cache"}
    assert all(positive(v) for v in figures["kv_cache_speedup"].values())


@pytest.mark.timeout(240)
def test_replicas_benchmark_quick_places_by_speed():
    figures = run_quick("replicas", "--only", "placement", timeout=200)
    assert figures["bench"] == "replicas" and figures["quick"] is True
    assert figures["runs"] == []  # --only placement: the replica runs are left out
    placement = figures["placement"]
    for key in ("equal_tokens_per_s", "balanced_tokens_per_s", "best_tokens_per_s"):
        assert positive(placement[key]), key
    assert placement["best_tokens_per_s"] >= placement["balanced_tokens_per_s"]
    assert sum(placement["balanced_split"]) == 8
    assert all(positive(v) for v in placement["probed_speeds"].values())
    assert all(positive(v) for v in placement["measured_speeds"].values())
    assert sorted(placement["stage_order"]) == ["fast", "slow"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    (why := shaped_paths_unavailable()) is not None, reason=f"no shaped paths here: {why}"
)
def test_wan_replicas_benchmark_quick_runs_both_groupings_on_two_sites():
    figures = run_quick("replicas", "--only", "sites", timeout=280)
    assert figures["runs"] == [] and figures["splits"] == {}
    sites = figures["sites"]
    assert set(sites) >= {"diloco", "rate_bit_s", "sync_every"} and "allreduce" not in sites
    row = sites["diloco"]
    # placement's pick (the unit tests check why): each DiLoCo pipeline on one site
    assert row["chosen"] == "at_home"
    assert positive(row["spread_tokens_per_s"]) and positive(row["at_home_tokens_per_s"])
    assert positive(row["chosen_over_other"]), row
    assert sites["rate_bit_s"] == 20e6


@pytest.mark.timeout(200)
def test_cpu_budget_benchmark_quick():
    why: list[str] = []
    with bench_module("cpuquota").cpu_quota(0.5, why=why) as prefix:
        if prefix is None:
            pytest.skip(why[0])
    figures = run_quick("cpu_budget", timeout=150)
    assert figures["bench"] == "cpu_budget" and figures["quick"] is True
    (arm,) = figures["arms"]
    assert arm["quota_cores"] == 0.5 and arm["budget_threads"] == 1
    assert arm["host_threads"] == figures["host_cores"]
    for key in ("host_threads_speed", "budget_threads_speed", "budget_over_host"):
        assert positive(arm[key]), key
