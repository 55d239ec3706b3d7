"""Stage checkpoints: every model and optimizer variable of one stage, plus where training was.

Layout, shared by all stages of a job (each writes only its own two files)::

    <checkpoint_dir>/<job_id>/attempt-<attempt>/step-<steps_done>/stage-<stage>.npz
    <checkpoint_dir>/<job_id>/attempt-<attempt>/step-<steps_done>/stage-<stage>.json

The ``.npz`` holds the arrays, the ``.json`` the meta data (plan identity, data position,
array names and shapes). Both are written to a temporary name, fsynced and renamed, the JSON
last: a stage's checkpoint is complete exactly when its JSON exists. Only stage 0 reads data,
so only its checkpoint has a data position; the other stages' ``data`` is null (a position
there, from a checkpoint written before they stopped reading data, is ignored).

Array names are ``model/<i>:<variable path>`` and ``optimizer/<i>:<variable path>`` (and, under
the ``overlap`` schedule, ``pending/<i>:<variable path>``: the gradient set aside for the
delayed update, whose step and micro-batch count the meta data's ``pending`` names; and, for
a replica under ``sync: "diloco"``, ``anchor/<i>:<path>`` and ``outer_momentum/<i>:<path>``:
the weights at the last outer step and the outer optimizer's momentum). The index
``i`` (the variable's position in the stage) is what restoring matches on; the path is for
people, since Keras numbers some auto-named variables per process.

Only numpy here: the model is passed in, so reading meta data needs no TensorFlow.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import msgspec
import numpy as np

from silentswarm.agent.errors import CheckpointError, CheckpointWriteError, DataError
from silentswarm.agent.runtime.data import DataState, TextDataset
from silentswarm.agent.runtime.schedule import PendingUpdate
from silentswarm.agent.runtime.tokenizer import Tokenizer, load_tokenizer
from silentswarm.plan import ModelConfig, StagePlan

if TYPE_CHECKING:
    from silentswarm.agent.runtime.stage_model import StageModel

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Checkpoint:
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    path: Path  # the JSON file


def step_dir(root: str | os.PathLike[str], job_id: str, attempt: int, steps_done: int) -> Path:
    """The directory all stages of a job write their checkpoint after ``steps_done`` steps."""
    return Path(root) / job_id / f"attempt-{attempt}" / f"step-{steps_done}"


# --- the variables of a stage -----------------------------------------------------------------


def is_adapter_variable(variable: Any) -> bool:
    """Whether ``variable`` is a LoRA adapter's (``lora_<w>_a``/``_b``, see ``model.py``)."""
    return str(variable.path).rsplit("/", 1)[-1].startswith("lora_")


def _model_variables(model: StageModel) -> list[Any]:
    """Every variable of every piece, non-trainable ones (dropout seed state) included; of a
    stage that trains an adapter, the adapter's only (the rest is the export it adapts)."""
    variables = [v for piece in model.pieces for v in piece.layer.variables]
    if model.plan.train.adapter is not None:
        return [v for v in variables if is_adapter_variable(v)]
    return variables


def named_variables(model: StageModel) -> list[tuple[str, Any]]:
    """``(array name, variable)`` for the model's and the optimizer's variables, in order."""
    named = [(f"model/{i}:{v.path}", v) for i, v in enumerate(_model_variables(model))]
    named += [(f"optimizer/{i}:{v.path}", v) for i, v in enumerate(model.optimizer.variables)]
    named += [  # each named after the variable whose gradient it holds
        (f"pending/{i}:{v.path}", p)
        for i, (v, p) in enumerate(zip(model.variables, model.pending, strict=False))
    ]
    named += [  # DiLoCo's outer state (replicas, sync "diloco"); none otherwise
        (f"{kind}/{i}:{v.path}", state)
        for kind, states in (("anchor", model.anchor), ("outer_momentum", model.outer_momentum))
        for i, (v, state) in enumerate(zip(model.variables, states, strict=False))
    ]
    return named


def stage_arrays(model: StageModel) -> dict[str, np.ndarray]:
    """A numpy copy of every variable of the stage, by array name."""
    return {name: np.asarray(v.numpy()) for name, v in named_variables(model)}


def _key(name: str) -> str:
    """``model/3:block_0/w_o`` -> ``model/3``: the part restoring matches on."""
    return name.split(":", 1)[0]


# --- writing ----------------------------------------------------------------------------------


def build_meta(
    plan: StagePlan,
    arrays: dict[str, np.ndarray],
    *,
    steps_done: int,
    data_state: DataState | None,
    pending: PendingUpdate | None = None,
    tokenizer_json: str | None = None,
) -> dict[str, Any]:
    """The JSON meta data of a stage's checkpoint; ``data_state`` None for a stage that
    reads no data (all but stage 0); ``tokenizer_json``: the trained BPE stage 0 encodes with
    (None for bytes, and on the other stages), so a resumed stage 0 and glue use the same."""
    data = None if data_state is None else {"epoch": data_state.epoch, "index": data_state.index}
    return {
        "format": FORMAT_VERSION,
        "job_id": plan.job_id,
        "attempt": plan.attempt,
        "stage": plan.stage,
        "n_stages": plan.n_stages,
        "layer_start": plan.layer_start,
        "layer_end": plan.layer_end,
        "steps_done": steps_done,
        "total_steps": plan.train.steps,
        "final": steps_done >= plan.train.steps,
        "data": data,
        "tokenizer": tokenizer_json,
        "pending": None if pending is None else msgspec.to_builtins(pending),
        "model": msgspec.to_builtins(plan.model),
        "train": msgspec.to_builtins(plan.train),
        "compression": plan.compression,
        "grad_compression": plan.grad_compression,
        "created_at": time.time(),
        "npz": f"stage-{plan.stage}.npz",
        "arrays": [
            {"name": name, "shape": list(a.shape), "dtype": str(a.dtype)}
            for name, a in arrays.items()
        ],
    }


def _write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write through a temporary file in the same directory, fsync it, rename it over ``path``.

    CheckpointWriteError (naming ``path``) when the OS refuses; the temporary file is gone."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointWriteError(path, exc) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(directory: Path) -> None:
    """Make the renames durable: a crash must not leave a JSON whose npz is not on disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # some file systems cannot fsync a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: str | os.PathLike[str],
    plan: StagePlan,
    arrays: dict[str, np.ndarray],
    *,
    steps_done: int,
    data_state: DataState | None,
    pending: PendingUpdate | None = None,
    tokenizer_json: str | None = None,
) -> Path:
    """Write this stage's checkpoint under ``root``; the step directory. ``data_state``:
    None for a stage that reads no data.

    CheckpointWriteError naming the path that could not be written; then nothing of this
    checkpoint is left behind (a full disk gets its space back)."""
    directory = step_dir(root, plan.job_id, plan.attempt, steps_done)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointWriteError(directory, exc) from exc
    meta = build_meta(
        plan,
        arrays,
        steps_done=steps_done,
        data_state=data_state,
        pending=pending,
        tokenizer_json=tokenizer_json,
    )
    npz = directory / meta["npz"]
    body = json.dumps(meta, indent=1).encode() + b"\n"
    try:
        _write_atomic(npz, lambda f: np.savez(f, **arrays))
        _fsync_dir(directory)
        _write_atomic(directory / f"stage-{plan.stage}.json", lambda f: f.write(body))
    except CheckpointWriteError:
        npz.unlink(missing_ok=True)  # arrays without their JSON are no checkpoint
        with contextlib.suppress(OSError):
            directory.rmdir()  # only if no other stage wrote there
        raise
    _fsync_dir(directory)
    return directory


def save_stage(
    root: str | os.PathLike[str],
    model: StageModel,
    dataset: TextDataset | None,
    *,
    steps_done: int,
    data_state: DataState | None = None,
    pending: PendingUpdate | None = None,
) -> Path:
    """Checkpoint a live stage: its model's and optimizer's variables and, on the stage that
    reads the data (``dataset``; None on the others), the data position (``data_state``:
    where the data stood after ``steps_done`` steps, when the stage has read ahead, as the
    overlap schedule does; otherwise where it stands)."""
    if dataset is None:
        data_state = None
    elif data_state is None:
        data_state = dataset.state()
    return save_checkpoint(
        root,
        model.plan,
        stage_arrays(model),
        steps_done=steps_done,
        data_state=data_state,
        pending=pending,
        tokenizer_json=None if dataset is None else dataset.tokenizer.to_json(),
    )


def checkpoint_tokenizer(plan: StagePlan, meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer stage 0's checkpoint was written with (its plan names the kind)."""
    text = meta.get("tokenizer")
    if text is not None and not isinstance(text, str):
        raise CheckpointError("the checkpoint's tokenizer is not a tokenizer's JSON text")
    try:
        return load_tokenizer(plan.train.tokenizer.kind, plan.model.vocab_size, text)
    except DataError as exc:
        raise CheckpointError(f"the checkpoint's tokenizer: {exc.message}") from None


def pending_update(checkpoint: Checkpoint) -> PendingUpdate | None:
    """The delayed update a checkpoint holds, if any."""
    raw = checkpoint.meta.get("pending")
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, PendingUpdate)
    except msgspec.ValidationError as exc:
        raise CheckpointError(f"{checkpoint.path}: bad pending update ({exc})") from None


# --- reading and restoring --------------------------------------------------------------------


def read_arrays(npz_path: Path) -> dict[str, np.ndarray]:
    """The arrays of an ``np.savez`` file, none bigger than the bytes it stores.

    A checkpoint may come from another fellow (a resumed or replaced stage reads the shards
    its predecessor pushed), so the file is a stranger's: a deflated member, or a header
    that declares more than its member holds, would make this process allocate what the
    file's size never bounded (a 190 KB member inflates to 200 MB). ``np.savez`` stores its
    members uncompressed, each one header and its data: anything else is a ValueError."""
    arrays: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(npz_path) as archive:
        for member in archive.infolist():
            if member.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{member.filename} is compressed")
            if not member.filename.endswith(".npy"):
                raise ValueError(f"{member.filename} is not an array")
            with archive.open(member) as file:
                version = np.lib.format.read_magic(file)
                if version not in ((1, 0), (2, 0)):
                    raise ValueError(f"{member.filename}: .npy format {version}")
                if version == (1, 0):
                    shape, _fortran, dtype = np.lib.format.read_array_header_1_0(file)
                else:
                    shape, _fortran, dtype = np.lib.format.read_array_header_2_0(file)
                declared = int(np.prod(shape, dtype=object)) * dtype.itemsize + file.tell()
                if dtype.hasobject or declared != member.file_size:
                    raise ValueError(f"{member.filename}'s header does not match its size")
                file.seek(0)  # read_array reads the header again
                arrays[member.filename[: -len(".npy")]] = np.lib.format.read_array(
                    file, allow_pickle=False
                )
    return arrays


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Meta data and arrays from a stage's JSON file (the npz next to it)."""
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: not a stage checkpoint of format {FORMAT_VERSION}")
    try:
        arrays = read_arrays(path.with_name(meta["npz"]))
    except (
        KeyError,
        ValueError,
        OSError,
        EOFError,
        OverflowError,
        MemoryError,
        zipfile.BadZipFile,
    ) as exc:
        raise CheckpointError(f"{path}: cannot read its arrays ({exc})") from None
    for entry in meta["arrays"]:
        array = arrays.get(entry["name"])
        if array is None or list(array.shape) != entry["shape"]:
            raise CheckpointError(f"{path}: array {entry['name']} is missing or misshapen")
    return Checkpoint(meta=meta, arrays=arrays, path=path)


def check_compatible(plan: StagePlan, meta: dict[str, Any]) -> None:
    """CheckpointError unless the checkpoint was written by this stage of this model."""
    want = {
        "stage": plan.stage,
        "n_stages": plan.n_stages,
        "layer_start": plan.layer_start,
        "layer_end": plan.layer_end,
        "compression": plan.compression,
    }
    wrong = [key for key, value in want.items() if meta.get(key) != value]
    try:  # as a ModelConfig: a field added since, at its default, is no difference
        if msgspec.convert(meta.get("model"), ModelConfig) != plan.model:
            wrong.append("model")
    except msgspec.ValidationError:
        wrong.append("model")
    if wrong:
        raise CheckpointError(f"checkpoint does not fit this stage: {', '.join(wrong)} differ")


def restore_into(model: StageModel, dataset: TextDataset | None, checkpoint: Checkpoint) -> None:
    """Put a checkpoint's variables into ``model`` and its data position into ``dataset``.

    ``model`` is a fresh ``StageModel`` built from a plan for the same stage and model;
    ``dataset`` None for a stage that reads no data (whatever position the checkpoint has is
    then not used). A dataset and a checkpoint without a position is a CheckpointError,
    before anything changed.
    """
    check_compatible(model.plan, checkpoint.meta)
    by_key = {_key(name): array for name, array in checkpoint.arrays.items()}
    targets = named_variables(model)
    # DiLoCo's outer state: a model without it (glue, a warm start, a plan without replicas)
    # takes the weights and leaves it; a DiLoCo model from a checkpoint without it anchors
    # at the restored weights.
    outer_wanted = any(_is_outer(name) for name, _ in targets)
    outer_saved = any(_is_outer(key) for key in by_key)
    if not outer_wanted:
        by_key = {key: array for key, array in by_key.items() if not _is_outer(key)}
    if not outer_saved:
        targets = [(name, v) for name, v in targets if not _is_outer(name)]
    if len(by_key) != len(targets):
        raise CheckpointError(
            f"checkpoint has {len(by_key)} arrays, this stage has {len(targets)} variables"
        )
    pairs = [(variable, by_key.get(_key(name)), name) for name, variable in targets]
    for variable, array, name in pairs:  # check everything before changing anything
        if array is None or tuple(array.shape) != tuple(variable.shape):
            raise CheckpointError(f"checkpoint has no array of shape {variable.shape} for {name}")
    state = None if dataset is None else _data_state(checkpoint)
    for variable, array, _ in pairs:
        variable.assign(array)
    if outer_wanted and not outer_saved:
        model.reset_anchor()
    if dataset is not None and state is not None:
        dataset.restore(state)


def _is_outer(name: str) -> bool:
    """Whether an array name (or key) is DiLoCo's outer state."""
    return name.startswith(("anchor/", "outer_momentum/"))


def _data_state(checkpoint: Checkpoint) -> DataState:
    """The data position a checkpoint holds; CheckpointError when it has none (a stage that
    read no data wrote it) or a malformed one."""
    data = checkpoint.meta.get("data")
    if data is None:
        raise CheckpointError(
            f"{checkpoint.path}: no data position (written by a stage that reads no data), "
            "but this stage reads the data"
        )
    try:
        return DataState(epoch=int(data["epoch"]), index=int(data["index"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint.path}: bad data position {data!r} ({exc})") from None


__all__ = [
    "Checkpoint",
    "PendingUpdate",
    "build_meta",
    "load_checkpoint",
    "named_variables",
    "pending_update",
    "restore_into",
    "save_checkpoint",
    "save_stage",
    "stage_arrays",
    "step_dir",
]
