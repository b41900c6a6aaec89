import os
import sys

import pytest

# The helpers (harness, channels, devices) live here; test modules in subfolders import them, and
# spawned ranks import rank functions from the test modules (pytest puts each test's folder
# on sys.path, which spawned processes inherit).
sys.path.insert(0, os.path.dirname(__file__))

import channels  # noqa: E402
import devices  # noqa: E402


@pytest.fixture(params=channels.ALL)
def channel(request):
    """Each data channel that can run here: CPU tensors over UCX, with a GPU also CUDA tensors
    over the copy engines, over UCX and over UCX on TCP alone."""
    return request.param


@pytest.fixture(params=channels.CUDA)
def cuda_channel(request):
    """Each channel of CUDA tensors (needs a GPU; ranks share it where there are fewer GPUs
    than ranks)."""
    return request.param


def pytest_collection_modifyitems(config, items):
    gpus = devices.gpu_count()
    for item in items:
        reason = devices.skip_reason("gpu" in item.keywords,
                                     item.get_closest_marker("distinct_gpus"), gpus, item.nodeid)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
