"""P2P traffic of CUDA tensors launches no kernels: every SM stays with compute."""

import pytest
import torch

from payloads import exchange

pytestmark = pytest.mark.gpu


def _zero_kernels(rank, world):
    dev = torch.device("cuda", rank)
    peer = 1 - rank
    mine = torch.ones(1 << 22, device=dev)
    got = torch.empty(1 << 22, device=dev)
    exchange(mine, got, peer)  # warm: mappings and streams exist
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            exchange(mine, got, peer)
        torch.cuda.synchronize()
    kernels = [evt.name for evt in prof.events()
               if evt.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in evt.name.lower() and "memset" not in evt.name.lower()]
    return kernels, bool(torch.all(got == 1))


def test_p2p_launches_no_kernels(cuda_channel):
    for kernels, ok in cuda_channel.run(_zero_kernels, 2):
        assert ok
        assert kernels == [], f"P2P ops launched kernels: {sorted(set(kernels))}"
