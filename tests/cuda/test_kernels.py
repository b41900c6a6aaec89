"""P2P traffic of CUDA tensors launches no kernels: every SM stays with compute."""

import pytest
import torch

from cuda_profile import kernels_launched
from devices import cuda_device
from payloads import exchange

pytestmark = pytest.mark.gpu


def _zero_kernels(rank, world, numel):
    dev = cuda_device(rank)
    peer = 1 - rank
    mine = torch.ones(numel, device=dev)
    got = torch.empty(numel, device=dev)
    exchange(mine, got, peer)  # warm: mappings and streams exist
    torch.cuda.synchronize()
    kernels = kernels_launched(lambda: exchange(mine, got, peer), 10)
    return kernels, bool(torch.all(got == 1))


# 16 MiB: copied straight into the receiver's buffer; 16 KiB: eager on the copy engines,
# through a slot of the receiver's, its copy out queued by the recv's wait().
@pytest.mark.parametrize("numel", [1 << 22, 1 << 12], ids=["16MiB", "16KiB"])
def test_p2p_launches_no_kernels(cuda_channel, numel):
    for kernels, ok in cuda_channel.run(_zero_kernels, 2, numel):
        assert ok
        assert kernels == [], f"P2P ops launched kernels: {sorted(set(kernels))}"
