"""The caching allocator under P2P traffic: buffers that move, segments returned to the driver,
expandable segments, and memory a peer had mapped released when its owner frees it."""

import random
import time

import pytest
import torch
import torch.distributed as dist

import channels
from devices import cuda_device
from payloads import exchange

pytestmark = pytest.mark.gpu


def _churn(rank, world, transfers, cache_size):
    # Random allocations and frees between transfers, so receive buffers move around and
    # the caching allocator returns segments to the driver; every payload is checksummed.
    dev = cuda_device(rank)
    peer = 1 - rank
    rng = random.Random(1234)  # same sequence on both ranks
    keep = []
    backend = dist.group.WORLD._get_backend(dev)
    most_mappings = 0
    for i in range(transfers):
        numel = rng.choice([1 << 10, 1 << 14, 1 << 18, 3 << 18, 1 << 20])
        mine = torch.randint(-1000, 1000, (numel,), dtype=torch.int32, device=dev,
                             generator=torch.Generator(dev).manual_seed(rank * 100_000 + i))
        got = torch.empty(numel, dtype=torch.int32, device=dev)
        exchange(mine, got, peer, batched=i % 2 == 0)
        expected_sum = torch.randint(-1000, 1000, (numel,), dtype=torch.int32, device=dev,
                                     generator=torch.Generator(dev).manual_seed(
                                         peer * 100_000 + i)).sum()
        assert got.sum().item() == expected_sum.item(), f"transfer {i}: checksum differs"
        keep.append(torch.empty(rng.randint(1, 64) << 20, dtype=torch.uint8, device=dev))
        if rng.random() < 0.5:
            keep.pop(rng.randrange(len(keep)))
        if i % 30 == 29:
            keep.clear()
            torch.cuda.empty_cache()  # segments go back to the driver; addresses get reused
            most_mappings = max(most_mappings, backend._stats()["ipc_mappings"])
    torch.cuda.synchronize()
    stats = backend._stats()
    return most_mappings, stats["live_ops"]


EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize("cache_size,alloc_conf", [(4, {}), (1024, {}), (4, EXPANDABLE)],
                         ids=["cache4", "cache1024", "cache4-expandable"])
def test_allocator_churn_keeps_data_right_and_mappings_bounded(cuda_channel, cache_size,
                                                               alloc_conf):
    results = cuda_channel.run(_churn, 2, 300, cache_size, timeout=240,
                               env={"SMFREE_IPC_CACHE_SIZE": str(cache_size), **alloc_conf})
    for most_mappings, live_ops in results:
        assert most_mappings <= cache_size
        assert live_ops == 0


def _spanning_chunks(rank, world):
    dev = cuda_device(rank)
    peer = 1 - rank
    pad = torch.empty(3 << 20, dtype=torch.uint8, device=dev)  # puts the tensor mid-chunk
    numel = (60 << 20) // 4  # 60 MiB: spans at least three 20 MiB chunks
    mine = torch.arange(numel, dtype=torch.int32, device=dev) * 3 + rank
    got = torch.full((numel,), -1, dtype=torch.int32, device=dev)
    expandable = any(segment.get("is_expandable") for segment in torch.cuda.memory_snapshot())
    for batched in (True, False):
        got.fill_(-1)
        exchange(mine, got, peer, batched=batched)
        expected = torch.arange(numel, dtype=torch.int32, device=dev) * 3 + peer
        assert torch.equal(got, expected), f"batched={batched}"
    del pad
    return expandable


def test_expandable_segments_tensor_spanning_several_chunks(cuda_channel):
    assert cuda_channel.run(_spanning_chunks, 2, env=EXPANDABLE) == [True, True]


def _memory_freed_by_its_owner(rank, world):
    dev = cuda_device(rank)
    backend = dist.group.WORLD._get_backend(dev)
    # Warm. The buffer stays alive: freeing it would unmap its segment at the empty_cache
    # below and retract the mapping of it at an unknown moment of the counts.
    warm = torch.empty(8, device=dev)
    exchange(torch.ones(8, device=dev), warm, 1 - rank)
    slack = 256 << 20
    if rank == 1:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        baseline = torch.cuda.mem_get_info(dev)[0]
        got = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
        dist.recv(got, 0)
        received = bool(got[::1 << 20].eq(7).all())
        del got
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the segment goes back to the driver...
        deadline = time.monotonic() + 10
        while torch.cuda.mem_get_info(dev)[0] < baseline - slack and time.monotonic() < deadline:
            time.sleep(0.05)
        # ...and so does the memory, once rank 0 closed its mapping of it
        returned = torch.cuda.mem_get_info(dev)[0] >= baseline - slack
        dist.barrier()
        del warm
        return received, returned
    before = backend._stats()["ipc_mappings"]
    dist.send(torch.full((2 << 30,), 7, dtype=torch.uint8, device=dev), 1)
    during = backend._stats()["ipc_mappings"]  # the copy is still running: rank 1 waits for it
    torch.cuda.synchronize()
    dist.barrier()
    return before, during, backend._stats()["ipc_mappings"]


@pytest.mark.distinct_gpus("reads its GPU's free memory, which on a shared GPU counts every other "
                           "process's allocations (failed so on one H200 beside other tests)")
@pytest.mark.parametrize("cuda_channel", channels.params(channels.COPY_ENGINE))
@pytest.mark.parametrize("alloc_conf", [{}, EXPANDABLE], ids=["cudaMalloc", "expandable"])
def test_memory_freed_by_its_owner_is_unmapped_by_its_peer(cuda_channel, alloc_conf):
    (before, during, after), (received, returned) = cuda_channel.run(
        _memory_freed_by_its_owner, 2, env=alloc_conf)
    assert received
    assert during == before + 1
    assert after <= before, "the mapping of the freed buffer is still open"
    assert returned, "the peer's mapping still holds the freed memory"
