"""Which GPU each rank of a test uses: rank r uses cuda:(r mod the GPUs present), so on one GPU
every rank shares it, and with as many GPUs as ranks each rank has its own."""

import pytest
import torch


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_gpu(rank: int) -> int:
    """The index of rank `rank`'s GPU."""
    count = gpu_count()
    if count == 0:
        raise RuntimeError(f"rank {rank} was given a GPU, but none is present")
    return rank % count


def cuda_device(rank: int) -> torch.device:
    """Rank `rank`'s GPU as a torch device."""
    return torch.device("cuda", rank_gpu(rank))


def ranks_share_a_gpu(world_size: int) -> bool:
    """Whether `world_size` ranks put two or more of them on one GPU."""
    return gpu_count() < world_size


def skip_reason(gpu: bool, distinct_gpus, gpus: int, nodeid: str) -> str | None:
    """Why a test cannot run with `gpus` GPUs, or None: `gpu`, whether it is marked gpu (needs
    a GPU); `distinct_gpus`, its distinct_gpus marker or None (needs a GPU per rank:
    distinct_gpus("why", gpus=N), N from 2, default 2)."""
    if gpu and gpus == 0:
        return "needs a CUDA GPU"
    if distinct_gpus is None:
        return None
    args, kwargs = distinct_gpus.args, distinct_gpus.kwargs
    if len(args) != 1 or not isinstance(args[0], str) or not args[0]:
        raise pytest.UsageError(f"{nodeid}: distinct_gpus takes one reason, what needs a GPU "
                                f"per rank: {args!r}")
    needed = kwargs.get("gpus", 2)
    if set(kwargs) - {"gpus"} or not isinstance(needed, int) or needed < 2:
        raise pytest.UsageError(f"{nodeid}: distinct_gpus's gpus must be a count from 2: "
                                f"{kwargs!r}")
    if gpus < needed:
        return f"needs {needed} GPUs, one per rank ({gpus} here): {args[0]}"
    return None
