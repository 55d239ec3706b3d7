"""TensorFlow process set-up, done once before any op runs."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from silentswarm.errors import ExtraMissingError

# What a host without TensorFlow installs (the base package and the `silentswarm` .deb have
# none: a leader host does not need it).
TENSORFLOW_FIX = (
    "pip install 'silentswarm[fellow]' (or 'silentswarm[gpu]' for GPUs; from the Debian "
    "packages: apt install silentswarm-fellow)"
)


def require_tensorflow(what: str) -> None:
    """Raise :class:`ExtraMissingError` naming the extra unless TensorFlow can be imported.

    Looks for it without importing it (the agent never loads TensorFlow itself).
    """
    if importlib.util.find_spec("tensorflow") is None:
        raise ExtraMissingError(
            f"{what} needs TensorFlow, which is not installed: {TENSORFLOW_FIX}"
        )


def before_import(*, plotting: bool = False) -> None:
    """What must hold before TensorFlow is imported: quiet logs, the PCI order of GPUs, and
    (without ``plotting``) no matplotlib (see :func:`configure_tensorflow`)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if not plotting:
        # Keras's helpers catch the ImportError this gives and go on without plots.
        sys.modules.setdefault("matplotlib", None)  # type: ignore[arg-type]


def configure_tensorflow(
    *, intra_op_threads: int, logical_cpus: int = 1, plotting: bool = False
) -> None:
    """Quiet logs, pin thread pools, and split the CPU into ``logical_cpus`` devices.

    Logical CPU devices let CPU-only runs exercise the per-slot device placement that GPUs
    use. Must run before TensorFlow initialises its runtime.

    Without ``plotting`` the process never imports matplotlib: Keras imports
    ``matplotlib.pyplot`` at start-up wherever it is installed (the ``plots`` extra, a
    developer's environment), for image-gallery helpers no stage or tool calls; that is
    0.5 s of every stage's start here, a third of what TensorFlow's own import costs.
    """
    before_import(plotting=plotting)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(max(1, intra_op_threads))
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if logical_cpus > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(logical_cpus)]
        )


def graph_function(fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """``tf.function(fn, **options)`` without AutoGraph; a decorator when ``fn`` is omitted.

    What the runtime traces is straight-line code: Python loops over lists of layers and
    variables, never over tensors, and no ``if`` on a tensor. AutoGraph would rewrite each of
    those functions, and every Keras layer call inside, into its own Python before tracing:
    for the same graph (the losses are bit for bit the same), a third of a stage's tracing,
    0.3-0.5 s of every stage's start here. A Python branch on a tensor fails loudly at trace
    time without it, so nothing can silently change.
    """
    import tensorflow as tf

    if fn is None:
        return lambda f: tf.function(f, autograph=False, **options)
    return tf.function(fn, autograph=False, **options)
