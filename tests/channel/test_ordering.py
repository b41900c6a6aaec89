"""Which send a recv gets: crossed posts, tags, one peer both ways, rings, all pairs, any source,
readiness in another order than posting."""

import time

import pytest
import torch
import torch.distributed as dist

from harness import rank_device, synchronize
from payloads import sends_then_recvs


def _crossed_unbatched(rank, world, numel):
    # Both ranks isend first, then irecv, unbatched: a design that blocks a send until the
    # matching recv is posted on the same thread deadlocks here.
    dev = rank_device(rank)
    peer = 1 - rank
    mine = (torch.arange(numel, dtype=torch.int32, device=dev) * 3 + rank)
    got = torch.empty(numel, dtype=torch.int32, device=dev)
    send = dist.isend(mine, peer)
    recv = dist.irecv(got, peer)
    send.wait()
    recv.wait()
    return torch.equal(got, torch.arange(numel, dtype=torch.int32, device=dev) * 3 + peer)


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_crossed_isend_before_irecv_unbatched(channel, large):
    # 64 B and 8 MiB in host memory, 4 KiB and 64 MiB in GPU memory.
    nbytes = {(False, False): 64, (False, True): 8 << 20,
              (True, False): 4096, (True, True): 64 << 20}[(channel.cuda, large)]
    assert channel.run(_crossed_unbatched, 2, nbytes // 4) == [True, True]


def _all_sends_before_any_recv(rank, world, count):
    # Both ranks post every send before any recv, then wait for the recvs last first: every op
    # has a partner, so the program completes whatever the count.
    numels = [1 << (i % 19) for i in range(count)]  # 4 B to 1 MiB, mixed on one tag
    return sends_then_recvs(rank, 1 - rank, numels, rank_device(rank))


@pytest.mark.parametrize("count", [100, 1000])
def test_all_sends_before_any_recv_complete_in_order(channel, count):
    assert channel.run(_all_sends_before_any_recv, 2, count, timeout=150) == [[], []]


def _interleaved_tags(rank, world):
    dev = rank_device(rank)
    peer = 1 - rank
    if rank == 0:
        works = [dist.isend(torch.full((4,), float(10 * tag + i), device=dev), peer, tag=tag)
                 for i in range(3) for tag in (1, 0, 2)]
        for work in works:
            work.wait()
        synchronize(dev)
        return None
    received = {}
    # Posted in a different tag order than sent: matching is per tag, FIFO within a tag.
    for tag in (2, 0, 1):
        for i in range(3):
            buf = torch.empty(4, device=dev)
            dist.recv(buf, peer, tag=tag)
            received[(tag, i)] = buf[0].item()
    return received


def test_interleaved_tags_match_per_tag_in_posting_order(channel):
    _, received = channel.run(_interleaved_tags, 2)
    assert received == {(tag, i): float(10 * tag + i) for tag in (0, 1, 2) for i in range(3)}


def _next_and_previous_is_one_peer(rank, world, steps):
    # PP = 2: the next stage and the previous stage are the same rank. Activations go
    # forward on rank 0 -> 1, gradients back on 1 -> 0, both in flight at once, with
    # batched and unbatched posts mixed as a 1F1B schedule does.
    dev = rank_device(rank)
    peer = 1 - rank
    seen = []
    for step in range(steps):
        act_out = torch.full((256,), float(step) + 0.5 * rank, device=dev)
        grad_out = torch.full((256,), -float(step) - 0.5 * rank, device=dev)
        act_in = torch.empty(256, device=dev)
        grad_in = torch.empty(256, device=dev)
        if rank == 0:
            ops = [dist.P2POp(dist.isend, act_out, peer), dist.P2POp(dist.irecv, grad_in, peer)]
            if step % 2:
                works = dist.batch_isend_irecv(ops)
            else:
                works = [dist.isend(act_out, peer), dist.irecv(grad_in, peer)]
            for work in works:
                work.wait()
            seen.append(grad_in[0].item())
        else:
            recv = dist.irecv(act_in, peer)
            send = dist.isend(grad_out, peer)
            recv.wait()
            send.wait()
            seen.append(act_in[0].item())
    synchronize(dev)
    return seen


def test_pp2_one_peer_is_next_and_previous_stage(channel):
    steps = 20
    seen0, seen1 = channel.run(_next_and_previous_is_one_peer, 2, steps)
    assert seen0 == [-float(s) - 0.5 for s in range(steps)]
    assert seen1 == [float(s) for s in range(steps)]


def _ring_batch(rank, world):
    dev = rank_device(rank)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    mine = torch.full((1024,), float(rank), device=dev)
    got = torch.empty(1024, device=dev)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.irecv, got, prev), dist.P2POp(dist.isend, mine, nxt)]
    )
    assert len(works) == 1, "a coalescing backend returns one Work for the batch"
    works[0].wait()
    return got[0].item()


@pytest.mark.parametrize("world", [3, 4])
def test_batch_isend_irecv_ring(channel, world):
    assert channel.run(_ring_batch, world) == [float((r - 1) % world) for r in range(world)]


def _all_pairs(rank, world, numel):
    # Every rank exchanges with every other rank at once, all ops posted before any wait.
    dev = rank_device(rank)
    works = []
    got = {}
    for peer in range(world):
        if peer != rank:
            got[peer] = torch.empty(numel, dtype=torch.int64, device=dev)
            works.append(dist.isend(torch.full((numel,), 100 * rank + peer, dtype=torch.int64,
                                               device=dev), peer))
            works.append(dist.irecv(got[peer], peer))
    for work in works:
        work.wait()
    synchronize(dev)
    return {peer: int(t[0]) for peer, t in got.items() if torch.all(t == t[0])}


def test_all_pairs_four_ranks(channel):
    results = channel.run(_all_pairs, 4, (1 << 18) if channel.cuda else 333)
    for rank, got in enumerate(results):
        assert got == {peer: 100 * peer + rank for peer in range(4) if peer != rank}


def _any_source(rank, world):
    dev = rank_device(rank)
    if rank != 0:
        time.sleep(0.05 * rank)
        dist.send(torch.full((8,), float(rank), device=dev), 0, tag=5)
        return None
    senders = []
    for _ in range(world - 1):
        buf = torch.empty(8, device=dev)
        src = dist.recv(buf, tag=5)  # no src: receive from any rank
        assert torch.all(buf == float(src)), f"data {buf[0].item()} did not come from rank {src}"
        senders.append(src)
    # The lower-level Work reports the source too.
    buf = torch.empty(8, device=dev)
    work = dist.group.WORLD.recv_anysource([buf], 6)
    if world > 1:
        dist.barrier()
    work.wait()
    return sorted(senders), work._source_rank(), buf[0].item()


def _any_source_peer(rank, world):
    if rank == 0:
        return _any_source(rank, world)
    _any_source(rank, world)
    dist.barrier()
    if rank == world - 1:
        dist.send(torch.full((8,), 42.0, device=rank_device(rank)), 0, tag=6)
    return None


def test_recv_from_any_source(channel):
    results = channel.run(_any_source_peer, 4)
    senders, source, value = results[0]
    assert senders == [1, 2, 3]
    assert (source, value) == (3, 42.0)


def _any_source_and_specific_share_a_line(rank, world):
    # An any-source recv posted first takes the first send; the specific recv posted after
    # it takes the second: posting order decides between them.
    dev = rank_device(rank)
    if rank == 1:
        dist.send(torch.tensor([1.0], device=dev), 0)
        dist.send(torch.tensor([2.0], device=dev), 0)
        synchronize(dev)
        return None
    first, second = torch.empty(1, device=dev), torch.empty(1, device=dev)
    any_work = dist.group.WORLD.recv_anysource([first], 0)
    specific = dist.irecv(second, 1)
    any_work.wait()
    specific.wait()
    return first.item(), second.item()


def test_any_source_and_specific_recvs_follow_posting_order(channel):
    assert channel.run(_any_source_and_specific_share_a_line, 2)[0] == (1.0, 2.0)


def _out_of_order_readiness(rank, world):
    # Rank 1 makes its stream wait for the tag-2 recv before it even posts the tag-1 recv,
    # while rank 0 sends tag 1 first. A DMA queue that waits on the receiver in posting
    # order would deadlock here.
    dev = rank_device(rank)
    if rank == 0:
        a = torch.full((1 << 16,), 1.0, device=dev)
        b = torch.full((1 << 16,), 2.0, device=dev)
        works = [dist.isend(a, 1, tag=1), dist.isend(b, 1, tag=2)]
        for work in works:
            work.wait()
        synchronize(dev)
        return None
    a = torch.zeros(1 << 16, device=dev)
    b = torch.zeros(1 << 16, device=dev)
    dist.irecv(b, 0, tag=2).wait()
    b.add_(1)  # uses b after its recv, in stream order
    dist.irecv(a, 0, tag=1).wait()
    synchronize(dev)
    return a[0].item(), b[0].item()


def test_readiness_in_another_order_than_posting(cuda_channel):
    assert cuda_channel.run(_out_of_order_readiness, 2)[1] == (1.0, 3.0)
