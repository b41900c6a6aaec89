"""Batches (coalescing blocks): empty ones, ones with a refused op, waits inside the block, a
group closed before the block ends."""

import pytest
import torch
import torch.distributed as dist

from harness import rank_device


def _coalescing(dev):
    return dist.distributed_c10d._coalescing_manager(dist.group.WORLD, dev, async_ops=True)


def _empty_batch(rank, world):
    with _coalescing(rank_device(rank)) as cm:
        pass
    assert len(cm.works) == 1 and cm.works[0] is not None
    cm.works[0].wait()
    return cm.works[0].is_completed()


def test_empty_batch_gets_a_completed_work(channel):
    assert channel.run(_empty_batch, 2) == [True, True]


def _batch_with_a_refused_op(rank, world):
    dev = rank_device(rank)
    peer = 1 - rank
    with pytest.raises(ValueError, match="from invalid rank 7"):
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((4,), 99.0, device=dev), peer),
                                dist.P2POp(dist.irecv, torch.zeros(4, device=dev), 7)])
    # Had the refused batch's send been posted, this recv would take its 99s.
    got = torch.zeros(4, device=dev)
    for work in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.full((4,), float(rank), device=dev), peer),
             dist.P2POp(dist.irecv, got, peer)]):
        work.wait()
    return got.tolist()


def test_batch_with_a_refused_op_posts_none_and_the_next_batch_works(channel):
    assert channel.run(_batch_with_a_refused_op, 2) == [[1.0] * 4, [0.0] * 4]


def _wait_inside_the_block(rank, world):
    dev = rank_device(rank)
    peer = 1 - rank
    got = torch.zeros(4, device=dev)
    with _coalescing(dev) as cm:
        send = dist.isend(torch.full((4,), float(rank), device=dev), peer)
        with pytest.raises(RuntimeError, match="inside its coalescing block"):
            send.wait()
        dist.irecv(got, peer)
    cm.wait()
    send.wait()  # posted once the block ended
    return got.tolist()


def test_wait_on_an_op_inside_its_coalescing_block_raises_instead_of_hanging(channel):
    assert channel.run(_wait_inside_the_block, 2) == [[1.0] * 4, [0.0] * 4]


def _batch_whose_group_closes_before_it_ends(rank, world):
    dev = rank_device(rank)
    peer = 1 - rank
    # Connected both ways before either side closes: the close, not a peer already gone, is
    # what the batch meets.
    got = torch.empty(1, device=dev)
    for work in [dist.isend(torch.ones(1, device=dev), peer), dist.irecv(got, peer)]:
        work.wait()
    with pytest.raises(dist.DistBackendError, match="is closed"):
        with _coalescing(dev):
            send = dist.isend(torch.ones(4, device=dev), peer)
            dist.group.WORLD._get_backend(dev).shutdown()
    with pytest.raises(dist.DistBackendError, match="not posted"):
        send.wait()  # fails instead of waiting for an op that was never posted
    return send.is_completed()


def test_ops_of_a_batch_that_cannot_be_posted_fail_instead_of_hanging(channel):
    assert channel.run(_batch_whose_group_closes_before_it_ends, 2) == [True, True]
