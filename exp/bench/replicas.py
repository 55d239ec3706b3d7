"""Replicas benchmark: replicas against one fellow, placement by speed, splits and sites.

Placement: an 8-block model on two stage processes, one at 100% of a core and one held to
50% by a cgroup v1 CPU quota (``cpu.cfs_quota_us`` 50000 over a 100000 period; the group is
made for the run and removed after), every process with 1 intra-op thread, 4 micro-batches.

1. Each fellow's speed is probed (``silentswarm.agent.hardware.probe_compute_speed``, the
   agent's own probe, the slow one inside the quota: its speed while it ran); the leader's
   ``place()`` with ``"partition": "balanced"`` and the slow fellow's ``cpu_share`` (0.5: one
   thread in half a core, as ``leader.decide.cpu_share`` derives it from a fellow's quota)
   gives the stage order and the probe's split.
2. A first job runs the equal split; its stages' step records (step time less waits and
   less the seconds the quota held them back) give each fellow's measured speed through the
   leader's own ``balance.measured_speed``, as the leader learns it; ``place()`` with those
   speeds and the share gives the **balanced** split (what the leader places once it has
   run a job on the fellows).
3. Every contiguous split of the 8 blocks over that stage order (1-7 ... 7-1) trains as a real
   2-stage pipeline (loopback ZeroMQ), in short rounds whose order alternates; each split's
   figure is the median over rounds of its slowest stage's steady tokens/s. ``equal`` is the
   4-4 split, ``balanced`` the split of step 2, ``best`` the best of all (so balanced and
   equal are measured in the same rounds as the others, side by side); the probe's split is
   reported beside them.

Runs (``--only runs``): stage replicas against one fellow, every process with 1 intra-op
thread (the comparison is of fellows, not of threads), real stage processes on loopback
ZeroMQ, in one invocation:

1. **Speed**, the speed model of ``pipeline.py`` (4 blocks, d_model 256, seq 128, batch 16
   per replica, one micro-batch): one fellow, and 2 replicas x 1 stage (``allreduce``), in
   short rounds whose order alternates; a run's tokens/s is the sum over its replicas of each
   pipeline's slowest stage's steady tokens/s, ``speedup_vs_one`` its ratio to the one
   fellow's (median of rounds). The **ceiling** runs in the same rounds: two one-fellow runs
   at once with no sync (what two processes get of this machine); the 2 x 1 run reports it
   (``ceiling_tokens_per_s``) and its ``fraction_of_ceiling`` (median of per-round ratios).
2. **Convergence**, a smaller model (4 blocks, d_model 128, seq 64, batch 8 per replica),
   ``--loss-steps`` steps (default 600) with the same seed and data: 2 replicas x 1 stage
   ``allreduce``, and ``diloco`` with H = ``--diloco-every`` (default 20) twice: with the
   spec's default outer optimizer (SGD lr 0.7, Nesterov momentum 0.9) and with plain
   averaging (lr 1.0, no momentum), then plain averaging at H / 4; each with its final
   validation loss (replica 0's last stage) and ``bytes_per_token``: the bytes the replicas
   sent each other over their rings per token trained (all replicas' tokens). The 2% target
   is checked against the better of the two outer settings at H. Each convergence run also
   reports ``sync_clipped`` and ``sync_missed``: the contributions its rings clipped (a norm
   far above the others') or went without (summed over its stages and rounds).
   ``--learning-rate`` sets the inner (AdamW) learning rate of every convergence run (default
   the spec's).
3. **2 replicas x 2 stages** on 4 processes (contended on 2 cores: correctness and bytes, not
   speed), ``allreduce`` on the speed model.

Splits (``--only splits``): replicas on unequal fellows, each splitting the layers on its
own fellows (one ring per segment of layers, silentswarm.rings) against one split for every
replica (over each stage position's weakest fellow, as placement does where rings per
segment cannot be). The placement model (8 blocks), 2 replicas x 2 stages on four stage
processes, each in a cgroup v1 CPU quota: shares 0.5 and 0.5 of a core for replica 0's
fellows, 0.25 and 0.75 for replica 1's (2 cores in all, this machine's); the splits come from
the leader's ``place()`` (``balanced``, the shares as speeds, p2p with two sync ports per
fellow, or one, which gives one split); ``allreduce``, alternating rounds, each run's
tokens/s the sum over replicas of each pipeline's slowest stage, ``own_over_one`` the
median of the per-round ratios.

Sites (``--only sites``): replicas on two sites joined by a slow path (a network namespace
one veth pair away, 20 Mbit/s each way with ``tbf``, no added delay: ``linkemu.FarSide``),
fellows a and b on the near site, c and d on the far one, ranked a b c d. 2 replicas x 2
stages, p2p, 1 intra-op thread each, the convergence model, ``--steps`` (default 60) steps
with a DiLoCo sync every ``--diloco-every`` (20; plain averaging) or ``allreduce``; both
groupings in alternating rounds: ``spread`` (dealt like cards: each pipeline across the path,
each ring on one site) and ``at_home`` (each pipeline on one site, each ring across). The
leader's ``place()``, given the path's rate as the measured links across it, picks one
(``chosen``); ``chosen_over_other`` is the median of the per-round ratios of its tokens/s
to the other's (``--quick``: ``diloco`` alone). Needs root (the namespace); left out, with
the reason, where it cannot be made.

The last line is one JSON object with every figure.

    python exp/bench/replicas.py                             # runs, placement, splits
    python exp/bench/replicas.py --only runs                 # the replica arms (~8 minutes)
    python exp/bench/replicas.py --only placement            # the full run (~15 minutes)
    python exp/bench/replicas.py --only placement --quick    # a smoke run (~1.5 minutes): a
        # small model, one round, only the equal split (the first job) and the balanced one
    python exp/bench/replicas.py --only splits               # ~8 minutes (--quick: ~2)
    python exp/bench/replicas.py --only sites                # ~8 minutes (--quick: ~1.5)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil
from _common import emit, load_avg, verdict  # puts the repo on sys.path
from cpuquota import cpu_quota

from silentswarm.agent.hardware import probe_compute_speed
from silentswarm.agent.runtime.launch import done, run_plans
from silentswarm.cpus import cpu_budget
from silentswarm.jobspec import JobSpec, Partition
from silentswarm.leader import balance
from silentswarm.leader.decide import cpu_share
from silentswarm.leader.placement import Candidate, Unplaceable, place
from silentswarm.plan import (
    ModelConfig,
    TrainConfig,
    Transport,
    chain_plans,
    replicated_chain_plans,
    single_process_plan,
)
from silentswarm.procs import free_port, free_ports
from silentswarm.types.links import MeasuredLink

SLOW_SHARE = 0.5
FAST, SLOW = "fast", "slow"


def probe_speeds(prefix: list[str] | None) -> dict[str, float]:
    """Both fellows' probed speeds, one after the other (each fellow probes its own machine;
    here they share one)."""
    speeds = {}
    for name, where in ((FAST, None), (SLOW, prefix)):
        speed, error = asyncio.run(probe_compute_speed(threads=1, prefix=where))
        if speed is None:
            raise SystemExit(f"the compute speed probe failed on {name}: {error}")
        speeds[name] = speed
    return speeds


def stage_speeds(
    events: list[list[dict[str, Any]]],
    order: list[str],
    sizes: list[int],
    model: ModelConfig,
    batch_size: int,
) -> dict[str, float]:
    """Each fellow's speed as the leader learns it from a run's step records: the median
    step's work (step time less waits; the first steps compile and are left out), through
    the leader's own :func:`balance.measured_speed`."""
    speeds = {}
    for stage, (name, stage_events) in enumerate(zip(order, events, strict=True)):
        steps = [e for e in stage_events if e["event"] == "step"][balance.SKIP_STEPS :]
        busy = statistics.median(e["step_time_s"] - e["wait_s"] - e["throttled_s"] for e in steps)
        speed = balance.measured_speed(
            model,
            batch_size=batch_size,
            layers=sizes[stage],
            last=stage == len(order) - 1,
            busy_s=busy,
        )
        if speed is None:
            raise SystemExit(f"stage {stage} ({name}) reported no work")
        speeds[name] = round(speed, 4)
    return speeds


def balanced_split(
    model: ModelConfig, train: TrainConfig, speeds: dict[str, float], shares: dict[str, float]
):
    """Through the leader's own placement: the stage order and the layer count of each
    (``shares``: each fellow's CPU share, as the leader derives it from its quota)."""
    ram = psutil.virtual_memory().available
    candidates = [
        Candidate(
            fellow_id=name,
            hostname=name,
            data_address=f"tcp://127.0.0.1:{free_port()}",
            cpu_cores=1,
            host_cpu_cores=cpu_budget().host,  # one machine's, as both fellows would report
            ram_available_bytes=ram,
            compute_speed=speed,
            cpu_share=shares.get(name, 1.0),
        )
        for name, speed in speeds.items()
    ]
    spec = JobSpec(
        model=model,
        partition=Partition.BALANCED,
        allow_cpu=True,
        stages=2,
        **msgspec.structs.asdict(train),
    )
    placement = place(spec, candidates)
    if isinstance(placement, Unplaceable):
        raise SystemExit(f"no balanced placement: {placement.reason}")
    order = [s.fellow_id for s in placement.stages]
    return order, placement.stages[0].layer_end


def run_split(
    work: Path,
    job: str,
    model: ModelConfig,
    train: TrainConfig,
    first: int,
    slow_stage: int,
    prefix: list[str] | None,
) -> list[list[dict[str, Any]]]:
    """A real 2-stage pipeline with ``first`` blocks on stage 0, stage ``slow_stage`` under
    the quota: each stage's events."""
    plans = chain_plans(
        job_id=job,
        model=model,
        train=train,
        addresses=[None, f"tcp://127.0.0.1:{free_port()}"],
        transport=Transport.P2P,
        intra_op_threads=1,
    )
    ranges = [(0, first), (first, model.n_layers)]
    plans = [
        msgspec.structs.replace(p, layer_start=a, layer_end=b)
        for p, (a, b) in zip(plans, ranges, strict=True)
    ]
    return run_plans(plans, work, command_prefixes={slow_stage: prefix} if prefix else None)


def tokens_per_s(events: list[list[dict[str, Any]]]) -> float:
    """The pipeline's pace: its slowest stage's steady state."""
    return min(done(s)["tokens_per_s"] for s in events)


def placement(work: Path, quick: bool, rounds: int, steps: int) -> dict[str, Any]:
    model = (
        ModelConfig(n_layers=8, d_model=128, seq_len=64, n_heads=4)
        if quick
        else ModelConfig(n_layers=8, d_model=256, seq_len=128, n_heads=4)
    )
    train = TrainConfig(steps=steps, batch_size=8, micro_batches=4, val_every=0, link_probe_every=0)
    n, equal = model.n_layers, model.n_layers // 2
    why: list[str] = []
    with cpu_quota(SLOW_SHARE, why=why) as prefix:
        if prefix is None:
            print(f"  {why[0]}: both fellows run at full speed", flush=True)
        probed = probe_speeds(prefix)
        # One thread in a quota of SLOW_SHARE of a core, as the leader derives its share.
        shares = {SLOW: cpu_share(1, SLOW_SHARE)} if prefix is not None else {}
        order, from_probe = balanced_split(model, train, probed, shares)
        slow = order.index(SLOW)
        print(
            f"  probed speeds {probed} (standard blocks/s); stage order {order}; "
            f"balanced split by the probe {from_probe}-{n - from_probe}",
            flush=True,
        )
        # The first job: equal layers; its step records give the speeds the leader keeps.
        first = run_split(work, "place-first", model, train, equal, slow, prefix)
        measured = stage_speeds(first, order, [equal, n - equal], model, train.batch_size)
        order_again, balanced = balanced_split(model, train, measured, shares)
        assert order_again == order, (order, order_again)
        print(
            f"  measured speeds {measured} (the equal run's step times); balanced split "
            f"{balanced}-{n - balanced}",
            flush=True,
        )
        splits = sorted({equal, balanced}) if quick else list(range(1, n))
        per_round: list[dict[int, float]] = []
        for r in range(rounds):
            got = {}
            for k in splits if r % 2 == 0 else splits[::-1]:
                if quick and k == equal:
                    got[k] = tokens_per_s(first)  # a smoke run: the first job is the arm
                else:
                    got[k] = tokens_per_s(
                        run_split(work, f"place-{r}-{k}", model, train, k, slow, prefix)
                    )
                print(f"  round {r + 1}: split {k}-{n - k} {got[k]:8.0f} tok/s", flush=True)
            per_round.append(got)
    med = {k: statistics.median(r[k] for r in per_round) for k in splits}
    best = max(med, key=med.get)
    figures = {
        "equal_tokens_per_s": med[equal],
        "balanced_tokens_per_s": med[balanced],
        "best_tokens_per_s": med[best],
        "balanced_over_equal": med[balanced] / med[equal],
        "balanced_over_best": med[balanced] / med[best],
        "balanced_split": [balanced, n - balanced],
        "best_split": [best, n - best],
        "probe_split": [from_probe, n - from_probe],
        "probe_split_tokens_per_s": med.get(from_probe),
        "stage_order": order,
        "probed_speeds": probed,
        "cpu_shares": shares,
        "measured_speeds": measured,
        "quota_applied": prefix is not None,
        "slow_share": SLOW_SHARE,
        "micro_batches": train.micro_batches,
        "splits_tokens_per_s": {f"{k}-{n - k}": v for k, v in med.items()},
        "rounds": rounds,
        "steps": steps,
        "model": msgspec.structs.asdict(model),
        "per_round": [{str(k): v for k, v in r.items()} for r in per_round],
    }
    over_equal, over_best = figures["balanced_over_equal"], figures["balanced_over_best"]
    verdict("balanced/equal", over_equal, ">= 1.3", over_equal >= 1.3)
    verdict("balanced/best", over_best, ">= 0.9", over_best >= 0.9)
    return figures


def port_range(n: int) -> str:
    """``n`` consecutive free loopback ports as a sync address range (one port per ring)."""
    first = free_ports(n)
    return f"tcp://127.0.0.1:{first}-{first + n - 1}"


# Shares of a core of the four fellows of the splits arm, by fellow: dealt out by place() as
# replica 0 = (c, a), replica 1 = (d, b) (equal memory: ranked by id; the best ranked runs the
# last stage), so replica 0 is two equal fellows and replica 1 a slow and a fast one.
SPLIT_SHARES = {"a": 0.5, "b": 0.75, "c": 0.5, "d": 0.25}


def two_by_two(model: ModelConfig, train: TrainConfig) -> JobSpec:
    """A balanced job of 2 replicas x 2 stages over p2p, as the leader would be given it."""
    return JobSpec(
        model=model,
        partition=Partition.BALANCED,
        allow_cpu=True,
        replicas=2,
        stages=2,
        transport=Transport.P2P,
        **msgspec.structs.asdict(train),
    )


def split_placement(model: ModelConfig, train: TrainConfig, ports: int) -> dict[str, Any]:
    """The leader's balanced placement of 2 replicas x 2 stages on the four fellows, whose
    speeds are their shares of a core, each with ``ports`` sync ports: with 2, each replica
    splits the layers on its own fellows; with 1 (p2p), every replica takes one split, over
    each stage position's weakest fellow (what placement did before rings per segment)."""
    ram = psutil.virtual_memory().available
    candidates = [
        Candidate(
            fellow_id=name,
            hostname=name,
            data_address=f"tcp://{name}:1",
            sync_address=f"tcp://{name}:7000" + ("-7001" if ports == 2 else ""),
            cpu_cores=1,
            ram_available_bytes=ram,
            compute_speed=share,
        )
        for name, share in SPLIT_SHARES.items()
    ]
    spec = two_by_two(model, train)
    placement = place(spec, candidates)
    if isinstance(placement, Unplaceable):
        raise SystemExit(f"no balanced placement: {placement.reason}")
    return {
        "fellows": [[s.fellow_id for s in placement.pipeline(r)] for r in range(2)],
        "splits": [placement.split(r) for r in range(2)],
    }


def split_run(
    work: Path,
    job: str,
    model: ModelConfig,
    train: TrainConfig,
    placed: dict[str, Any],
    prefixes: dict[str, list[str] | None],
) -> list[list[dict[str, Any]]]:
    """2 replicas x 2 stages as real stage processes with ``placed``'s splits, each stage in
    its fellow's CPU quota."""

    def port() -> str:
        return f"tcp://127.0.0.1:{free_port()}"

    plans = replicated_chain_plans(
        job_id=job,
        model=model,
        train=train,
        addresses=[[None, port()] for _ in range(2)],
        sync_addresses=[[port_range(2) for _ in range(2)] for _ in range(2)],
        splits=placed["splits"],
        transport=Transport.P2P,
        intra_op_threads=1,
    )
    where = {
        (r, s): prefixes[name]
        for r, row in enumerate(placed["fellows"])
        for s, name in enumerate(row)
        if prefixes[name] is not None
    }
    return run_plans([p for row in plans for p in row], work, command_prefixes=where)


def splits(work: Path, quick: bool, rounds: int, steps: int) -> dict[str, Any]:
    """Replicas on unequal fellows: one split for every replica against each replica's own
    (rings per segment), allreduce, in alternating rounds."""
    model = (
        ModelConfig(n_layers=8, d_model=128, seq_len=64, n_heads=4)
        if quick
        else ModelConfig(n_layers=8, d_model=256, seq_len=128, n_heads=4)
    )
    train = TrainConfig(steps=steps, batch_size=8, micro_batches=4, val_every=0, link_probe_every=0)
    arms = {
        "one_split": split_placement(model, train, 1),
        "own_splits": split_placement(model, train, 2),
    }
    for arm, placed in arms.items():
        print(f"  {arm}: fellows {placed['fellows']}, splits {placed['splits']}", flush=True)
    per_round: list[dict[str, dict[str, Any]]] = []
    with contextlib.ExitStack() as stack:
        prefixes = {
            name: stack.enter_context(cpu_quota(share)) for name, share in SPLIT_SHARES.items()
        }
        for r in range(rounds):
            got = {}
            for arm in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                events = split_run(work, f"splits-{r}-{arm}", model, train, arms[arm], prefixes)
                got[arm] = run_figures(events, 2, 2, train, model.seq_len)
                print(
                    f"  round {r + 1}: {arm:10s} {got[arm]['tokens_per_s']:8.0f} tok/s", flush=True
                )
            per_round.append(got)
    med = {arm: statistics.median(r[arm]["tokens_per_s"] for r in per_round) for arm in arms}
    ratio = statistics.median(
        r["own_splits"]["tokens_per_s"] / r["one_split"]["tokens_per_s"] for r in per_round
    )
    figures = {
        "one_split_tokens_per_s": med["one_split"],
        "own_splits_tokens_per_s": med["own_splits"],
        "own_over_one": round(ratio, 3),
        "one_split": arms["one_split"]["splits"],
        "own_splits": arms["own_splits"]["splits"],
        "fellows": arms["own_splits"]["fellows"],
        "shares": SPLIT_SHARES,
        "quota_applied": all(p is not None for p in prefixes.values()),
        "sync_missed": sum(r[a]["sync_missed"] for r in per_round for a in arms),
        "rounds": rounds,
        "steps": steps,
        "model": msgspec.structs.asdict(model),
        "per_round": [{a: r[a]["tokens_per_s"] for a in arms} for r in per_round],
    }
    print(f"  each replica's own split / one split for all: {ratio:.3f}x")
    return figures


# Sites (--only sites): two fellows on each side of a shaped path (linkemu.FarSide), the
# rate between the sites in bit/s (rate limited both ways; no added delay).
SITE_RATE_BIT_S = 20e6
SITE_FELLOWS = {"a": "near", "b": "near", "c": "far", "d": "far"}


def site_placements(
    model: ModelConfig, train: TrainConfig, hosts: dict[str, str]
) -> tuple[dict[str, list[list[str]]], str]:
    """The two groupings of a balanced 2 replicas x 2 stages job on the four fellows (ranked
    a b c d by memory, equal speeds, data addresses on their site's host), each as its
    replicas' fellows in stage order: ``spread`` (dealt like cards, what placement gives
    without links: each pipeline across the path, each ring on one site) and ``at_home``
    (each pipeline on one site, each ring across); and which of them the leader's
    ``place()`` picks given the path's rate as the measured links across it."""
    candidates = [
        Candidate(
            fellow_id=name,
            hostname=name,
            data_address=f"tcp://{hosts[site]}:1",
            sync_address=f"tcp://{hosts[site]}:2",
            cpu_cores=1,
            ram_available_bytes=(16 - at) << 30,
            compute_speed=1.0,
        )
        for at, (name, site) in enumerate(SITE_FELLOWS.items())
    ]
    across = MeasuredLink(mbit_s=SITE_RATE_BIT_S / 1e6, rtt_ms=0.2)
    links = {
        (a, b): across
        for a, b in itertools.combinations(SITE_FELLOWS, 2)
        if SITE_FELLOWS[a] != SITE_FELLOWS[b]
    }
    spec = two_by_two(model, train)
    arms = {"spread": [["c", "a"], ["d", "b"]], "at_home": [["b", "a"], ["d", "c"]]}
    got = {}
    for known in (None, links):
        placed = place(spec, candidates, links=known)
        if isinstance(placed, Unplaceable):
            raise SystemExit(f"no placement of the sites arm: {placed.reason}")
        got[known is None] = [[s.fellow_id for s in placed.pipeline(r)] for r in range(2)]
    if got[True] != arms["spread"] or got[False] not in arms.values():
        raise SystemExit(f"placement changed under the benchmark: {got}")
    chosen = next(arm for arm, fellows in arms.items() if fellows == got[False])
    return arms, chosen


def site_run(
    work: Path,
    job: str,
    model: ModelConfig,
    train: TrainConfig,
    fellows: list[list[str]],
    far: Any,
) -> list[list[dict[str, Any]]]:
    """2 replicas x 2 stages as real stage processes, each fellow's on its site: the far
    site's in the path's namespace, its sockets on the far address; p2p, 1 thread each."""
    ip = {"near": far.near_ip, "far": far.far_ip}

    def at(name: str) -> str:
        return f"tcp://{ip[SITE_FELLOWS[name]]}:{free_port()}"

    plans = replicated_chain_plans(
        job_id=job,
        model=model,
        train=train,
        addresses=[[None, at(row[1])] for row in fellows],
        sync_addresses=[[at(name) for name in row] for row in fellows],
        transport=Transport.P2P,
        intra_op_threads=1,
    )
    where = {
        (r, s): far.prefix
        for r, row in enumerate(fellows)
        for s, name in enumerate(row)
        if SITE_FELLOWS[name] == "far"
    }
    return run_plans([p for row in plans for p in row], work, command_prefixes=where)


def sites(work: Path, quick: bool, rounds: int, steps: int, every: int) -> dict[str, Any]:
    """Replicas on two sites joined by a slow path: both groupings of their fellows, under
    ``diloco`` and ``allreduce``, in alternating rounds, and the one placement picks of the
    links against the other."""
    from linkemu import FarSide, symmetric, unavailable_reason

    why = unavailable_reason()
    if why is not None:
        print(f"  sites: no shaped path here ({why}): left out", flush=True)
        return {"skipped": why}
    model = QUICK_MODEL if quick else LOSS_MODEL
    figures: dict[str, Any] = {}
    with FarSide(symmetric("sites", SITE_RATE_BIT_S, 0.0)) as far:
        hosts = {"near": far.near_ip, "far": far.far_ip}
        for sync in ("diloco",) if quick else ("diloco", "allreduce"):
            train = TrainConfig(
                steps=steps,
                batch_size=8,
                micro_batches=2,
                val_every=0,
                link_probe_every=0,
                sync=sync,
                sync_every=every,
                outer_learning_rate=1.0,
                outer_momentum=0.0,
            )
            arms, chosen = site_placements(model, train, hosts)
            other = next(arm for arm in arms if arm != chosen)
            print(f"  sites, {sync}: placement picks {chosen} {arms[chosen]}", flush=True)
            per_round: list[dict[str, float]] = []
            for r in range(rounds):
                got = {}
                for arm in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                    job = f"sites-{sync}-{r}-{arm}"
                    events = site_run(work, job, model, train, arms[arm], far)
                    got[arm] = run_figures(events, 2, 2, train, model.seq_len)["tokens_per_s"]
                    print(f"  round {r + 1}: {sync} {arm:8s} {got[arm]:8.0f} tok/s", flush=True)
                per_round.append(got)
            ratio = statistics.median(r[chosen] / r[other] for r in per_round)
            figures[sync] = {
                "chosen": chosen,
                **{
                    f"{arm}_tokens_per_s": statistics.median(r[arm] for r in per_round)
                    for arm in arms
                },
                "chosen_over_other": round(ratio, 3),
                "per_round": per_round,
            }
            print(f"  sites, {sync}: placement's choice / the other {ratio:.3f}x", flush=True)
    figures.update(
        rate_bit_s=SITE_RATE_BIT_S,
        sync_every=every,
        rounds=rounds,
        steps=steps,
        model=msgspec.structs.asdict(model),
    )
    return figures


SPEED_MODEL = ModelConfig(n_layers=4, d_model=256, seq_len=128, n_heads=4)
LOSS_MODEL = ModelConfig(n_layers=4, d_model=128, seq_len=64, n_heads=4)
QUICK_MODEL = ModelConfig(n_layers=2, d_model=64, seq_len=32, n_heads=4)


def replica_run(
    work: Path,
    job: str,
    model: ModelConfig,
    train: TrainConfig,
    replicas: int,
    stages: int,
) -> list[list[dict[str, Any]]]:
    """``replicas`` copies of a ``stages``-stage pipeline as real stage processes (one is one
    fellow: the fused single-process plan); every stage's events, by (replica, stage)."""
    if replicas == 1 and stages == 1:
        return run_plans([single_process_plan(job_id=job, model=model, train=train)], work)

    def port() -> str:
        return f"tcp://127.0.0.1:{free_port()}"

    plans = replicated_chain_plans(
        job_id=job,
        model=model,
        train=train,
        addresses=[[None, *(port() for _ in range(stages - 1))] for _ in range(replicas)],
        sync_addresses=[[port() for _ in range(stages)] for _ in range(replicas)],
        transport=Transport.P2P,
        intra_op_threads=1,
    )
    return run_plans([p for pipeline in plans for p in pipeline], work)


def ceiling(work: Path, job: str, model: ModelConfig, train: TrainConfig) -> float:
    """Two one-fellow runs at the same time, without any sync: their summed tokens/s, the
    most two replicas could get of this machine."""
    got: dict[int, float] = {}

    def one(i: int) -> None:
        plan = single_process_plan(job_id=f"{job}-{i}", model=model, train=train)
        (events,) = run_plans([plan], work / f"{job}-{i}")
        got[i] = done(events)["tokens_per_s"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(got) != 2:
        raise RuntimeError(f"{job}: a ceiling run failed (see {work})")
    return round(got[0] + got[1], 1)


def run_figures(
    events: list[list[dict[str, Any]]], replicas: int, stages: int, train: TrainConfig, seq: int
) -> dict[str, Any]:
    """A run's tokens/s (the sum over replicas of each pipeline's slowest stage), its final
    validation loss (replica 0's last stage) and the replicas' sync bytes per token."""
    dones = [done(e) for e in events]
    pipelines = [dones[r * stages : (r + 1) * stages] for r in range(replicas)]
    tokens = sum(min(d["tokens_per_s"] for d in pipe) for pipe in pipelines)
    sync_bytes = sum(d.get("sync_bytes_sent", 0) for d in dones)
    trained = train.steps * train.batch_size * seq * replicas
    return {
        "tokens_per_s": round(tokens, 1),
        "val_loss": pipelines[0][-1]["val_loss"],
        "bytes_per_token": round(sync_bytes / trained, 3),
        "sync_clipped": sum(d.get("sync_clipped", 0) for d in dones),
        "sync_missed": sum(d.get("sync_missed", 0) for d in dones),
    }


def runs(
    work: Path,
    quick: bool,
    rounds: int,
    steps: int,
    loss_steps: int,
    every: int,
    learning_rate: float,
) -> list[dict[str, Any]]:
    speed_model = QUICK_MODEL if quick else SPEED_MODEL
    loss_model = QUICK_MODEL if quick else LOSS_MODEL
    common = {"val_every": 0, "link_probe_every": 0, "warmup_steps": 10, "val_batches": 4}
    speed_train = TrainConfig(steps=steps, batch_size=16, micro_batches=1, **common)
    seq = speed_model.seq_len
    out: list[dict[str, Any]] = []

    # 1. speed: one fellow against 2 replicas x 1 stage, and the ceiling (two one-fellow
    # runs at once, no sync: what two processes get of this machine), interleaved rounds
    arms = [(1, "none"), (2, "allreduce"), (0, "ceiling")]
    per_round: list[dict[int, dict[str, Any]]] = []
    for r in range(rounds):
        got = {}
        for k, sync in arms if r % 2 == 0 else arms[::-1]:
            train = msgspec.structs.replace(speed_train, sync="allreduce")
            if k == 0:
                got[k] = {"tokens_per_s": ceiling(work, f"ceiling-{r}", speed_model, train)}
            else:
                events = replica_run(work, f"speed-{r}-{k}", speed_model, train, k, 1)
                got[k] = run_figures(events, k, 1, train, seq)
            print(f"  round {r + 1}: {k or 2} x 1 {sync:9s} {got[k]['tokens_per_s']:8.0f} tok/s")
        per_round.append(got)
    one = statistics.median(r[1]["tokens_per_s"] for r in per_round)
    top = statistics.median(r[0]["tokens_per_s"] for r in per_round)
    arms = arms[:2]
    for k, sync in arms:
        tps = statistics.median(r[k]["tokens_per_s"] for r in per_round)
        last = per_round[-1][k]
        out.append(
            {
                "arm": "speed",
                "replicas": k,
                "stages": 1,
                "sync": sync,
                "tokens_per_s": tps,
                "speedup_vs_one": round(tps / one, 3),
                "val_loss": last["val_loss"],
                "bytes_per_token": last["bytes_per_token"],
                "steps": steps,
                "per_round_tokens_per_s": [r[k]["tokens_per_s"] for r in per_round],
            }
        )
        if k == 2:  # the median of the per-round ratios to the ceiling
            out[-1]["ceiling_tokens_per_s"] = top
            out[-1]["fraction_of_ceiling"] = round(
                statistics.median(r[2]["tokens_per_s"] / r[0]["tokens_per_s"] for r in per_round),
                3,
            )

    # 2. convergence: allreduce against diloco at equal tokens, and one fellow's speed
    loss_train = TrainConfig(
        steps=loss_steps,
        batch_size=8,
        micro_batches=1,
        learning_rate=learning_rate,
        **common,
    )
    one_loss = run_figures(
        replica_run(
            work,
            "loss-one",
            loss_model,
            msgspec.structs.replace(loss_train, steps=min(loss_steps, steps)),
            1,
            1,
        ),
        1,
        1,
        loss_train,
        loss_model.seq_len,
    )
    defaults = TrainConfig()
    convergence = [
        ("allreduce", 1, defaults.outer_learning_rate, defaults.outer_momentum),
        ("diloco", every, defaults.outer_learning_rate, defaults.outer_momentum),
        ("diloco", every, 1.0, 0.0),  # plain averaging of the replicas' weights
        ("diloco", max(1, every // 4), 1.0, 0.0),
    ]
    for i, (sync, h, outer_lr, outer_mu) in enumerate(convergence):
        train = msgspec.structs.replace(
            loss_train,
            sync=sync,
            sync_every=h,
            outer_learning_rate=outer_lr,
            outer_momentum=outer_mu,
        )
        events = replica_run(work, f"loss-{sync}-{i}", loss_model, train, 2, 1)
        got = run_figures(events, 2, 1, train, loss_model.seq_len)
        outer = f" H={h} outer lr {outer_lr} mu {outer_mu}" if sync == "diloco" else ""
        print(
            f"  convergence 2 x 1 {sync}{outer}: val loss {got['val_loss']:.4f}, "
            f"{got['bytes_per_token']:.1f} sync bytes/token, {got['tokens_per_s']:.0f} tok/s"
        )
        arm = {
            "arm": "convergence",
            "replicas": 2,
            "stages": 1,
            "sync": sync,
            "sync_every": h,
            "tokens_per_s": got["tokens_per_s"],
            "speedup_vs_one": round(got["tokens_per_s"] / one_loss["tokens_per_s"], 3),
            "val_loss": got["val_loss"],
            "bytes_per_token": got["bytes_per_token"],
            "sync_clipped": got["sync_clipped"],
            "sync_missed": got["sync_missed"],
            "steps": loss_steps,
            "learning_rate": learning_rate,
        }
        if sync == "diloco":
            arm |= {"outer_learning_rate": outer_lr, "outer_momentum": outer_mu}
        out.append(arm)

    # 3. 2 replicas x 2 stages on 4 processes (contended: correctness and bytes)
    train = msgspec.structs.replace(speed_train, micro_batches=4)
    got = run_figures(replica_run(work, "two-by-two", speed_model, train, 2, 2), 2, 2, train, seq)
    print(
        f"  2 x 2 allreduce {got['tokens_per_s']:.0f} tok/s, "
        f"{got['bytes_per_token']:.1f} sync bytes/token"
    )
    out.append(
        {
            "arm": "contended",
            "replicas": 2,
            "stages": 2,
            "sync": "allreduce",
            "tokens_per_s": got["tokens_per_s"],
            "speedup_vs_one": round(got["tokens_per_s"] / one, 3),
            "val_loss": got["val_loss"],
            "bytes_per_token": got["bytes_per_token"],
            "sync_clipped": got["sync_clipped"],
            "sync_missed": got["sync_missed"],
            "steps": steps,
        }
    )
    speed = next(r for r in out if r["arm"] == "speed" and r["replicas"] == 2)
    verdict(
        "2x1 allreduce / one fellow",
        speed["speedup_vs_one"],
        ">= 1.8",
        speed["speedup_vs_one"] >= 1.8,
    )
    print(
        f"  (two one-fellow runs at once, no sync: {top / one:.3f}x one fellow; 2x1 allreduce "
        f"reaches {speed['fraction_of_ceiling']:.3f} of that ceiling)"
    )
    converged = [r for r in out if r["arm"] == "convergence"]
    ar = next(r for r in converged if r["sync"] == "allreduce")
    at_h = [r for r in converged if r["sync"] == "diloco" and r["sync_every"] == every]
    dl = min(at_h, key=lambda r: r["val_loss"] or float("inf"))  # the better outer setting
    if ar["val_loss"] and dl["val_loss"]:
        gap = dl["val_loss"] / ar["val_loss"] - 1
        verdict(
            f"diloco H={every} val loss vs allreduce (best outer setting)",
            gap,
            "<= 0.02",
            gap <= 0.02,
        )
        for r in converged:
            if r["sync"] == "diloco" and r["val_loss"]:
                print(
                    f"  diloco H={r['sync_every']} outer lr {r['outer_learning_rate']} mu "
                    f"{r['outer_momentum']}: {r['val_loss'] / ar['val_loss'] - 1:+.3f} vs allreduce"
                )
    if dl["bytes_per_token"]:
        fewer = ar["bytes_per_token"] / dl["bytes_per_token"]
        verdict("allreduce / diloco sync bytes per token", fewer, f"~{every}", fewer >= every / 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: small models, one round (~1-2 minutes a part)",
    )
    parser.add_argument("--only", choices=["runs", "placement", "splits", "sites"], default=None)
    parser.add_argument("--rounds", type=int, default=None, help="default 3, quick 1")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (24, quick 8)")
    parser.add_argument("--loss-steps", type=int, default=None, help="default 600, quick 20")
    parser.add_argument("--diloco-every", type=int, default=20, help="DiLoCo's H")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=TrainConfig().learning_rate,
        help="the convergence runs' inner learning rate (default the spec's)",
    )
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    # A SIGTERM runs the finally blocks: the stages stop and the cgroup is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rounds = args.rounds or (1 if args.quick else 3)
    steps = args.steps or (8 if args.quick else 24)
    loss_steps = args.loss_steps or (20 if args.quick else 600)
    started = time.time()
    run_list: list[dict[str, Any]] = []
    figures: dict[str, Any] = {}
    split_figures: dict[str, Any] = {}
    site_figures: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        if args.only in (None, "runs"):
            every = min(args.diloco_every, loss_steps)
            run_list = runs(work, args.quick, rounds, steps, loss_steps, every, args.learning_rate)
        if args.only in (None, "placement"):
            figures = placement(work, args.quick, rounds, steps)
        if args.only in (None, "splits"):
            split_figures = splits(work, args.quick, rounds, steps)
        if args.only in (None, "sites"):
            site_steps = args.steps or (12 if args.quick else 60)
            every = min(args.diloco_every, site_steps)
            site_figures = sites(work, args.quick, rounds, site_steps, every)
    emit(
        {
            "bench": "replicas",
            "quick": args.quick,
            "runs": run_list,
            "placement": figures,
            "splits": split_figures,
            "sites": site_figures,
            "cpus": os.cpu_count(),
            "load_avg": load_avg(),
            "seconds": round(time.time() - started, 1),
        }
    )


if __name__ == "__main__":
    main()
