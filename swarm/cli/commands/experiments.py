"""Experiments: ``swarm sweep``, a grid of jobs run one after another (the logic is
:mod:`silentswarm.cli.experiments`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import cyclopts
from cyclopts import Parameter

from silentswarm.cli.commands.jobs import read_config
from silentswarm.cli.context import CliContext, Ctx
from silentswarm.cli.experiments import plot, runner
from silentswarm.cli.experiments import sweep as sweeps
from silentswarm.cli.options import LEADER, LeaderOptions
from silentswarm.errors import ConfigError, SweepRefusedError
from silentswarm.subjects import TOKEN_RE


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
    plot_png: Annotated[
        bool,
        Parameter(
            name="--plot",
            help=f"Draw {plot.PLOT_FILE} after every point (matplotlib: {plot.INSTALL_HINT})",
        ),
    ] = True,
    options: LeaderOptions = LEADER,
    ctx: Ctx,
) -> None:
    """Run a grid of jobs one after another; results.csv and a val-loss-vs-bytes PNG.

    Rerunning with the same config and --out skips the points already in results.csv.
    A sweep with allow_cpu: false points is refused at once on a swarm without usable GPUs.
    Ctrl-C cancels the running point's job and stops the sweep (rerun to resume)."""
    plan = load_sweep(config, partition=partition, sweep_id=sweep_id)
    out_dir = out / plan.sweep_id
    if plot_png and not dry_run and (missing := plot.missing_matplotlib()) is not None:
        ctx.progress(missing)  # once; the sweep runs on without its plot
        plot_png = False
    full_grid = sweeps.grid_size(plan.config)
    for note in sweeps.override_notes(plan, full_grid, {"partition": "--partition"}):
        ctx.progress(note)
    with ctx.client() as client:
        refusal = sweeps.gpu_refusal(plan, client.nodes())
        if dry_run:
            rows = runner.read_rows(out_dir / "results.csv")
            ctx.emit(*sweeps.plan_report(plan, rows, out_dir, refusal, retry_failed=retry_failed))
            if refusal:
                raise SystemExit(1)
            return
        if refusal:
            raise SweepRefusedError(refusal)
        rows = runner.run_sweep(
            client,
            plan,
            out_dir,
            progress=ctx.progress,
            poll_s=poll,
            point_timeout_s=point_timeout,
            retry_failed=retry_failed,
            with_plot=plot_png,
        )
    _report(ctx, plan, out_dir, rows, with_plot=plot_png)


def load_sweep(config: Path, *, partition: str | None, sweep_id: str | None) -> sweeps.Sweep:
    """The sweep a config file and the command's overrides describe, every point checked."""
    data = read_config(config)
    if sweep_id is not None and not TOKEN_RE.match(sweep_id):
        raise ConfigError(f"--sweep-id {sweep_id!r}: 1-64 letters, digits, '-' or '_'")
    parsed = sweeps.decode_sweep_config(data, source=str(config))
    return sweeps.expand(
        parsed,
        source=str(config),
        overrides={"partition": partition} if partition else None,
        sweep_id_override=sweep_id,
    )


def _report(
    ctx: CliContext,
    plan: sweeps.Sweep,
    out_dir: Path,
    rows: list[dict[str, str]],
    *,
    with_plot: bool,
) -> None:
    completed = sum(1 for r in rows if r.get("state") == "COMPLETED")
    plot_path = out_dir / plot.PLOT_FILE if with_plot else None
    summary: dict[str, Any] = {
        "sweep_id": plan.sweep_id,
        "out_dir": str(out_dir),
        "results": str(out_dir / "results.csv"),
        "plot": None if plot_path is None else str(plot_path),
        "points": len(plan.points),
        "completed": completed,
        "overridden": plan.overridden,
        "rows": rows,
    }
    ctx.emit(
        summary,
        f"sweep {plan.sweep_id}: {completed}/{len(plan.points)} point(s) completed; "
        f"results {out_dir / 'results.csv'}" + ("" if plot_path is None else f", plot {plot_path}"),
    )


def register(app: cyclopts.App) -> None:
    app.command(sweep)
