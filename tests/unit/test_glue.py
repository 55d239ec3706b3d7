"""Glue and generate: a trained 2-stage export becomes one Keras model that is the pipeline.

Exports are made the way a job makes them: plans from ``stage_plans`` (as the leader's), stage
checkpoints of one step, and ``run_manifest.json`` listing them with their sha256s. The main
one comes from real ``swarm-stage`` processes (so the pipeline's own validation loss is there
to compare with); the others train in this process with the stage loop's arithmetic (forward,
the wire codec on activations and gradients, AdamW), which is quicker. Real TensorFlow on the
CPU, a tiny model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from silentswarm.jobspec import JobSpec, PlacedStage, Placement, stage_plans
from silentswarm.plan import ModelConfig, StagePlan, Transport

# Keras's own variable saving trips numpy 2's __array__(copy=...) deprecation.
# Real stage processes train the export the glue reads (a minute here): integration tests.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
]

REPO = Path(__file__).resolve().parents[2]
TINY = ModelConfig(vocab_size=256, seq_len=32, n_layers=2, d_model=32, n_heads=2)
STEPS = 6


def _spec(compression: str, steps: int, model: ModelConfig) -> JobSpec:
    return JobSpec(
        name="tiny",
        model=model,
        max_data_bytes=120_000,
        steps=steps,
        batch_size=8,
        micro_batches=2,
        warmup_steps=2,
        compression=compression,
        seed=3,
    )


def _placement(ranges: list[tuple[int, int]]) -> Placement:
    return Placement(
        stages=[
            PlacedStage(
                stage=i,
                fellow_id=f"f{i + 1}",
                hostname=f"h{i + 1}",
                layer_start=start,
                layer_end=end,
                data_address=f"tcp://127.0.0.1:{i + 1}" if i else None,
            )
            for i, (start, end) in enumerate(ranges)
        ],
        transport=Transport.AUTO,
    )


def _wire(array: np.ndarray, spec: str) -> np.ndarray:
    from silentswarm.agent.pipe.wire import Direction, decode_frame, encode_frame, parse_wire_codec

    _, parts = encode_frame(
        np.ascontiguousarray(array, dtype=np.float32),
        parse_wire_codec(spec),
        job="j",
        attempt=1,
        step=0,
        micro=0,
        direction=Direction.FWD,
    )
    return np.array(decode_frame([bytes(p) for p in parts])[1])


def _train(plans: list[StagePlan], steps: int):
    """Every stage's model and dataset after ``steps`` steps of the stage loop's arithmetic."""
    import tensorflow as tf

    from silentswarm.agent.runtime.data import TextDataset
    from silentswarm.agent.runtime.stage_model import StageModel
    from silentswarm.compression import parse_compression

    models = [StageModel(p) for p in plans]
    train, cfg = plans[0].train, plans[0].model
    datasets = [
        TextDataset(
            train.data,
            seq_len=cfg.seq_len,
            seed=train.seed,
            val_fraction=train.val_fraction,
            max_bytes=train.max_data_bytes,
        )
        for _ in plans
    ]
    wire = parse_compression(plans[0].compression, d_model=cfg.d_model).wire
    m, mb = train.micro_batches, train.batch_size // train.micro_batches
    for step in range(steps):
        inputs, targets = datasets[0].next_batch(train.batch_size)
        for data in datasets[1:]:
            data.next_batch(train.batch_size)
        for i in range(m):
            x = tf.constant(inputs[i * mb : (i + 1) * mb])
            tapes = []
            for model in models:  # forward: each stage's output crosses the wire
                with tf.GradientTape() as tape:
                    if not model.plan.is_first:
                        tape.watch(x)
                    if model.plan.is_last:
                        out = model.forward_loss(x, tf.constant(targets[i * mb : (i + 1) * mb]))
                    else:
                        out = model.forward(x)
                tapes.append((tape, x, out))
                x = tf.constant(_wire(out.numpy(), wire)) if not model.plan.is_last else None
            back = None
            for model, (tape, x, out) in reversed(list(zip(models, tapes, strict=True))):
                sources = model.variables if model.plan.is_first else [*model.variables, x]
                grads = tape.gradient(out, sources, output_gradients=back)
                model.accumulate(grads[: len(model.variables)])
                if not model.plan.is_first:
                    back = tf.constant(_wire(grads[-1].numpy(), wire))
        for model in models:
            model.apply(step, m)
    return models, datasets


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_export(
    directory: Path,
    compression: str,
    steps: int = STEPS,
    *,
    model: ModelConfig = TINY,
    ranges: tuple[tuple[int, int], ...] = ((0, 1), (1, 2)),
):
    """An export directory as the leader writes it; also the trained stage models."""
    from silentswarm.agent.runtime.checkpoint import save_checkpoint, stage_arrays

    spec, placement = _spec(compression, steps, model), _placement(list(ranges))
    plans = stage_plans(
        job_id="j-tiny", attempt=1, spec=spec, placement=placement, subject_prefix="swarm"
    )
    models, datasets = _train(plans, steps)
    shards = directory / "shards" / f"step-{steps}"
    shards.mkdir(parents=True)
    for plan, model, data in zip(plans, models, datasets, strict=True):
        written = save_checkpoint(
            directory / "tmp",
            plan,
            stage_arrays(model),
            steps_done=steps,
            data_state=data.state(),
        )
        for suffix in ("json", "npz"):
            shutil.move(written / f"stage-{plan.stage}.{suffix}", shards)
    shutil.rmtree(directory / "tmp")
    _manifest(directory, spec, placement, steps)
    return models


def _manifest(directory: Path, spec: JobSpec, placement: Placement, step: int, **extra) -> None:
    """``run_manifest.json`` for the checkpoints in ``directory/shards/step-<step>/``."""
    stages = []
    for placed in placement.stages:
        rel = f"shards/step-{step}/stage-{placed.stage}"
        stages.append(
            {
                "stage": placed.stage,
                "fellow_id": placed.fellow_id,
                "layer_start": placed.layer_start,
                "layer_end": placed.layer_end,
                "checkpoint": f"{rel}.json",
                "checkpoint_sha256": _sha(directory / f"{rel}.json"),
                "weights": f"{rel}.npz",
                "weights_sha256": _sha(directory / f"{rel}.npz"),
                "bytes": (directory / f"{rel}.npz").stat().st_size,
            }
        )
    manifest = {
        "format": 1,
        "job_id": "j-tiny",
        "name": spec.name,
        "attempt": 1,
        "package_version": "0.1.0",
        "spec": msgspec.to_builtins(spec),
        "placement": msgspec.to_builtins(placement),
        "compression": spec.compression,
        "step": step,
        "total_steps": spec.steps,
        "loss": None,
        "val_loss": None,
        "stages": stages,
        "updated_at": 1764500000.0,
        **extra,
    }
    (directory / "run_manifest.json").write_text(json.dumps(manifest, indent=1))


def export_from_stage_processes(directory: Path, work: Path) -> dict:
    """Train with real ``swarm-stage`` processes, checkpoint after the last step, export.

    Each stage gets the checkpoint request over ``--control-stdin`` as from its agent. The
    last stage's ``done`` event (with the pipeline's own validation loss) is returned.
    """
    from silentswarm.agent.runtime.launch import stage_command, stage_env, write_plans
    from silentswarm.procs import free_port

    spec = _spec("none", STEPS, TINY)
    placement = _placement([(0, 1), (1, 2)])
    placement.stages[1].data_address = f"tcp://127.0.0.1:{free_port()}"
    plans = stage_plans(
        job_id="j-tiny", attempt=1, spec=spec, placement=placement, subject_prefix="swarm"
    )
    ckpt = work / "ckpt"
    plans = [
        msgspec.structs.replace(p, checkpoint_dir=str(ckpt), intra_op_threads=1) for p in plans
    ]
    request = json.dumps({"cmd": "checkpoint", "id": "export", "at_step": STEPS}) + "\n"
    procs = []
    try:
        for plan, path in reversed(list(zip(plans, write_plans(plans, work), strict=True))):
            out = work / f"stage-{plan.stage}.out"
            with open(out, "wb") as stdout, open(out.with_suffix(".err"), "wb") as stderr:
                proc = subprocess.Popen(
                    stage_command(path, control_stdin=True),
                    stdin=subprocess.PIPE,
                    stdout=stdout,
                    stderr=stderr,
                    env=stage_env(),
                )
            proc.stdin.write(request.encode())
            proc.stdin.flush()
            procs.append(proc)
        for proc in procs:  # stdin stays open until the stage is done: EOF would end it
            if proc.wait(timeout=120) != 0:
                errors = [f.read_text()[-2000:] for f in sorted(work.glob("stage-*.err"))]
                pytest.fail(f"a stage exited {proc.returncode}:\n" + "\n".join(errors))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdin.close()
    events = [
        json.loads(line)
        for line in (work / "stage-1.out").read_text().splitlines()
        if line.startswith("{")
    ]
    done = next(e for e in events if e["event"] == "done")
    shutil.copytree(
        ckpt / "j-tiny" / "attempt-1" / f"step-{STEPS}", directory / "shards" / f"step-{STEPS}"
    )
    _manifest(directory, spec, placement, STEPS, loss=done["loss"], val_loss=done["val_loss"])
    return done


def chain_logits(models, tokens: np.ndarray, wire: str) -> np.ndarray:
    """The pipeline's forward: each stage, the wire codec between, the last stage's logits."""
    import tensorflow as tf

    x = tf.constant(tokens)
    for model in models[:-1]:
        x = tf.constant(_wire(model.forward(x, training=False).numpy(), wire))
    for piece in models[-1].pieces:
        layer = piece.layer
        x = layer(x, training=False) if layer.name.startswith("block_") else layer(x)
    return x.numpy()


def run(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """An export of a run of real stage processes, and those stages' models, restored."""
    from silentswarm.agent.runtime.glue import build_stage_models, plans_for, read_run_manifest

    directory = tmp_path_factory.mktemp("export-none")
    done = export_from_stage_processes(directory, tmp_path_factory.mktemp("run"))
    manifest = read_run_manifest(directory)
    return directory, build_stage_models(manifest, plans_for(manifest)), done


@pytest.fixture(scope="module")
def glued(export):
    """The export glued by the command line, as a user would."""
    directory, models, _ = export
    done = run("silentswarm.agent.runtime.glue", "--export-dir", str(directory), "--json")
    assert done.returncode == 0, done.stderr
    return directory, models, json.loads(done.stdout)


# --- the wire codec in TensorFlow -------------------------------------------------------------


@pytest.mark.parametrize("codec", ["fp16", *(f"fixed_int{n}" for n in range(2, 9))])
def test_the_tensorflow_codec_is_the_wire_bit_for_bit(codec):
    """Eager, in a tf.function (where Grappler rewrites divisions) and under XLA."""
    import tensorflow as tf

    from silentswarm.agent.runtime.model import WireRoundTrip

    rng = np.random.default_rng(0)
    rows = rng.exponential(1.0, (16, 64, 1)) * 10.0 ** rng.integers(-6, 3, (16, 64, 1))
    x = (rng.standard_normal((16, 64, 48)) * rows).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero row
    want = _wire(x, codec)
    layer = WireRoundTrip(codec)
    for run_it in (layer, tf.function(layer), tf.function(layer, jit_compile=True)):
        np.testing.assert_array_equal(run_it(tf.constant(x)).numpy(), want)


@pytest.mark.parametrize("magnitude", [0.0, 1e-6, 1e-30, 1e20])
def test_the_tensorflow_fp16_shift_is_the_wire_bit_for_bit(magnitude):
    """Tensors whose absmax puts the shift far from 0 (a late step's gradients), or at its
    clip, or none at all (zeros)."""
    import tensorflow as tf

    from silentswarm.agent.runtime.model import WireRoundTrip

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 16, 48)) * magnitude).astype(np.float32)
    want = _wire(x, "fp16")
    layer = WireRoundTrip("fp16")
    for run_it in (layer, tf.function(layer), tf.function(layer, jit_compile=True)):
        np.testing.assert_array_equal(run_it(tf.constant(x)).numpy(), want)


# --- glue -------------------------------------------------------------------------------------


def test_glue_writes_a_model_and_its_manifest(export, glued):
    directory, _, result = glued
    pipeline = export[2]  # the last stage's "done" event
    out = directory / "full_model"
    assert result["out"] == str(out)
    assert sorted(p.name for p in out.iterdir()) == ["inference_manifest.json", "model.keras"]
    manifest = json.loads((out / "inference_manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["job_id"] == "j-tiny"
    assert (manifest["step"], manifest["seq_len"], manifest["vocab_size"]) == (STEPS, 32, 256)
    assert manifest["model"] == msgspec.to_builtins(TINY)
    assert manifest["compression"] == "none" and manifest["fallback"] is None
    assert manifest["model_file"] == "model.keras"
    assert manifest["files"]["model.keras"]["sha256"] == _sha(out / "model.keras")
    assert manifest["max_abs_diff"] < 1e-4 <= manifest["tolerance"]
    assert manifest["check"]["batches"] == 4 and manifest["data"]["val_batches"] == 4
    # The same validation batches as the pipeline's last stage: the restored stages give its
    # loss exactly, the glued model to float noise; training moved it below uniform (5.545).
    assert manifest["pipeline_val_loss"] == pipeline["val_loss"] < 5.5
    assert manifest["chain_val_loss"] == pytest.approx(pipeline["val_loss"], abs=1e-6)
    assert manifest["val_loss"] == pytest.approx(pipeline["val_loss"], abs=1e-5)
    assert manifest["keras_version"] and manifest["tensorflow_version"]
    assert not [p for p in directory.iterdir() if p.name.startswith(".")], "no temporary left"


def test_the_keras_file_loads_in_a_fresh_process_and_is_the_pipeline(glued, tmp_path):
    directory, models, _ = glued
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 256, (3, TINY.seq_len)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    code = (
        "import sys, numpy as np, keras\n"
        "import silentswarm.agent.runtime.model\n"
        f"model = keras.saving.load_model({str(directory / 'full_model' / 'model.keras')!r})\n"
        f"tokens = np.load({str(tmp_path / 'tokens.npy')!r})\n"
        f"np.save({str(tmp_path / 'logits.npy')!r}, model(tokens).numpy())\n"
        "print(type(model).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "GluedTransformer"
    got = np.load(tmp_path / "logits.npy")
    want = chain_logits(models, tokens, "none")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_a_learned_bottleneck_with_int8_glues_and_reproduces_the_pipeline(tmp_path):
    from silentswarm.agent.runtime.glue import end_to_end_rtol, glue

    models = make_export(tmp_path, "learned_dim8_int8", steps=3)
    result = glue(tmp_path, tmp_path / "glued").manifest
    assert result.compression == "learned_dim8_int8" and result.bottleneck_dim == 8
    assert result.wire_codec == "fixed_int8"
    assert result.check.stage_max_abs_diff[0] < 1e-4
    assert result.max_abs_diff <= result.tolerance
    want_tolerance = end_to_end_rtol("fixed_int8") * result.check.logit_scale
    assert result.tolerance == pytest.approx(want_tolerance)
    import keras

    model = keras.saving.load_model(tmp_path / "glued" / "model.keras")
    assert [p.name for p in model.downs] == ["down_0"] and [p.name for p in model.ups] == ["up_0"]
    tokens = np.random.default_rng(1).integers(0, 256, (2, TINY.seq_len)).astype(np.int32)
    want = chain_logits(models, tokens, "fixed_int8")
    got = model(tokens).numpy()
    assert np.max(np.abs(got - want)) <= result.tolerance


def test_a_corrupt_shard_is_an_error_naming_it_and_nothing_is_written(export, tmp_path):
    directory, _, _ = export
    copy = tmp_path / "export"
    shutil.copytree(directory, copy, ignore=shutil.ignore_patterns("full_model"))
    npz = copy / "shards" / f"step-{STEPS}" / "stage-1.npz"
    data = bytearray(npz.read_bytes())
    data[100:104] = bytes(b ^ 0xFF for b in data[100:104])
    npz.write_bytes(bytes(data))
    done = run("silentswarm.agent.runtime.glue", "--export-dir", str(copy))
    assert done.returncode == 2
    assert f"glue: error: shards/step-{STEPS}/stage-1.npz: sha256" in done.stderr
    assert "does not match the manifest" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in copy.iterdir()) == ["run_manifest.json", "shards"]

    npz.unlink()
    done = run("silentswarm.agent.runtime.glue", "--export-dir", str(copy))
    assert done.returncode == 2 and f"shards/step-{STEPS}/stage-1.npz: missing" in done.stderr


def test_a_bad_manifest_is_an_error_naming_the_problem(export, tmp_path):
    from silentswarm.agent.errors import GlueError
    from silentswarm.agent.runtime.glue import read_run_manifest

    directory, _, _ = export
    raw = json.loads((directory / "run_manifest.json").read_text())
    copy = tmp_path / "export"
    shutil.copytree(directory / "shards", copy / "shards")
    for change, needle in [
        ({"format": 2}, "format 2"),
        ({"step": None}, "step must be int"),
        ({"stages": raw["stages"][:1]}, "lists 1 stage checkpoints"),
        ({"step": STEPS + 1}, "steps_done"),
        ({"compression": "fp16"}, "compression"),
    ]:
        (copy / "run_manifest.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(GlueError, match=needle):
            read_run_manifest(copy)
    escaping = [{**raw["stages"][0], "weights": "../elsewhere.npz"}, raw["stages"][1]]
    (copy / "run_manifest.json").write_text(json.dumps({**raw, "stages": escaping}))
    with pytest.raises(GlueError, match="leaves the export directory"):
        read_run_manifest(copy)


def test_a_glued_model_that_differs_from_the_pipeline_is_refused(export, monkeypatch, tmp_path):
    from silentswarm.agent.errors import GlueMismatchError
    from silentswarm.agent.runtime.glue import assemble, glue

    directory, _, _ = export
    build = assemble.glued_from_stages

    def broken(models):
        glued = build(models)
        glued.blocks[1].w_o.assign(glued.blocks[1].w_o * 1.5)
        return glued

    monkeypatch.setattr(assemble, "glued_from_stages", broken)
    with pytest.raises(GlueMismatchError, match=r"stage 1: .* differs .* by"):
        glue(directory, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_without_the_keras_format_it_falls_back_to_weights_and_config(
    export, monkeypatch, tmp_path
):
    from silentswarm.agent.errors import GlueError
    from silentswarm.agent.runtime.generate import generate, load_model
    from silentswarm.agent.runtime.glue import glue
    from silentswarm.agent.runtime.model import GluedTransformer

    directory, _, _ = export
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("not a glued model")
    with pytest.raises(GlueError, match="refusing to replace it"):
        glue(directory, out)
    with pytest.raises(GlueError, match="would replace the export directory"):
        glue(directory, directory)
    (out / "inference_manifest.json").write_text("{}")  # an earlier glue's output

    def refuse(self, *args, **kwargs):
        raise OSError("no .keras today")

    monkeypatch.setattr(GluedTransformer, "save", refuse)
    raw = json.loads((directory / "run_manifest.json").read_text())
    raw["spec"]["data"] = [str(tmp_path / "nowhere" / "*.txt")]
    moved = tmp_path / "moved"
    shutil.copytree(directory, moved, ignore=shutil.ignore_patterns("full_model"))
    (moved / "run_manifest.json").write_text(json.dumps(raw))
    with pytest.raises(GlueError, match=r"cannot read the job's validation data .*--data"):
        glue(moved, out)
    assert (out / "stale").exists(), "a failed glue leaves the earlier output alone"

    # The job's data lives elsewhere here: --data points at it (the same text, so the same
    # validation batches).
    result = glue(moved, out, data=["stdlib"]).manifest
    assert result.fallback == "saving model.keras failed: OSError: no .keras today"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "inference_manifest.json",
        "model.weights.h5",
    ]
    assert result.data.override and result.max_abs_diff <= result.tolerance
    assert set(result.files) == {"model.weights.h5", "config.json"}
    loaded = load_model(out)
    assert isinstance(loaded.model, GluedTransformer)
    assert len(generate(loaded, b"import", max_new_tokens=4, seed=1)) == 4


def test_the_exp_script_is_the_glue_command(tmp_path):
    script = REPO / "exp" / "scripts" / "glue_model_export.py"
    done = subprocess.run(
        [sys.executable, str(script), "--export-dir", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == f"glue: error: {tmp_path / 'none'}: not a directory\n"


def test_the_exp_script_glues_an_export_dir_or_the_folder_holding_its_model_export(
    export, glued, tmp_path
):
    """``--export-dir DIR`` with DIR the export (run_manifest.json), or a folder whose
    model_export/ is one (<root>/<job_id>, a benchmark repeat's folder)."""
    directory, _, _ = export
    _, _, expected = glued
    script = REPO / "exp" / "scripts" / "glue_model_export.py"
    holder = tmp_path / "repeat-1"
    shutil.copytree(directory, holder / "model_export", ignore=shutil.ignore_patterns("full_*"))
    for given, out in ((directory, tmp_path / "direct"), (holder, None)):
        args = ["--export-dir", str(given), "--json"] + (["--out", str(out)] if out else [])
        done = subprocess.run(
            [sys.executable, str(script), *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=180,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
        written = out or holder / "model_export" / "full_model"
        assert (written / "inference_manifest.json").is_file(), given


# --- generate ---------------------------------------------------------------------------------


def test_generate_gives_the_requested_bytes_deterministically(glued):
    from silentswarm.agent.runtime.generate import Sampler, generate, load_model

    directory, _, _ = glued
    loaded = load_model(directory)  # the export directory: its full_model/ is found
    sampler = Sampler(loaded)
    a = generate(loaded, b"def ", max_new_tokens=40, seed=5, sampler=sampler)
    b = generate(loaded, b"def ", max_new_tokens=40, seed=5, sampler=sampler)
    c = generate(loaded, b"def ", max_new_tokens=40, seed=6, sampler=sampler)
    assert len(a) == 40 and a == b and a != c
    greedy = generate(loaded, b"x" * 100, max_new_tokens=5, temperature=0, sampler=sampler)
    assert greedy == generate(loaded, b"x" * 100, max_new_tokens=5, temperature=0, top_k=1)
    assert len(generate(loaded, b"", max_new_tokens=3, sampler=sampler)) == 3

    args = ["--model-dir", str(directory / "full_model"), "--prompt", "import ", "--seed", "2"]
    first = run("silentswarm.agent.runtime.generate", *args, "--max-new-tokens", "20")
    second = run("silentswarm.agent.runtime.generate", *args, "--max-new-tokens", "20")
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.endswith("\n")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--temperature", "-1"], "--temperature"),
        (["--top-k", "-1"], "--top-k"),
        (["--max-new-tokens", "-2"], "--max-new-tokens"),
        (["--max-new-tokens", "many"], "invalid int value"),
    ],
)
def test_generate_refuses_bad_arguments(tmp_path, args, needle):
    done = run(
        "silentswarm.agent.runtime.generate", "--model-dir", str(tmp_path), "--prompt", "a", *args
    )
    assert done.returncode == 2 and needle in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.startswith("generate: error: ")


def test_generate_needs_a_glued_model(tmp_path):
    done = run("silentswarm.agent.runtime.generate", "--model-dir", str(tmp_path), "--prompt", "a")
    assert done.returncode == 2 and "inference_manifest.json" in done.stderr
