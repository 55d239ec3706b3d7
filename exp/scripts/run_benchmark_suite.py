"""Run a benchmark suite (e.g. exp/configs/benchmarks/multinode_training_v1.json).

    python exp/scripts/run_benchmark_suite.py --suite FILE --leader-url URL [--dry-run]
        [--out DIR] [--only SCENARIO ...] [--poll S] [--job-timeout S]

``--dry-run`` checks the connected fellows against each scenario's infra profile and prints
one line per scenario (what runs where, or exactly what is missing); exit 0 if every scenario
can run, 1 if some cannot. A real run refuses to start while a job is PENDING or RUNNING
(exit 1: a benchmark must not share its fellows), then runs each scenario's job once per
repeat, one at a time, and keeps for each under
``OUT/<suite_run_id>/<scenario_id>/repeat-<n>/`` (OUT: ``exp/runs/benchmarks``): ``job.json``
(the job record), ``metrics_history.json``, ``results.json`` and, when the job's
``export_dir`` exists on this machine, a copy of it in ``model_export/`` (its hard links, the
stages' ``weights.npz``, stay links). Scenarios whose infrastructure is missing are skipped
with their finding in ``OUT/<suite_run_id>/<scenario_id>/skipped.json``.

The operator token is ``SWARM_API_TOKEN`` (else the local cluster's, as for the ``swarm``
CLI). Exit 2 on a bad suite file (the path, the field and the reason), 3 when the leader is
unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from silentswarm.cli.client import LeaderClient  # noqa: E402
from silentswarm.cli.experiments import suite as suites  # noqa: E402
from silentswarm.cli.experiments.runner import wait_for_end  # noqa: E402
from silentswarm.entry import run_or_exit  # noqa: E402
from silentswarm.errors import ConfigError, LeaderResponseError  # noqa: E402
from silentswarm.settings import Settings  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", type=Path, required=True, help="the suite (JSON)")
    parser.add_argument("--leader-url", help="leader URL (default: SWARM_LEADER_URL, local)")
    parser.add_argument("--dry-run", action="store_true", help="only check the fellows")
    parser.add_argument("--out", type=Path, default=Path("exp/runs/benchmarks"))
    parser.add_argument("--suite-run-id", help="default: <suite name>-<UTC time>")
    parser.add_argument("--only", nargs="*", default=None, help="run only these scenarios")
    parser.add_argument("--poll", type=float, default=5.0, help="seconds between job polls")
    parser.add_argument("--job-timeout", type=float, default=None, help="cancel a repeat after")
    return parser.parse_args(argv)


def write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(msgspec.to_builtins(value), indent=2, sort_keys=True) + "\n")


def repeat_path(run_dir: Path, scenario: str, repeat: int) -> Path:
    """Where one repeat of a scenario keeps its artifacts (repeats count from 1)."""
    return run_dir / scenario / f"repeat-{repeat}"


def copy_keeping_links() -> Any:
    """A ``copy_function`` for :func:`shutil.copytree` that copies a file with several links
    once and links its other names to that copy (an export's ``stage-<i>/weights.npz`` is its
    newest shard's ``.npz``: copied twice, it would take twice the disk)."""
    copied: dict[tuple[int, int], str] = {}

    def copy(src: str, dst: str) -> str:
        info = os.stat(src)
        key = (info.st_dev, info.st_ino)
        if info.st_nlink > 1 and key in copied:
            os.link(copied[key], dst)
            return dst
        shutil.copy2(src, dst)
        copied[key] = dst
        return dst

    return copy


def run_repeat(
    client: LeaderClient,
    scenario: suites.ResolvedScenario,
    repeat: int,
    repeat_dir: Path,
    args: Any,
) -> dict[str, Any]:
    """One job of a scenario, start to end, and its artifacts."""
    try:
        record = client.submit(scenario.spec_json)
    except LeaderResponseError as exc:
        results = {"state": "REFUSED", "reason": f"{exc.code}: {exc.message}"}
        write_json(repeat_dir / "results.json", results)
        return results
    job_id = record.job_id
    print(f"  {scenario.name} #{repeat}: {job_id} submitted", flush=True)
    try:
        job = wait_for_end(client, job_id, poll_s=args.poll, timeout_s=args.job_timeout)
    except KeyboardInterrupt:
        # Ctrl-C stops the suite, and with it the job it started: never leave one running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        client.cancel(job_id)
        print(f"  interrupted: cancelled {job_id}", file=sys.stderr, flush=True)
        raise
    if job is None:
        client.cancel(job_id)
        job = client.job(job_id)
    write_json(repeat_dir / "job.json", job)
    write_json(repeat_dir / "metrics_history.json", client.history(job_id))
    results = suites.run_results(job)
    results["scenario"] = scenario.name
    results["repeat"] = repeat
    if scenario.network is not None:
        results["network"] = {
            "target_bandwidth_mbps": scenario.network.target_bandwidth_mbps,
            "target_latency_ms": scenario.network.target_latency_ms,
            "enforcement": scenario.network.enforcement,
        }
    export = job.export_dir
    if export and Path(export).is_dir():
        shutil.copytree(
            export,
            repeat_dir / "model_export",
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns(".incoming"),  # the leader's partial uploads
            copy_function=copy_keeping_links(),
        )
        results["model_export"] = str(repeat_dir / "model_export")
    write_json(repeat_dir / "results.json", results)
    print(
        f"  {scenario.name} #{repeat}: {job.state} loss {results['final_loss']} "
        f"val {results['final_val_loss']} tok/s {results['tokens_per_s']}",
        flush=True,
    )
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        data = args.suite.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {args.suite}: {exc.strerror}") from None
    suite = suites.decode_suite(data, source=str(args.suite))
    if args.only:
        unknown = set(args.only) - {s.name for s in suite.scenarios}
        if unknown:
            raise ConfigError(f"--only: no scenario {sorted(unknown)[0]!r} in {args.suite}")
    settings = Settings.from_env().replace(leader_url=args.leader_url)
    url = settings.leader_url or settings.default_leader_url
    if not args.leader_url and not settings.leader_url:
        from silentswarm.cli import cluster

        url = cluster.running_leader_url(settings) or url
    with LeaderClient(url, token=settings.client_token()) as client:
        findings = suites.dry_run(suite, client.fellows())
        wanted = [s for s in suite.scenarios if not args.only or s.name in args.only]
        by_name = {f.scenario: f for f in findings}
        for s in wanted:
            print(by_name[s.name].message)
        if args.dry_run:
            return 0 if all(by_name[s.name].ok for s in wanted) else 1
        busy = suites.busy_jobs(client.jobs())
        if busy:
            print(
                f"run_benchmark_suite: error: the cluster is busy ({len(busy)} job(s) pending "
                f"or running: {', '.join(busy)}); wait for them or cancel them first",
                file=sys.stderr,
            )
            return 1
        run_id = args.suite_run_id or (
            f"{suite.config.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        )
        run_dir = args.out / run_id
        write_json(run_dir / "suite.json", json.loads(data))
        print(f"suite run {run_id}: artifacts in {run_dir}", flush=True)
        all_ok = True
        collected: dict[str, list[dict[str, Any]]] = {}
        for s in wanted:
            finding = by_name[s.name]
            if not finding.ok:
                write_json(run_dir / s.name / "skipped.json", {"reason": finding.message})
                all_ok = False
                continue
            for repeat in range(1, s.repeats + 1):
                where = repeat_path(run_dir, s.name, repeat)
                results = run_repeat(client, s, repeat, where, args)
                collected.setdefault(s.name, []).append(results)
                all_ok = all_ok and results.get("state") == "COMPLETED"
                write_json(run_dir / "summary.json", suites.summarize(collected))
        print(f"suite run {run_id} done: {'all completed' if all_ok else 'some did not'}")
        return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(run_or_exit("run_benchmark_suite", lambda: main()))
