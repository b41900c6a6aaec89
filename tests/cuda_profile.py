"""What a test reads of the GPU's timeline under torch's profiler: the kernels a step launched."""

import torch


def kernels_launched(step, rounds: int) -> list[str]:
    """The names of the kernels `rounds` calls of `step` put on the GPU, in order. Copies and
    memsets are no kernels, nor are the Works' own ranges (smfree:send, smfree:recv, …), which
    show on the GPU's timeline as annotations around the copies queued inside them."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(rounds):
            step()
        torch.cuda.synchronize()
    return [evt.name for evt in prof.events()
            if evt.device_type == torch.autograd.DeviceType.CUDA
            and "memcpy" not in evt.name.lower() and "memset" not in evt.name.lower()
            and not getattr(evt, "is_user_annotation", False)
            and not evt.name.startswith("smfree:")]
