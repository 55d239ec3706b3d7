"""TensorFlow's process set-up: a stage's start leaves matplotlib out."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, child_env

pytestmark = pytest.mark.integration  # each case imports TensorFlow in a fresh process

PROBE = """
import sys
from silentswarm.agent.runtime.tfsetup import configure_tensorflow
configure_tensorflow(intra_op_threads=1, plotting={plotting})
import keras
import tensorflow as tf
assert float(tf.reduce_sum(tf.ones([3]))) == 3.0
print(type(sys.modules.get("matplotlib")).__name__)
"""


@pytest.mark.parametrize(("plotting", "matplotlib"), [(False, "NoneType"), (True, "module")])
def test_a_stage_imports_keras_without_matplotlib_unless_it_plots(plotting, matplotlib):
    pytest.importorskip("matplotlib")  # the `plots` extra: what would be imported
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(plotting=plotting)],
        cwd=REPO,
        env=child_env(TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [matplotlib]
