"""Staging: sends the copy engines copy into a slot of the receiver's staging ring when its
buffer is not ready, and CUDA tensors UCX moves through pinned host memory where it reaches the
peer over TCP only."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import channels
from devices import cuda_device
from payloads import exchange, numbered

pytestmark = pytest.mark.gpu


# Sizes on both sides of staging's range (8 MiB to SMFREE_STAGING_BYTES, 16 MiB below).
STAGING_SIZES = [16 << 20, 4 << 20, 1 << 20, 20 << 20, 8 << 20]
# Staging is off by default (its copy out of a slot is a copy within one GPU, which goes in two
# hops unless the driver's copies run it); eager lanes take sends up to their slot (16 MiB by
# default) before staging can: slots of 8 MiB leave the sends above them to staging.
EAGER_BELOW_STAGING = {"SMFREE_EAGER_BYTES": str(8 << 20), "SMFREE_STAGING_BYTES": str(16 << 20)}


def _one_way_into_one_buffer(rank, world, rounds):
    dev = cuda_device(rank)
    backend = dist.group.WORLD._get_backend(dev)
    buffer = torch.empty(max(STAGING_SIZES) // 4, dtype=torch.int32, device=dev)
    # Connect first, with the sender's kernels loaded, and start together: the receiver's sleep
    # below must outlast the wait for the first send. Without the exchange, a first op's setup
    # fell inside it in some runs (no send staged, on 2 and 4 GPUs).
    numbered(0, 1, dev)
    exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), 1 - rank)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        for i in range(rounds):
            numel = STAGING_SIZES[i % len(STAGING_SIZES)] // 4
            buffer[:numel].copy_(numbered(i, numel, dev))  # must wait for the last copy
            dist.isend(buffer[:numel], 1).wait()
        torch.cuda.synchronize()
        return backend._stats()["staged_sends"]
    # Behind this (~0.5 s), no recv's stream is ready when its send is cleared: each send may be
    # staged.
    torch.cuda._sleep(1_000_000_000)
    received = []
    for i in range(rounds):
        numel = STAGING_SIZES[i % len(STAGING_SIZES)] // 4
        dist.irecv(buffer[:numel], 0).wait()
        received.append(buffer[:numel].clone())  # before the next recv may overwrite it
    torch.cuda.synchronize()
    wrong = [i for i, got in enumerate(received)
             if not torch.equal(got, numbered(i, got.numel(), dev))]
    stats = backend._stats()
    return wrong, stats["staged_recvs"], stats["staging_rings"]


@pytest.mark.parametrize("staging", ["16777216", "0"], ids=["staging", "no-staging"])
def test_sends_into_a_buffer_the_receiver_keeps_reusing(staging):
    rounds = 40
    staged_sends, (wrong, staged_recvs, rings) = channels.COPY_ENGINE.run(
        _one_way_into_one_buffer, 2, rounds,
        env={**EAGER_BELOW_STAGING, "SMFREE_STAGING_BYTES": staging})
    assert wrong == []
    stageable = sum(1 for i in range(rounds)
                    if 8 << 20 <= STAGING_SIZES[i % len(STAGING_SIZES)] <= int(staging))
    assert staged_sends == staged_recvs
    assert (1 if staging != "0" else 0) <= staged_sends <= stageable
    assert rings == (1 if staging != "0" else 0)


def _receiver_dies_with_sends_waiting_for_slots(rank, world):
    dev = cuda_device(rank)
    exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), 1 - rank)  # connect first
    torch.cuda.synchronize()
    numel = (16 << 20) // 4
    if rank == 1:
        torch.cuda._sleep(1 << 40)  # its recvs' buffers are never free: no slot is emptied
        works = [dist.irecv(torch.empty(numel, dtype=torch.int32, device=dev), 0)
                 for _ in range(4)]
        time.sleep(1.0)  # the sender fills both slots and holds the other two sends
        os._exit(1)
    works = [dist.isend(torch.full((numel,), i, dtype=torch.int32, device=dev), 1)
             for i in range(4)]
    errors = []
    for work in works:
        try:
            work.wait()
            errors.append(None)
        except dist.DistBackendError as failure:
            errors.append(str(failure))
    started = time.monotonic()
    torch.cuda.synchronize()
    return errors, time.monotonic() - started, dist.group.WORLD._get_backend(dev)._stats()


def test_receiver_death_fails_the_sends_held_for_a_staging_slot():
    errors, waited, stats = channels.COPY_ENGINE.run(
        _receiver_dies_with_sends_waiting_for_slots, 2, group_timeout_s=60, expect_exit=(1,),
        env=EAGER_BELOW_STAGING)[0]
    assert errors[:2] == [None, None], errors  # copied into the two slots before it died
    assert all(error and "its peer process" in error for error in errors[2:]), errors
    assert stats["staged_sends"] == 2 and stats["live_ops"] == 0
    assert waited < 30


def _exchanges_and_staging(rank, world, sizes):
    dev = cuda_device(rank)
    backend = dist.group.WORLD._get_backend(dev)
    before = backend._stats()
    for nbytes in sizes:
        mine = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev,
                             generator=torch.Generator(dev).manual_seed(rank + nbytes))
        got = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        exchange(mine, got, 1 - rank, batched=nbytes % 2 == 0)
        expected = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev,
                                 generator=torch.Generator(dev).manual_seed(1 - rank + nbytes))
        assert torch.equal(got, expected), f"{nbytes} B differ"
    after = backend._stats()
    return {key: after[key] - before[key] if key != "ucx_relay_cached_bytes" else after[key]
            for key in ("ucx_relayed_sends", "ucx_relayed_recvs",
                        "ucx_relay_cached_bytes")}


@pytest.mark.parametrize("cuda_channel", channels.CUDA_OVER_UCX)
def test_cuda_goes_through_pinned_host_memory_exactly_where_ucx_has_only_tcp(cuda_channel):
    sizes = [0, 1, 4097, 1 << 20, (16 << 20) + 3, 1 << 20]
    moved = sum(1 for nbytes in sizes if nbytes)
    for counts in cuda_channel.run(_exchanges_and_staging, 2, sizes):
        staged = moved if cuda_channel.host_relayed else 0
        assert counts["ucx_relayed_sends"] == staged, counts
        assert counts["ucx_relayed_recvs"] == staged, counts
        # Host buffers come back to the cache once their transfers are done.
        assert (counts["ucx_relay_cached_bytes"] > 0) == cuda_channel.host_relayed, counts
