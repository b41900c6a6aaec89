import os
import sys

import pytest
import torch

# The helpers (harness, channels) live here; test modules in subfolders import them, and
# spawned ranks import rank functions from the test modules (pytest puts each test's folder
# on sys.path, which spawned processes inherit).
sys.path.insert(0, os.path.dirname(__file__))

import channels  # noqa: E402


@pytest.fixture(params=channels.ALL)
def channel(request):
    """Each data channel that can run here: CPU tensors over UCX, with 2 GPUs also CUDA tensors
    over the copy engines, over UCX and over UCX on TCP alone."""
    return request.param


@pytest.fixture(params=channels.CUDA)
def cuda_channel(request):
    """Each channel of CUDA tensors (needs 2 GPUs)."""
    return request.param


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(reason="needs at least 2 CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
