"""Streams: one hardware queue shared by every stream of a process, side streams, many groups
each on its own stream."""

import pytest
import torch
import torch.distributed as dist

from devices import cuda_device
from payloads import DTYPES, exchange, exchange_every_dtype, exchange_sizes

pytestmark = pytest.mark.gpu


def _pp2_one_peer(rank, world, steps):
    # PP = 2 with 1F1B-like traffic: activations forward and gradients backward to the same
    # peer, compute between, some steps batched, some not, ops on a side stream.
    dev = cuda_device(rank)
    peer = 1 - rank
    side = torch.cuda.Stream(dev)
    weight = torch.randn(512, 512, device=dev)
    seen = []
    for step in range(steps):
        out = (torch.full((512, 512), float(step), device=dev) @ torch.eye(512, device=dev)) + rank
        got = torch.empty(512, 512, device=dev)
        with torch.cuda.stream(side if step % 3 == 0 else torch.cuda.current_stream()):
            if step % 3 == 0:
                side.wait_stream(torch.cuda.default_stream(dev))
            exchange(out, got, peer, batched=step % 2 == 0)
            checksum = got[0, 0].clone()
        torch.cuda.current_stream().wait_stream(side)
        _ = weight @ weight  # compute that overlaps the next step's transfers
        seen.append(checksum)
    torch.cuda.synchronize()
    return [s.item() for s in seen]


@pytest.mark.parametrize("connections", ["1", "2"])
def test_streams_sharing_one_hardware_queue(cuda_channel, connections):
    # Megatron runs with CUDA_DEVICE_MAX_CONNECTIONS=1: every stream of a process, the DMA
    # streams included, shares one hardware queue, so a stream wait queued ahead of the copy
    # that ends it would hold that copy back forever. Back-to-back exchanges of fresh
    # tensors with CPU syncs between them, then PP = 2 traffic on two streams.
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": connections}
    assert cuda_channel.run(exchange_every_dtype, 2, env=env) == [len(DTYPES)] * 2
    sizes = [0, 1, 4097, 1 << 20]
    assert cuda_channel.run(exchange_sizes, 2, sizes, env=env) == [sizes, sizes]
    steps = 12
    for rank, seen in enumerate(cuda_channel.run(_pp2_one_peer, 2, steps, env=env)):
        assert seen == [float(s) + (1 - rank) for s in range(steps)]


def test_pp2_one_peer_next_and_previous_stage_on_a_side_stream(cuda_channel):
    steps = 30
    for rank, seen in enumerate(cuda_channel.run(_pp2_one_peer, 2, steps)):
        assert seen == [float(s) + (1 - rank) for s in range(steps)]


def _many_groups_many_streams(rank, world, groups_count, rounds):
    dev = cuda_device(rank)
    peer = 1 - rank
    groups = [dist.new_group([0, 1], backend="smfree") for _ in range(groups_count)]
    streams = [torch.cuda.Stream(dev) for _ in groups]
    results = []
    works = []
    for step in range(rounds):
        for index, (group, stream) in enumerate(zip(groups, streams)):
            with torch.cuda.stream(stream):
                mine = torch.full((4096,), float(1000 * index + 10 * step + rank), device=dev)
                got = torch.empty(4096, device=dev)
                # Alternate which direction goes first per group: any order must complete.
                ops = [dist.isend(mine, peer, group=group), dist.irecv(got, peer, group=group)]
                if (index + rank) % 2:
                    ops.reverse()
                for work in ops:
                    work.wait()
                works.append((index, step, got))
    torch.cuda.synchronize()
    for index, step, got in works:
        results.append(bool(torch.all(got == 1000 * index + 10 * step + peer)))
    return all(results)


def test_many_groups_and_streams_any_posting_order(cuda_channel):
    assert cuda_channel.run(_many_groups_many_streams, 2, 4, 10) == [True, True]
