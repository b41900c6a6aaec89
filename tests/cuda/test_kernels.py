"""P2P traffic of CUDA tensors launches no kernels: every SM stays with compute."""

import pytest
import torch

from payloads import exchange

pytestmark = pytest.mark.gpu


def _zero_kernels(rank, world, numel):
    dev = torch.device("cuda", rank)
    peer = 1 - rank
    mine = torch.ones(numel, device=dev)
    got = torch.empty(numel, device=dev)
    exchange(mine, got, peer)  # warm: mappings and streams exist
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            exchange(mine, got, peer)
        torch.cuda.synchronize()
    # The Works' own ranges (smfree:send, smfree:recv) show on the GPU's timeline as
    # annotations around the copies queued inside them: they are not kernels.
    kernels = [evt.name for evt in prof.events()
               if evt.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in evt.name.lower() and "memset" not in evt.name.lower()
               and not getattr(evt, "is_user_annotation", False)
               and not evt.name.startswith("smfree:")]
    return kernels, bool(torch.all(got == 1))


# 16 MiB: copied straight into the receiver's buffer; 16 KiB: eager on the copy engines,
# through a slot of the receiver's, its copy out queued by the recv's wait().
@pytest.mark.parametrize("numel", [1 << 22, 1 << 12], ids=["16MiB", "16KiB"])
def test_p2p_launches_no_kernels(cuda_channel, numel):
    for kernels, ok in cuda_channel.run(_zero_kernels, 2, numel):
        assert ok
        assert kernels == [], f"P2P ops launched kernels: {sorted(set(kernels))}"
