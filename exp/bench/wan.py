"""WAN benchmark: a 2-stage pipeline over emulated slow links, per profile, codec and transport.

Every boundary of a shaped arm crosses a path of ``linkemu.py`` (a network namespace, a
``tbf`` rate limit per direction, a user-space relay for the one-way delay): stage 1 runs in
the namespace, stage 0 in the root namespace. ``loopback`` arms use no path. In ``tunnel``
arms the nats-server runs beside stage 0 and stage 1 reaches it through the path, so the
relay crosses the slow link once, as p2p does.

Each arm is (profile, compression, transport, schedule, micro_batches, in_flight, defer:
``TrainConfig.defer_weight_grads``, "auto" unless ``--defer`` says otherwise). Its reference
is the ``loopback`` arm with codec ``none`` and the same transport, schedule, micro-batches,
in-flight window and deferral, run in the same invocation (added when not asked for):

- ``tokens_per_s``: the median over short interleaved rounds (the arms' order flips every
  round) of the last stage's tokens/s over the second half of its steps (past compilation and
  an "auto" arm's first calibrations); ``retention`` the median of the per-round ratios to the
  reference's;
- ``bytes_per_step``: a training step's bytes across the boundary, both directions, headers and
  scales included (the median per step; validation left out);
- ``val_loss`` after ``--loss-steps`` steps, same seed and data; ``val_loss_vs_reference`` its
  relative difference from the reference's. With ``--loss-seeds`` every loss run is repeated
  with each seed (weights, data order): ``val_loss`` is then the mean over the seeds,
  ``val_loss_vs_reference`` the mean of the per-seed differences (each seed against the
  reference of the same seed), both per seed in ``val_loss_per_seed`` and
  ``val_loss_vs_reference_per_seed``: a 400-step trajectory moves by a percent or more from
  seed to seed, as much as int8's rounding costs;
- an ``overlap`` arm (``--schedules overlap``) also has ``speedup_vs_sync`` (median per-round
  ratio of its tokens/s to its synchronous twin's, the same arm with ``1f1b``, added when not
  asked for) and ``val_loss_vs_sync`` (its validation loss against the twin's): what
  overlapping the steps buys and what its delayed update costs.

  Neither schedule's math depends on the link (the same frames arrive, later) or on the
  in-flight window or the deferral (the same gradients accumulate in the same order, to
  float rounding; the overlap schedule
  delays every update by one step whatever the timing), so each (codec, transport, schedule,
  m) trains once, over loopback, and its arms on every profile and window share that run
  (``loss_profile``); ``--loss-per-arm`` trains every arm over its own link instead, to check
  that claim. An arm whose compression or micro-batch count is ``auto`` always trains over its
  own link: there the link decides what the stages choose. Where the loss runs would train
  exactly as the throughput runs did (``--quick``: the same steps and config), the
  throughput runs are taken as they are. ``chosen`` says what an arm's last round
  measured (round trip, Mbit/s each way) and settled on (codecs, count, window).

The last line is one JSON object: ``{"bench": "wan", "arms": [...], ...}``; a PNG of tokens/s
per profile and codec is written beside it (``--png``).

    python exp/bench/wan.py --profiles wan100 --specs none fixed_int8
    python exp/bench/wan.py --profiles wan20 --specs auto --micro-batches auto
    python exp/bench/wan.py --profiles wan100 --specs fixed_int8 --schedules overlap
    python exp/bench/wan.py --quick        # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
from _common import emit, load_avg, wire_per_step  # puts the repo on sys.path
from linkemu import PROFILES, EmulatorUnavailable, FarSide, check_available, profile, remove_stale

from silentswarm.agent.runtime.launch import done, run_plans
from silentswarm.natsd import start_nats_server
from silentswarm.plan import ModelConfig, NatsAccess, Peer, TrainConfig, Transport, chain_plans
from silentswarm.procs import free_port

SPECS = ["none", "fp16", "fixed_int8", "fixed_int4", "learned_dim32_int8"]
# "1f1b": synchronous (the default); "overlap": consecutive steps overlap, each update a
# step late (TrainConfig.schedule).
SCHEDULES = ["1f1b", "overlap"]


@dataclass(frozen=True)
class Arm:
    profile: str
    compression: str
    transport: str
    schedule: str
    micro_batches: int | str  # or "auto"
    in_flight: int | None = None  # TrainConfig.in_flight; None: 1F1B's p - s
    defer: int | str = "auto"  # TrainConfig.defer_weight_grads

    @property
    def adaptive(self) -> bool:
        """Whether the stages choose from what they measure: then the link decides the math."""
        return "auto" in (self.compression, self.micro_batches)

    @property
    def reference(self) -> Arm:
        return Arm(
            "loopback",
            "none",
            self.transport,
            self.schedule,
            self.micro_batches,
            self.in_flight,
            self.defer,
        )

    @property
    def synchronous(self) -> Arm:
        """The same arm with the synchronous schedule: what an overlap arm is compared with."""
        return dataclasses.replace(self, schedule="1f1b")

    @property
    def math(self) -> tuple[Any, ...]:
        """What decides the arm's losses: neither the link nor the in-flight window (the same
        gradients accumulate in the same order, and the overlap schedule delays each update by
        one step whatever the timing), unless the stages choose codecs or counts from the
        link ("auto")."""
        link = (self.profile,) if self.adaptive else ()
        return (self.compression, self.transport, self.schedule, self.micro_batches, *link)

    @property
    def tag(self) -> str:
        window = f"-w{self.in_flight}" if self.in_flight else ""
        schedule = "" if self.schedule == "1f1b" else f"-{self.schedule}"
        defer = "" if self.defer == "auto" else f"-d{self.defer}"
        return (
            f"{self.profile}-{self.compression}-{self.transport}-m{self.micro_batches}{window}"
            f"{schedule}{defer}"
        ).replace("_", "-")


def plan_arms(
    profiles: list[str],
    specs: list[str],
    transports: list[str],
    schedules: list[str],
    ms: list[int],
    in_flights: list[int | None] | None = None,
    defers: list[int | str] | None = None,
) -> list[Arm]:
    """Every combination asked for, and each one's reference (and an overlap arm's
    synchronous twin) where it is not among them."""
    arms = [
        Arm(p, c, t, s, m, w, d)
        for p in profiles
        for c in specs
        for t in transports
        for s in schedules
        for m in ms
        for w in in_flights or [None]
        for d in defers or ["auto"]
    ]
    todo = list(arms)
    while todo:
        arm = todo.pop()
        for needed in (arm.reference, arm.synchronous):
            if needed not in arms:
                arms.insert(0, needed)
                todo.append(needed)
    return arms


def run_arm(
    work: Path, arm: Arm, model: ModelConfig, train: TrainConfig, *, shaped: bool = True
) -> dict[str, Any]:
    """One 2-stage run of ``arm`` (over its profile's path unless ``shaped`` is False): the
    last stage's done event, with the boundary's bytes per step."""
    prof = profile(arm.profile) if shaped else PROFILES["loopback"]
    train = msgspec.structs.replace(
        train,
        micro_batches=arm.micro_batches,
        in_flight=arm.in_flight,
        schedule=arm.schedule,
        defer_weight_grads=arm.defer,
    )
    run_dir = work / f"{arm.tag}-{train.steps}"
    run_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as cleanup:
        far = cleanup.enter_context(FarSide(prof, seed=train.seed)) if prof.shaped else None
        nats = None
        near_host = far.near_ip if far else "127.0.0.1"
        if arm.transport == "tunnel":
            nats = start_nats_server(
                host=near_host,
                port=0,
                store_dir=run_dir / "nats",
                log_path=run_dir / "nats.log",
                tie_to_parent=True,
            )
            cleanup.callback(nats.stop)
        port = free_port()
        plans = chain_plans(
            job_id=f"wan-{arm.tag}",
            model=model,
            train=train,
            addresses=[None, f"tcp://127.0.0.1:{port}"],
            compression=arm.compression,
            transport=Transport(arm.transport),
            nats_url=nats.url if nats else None,
            intra_op_threads=1,
        )
        prefixes: dict[int, list[str]] = {}
        if far is not None:
            prefixes[1] = far.prefix
            if arm.transport == "tunnel":
                host, entry = far.relay(far=True, target=(far.near_ip, nats.port))
                plans[1] = msgspec.structs.replace(
                    plans[1], nats=NatsAccess(url=f"nats://{host}:{entry}")
                )
            else:
                host, entry = far.relay(far=False, target=(far.far_ip, port))
                plans[1] = msgspec.structs.replace(
                    plans[1], data_address=f"tcp://{far.far_ip}:{port}"
                )
                plans[0] = msgspec.structs.replace(
                    plans[0],
                    next=Peer(fellow_id=plans[1].fellow_id, data_address=f"tcp://{host}:{entry}"),
                )
        first, last = run_plans(plans, run_dir, timeout=3600, command_prefixes=prefixes)
    summary = dict(done(last))
    summary["bytes_per_step"] = wire_per_step(first)
    summary["tokens_per_s"] = steady_tokens_per_s(last)
    summary["chosen"] = chosen(first, last)
    return summary


def steady_tokens_per_s(events: list[dict[str, Any]]) -> float:
    """The last stage's tokens/s over the second half of its steps: past compilation, and
    past the first calibrations of an "auto" arm (a new micro-batch count compiles anew)."""
    ran = [e for e in events if e["event"] == "step"]
    half = ran[len(ran) // 2 :]
    seconds = sum(e["step_time_s"] for e in half)
    return sum(e["step_time_s"] * e["tokens_per_s"] for e in half) / seconds


def chosen(first: list[dict[str, Any]], last: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the last calibration measured and settled on (the boundary's codecs, the
    schedule), from stage 0's links events, and the deferred weight passes the last stage
    kept (its check of the calibration's proposal may have settled on another count, with
    the steps it measured); None without a calibration."""
    links = [e for e in first if e["event"] == "links" and e.get("down_link")]
    if not links:
        return None
    link, tuning = links[-1]["down_link"], links[-1]["tuning"]
    kept = [e["tuning"] for e in last if e["event"] == "links" and e.get("tuning")]
    final = kept[-1] if kept else tuning
    return {
        "rtt_ms": link["rtt_ms"],
        "fwd_mbit_s": link["fwd_mbit_s"],
        "bwd_mbit_s": link["bwd_mbit_s"],
        "fwd_codec": link["fwd_codec"],
        "bwd_codec": link["bwd_codec"],
        "micro_batches": tuning["micro_batches"],
        "in_flight": tuning["in_flight"],
        "deferred": final.get("deferred", 0),
        "deferral": final.get("deferral"),
    }


def throughput(
    work: Path, arms: list[Arm], model: ModelConfig, train: TrainConfig, rounds: int
) -> tuple[dict[Arm, list[float]], dict[Arm, dict[str, Any]]]:
    """tokens/s of every arm in every round (the order flips every round), and each arm's
    last run (what it measured and chose)."""
    got: dict[Arm, list[float]] = {arm: [] for arm in arms}
    last: dict[Arm, dict[str, Any]] = {}
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            result = run_arm(work / f"round-{r}", arm, model, train)
            got[arm].append(result["tokens_per_s"])
            last[arm] = result
            print(
                f"  round {r + 1} {arm.tag:40s} {result['tokens_per_s']:8.0f} tok/s  "
                f"{result['chosen']}",
                flush=True,
            )
    return got, last


def losses(
    work: Path,
    arms: list[Arm],
    model: ModelConfig,
    train: TrainConfig,
    per_arm: bool,
    seeds: list[int],
    ran: tuple[TrainConfig, dict[Arm, dict[str, Any]]] | None = None,
) -> dict[Arm, dict[int, dict[str, Any]]]:
    """Each arm's loss run per seed: its own, or the loopback run of its math (see the
    module doc). ``ran`` is a training config and the runs already made with it: a loss
    run that is one of them (the same config, and the same arm or the same math over
    loopback) is not made again."""
    runs: dict[Any, dict[str, Any]] = {}
    out: dict[Arm, dict[int, dict[str, Any]]] = {}

    def key(arm: Arm, seed: int) -> tuple[Any, int]:
        return (arm if per_arm else arm.math, seed)

    def over_link(arm: Arm) -> bool:
        return per_arm or arm.adaptive

    for seed in seeds:
        seeded = msgspec.structs.replace(train, seed=seed)
        for arm, result in ran[1].items() if ran and ran[0] == seeded else ():
            if (over_link(arm) or not profile(arm.profile).shaped) and key(arm, seed) not in runs:
                runs[key(arm, seed)] = {**result, "loss_profile": arm.profile}
                print(f"  loss {arm.tag:40s} seed {seed}: its throughput run", flush=True)
        for arm in arms:
            k = key(arm, seed)
            if k not in runs:
                linked = over_link(arm)
                result = run_arm(work / f"loss-{seed}", arm, model, seeded, shaped=linked)
                result["loss_profile"] = arm.profile if linked else "loopback"
                runs[k] = result
                print(
                    f"  loss {arm.tag if per_arm else '/'.join(map(str, arm.math)):40s} "
                    f"seed {seed} val loss {result['val_loss']:.4f} "
                    f"over {result['loss_profile']}",
                    flush=True,
                )
            out.setdefault(arm, {})[seed] = runs[k]
    return out


def versus(runs: dict[int, dict[str, Any]], refs: dict[int, dict[str, Any]]) -> list[float]:
    """Per seed, the relative validation-loss difference of a run from its reference's."""
    return [runs[s]["val_loss"] / refs[s]["val_loss"] - 1.0 for s in runs]


def tunnel_vs_p2p(tps: dict[Arm, list[float]]) -> list[dict[str, Any]]:
    """For every tunnel arm with a p2p twin: the median per-round ratio of their tokens/s."""
    out = []
    for arm, values in tps.items():
        twin = dataclasses.replace(arm, transport="p2p")
        if arm.transport == "tunnel" and twin in tps:
            out.append(
                {
                    "profile": arm.profile,
                    "compression": arm.compression,
                    "schedule": arm.schedule,
                    "micro_batches": arm.micro_batches,
                    "in_flight": arm.in_flight,
                    "defer": arm.defer,
                    "ratio": statistics.median(
                        a / b for a, b in zip(values, tps[twin], strict=True)
                    ),
                }
            )
    return out


def loss_cost(row: dict[str, Any], rows: list[dict[str, Any]]) -> float:
    """An arm's validation loss against the synchronous loopback ``none`` arm (same transport,
    count and window): its ``val_loss_vs_reference`` for a synchronous arm; for an overlap
    arm, whose reference overlaps too, what the delayed update costs is counted as well."""
    if row["schedule"] == "1f1b":
        return row["val_loss_vs_reference"]
    same = ("transport", "micro_batches", "in_flight", "defer")
    for ref in rows:
        if (ref["profile"], ref["compression"], ref["schedule"]) == (
            "loopback",
            "none",
            "1f1b",
        ) and all(ref.get(k) == row.get(k) for k in same):
            mine, theirs = row["val_loss_per_seed"], ref["val_loss_per_seed"]
            return statistics.fmean(mine[s] / theirs[s] - 1.0 for s in mine)
    return float("inf")  # no synchronous reference in this run: the target is not shown met


def targets(rows: list[dict[str, Any]], relay: list[dict[str, Any]]) -> dict[str, bool]:
    """The issue's targets, for the arms this run has (a target without its arm is left out):
    met where any arm of that profile and codec (any transport, schedule, m, window) meets it,
    its loss counted against the synchronous reference (:func:`loss_cost`)."""
    goals = {
        "wan100_fixed_int8_retention_ge_0.90_loss_le_1pct": ("wan100", "fixed_int8", 0.90, 0.01),
        "wan20_learned_dim32_int8_retention_ge_0.80_loss_le_3pct": (
            "wan20",
            "learned_dim32_int8",
            0.80,
            0.03,
        ),
    }
    out = {}
    for name, (prof, codec, retention, loss) in goals.items():
        arms = [r for r in rows if (r["profile"], r["compression"]) == (prof, codec)]
        if arms:
            out[name] = any(
                r["retention"] >= retention and loss_cost(r, rows) <= loss for r in arms
            )
    wan100 = [r["ratio"] for r in relay if r["profile"] == "wan100"]
    if wan100:
        out["wan100_tunnel_within_5pct_of_p2p"] = all(r >= 0.95 for r in wan100)
    return out


def draw(path: Path, rows: list[dict[str, Any]]) -> bool:
    """Grouped bars: tokens/s per profile (groups) and codec (bars; one per in-flight window
    and schedule where the run has several: 1F1B's window hatched, overlapped steps dotted);
    False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    codecs = list(dict.fromkeys(r["compression"] for r in rows))
    series = sorted(
        {(r["compression"], r["in_flight"], r["schedule"], r.get("defer", "auto")) for r in rows},
        key=lambda cwsd: (codecs.index(cwsd[0]), cwsd[1] or 0, cwsd[2], str(cwsd[3])),
    )
    windows = len({w for _, w, _, _ in series}) > 1
    schedules = len({k for _, _, k, _ in series}) > 1
    defers = len({d for _, _, _, d in series}) > 1
    colours = {c: f"C{i}" for i, c in enumerate(codecs)}
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(2.0 + 1.8 * len(profiles), 4.8))
    for i, (codec, window, schedule, defer) in enumerate(series):
        xs, ys = [], []
        for j, prof in enumerate(profiles):
            values = [
                r["tokens_per_s"]
                for r in rows
                if (
                    r["profile"],
                    r["compression"],
                    r["in_flight"],
                    r["schedule"],
                    r.get("defer", "auto"),
                )
                == (prof, codec, window, schedule, defer)
            ]
            if values:
                xs.append(j + (i - (len(series) - 1) / 2) * width)
                ys.append(statistics.median(values))
        label = codec
        if windows:
            label += ", " + (f"{window} in flight" if window else "1F1B")
        if schedules:
            label += f", {schedule}"
        if defers:
            label += f", {defer} deferred"
        hatch = ("" if window else "//") + (".." if schedule == "overlap" else "")
        ax.bar(xs, ys, width, label=label, color=colours[codec], hatch=hatch)
    ax.set_xticks(range(len(profiles)), profiles)
    ax.set_ylabel("tokens/s (2 stages)")
    ax.set_title("Throughput per link profile, codec, window, schedule")
    ax.legend(fontsize="x-small", ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def micro_batches(text: str) -> int | str:
    """A --micro-batches (or --defer) value: a count, or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count nor auto") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", default=["wan100", "wan20"], choices=PROFILES)
    parser.add_argument("--specs", nargs="+", default=None, help=f"codecs (default: {SPECS})")
    parser.add_argument("--schedules", nargs="+", default=["1f1b"], choices=SCHEDULES)
    parser.add_argument("--transports", nargs="+", default=["p2p"], choices=["p2p", "tunnel"])
    parser.add_argument(
        "--micro-batches",
        type=micro_batches,
        nargs="+",
        default=None,
        help='micro-batches per step, or "auto" (the stages choose)',
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        nargs="+",
        default=None,
        help="micro-batches in flight per stage (TrainConfig.in_flight; 0 or default: 1F1B's)",
    )
    parser.add_argument(
        "--defer",
        type=micro_batches,
        nargs="+",
        default=None,
        help='deferred weight-gradient passes (TrainConfig.defer_weight_grads): counts or "auto"'
        " (default: auto)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="throughput rounds (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps of a throughput run")
    parser.add_argument("--loss-steps", type=int, default=None, help="steps of a loss run (400)")
    parser.add_argument("--loss-per-arm", action="store_true", help="train each arm on its link")
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed (one for all arms)")
    parser.add_argument(
        "--loss-seeds",
        type=int,
        nargs="+",
        default=None,
        help="repeat each loss run with these seeds and average (default: --seed)",
    )
    parser.add_argument("--png", type=Path, default=None, help="where the plot goes")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = parser.parse_args()
    try:
        check_available()
    except EmulatorUnavailable as e:
        sys.exit(f"wan.py: {e}")
    remove_stale()

    if args.quick:
        model = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32)
        train = TrainConfig(
            steps=args.steps or 6,
            batch_size=8,
            max_data_bytes=500_000,
            val_batches=2,
            seed=args.seed,
        )
        # the loss runs are the throughput runs (losses() does not make them again)
        loss_train = msgspec.structs.replace(train, steps=args.loss_steps or train.steps)
        ms = args.micro_batches or [4]
        specs = args.specs or ["none", "fixed_int8"]
    else:
        # The speed model of pipeline.py.
        model = ModelConfig(n_layers=4, d_model=256, n_heads=8, seq_len=128)
        train = TrainConfig(steps=args.steps or 20, batch_size=16, seed=args.seed)
        loss_train = msgspec.structs.replace(
            train, steps=args.loss_steps or 400, warmup_steps=20, val_batches=64
        )
        ms = args.micro_batches or [8]
        specs = args.specs or SPECS
    windows = [w or None for w in args.in_flight] if args.in_flight else None
    arms = plan_arms(args.profiles, specs, args.transports, args.schedules, ms, windows, args.defer)
    rounds = args.rounds or (1 if args.quick else 2)
    work = args.work or Path(tempfile.mkdtemp(prefix="swarm-wan-"))
    png = args.png or work / "wan_tokens_per_s.png"
    print(f"model {model}\nwork dir {work}\n{len(arms)} arms, {rounds} rounds", flush=True)
    load_start = load_avg()
    tps, tps_last = throughput(work, arms, model, train, rounds)
    seeds = list(dict.fromkeys(args.loss_seeds or [args.seed]))
    loss = losses(work, arms, model, loss_train, args.loss_per_arm, seeds, ran=(train, tps_last))
    rows = []
    for arm in arms:
        ref = arm.reference
        runs = loss[arm]
        run = runs[seeds[0]]
        vs_ref = versus(runs, loss[ref])
        row = {
            **asdict(arm),
            "tokens_per_s": statistics.median(tps[arm]),
            "retention": statistics.median(a / b for a, b in zip(tps[arm], tps[ref], strict=True)),
            "bytes_per_step": run["bytes_per_step"],
            "val_loss": statistics.fmean(r["val_loss"] for r in runs.values()),
            "val_loss_vs_reference": statistics.fmean(vs_ref),
            "val_loss_per_seed": {str(s): r["val_loss"] for s, r in runs.items()},
            "val_loss_vs_reference_per_seed": {
                str(s): v for s, v in zip(runs, vs_ref, strict=True)
            },
            "loss_profile": run["loss_profile"],
            "chosen": tps_last[arm]["chosen"],
            "per_round_tokens_per_s": tps[arm],
        }
        if arm.schedule != "1f1b":
            sync = arm.synchronous
            row["speedup_vs_sync"] = statistics.median(
                a / b for a, b in zip(tps[arm], tps[sync], strict=True)
            )
            row["val_loss_vs_sync"] = statistics.fmean(versus(runs, loss[sync]))
        rows.append(row)
        print(
            f"  {arm.tag:40s} {row['tokens_per_s']:8.0f} tok/s  retention {row['retention']:.2f}"
            f"  {row['bytes_per_step'] / 2**20:7.2f} MiB/step  val loss {row['val_loss']:.4f}"
            f" ({100 * row['val_loss_vs_reference']:+.2f}%)",
            flush=True,
        )
    drew = draw(png, rows)
    if not drew:
        print(
            f"  no {png.name}: matplotlib is not installed (pip install 'silentswarm[plots]')",
            flush=True,
        )
    relay = tunnel_vs_p2p(tps)
    for row in relay:
        print(
            f"  tunnel vs p2p {row['profile']} {row['compression']} in flight "
            f"{row['in_flight'] or '1F1B'}: {row['ratio']:.2f}",
            flush=True,
        )
    emit(
        {
            "bench": "wan",
            "quick": args.quick,
            "model": msgspec.to_builtins(model),
            "steps": train.steps,
            "loss_steps": loss_train.steps,
            "loss_seeds": seeds,
            "arms": rows,
            "profiles": {
                name: msgspec.to_builtins(asdict(PROFILES[name]))
                for name in dict.fromkeys(a.profile for a in arms)
            },
            "tunnel_vs_p2p": relay,
            "targets": targets(rows, relay),
            "png": str(png) if drew else None,
            "cpu_count": os.cpu_count(),
            "load_avg": {"start": load_start, "end": load_avg()},
        }
    )


if __name__ == "__main__":
    main()
