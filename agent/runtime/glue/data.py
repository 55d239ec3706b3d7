"""The validation batches glue checks and scores on: the job's, read on this machine.

``train.data`` of the job is resolved here (so ``stdlib`` means this Python's standard
library, and relative paths are relative to the working directory); ``--data`` points at
another copy. What was read (how many tokens, their sha256) goes into the inference manifest,
next to ``chain_val_loss`` (the stage models' own loss on these batches) and
``pipeline_val_loss`` (what the job reported): if they differ a lot, the data here is not
what the job validated on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from silentswarm.agent.errors import GlueError
from silentswarm.plan import StagePlan
from silentswarm.types.manifests import DataInfo

if TYPE_CHECKING:
    import numpy as np

    from silentswarm.agent.runtime.tokenizer import Tokenizer


@dataclass
class ValidationData:
    batches: list[tuple[np.ndarray, np.ndarray]]
    scored: bool  # the pipeline's validation batches (else: one short batch, for the check)
    info: DataInfo


def validation_data(
    plan: StagePlan, data: Sequence[str] | None, tokenizer: Tokenizer | None = None
) -> ValidationData:
    """The pipeline's validation batches (stage 0 reads them; the last stage scores the
    targets they bring): the same ``job_dataset`` and ``job_val_batches`` as
    :class:`StageRunner`, so the pipeline's ``val_loss`` and ``chain_val_loss`` agree to
    the last bit (tested against real stage processes).
    """
    from silentswarm.agent.errors import DataError
    from silentswarm.agent.runtime.data import job_dataset, job_val_batches

    train = plan.train
    patterns = list(data) if data else list(train.data)
    try:
        dataset = job_dataset(train, plan.model.seq_len, patterns, tokenizer=tokenizer)
    except (DataError, OSError) as exc:
        raise GlueError(
            f"cannot read the job's validation data {patterns}: {exc} (--data points at a copy)"
        ) from None
    batches = list(job_val_batches(dataset, train))
    scored = bool(batches)
    if not batches:  # fewer validation windows than one batch: the pipeline had no val loss
        batches = list(dataset.val_batches(train.batch_size, max_batches=1))
    info = DataInfo(
        patterns=patterns,
        override=bool(data),
        n_tokens=dataset.n_tokens,
        sha256=dataset.tokens_sha256(),  # through the map, a chunk at a time
        batch_size=train.batch_size,
        val_batches=len(batches) if scored else 0,
    )
    return ValidationData(batches=batches, scored=scored, info=info)
