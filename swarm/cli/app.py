"""The ``swarm`` CLI (cyclopts). Global options: ``--leader-url`` and ``--json``."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import cyclopts
import msgspec
from cyclopts import Parameter

from swarm import __version__
from swarm.cli import cluster, render, sse
from swarm.cli.client import LeaderClient, decode_answer
from swarm.cli.watch import watch_job, watch_stream
from swarm.entry import run_or_exit
from swarm.errors import ConfigError, SweepRefusedError
from swarm.jobspec import decode_job_spec
from swarm.natsauth import NatsAuthority, fellow_permissions
from swarm.settings import Settings
from swarm.subjects import TOKEN_RE
from swarm.types.fleet import LogEntry

app = cyclopts.App(
    name="swarm",
    help="SilentSwarm: pipeline-parallel training across heterogeneous machines.",
    version=__version__,
)


@dataclass
class Context:
    settings: Settings
    json: bool = False

    @property
    def leader_url(self) -> str:
        """--leader-url or SWARM_LEADER_URL; else the local cluster's leader; else the default."""
        return (
            self.settings.leader_url
            or cluster.running_leader_url(self.settings)
            or self.settings.default_leader_url
        )

    def client(self) -> LeaderClient:
        return LeaderClient(self.leader_url, token=self.token)

    @property
    def token(self) -> str | None:
        """SWARM_API_TOKEN, else the token the local leader stored in the state directory."""
        return self.settings.client_token()

    def emit(self, value: Any, human: str) -> None:
        print(render.dumps(value) if self.json else human)


CTX = Context(settings=Settings())


@app.meta.default
def launcher(
    *tokens: Annotated[str, Parameter(show=False, allow_leading_hyphen=True)],
    leader_url: Annotated[
        str | None,
        Parameter(
            help="Leader URL [env SWARM_LEADER_URL; default: the leader of the cluster that "
            "start-cluster runs from SWARM_STATE_DIR, else http://127.0.0.1:8080]"
        ),
    ] = None,
    json: Annotated[bool, Parameter(help="Machine-readable JSON output")] = False,
) -> Any:
    CTX.settings = Settings.from_env().replace(leader_url=leader_url)
    CTX.json = json
    return app(tokens)


@app.command
def info() -> None:
    """Leader version, NATS URL and fellow counts."""
    with CTX.client() as client:
        data = client.info()
    counts = ", ".join(f"{k} {v}" for k, v in data.fellows.items() if v) or "none"
    CTX.emit(
        data,
        "\n".join(
            [
                f"leader    {CTX.leader_url} (version {data.version})",
                f"nats      {data.nats_url} "
                f"({'connected' if data.nats_connected else 'DISCONNECTED'})",
                f"fellows   {counts}",
                f"nodes     {data.nodes}",
                f"uptime    {data.uptime_s:.0f}s",
            ]
        ),
    )


@app.command
def fellows() -> None:
    """Every fellow the leader knows: status, host, hardware, last heartbeat."""
    with CTX.client() as client:
        workers = client.workers()
    rows = [
        [
            w.fellow_id,
            w.status,
            w.hostname,
            len(w.hardware.gpus) or "cpu",
            render.gib(w.hardware.ram_available_bytes),
            w.job_id,
            render.ago(w.last_heartbeat_age_s),
        ]
        for w in workers
    ]
    headers = ["FELLOW", "STATUS", "HOST", "GPUS", "RAM FREE", "JOB", "LAST HEARTBEAT"]
    CTX.emit(workers, render.table(headers, rows) if rows else "no fellows registered")


@app.command
def nodes() -> None:
    """Hosts with their CPU cores, RAM and GPUs (total/free VRAM)."""
    with CTX.client() as client:
        hosts = client.nodes()
    rows = []
    for n in hosts:
        gpus = ", ".join(
            f"{g.index}:{g.name} {render.gib(g.memory_free_bytes)}/"
            f"{render.gib(g.memory_total_bytes)}"
            for g in n.gpus
        )
        rows.append(
            [
                n.hostname,
                "online" if n.online else "offline",
                n.cpu_cores,
                f"{render.gib(n.ram_available_bytes)}/{render.gib(n.ram_total_bytes)}",
                gpus or "none",
                ",".join(n.fellows),
            ]
        )
    headers = ["HOST", "STATE", "CORES", "RAM FREE/TOTAL", "GPUS (FREE/TOTAL)", "FELLOWS"]
    warnings = [f"{n.hostname}: {n.gpu_warning}" for n in hosts if n.gpu_warning]
    text = render.table(headers, rows) if rows else "no nodes"
    CTX.emit(hosts, "\n".join([text, *warnings]))


@app.command
def jobs() -> None:
    """Every job: state, steps, loss, fellows."""
    with CTX.client() as client:
        records = client.jobs()
    rows = []
    for j in records:
        view = j.current_view()
        rows.append(
            [
                j.job_id,
                j.state,
                f"{view.step if view.step is not None else '-'}/{j.spec.steps}",
                "-" if view.loss is None else f"{view.loss:.4f}",
                ",".join(view.fellows) or "-",
                render.since(j.created_at),
                j.reason[:60],
            ]
        )
    headers = ["JOB", "STATE", "STEP", "LOSS", "FELLOWS", "AGE", "REASON"]
    CTX.emit(records, render.table(headers, rows) if rows else "no jobs")


@app.command
def job(job_id: str) -> None:
    """One job in full (JSON): spec, placement, progress, signals, history."""
    with CTX.client() as client:
        record = client.job(job_id)
    print(render.dumps(record))


@app.command
def submit(
    config: Annotated[Path, Parameter(help="Job spec (JSON), e.g. exp/configs/quickstart.json")],
    *,
    watch: Annotated[bool, Parameter(help="Follow the job until it ends")] = False,
    partition: Annotated[
        Literal["equal", "weighted"] | None,
        Parameter(help="Override the spec's partition: equal layers, or weighted by memory"),
    ] = None,
) -> None:
    """Submit a job; prints its id. With --watch, follows it to its end: exit 0 when it
    COMPLETED with its final model exported, 1 when it failed or was cancelled, 4 when it
    completed but its final model is not in the export (the job's export_error is printed)."""
    try:
        body = config.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {config}: {exc.strerror}") from None
    if partition is not None:
        body = _override(body, config, partition=partition)
    try:
        decode_job_spec(body)  # the leader's own checks, here first: the path, field, reason
    except ConfigError as exc:
        raise ConfigError(f"{config}: {exc.message}") from None
    with CTX.client() as client:
        record = client.submit(body)
        if not watch:
            CTX.emit(record, record.job_id)
            return
        progress = _stderr if CTX.json else print
        progress(
            f"submitted {record.job_id} ({record.name}); following it (Ctrl-C stops "
            f"following, not the job)"
        )
        final = watch_job(client, record.job_id, out=progress)
    if CTX.json:
        print(render.dumps(final))


@app.command
def sweep(
    *,
    config: Annotated[Path, Parameter(help="Sweep config (JSON): name, base job spec, grid")],
    partition: Annotated[
        Literal["equal", "weighted"] | None,
        Parameter(help="Force this partition on every point (overrides a partition axis)"),
    ] = None,
    out: Annotated[
        Path, Parameter(help="Parent of the sweep's directory (results in OUT/SWEEP_ID/)")
    ] = Path("exp/runs/sweeps"),
    sweep_id: Annotated[
        str | None, Parameter(help="Resume/write this sweep id (default: name + content hash)")
    ] = None,
    retry_failed: Annotated[
        bool, Parameter(help="On resume, run points again whose row is not COMPLETED")
    ] = False,
    point_timeout: Annotated[
        float | None, Parameter(help="Seconds a point may take; then it is cancelled")
    ] = None,
    poll: Annotated[float, Parameter(help="Seconds between polls of a running point")] = 2.0,
    dry_run: Annotated[
        bool, Parameter(help="Print the points and check the swarm can run them; submit nothing")
    ] = False,
) -> None:
    """Run a grid of jobs one after another; results.csv and a val-loss-vs-bytes PNG.

    Rerunning with the same config and --out skips the points already in results.csv.
    A sweep with allow_cpu: false points is refused at once on a swarm without usable GPUs.
    Ctrl-C cancels the running point's job and stops the sweep (rerun to resume)."""
    from swarm import sweep as sweeps

    try:
        data = config.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {config}: {exc.strerror}") from None
    if sweep_id is not None and not TOKEN_RE.match(sweep_id):
        raise ConfigError(f"--sweep-id {sweep_id!r}: 1-64 letters, digits, '-' or '_'")
    parsed = sweeps.decode_sweep_config(data, source=str(config))
    plan = sweeps.expand(
        parsed,
        source=str(config),
        overrides={"partition": partition} if partition else None,
        sweep_id_override=sweep_id,
    )
    out_dir = out / plan.sweep_id
    progress = _stderr if CTX.json else print
    notes = sweeps.override_notes(plan, sweeps.grid_size(parsed), {"partition": "--partition"})
    for note in notes:
        progress(note)
    with CTX.client() as client:
        refusal = sweeps.gpu_refusal(plan, client.nodes())
        if dry_run:
            rows = sweeps.read_rows(out_dir / "results.csv")
            report = sweeps.plan_report(plan, rows, out_dir, refusal, retry_failed=retry_failed)
            CTX.emit(*report)
            if refusal:
                raise SystemExit(1)
            return
        if refusal:
            raise SweepRefusedError(refusal)
        rows = sweeps.run_sweep(
            client,
            plan,
            out_dir,
            progress=progress,
            poll_s=poll,
            point_timeout_s=point_timeout,
            retry_failed=retry_failed,
        )
    completed = sum(1 for r in rows if r.get("state") == "COMPLETED")
    summary = {
        "sweep_id": plan.sweep_id,
        "out_dir": str(out_dir),
        "results": str(out_dir / "results.csv"),
        "plot": str(out_dir / "val_loss_vs_bytes.png"),
        "points": len(plan.points),
        "completed": completed,
        "overridden": plan.overridden,
        "rows": rows,
    }
    CTX.emit(
        summary,
        f"sweep {plan.sweep_id}: {completed}/{len(plan.points)} point(s) completed; "
        f"results {out_dir / 'results.csv'}, plot {out_dir / 'val_loss_vs_bytes.png'}",
    )


@app.command
def watch(job_id: str) -> None:
    """Live merged metrics of a job (SSE): progress bar, loss, tokens/s, step time, ETA and a
    row per fellow, until it ends. Exit 0 if it COMPLETED with its final model exported, 1 if
    it failed or was cancelled, 4 if it completed but its final model is not in the export
    (the job's export_error is printed)."""
    out = _stderr if CTX.json else print
    with CTX.client() as client:
        end = watch_stream(
            CTX.leader_url,
            job_id,
            out=out,
            tty=sys.stdout.isatty() and not CTX.json,
            token=CTX.token,
            fetch_job=client.job,
        )
    if CTX.json:
        print(render.dumps(end))


@app.command
def logs(
    fellow_id: str,
    *,
    follow: Annotated[bool, Parameter(help="Keep printing new records (SSE)")] = False,
    limit: Annotated[int, Parameter(help="How many of the latest records")] = 100,
) -> None:
    """A fellow's logs (its agent and its stage runtime), shipped to the leader."""
    with CTX.client() as client:
        records = client.logs(fellow_id, limit=limit)
    for r in records:
        _print_log(r)
    if not follow:
        return
    last = str(records[-1].seq) if records else None
    for event in sse.follow(
        CTX.leader_url,
        f"/api/v1/workers/{fellow_id}/logs/stream",
        last_event_id=last,
        token=CTX.token,
    ):
        if event.event == "logs":
            for r in decode_answer(event.data, list[LogEntry], "the log stream"):
                _print_log(r)


def _print_log(r: LogEntry) -> None:
    if CTX.json:
        print(json.dumps(msgspec.to_builtins(r), sort_keys=True))
        return
    stamp = time.strftime("%H:%M:%S", time.localtime(r.ts))
    print(f"{stamp} {r.fellow_id} {r.level:<7} {r.logger}: {r.message}")


@app.command
def cancel(job_id: str) -> None:
    """Cancel a pending or running job (its fellows stop and return to ready)."""
    with CTX.client() as client:
        record = client.cancel(job_id)
    CTX.emit(record, f"job {record.job_id} {record.state}")


@app.command
def checkpoint(job_id: str) -> None:
    """Ask every fellow of a running job to write a checkpoint at the same step."""
    with CTX.client() as client:
        record = client.checkpoint(job_id)
    acked = sum(1 for s in record.stages if s.acknowledged)
    CTX.emit(
        record,
        f"checkpoint {record.checkpoint_id} at step {record.at_step}: "
        f"{acked}/{len(record.stages)} fellows acknowledged "
        f"(see 'swarm job {job_id}' for the paths)",
    )


@app.command
def update(
    *,
    fellow_id: Annotated[str | None, Parameter(help="Only this fellow (default: all)")] = None,
) -> None:
    """Update idle fellows: joined ones reinstall the leader's package; all restart in place."""
    with CTX.client() as client:
        records = client.update(fellow_id)
    rows = [[r.fellow_id, "ok" if r.ok else r.code, r.message] for r in records]
    CTX.emit(records, render.table(["FELLOW", "RESULT", "MESSAGE"], rows) if rows else "no fellows")


@app.command
def release(
    *,
    fellow_id: Annotated[str, Parameter(help="The fellow to remove from the registry")],
    purge_install: Annotated[
        bool, Parameter(help="Also make it delete its local state (<state>/fellows/<id>)")
    ] = False,
) -> None:
    """Remove a fellow from the registry (its agent exits); --purge-install also wipes it."""
    with CTX.client() as client:
        result = client.release(fellow_id, purge_install=purge_install)
    purge = {
        None: "",
        "delivered": "; purge delivered",
        "pending": "; purge pending until it comes back (swarm pending-purges)",
    }[result.purge]
    CTX.emit(result, f"released {fellow_id}{purge}")


join_session = cyclopts.App(name="join-session", help="Join sessions for remote machines.")
app.command(join_session)


@join_session.command(name="create")
def join_session_create(
    *,
    name: Annotated[
        str | None, Parameter(help="The new fellow's id (default: its host name)")
    ] = None,
    ttl: Annotated[float, Parameter(help="Seconds the one-time token stays valid")] = 3600.0,
) -> None:
    """Create a join session and print the one command the remote host runs."""
    with CTX.client() as client:
        session = client.create_join_session(name, ttl)
    CTX.emit(
        session,
        f"join session {session.session_id} (valid {ttl:.0f}s, single use); "
        f"on the new host run:\n  {session.command}",
    )


@join_session.command(name="list")
def join_session_list() -> None:
    """Join sessions and their status (created, installing, registered, failed)."""
    with CTX.client() as client:
        sessions = client.join_sessions()
    rows = [
        [
            s.session_id,
            s.status,
            s.fellow_name or "-",
            render.since(s.created_at),
            s.log_lines,
            s.reason or "-",
        ]
        for s in sessions
    ]
    headers = ["SESSION", "STATUS", "FELLOW", "AGE", "LOG LINES", "REASON"]
    CTX.emit(sessions, render.table(headers, rows) if rows else "no join sessions")


nats_auth = cyclopts.App(
    name="nats-auth", help="NATS users for a swarm whose nats-server you run yourself."
)
app.command(nats_auth)
_AUTH_DIR = Parameter(
    help="The authority directory [SWARM_NATS_AUTH_DIR, default <state>/nats-auth]"
)


@nats_auth.command(name="init")
def nats_auth_init(*, dir: Annotated[Path | None, _AUTH_DIR] = None) -> None:
    """Create the keys (or keep existing ones), server.conf for nats-server and leader.creds."""
    authority = NatsAuthority.load_or_create(dir or CTX.settings.authority_dir)
    paths = {
        "dir": str(authority.dir),
        "server_config": str(authority.server_config_path),
        "leader_creds": str(authority.leader_creds_path),
        "account": authority.account_public,
    }
    CTX.emit(
        paths,
        f"NATS authority in {authority.dir} (account {authority.account_public})\n"
        f"  nats-server:  include {authority.server_config_path} in its config "
        "(or run it with --config)\n"
        f"  leader:       SWARM_NATS_CREDS={authority.leader_creds_path} "
        f"SWARM_NATS_AUTH_DIR={authority.dir}\n"
        "  each fellow:  swarm nats-auth fellow NAME",
    )


@nats_auth.command(name="fellow")
def nats_auth_fellow(
    name: str,
    *,
    dir: Annotated[Path | None, _AUTH_DIR] = None,
    out: Annotated[
        Path | None, Parameter(help="Write the .creds here ('-': stdout; default: the authority)")
    ] = None,
) -> None:
    """Mint a fellow's own NATS user (it may publish only its own subjects)."""
    if not TOKEN_RE.match(name):
        raise ConfigError(f"{name!r} is not a fellow id (1-64 letters, digits, '-' or '_')")
    authority = NatsAuthority.load(dir or CTX.settings.authority_dir)
    prefix = CTX.settings.subject_prefix
    if out is not None and str(out) == "-":
        sys.stdout.write(authority.fellow_creds(prefix, name))
        return
    if out is None:
        path = authority.write_fellow_creds(prefix, name)
    else:
        path = authority.write_creds(out, name, fellow_permissions(prefix, name))
    CTX.emit(
        {"fellow": name, "creds": str(path)},
        f"{path}: NATS user for fellow {name!r}; give it to that fellow as SWARM_NATS_CREDS",
    )


@app.command(name="pending-purges")
def pending_purges() -> None:
    """Purges waiting for their (offline) fellow to come back."""
    with CTX.client() as client:
        records = client.pending_purges()
    rows = [
        [p.fellow_id, render.since(p.requested_at), p.attempts, p.last_error or "-"]
        for p in records
    ]
    headers = ["FELLOW", "REQUESTED", "ATTEMPTS", "LAST ERROR"]
    CTX.emit(records, render.table(headers, rows) if rows else "no pending purges")


@app.command(name="retry-purge")
def retry_purge(
    *,
    fellow_id: Annotated[str | None, Parameter(help="Only this fellow (default: all)")] = None,
) -> None:
    """Try to deliver pending purges now."""
    with CTX.client() as client:
        results = client.retry_purges(fellow_id)
    rows = [
        [r.fellow_id, "delivered" if r.delivered else "pending", r.error or "-"] for r in results
    ]
    CTX.emit(
        results, render.table(["FELLOW", "PURGE", "ERROR"], rows) if rows else "nothing pending"
    )


@app.command
def glue(
    export_dir: Annotated[Path, Parameter(help="A job's export directory (run_manifest.json)")],
    *,
    out: Annotated[
        Path | None, Parameter(help="Where to write (default: EXPORT_DIR/full_model)")
    ] = None,
) -> None:
    """Assemble a job's pushed shards into one Keras model, checked against the pipeline."""
    argv = ["--export-dir", str(export_dir), *(["--out", str(out)] if out else [])]
    _run_runtime("agent.runtime.glue", [*argv, *(["--json"] if CTX.json else [])])


@app.command
def generate(
    *,
    model_dir: Annotated[Path, Parameter(help="A glued model (full_model/ or its export dir)")],
    prompt: Annotated[str, Parameter(help="The text to continue")],
    max_new_tokens: Annotated[int, Parameter(help="How many bytes to generate")] = 100,
    temperature: Annotated[float, Parameter(help="0: greedy")] = 0.8,
    top_k: Annotated[int, Parameter(help="Sample from the k likeliest (0: all)")] = 40,
    seed: Annotated[int, Parameter(help="Sampling seed")] = 0,
) -> None:
    """Sample text from a glued model."""
    _run_runtime(
        "agent.runtime.generate",
        [
            "--model-dir",
            str(model_dir),
            "--prompt",
            prompt,
            "--max-new-tokens",
            str(max_new_tokens),
            "--temperature",
            str(temperature),
            "--top-k",
            str(top_k),
            "--seed",
            str(seed),
        ],
    )


def _run_runtime(module: str, argv: list[str]) -> None:
    """A TensorFlow tool in its own process (the CLI never imports TensorFlow): its output
    and its exit status are the command's."""
    import os
    import subprocess

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    code = subprocess.call([sys.executable, "-m", module, *argv], env=env)
    if code:
        raise SystemExit(code)


@app.command(name="start-cluster")
def start_cluster(
    *,
    fellows: Annotated[int, Parameter(help="How many fellow agents to start")] = 2,
    leader_port: Annotated[int | None, Parameter(help="[SWARM_LEADER_PORT, default 8080]")] = None,
    nats_port: Annotated[
        int | None,
        Parameter(
            help="[SWARM_NATS_PORT, default 4222; 0 = the port this state directory's NATS "
            "had before, else a free one, kept from then on so clients keep the URL]"
        ),
    ] = None,
    state_dir: Annotated[Path | None, Parameter(help="[SWARM_STATE_DIR, default ./.swarm]")] = None,
    timeout: Annotated[float, Parameter(help="Seconds to wait for every fellow")] = 60.0,
    dev: Annotated[
        bool | None,
        Parameter(
            help="NATS without authentication (default: a NATS user per process) [SWARM_DEV]"
        ),
    ] = None,
) -> None:
    """Start NATS, the leader and N fellows in the background; return when all are ready.

    Refused while a cluster from this state directory runs, even one whose record
    (run/cluster.json) is gone: its nats-server holds the NATS store for as long as it lives.
    """
    if fellows < 1:
        raise ConfigError(f"--fellows {fellows}: a cluster needs at least 1 fellow")
    settings = CTX.settings.replace(
        leader_port=leader_port, nats_port=nats_port, state_dir=state_dir, dev=dev
    )
    settings = settings.replace(state_dir=settings.state_dir.resolve())
    progress = _stderr if CTX.json else print
    manifest = cluster.start_cluster(settings, fellows=fellows, timeout=timeout, progress=progress)
    CTX.emit(
        msgspec.to_builtins(manifest),
        f"cluster ready: {fellows} fellow(s); leader {manifest.leader_url}\n"
        f"logs in {settings.logs_dir}; stop with: swarm stop-cluster"
        + (f" --state-dir {settings.state_dir}" if state_dir else ""),
    )


@app.command(name="stop-cluster")
def stop_cluster(
    *,
    state_dir: Annotated[Path | None, Parameter(help="[SWARM_STATE_DIR, default ./.swarm]")] = None,
) -> None:
    """Stop exactly what start-cluster started; safe to run twice.

    A process it cannot stop (or cannot tell is the cluster's) keeps its record in
    run/cluster.json, and the command says which and exits 1.
    """
    settings = CTX.settings.replace(state_dir=state_dir)
    settings = settings.replace(state_dir=settings.state_dir.resolve())
    progress = _stderr if CTX.json else print
    stopped = cluster.stop_cluster(settings, progress=progress)
    CTX.emit(
        {"stopped": stopped},
        "cluster stopped" if stopped else f"no cluster running from {settings.state_dir}",
    )


def _override(body: bytes, config: Path, **fields: Any) -> bytes:
    """The spec with some top-level fields replaced (the leader still checks all of it)."""
    try:
        spec = json.loads(body)
    except ValueError as exc:
        raise ConfigError(f"{config} is not valid JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{config}: a job spec is a JSON object")
    return json.dumps({**spec, **fields}).encode()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def main() -> None:
    run_or_exit("swarm", app.meta)


if __name__ == "__main__":
    main()
