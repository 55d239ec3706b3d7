import pytest

from silentswarm.agent.runtime.devices import tf_gpu_index


@pytest.mark.parametrize(
    ("index", "uuid", "visible", "expected"),
    [
        (2, "GPU-aaa", None, 2),
        (2, "GPU-aaa", "2,3", 0),
        (3, "GPU-bbb", "2,3", 1),
        (1, "GPU-bbb", "2,3", None),
        (5, "GPU-bbb", "GPU-aaa,GPU-bbb", 1),
        (5, "GPU-bbb-1234", "GPU-bbb", 0),
        (0, "GPU-aaa", "", None),
    ],
)
def test_slot_to_tensorflow_gpu(index, uuid, visible, expected):
    assert tf_gpu_index(index, uuid, visible) == expected
