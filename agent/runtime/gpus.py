"""``python -m silentswarm.agent.runtime.gpus``: print how many GPUs TensorFlow can use, as JSON.

The agent runs this once at start, in a subprocess (it must never import TensorFlow itself),
when NVML reports GPUs: a GPU that NVML sees but TensorFlow cannot use (no CUDA/cuDNN
wheels) must not be planned for.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    print(json.dumps({"gpus": len(gpus), "names": [g.name for g in gpus]}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
