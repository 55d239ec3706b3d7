"""Real stage processes training the model over ZeroMQ and over the NATS relay."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import psutil
import pytest

from silentswarm.agent.errors import StageFailedError
from silentswarm.agent.runtime.launch import done, links, run_plans, steps, write_plans
from silentswarm.plan import (
    GpuSlot,
    ModelConfig,
    Peer,
    StagePlan,
    TrainConfig,
    Transport,
    chain_plans,
    single_process_plan,
)
from silentswarm.procs import free_port
from tests.helpers import REPO, child_env, wait_for

pytestmark = pytest.mark.integration

SMALL = ModelConfig(n_layers=3, d_model=64, n_heads=4, seq_len=32)


def train(steps: int, **kw) -> TrainConfig:
    return TrainConfig(
        steps=steps, batch_size=8, micro_batches=4, max_data_bytes=400_000, val_batches=2, **kw
    )


def addresses(n: int) -> list[str | None]:
    return [None] + [f"tcp://127.0.0.1:{free_port()}" for _ in range(n - 1)]


def chain(
    job_id: str,
    stages: int | list[str | None],
    config: TrainConfig,
    *,
    model: ModelConfig = SMALL,
    transport: Transport = Transport.P2P,
    **kw,
) -> list[StagePlan]:
    """Plans for local stages on loopback, one intra-op thread each."""
    where = addresses(stages) if isinstance(stages, int) else stages
    return chain_plans(
        job_id=job_id,
        model=model,
        train=config,
        addresses=where,
        transport=transport,
        intra_op_threads=1,
        **kw,
    )


def test_two_stages_reproduce_one_process_step_by_step(procs, tmp_path):
    """The proof that gradients really flow across the boundary: same losses for 50 steps."""
    model = ModelConfig(n_layers=4, d_model=64, n_heads=4, seq_len=32, dropout=0.0)
    config = train(50, learning_rate=3e-3, warmup_steps=5)
    single = single_process_plan(job_id="ref", model=model, train=config)
    pipeline = chain("pipe", 2, config, model=model)
    (reference,) = run_plans([single], tmp_path)
    first, last = run_plans(pipeline, tmp_path)
    want = [s["loss"] for s in steps(reference)]
    got = [s["loss"] for s in steps(last)]
    assert len(want) == len(got) == 50
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: single {a} vs pipeline {b}"
    assert got[-1] < got[0] - 1.0, "the loss fell"
    assert all(s["loss"] is None for s in steps(first))
    assert done(first)["down_bytes_sent"] > 0


@pytest.mark.parametrize(
    ("micro_batches", "in_flight", "recompute", "deferred"),
    [(4, 4, False, 0), (4, 4, True, 3), (1, None, False, 0)],
    ids=["window", "window-recompute-deferred", "one-micro-batch"],
)
def test_three_stages_over_zeromq_match_one_process(
    procs, tmp_path, micro_batches, in_flight, recompute, deferred
):
    """A middle stage (both boundaries) passes gradients on exactly too, also with every
    micro-batch in flight on every stage before the last (deeper than 1F1B's 3 and 2), and so
    when those stages recompute their forwards in their backwards (``recompute``) while the
    last stage defers 3 of its 4 weights' passes (``defer_weight_grads``); with one
    micro-batch the fused calls apply straight from the gradients (no accumulators)."""
    config = msgspec.structs.replace(
        train(10),
        micro_batches=micro_batches,
        in_flight=in_flight,
        recompute=recompute,
        defer_weight_grads=deferred,
    )
    single = single_process_plan(job_id="ref3", model=SMALL, train=config)
    plans = chain("zmq3", 3, config)
    (reference,) = run_plans([single], tmp_path)
    results = run_plans(plans, tmp_path)
    transports = [links(r) for r in results]
    assert [(link["up"], link["down"]) for link in transports] == [
        (None, "p2p"),
        ("p2p", "p2p"),
        ("p2p", None),
    ]
    want = [s["loss"] for s in steps(reference)]
    got = [s["loss"] for s in steps(results[-1])]
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: single {a} vs pipeline {b}"
    assert abs(done(results[-1])["val_loss"] - done(reference)["val_loss"]) < 1e-3
    agreed = [e["tuning"]["deferred"] for e in results[-1] if e["event"] == "links"]
    assert agreed and set(agreed) == {deferred}
    middle = done(results[1])
    assert middle["up_bytes_received"] == done(results[0])["down_bytes_sent"]
    assert middle["down_bytes_sent"] == done(results[2])["up_bytes_received"]


def test_stages_with_different_vocabularies_refuse_to_train_together(procs, tmp_path):
    """The handshake compares the model config, the tokenizer and the schedule: a last stage
    whose ids would mean other tokens refuses before any frame (the data it need not have)."""
    plans = chain("mismatch", 2, train(3), peer_timeout_s=20)
    plans[1] = msgspec.structs.replace(
        plans[1], model=msgspec.structs.replace(plans[1].model, vocab_size=512)
    )
    with pytest.raises(StageFailedError, match=r"fingerprints differ.*model config, tokenizer"):
        run_plans(plans, tmp_path)


def without_data(plan: StagePlan, nowhere: Path, **changes) -> StagePlan:
    """``plan`` with data that does not exist on its machine (and other stage-0-only fields
    changed): a stage after the first must train without ever opening a data file."""
    config = msgspec.structs.replace(
        plan.train, data=[str(nowhere / "*.txt")], max_data_bytes=1, **changes
    )
    return msgspec.structs.replace(plan, train=config)


def test_only_stage_0_reads_data_the_targets_travel_with_the_activations(procs, tmp_path):
    """Stages 1 and 2 are told of data that does not exist there, and of other validation
    settings: they train on the targets stage 0 sends with its activations, and validate as
    many batches as it says, losing exactly what one process loses."""
    config = msgspec.structs.replace(train(8), val_every=3)
    (reference,) = run_plans(
        [single_process_plan(job_id="ref0", model=SMALL, train=config)], tmp_path
    )
    plans = chain("only0", 3, config)
    nowhere = tmp_path / "nowhere"
    plans[1:] = [without_data(p, nowhere, val_batches=7, val_fraction=0.5) for p in plans[1:]]
    results = run_plans(plans, tmp_path)
    want = [s["loss"] for s in steps(reference)]
    got = [s["loss"] for s in steps(results[-1])]
    assert len(want) == len(got) == 8
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: single {a} vs pipeline {b}"
    val_want = [s.get("val_loss") for s in steps(reference)]
    val_got = [s.get("val_loss") for s in steps(results[-1])]
    assert [v is not None for v in val_got] == [i in (2, 5) for i in range(8)]
    for a, b in zip(val_want, val_got, strict=True):
        assert a is None or b == pytest.approx(a, rel=1e-4)
    assert done(results[-1])["val_loss"] == pytest.approx(done(reference)["val_loss"], rel=1e-4)
    assert not nowhere.exists()
    # The targets are frame parts, counted like the rest: what stage 0 sent is what stage 1
    # counted, at least the activations and the targets (one byte a position) of 8 steps of
    # 8 rows and 3 validations of 2 batches of 8 (test_links checks the exact count).
    first, middle, last = (done(r) for r in results)
    assert middle["up_bytes_received"] == first["down_bytes_sent"]
    assert middle["down_bytes_sent"] == last["up_bytes_received"]
    rows = 8 * 8 + 3 * 2 * 8
    assert first["down_bytes_sent"] > rows * 32 * (64 * 4 + 1)


def test_a_validation_without_batches_tells_the_stages_after_stage_0(procs, tmp_path):
    """Too little validation text for one batch: stage 0 says so in one empty eval frame,
    which the middle stage passes on; the run completes without a validation loss."""
    config = msgspec.structs.replace(train(2), val_every=1, val_fraction=0.0005)
    plans = chain("noval", 3, config)
    plans[1:] = [without_data(p, tmp_path / "nowhere") for p in plans[1:]]
    results = run_plans(plans, tmp_path)
    assert [s.get("val_loss") for s in steps(results[-1])] == [None, None]
    assert done(results[-1])["val_loss"] is None
    assert len(steps(results[-1])) == 2 and steps(results[-1])[-1]["loss"] is not None


def test_three_stages_train_over_the_nats_relay(procs, nats_server, tmp_path):
    plans = chain(
        "relay3", addresses(3), train(8), transport=Transport.TUNNEL, nats_url=nats_server.url
    )
    seen: list[dict] = []
    results = run_plans(plans, tmp_path, on_event=seen.append)
    assert sorted(map(str, seen)) == sorted(str(e) for r in results for e in r), "live events"
    transports = [links(r) for r in results]
    assert [(link["up"], link["down"]) for link in transports] == [
        (None, "relay"),
        ("relay", "relay"),
        ("relay", None),
    ]
    losses = [s["loss"] for s in steps(results[-1])]
    assert losses[-1] < losses[0]


def test_auto_falls_back_to_the_relay_when_the_direct_path_is_unreachable(
    procs, nats_server, tmp_path
):
    """Stage 1 binds one port but stage 0 is told another, where nothing listens."""
    bound, advertised = free_port(), free_port()
    base = chain(
        "auto",
        [None, f"tcp://127.0.0.1:{bound}"],
        train(4),
        transport=Transport.AUTO,
        nats_url=nats_server.url,
    )
    wrong_next = Peer(
        fellow_id=base[0].next.fellow_id, data_address=f"tcp://127.0.0.1:{advertised}"
    )
    first = msgspec.structs.replace(base[0], next=wrong_next)
    results = run_plans([first, base[1]], tmp_path)
    assert links(results[0])["down"] == "relay"
    assert links(results[1])["up"] == "relay"
    assert done(results[1])["val_loss"] is not None


def test_auto_prefers_the_direct_path_when_it_works(procs, nats_server, tmp_path):
    plans = chain(
        "auto-p2p", addresses(2), train(3), transport=Transport.AUTO, nats_url=nats_server.url
    )
    results = run_plans(plans, tmp_path)
    assert links(results[0])["down"] == "p2p"


@pytest.mark.timeout(240)
def test_a_vanished_peer_ends_the_stage_with_an_error_naming_the_boundary(procs, tmp_path):
    # Long enough for the first step's compilation on a busy machine, short for the test.
    plans = chain("vanish", 2, train(100_000), peer_timeout_s=8.0)
    paths = write_plans(plans, tmp_path)
    env = child_env(TF_CPP_MIN_LOG_LEVEL="2")
    last, first = (
        procs.python(name, "silentswarm.agent.runtime.main", "--plan", str(path), env=env)
        for name, path in (("last", paths[1]), ("first", paths[0]))
    )
    # Two TensorFlow start-ups on two cores: slow when the machine is busy.
    wait_for(lambda: '"event":"step"' in procs.log(last), timeout=150, what="training to start")
    first.kill()
    killed_at = time.monotonic()
    assert last.wait(timeout=30) == 1
    assert time.monotonic() - killed_at < 8.0 + 10.0
    log = procs.log(last)
    assert "boundary 0 (stage-0 -> stage-1)" in log and "nothing received" in log
    assert '"code":"PEER_TIMEOUT"' in log  # the error event says why in a code
    assert "Traceback" not in log


def test_the_first_hello_is_awaited_beyond_peer_timeout(procs, tmp_path):
    """Stage 0 may spend minutes preparing its data before it connects: the stage after it
    waits for that first HELLO longer than ``peer_timeout_s`` (here 10 s, which also bounds
    every wait after the HELLO, stage 1's first compile under a loaded machine's included;
    stage 0 starts 3 s after stage 1 could have given up) and the pair trains."""
    plans = chain("late", 2, train(2), peer_timeout_s=10.0)
    paths = write_plans(plans, tmp_path)
    env = child_env(TF_CPP_MIN_LOG_LEVEL="2")
    last = procs.python("last", "silentswarm.agent.runtime.main", "--plan", str(paths[1]), env=env)
    started = time.monotonic()
    # The upstream's absence itself is what is tested: it must outlast peer_timeout_s.
    wait_for(lambda: time.monotonic() - started > 13.0, timeout=20, what="the peer timeout")
    assert last.poll() is None, procs.log(last)
    first = procs.python(
        "first", "silentswarm.agent.runtime.main", "--plan", str(paths[0]), env=env
    )
    assert first.wait(timeout=150) == 0, procs.log(first)
    assert last.wait(timeout=60) == 0, procs.log(last)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (
            b'{"job_id": "j", "stage": 0, "n_stages": 1, "layer_start": 0, "layer_end": 4, '
            b'"bogus": 1}',
            "bogus",
        ),
        (
            b'{"job_id": "j", "stage": 0, "n_stages": 1, "layer_start": 0, "layer_end": 9}',
            "outside the model",
        ),
        (
            b'{"job_id": "j", "stage": 0, "n_stages": 1, "layer_start": 0, "layer_end": 4, '
            b'"compression": "zip"}',
            "compression 'zip'",
        ),
    ],
)
def test_a_bad_plan_is_a_one_line_error_and_exit_2(tmp_path, content, needle):
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    result = subprocess.run(
        [sys.executable, "-m", "silentswarm.agent.runtime.main", "--plan", str(path)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.stderr


def test_gpu_slots_place_layers_on_their_own_devices_even_on_cpu(tmp_path):
    """On a CPU-only machine each slot becomes a logical CPU device: the same code path."""
    plan = StagePlan(
        job_id="slots",
        stage=0,
        n_stages=1,
        layer_start=0,
        layer_end=4,
        model=SMALL.__class__(n_layers=4, d_model=64, n_heads=4, seq_len=32),
        train=train(2),
        gpu_slots=[
            GpuSlot(gpu_index=0, gpu_uuid="GPU-a", layer_start=0, layer_end=2),
            GpuSlot(gpu_index=1, gpu_uuid="GPU-b", layer_start=2, layer_end=4),
        ],
        intra_op_threads=1,
    )
    (events,) = run_plans([plan], tmp_path)
    devices = next(e for e in events if e["event"] == "placement")["devices"]
    first_slot = {devices[n] for n in ("embed", "block_0", "block_1")}
    second_slot = {devices[n] for n in ("block_2", "block_3", "head")}
    assert len(first_slot) == len(second_slot) == 1 and first_slot != second_slot
    assert all("CPU" in d for d in devices.values())
    assert done(events)["val_loss"] is not None


CALLER = """
import sys
from pathlib import Path

from silentswarm.agent.runtime.launch import run_plans
from silentswarm.plan import ModelConfig, TrainConfig, single_process_plan

model = ModelConfig(n_layers=1, d_model=32, n_heads=2, seq_len=16)
train = TrainConfig(steps=10**6, batch_size=2, micro_batches=1, max_data_bytes=100_000)
run_plans([single_process_plan(job_id="orphan", model=model, train=train)], Path(sys.argv[1]))
"""


@pytest.mark.parametrize("forked", ["0", "1"], ids=["started", "forked"])
def test_a_killed_caller_takes_its_stages_along(tmp_path, forked):
    """A benchmark or script killed mid-run (SIGKILL: no finally runs) leaves no stage, also
    when its stages were forked by its fork server (the server dies with the caller, its
    children with it)."""
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    caller = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run")],
        env=child_env(PYTHONPATH=str(REPO), SWARM_STAGE_FORKSERVER=forked),
    )
    out = tmp_path / "run" / "stage-orphan-0.out"
    stages: list[psutil.Process] = []
    try:
        wait_for(lambda: out.exists() and out.read_text(), timeout=60, what="the stage's events")
        stages = psutil.Process(caller.pid).children(recursive=True)
        assert len(stages) == 1 + int(forked), stages  # the stage (and its fork server)
        caller.kill()
        caller.wait(timeout=10)
        _, alive = psutil.wait_procs(stages, timeout=30)
        assert not alive, f"stages outlived their caller: {alive}"
    finally:
        for proc in [psutil.Process(caller.pid)] if caller.poll() is None else []:
            proc.kill()
        for stage in stages:
            with contextlib.suppress(psutil.NoSuchProcess):
                stage.kill()
