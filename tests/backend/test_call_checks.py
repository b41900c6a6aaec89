"""Every point-to-point call checked before anything is posted: ranks out of the group for every
op kind, send and recv buffers that overlap, a send's storage freed before its bytes moved. Each
misuse gets an error naming it, the rank stays alive, and the next exchange is intact."""

import re

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks


def _exchange(rank, step):
    """One exchange between the two ranks; True if each got the other's bytes."""
    peer = 1 - rank
    mine = torch.arange(64, dtype=torch.float32) + 1000 * rank + step
    got = torch.zeros(64)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer),
                                    dist.P2POp(dist.irecv, got, peer)])
    for work in works:
        work.wait()
    return bool(torch.equal(got, torch.arange(64, dtype=torch.float32) + 1000 * peer + step))


def _bad_ranks(rank, world):
    t = torch.ones(4)
    send = rf"smfree: send on rank {rank} to invalid rank {{}} \(group '0' of size 2, tag 0, 16 B\)"
    recv = rf"smfree: recv on rank {rank} from invalid rank {{}} \(group '0' of size 2, tag 0, 16 B\)"
    any_source = r"; a recv from any source is irecv or recv without a source"
    calls = {
        "isend(t, -1)": (lambda: dist.isend(t, -1), send.format(-1)),
        "isend(t, group_dst=-1)": (lambda: dist.isend(t, group_dst=-1), send.format(-1)),
        "isend(t, -5)": (lambda: dist.isend(t, -5), send.format(-5)),
        "isend(t, 2)": (lambda: dist.isend(t, 2), send.format(2)),
        "send(t, -1)": (lambda: dist.send(t, -1), send.format(-1)),
        "batch isend -1": (lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, t, -1)]),
                           send.format(-1)),
        "batch isend group_peer=-1": (
            lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, t, group_peer=-1)]),
            send.format(-1)),
        "irecv(t, -1)": (lambda: dist.irecv(t, -1), recv.format(-1) + any_source),
        "irecv(t, group_src=-1)": (lambda: dist.irecv(t, group_src=-1),
                                   recv.format(-1) + any_source),
        "recv(t, -1)": (lambda: dist.recv(t, -1), recv.format(-1) + any_source),
        "irecv(t, 2)": (lambda: dist.irecv(t, 2), recv.format(2)),
        "batch irecv -1": (lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, -1)]),
                           recv.format(-1) + any_source),
    }
    for name, (call, message) in calls.items():
        with pytest.raises(ValueError, match=message):
            call()
    # A batch with a bad op among good ones posts none of them: the exchange after it is intact.
    with pytest.raises(ValueError, match=send.format(-1)):
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(4), 1 - rank),
                                dist.P2POp(dist.isend, t, -1)])
    return [_exchange(rank, step) for step in range(2)]


def test_ranks_out_of_the_group_are_value_errors_for_every_op_kind():
    assert run_ranks(_bad_ranks, 2) == [[True, True]] * 2


def _any_source_still_works(rank, world):
    # The one way to receive from any source: irecv without a source.
    if rank == 0:
        got = torch.zeros(4)
        work = dist.irecv(got)
        work.wait()
        return work._source_rank(), got.tolist()
    dist.isend(torch.full((4,), 7.0), 0).wait()
    return None


def test_recv_without_a_source_still_receives_from_any_source():
    assert run_ranks(_any_source_still_works, 2)[0] == (1, [7.0] * 4)


def _overlaps(rank, world):
    peer = 1 - rank
    base = torch.zeros(64)
    recv_op = r"recv on rank {} from rank {} \(group '0', tag 0, {} B\)"
    send_op = r"send on rank {} to rank {} \(group '0', tag 0, {} B\)"
    seen = []
    # The same tensor sent and received in one batch.
    with pytest.raises(ValueError, match=r"overlap") as raised:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, base, peer),
                                dist.P2POp(dist.irecv, base, peer)])
    message = str(raised.value)
    assert re.search(recv_op.format(rank, peer, 256), message), message
    assert re.search(send_op.format(rank, peer, 256), message), message
    seen.append("same tensor")
    # Overlapping views of one storage, recv first in the batch.
    with pytest.raises(ValueError, match=r"overlap"):
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, base[8:40], peer),
                                dist.P2POp(dist.isend, base[32:], peer)])
    seen.append("overlapping views")
    # Disjoint views of one storage are fine, and so are two sends of the same bytes.
    assert _exchange(rank, 0)
    halves = torch.zeros(128)
    halves[:64] = torch.arange(64, dtype=torch.float32) + 1000 * rank
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, halves[:64], peer),
                                    dist.P2POp(dist.isend, halves[:64], peer, tag=1),
                                    dist.P2POp(dist.irecv, halves[64:], peer),
                                    dist.P2POp(dist.irecv, base, peer, tag=1)])
    for work in works:
        work.wait()
    expected = torch.arange(64, dtype=torch.float32) + 1000 * peer
    assert torch.equal(halves[64:], expected) and torch.equal(base, expected)
    seen.append("disjoint and send+send fine")
    # A recv posted while a send of its bytes is in flight, outside any batch.
    dist.barrier()
    if rank == 0:
        pending = dist.isend(halves[:64], peer, tag=2)  # its recv comes after the barrier
        with pytest.raises(ValueError, match=r"overlap") as raised:
            dist.irecv(halves[16:32], peer, tag=3)
        assert "send on rank 0 to rank 1 (group '0', tag 2, 256 B)" in str(raised.value)
        assert "recv on rank 0 from rank 1 (group '0', tag 3, 64 B)" in str(raised.value)
        # A second send of the same bytes is fine.
        second = dist.isend(halves[:64], peer, tag=4)
        dist.barrier()
        pending.wait()
        second.wait()
        seen.append("recv over a send in flight")
    else:
        dist.barrier()
        first, second = torch.zeros(64), torch.zeros(64)
        dist.irecv(first, peer, tag=2).wait()
        dist.irecv(second, peer, tag=4).wait()
        assert torch.equal(first, expected) and torch.equal(second, expected)
        seen.append("recv over a send in flight")
    # A recv in flight: nothing may overlap it, nor a send.
    dist.barrier()
    if rank == 1:
        pending = dist.irecv(base, peer, tag=5)
        with pytest.raises(ValueError, match=r"overlap"):
            dist.isend(base[60:], peer, tag=6)
        with pytest.raises(ValueError, match=r"overlap"):
            dist.irecv(base[:1], peer, tag=7)
        dist.barrier()
        pending.wait()
        assert torch.all(base == 5.0)
        # Once it has ended, its bytes are free again.
        dist.isend(base[60:], peer, tag=6).wait()
    else:
        dist.barrier()
        dist.isend(torch.full((64,), 5.0), peer, tag=5).wait()
        got = torch.zeros(4)
        dist.irecv(got, peer, tag=6).wait()
        assert torch.all(got == 5.0)
    seen.append("recv in flight")
    seen.append([_exchange(rank, step) for step in range(2)])
    return seen


def test_overlapping_send_and_recv_buffers_are_refused_and_post_nothing():
    expected = ["same tensor", "overlapping views", "disjoint and send+send fine",
                "recv over a send in flight", "recv in flight", [True, True]]
    assert run_ranks(_overlaps, 2) == [expected, expected]


def _freed_storage(rank, world):
    peer = 1 - rank
    if rank == 0:
        sent = torch.full((1024,), 3.0)
        work = dist.isend(sent, peer, tag=1)
        # As FSDP frees a parameter's memory: before the receiver has posted its recv.
        sent.untyped_storage().resize_(0)
        dist.barrier()
        with pytest.raises(dist.DistBackendError) as raised:
            work.wait()
        message = str(raised.value)
        assert "send on rank 0 to rank 1 (group '0', tag 1" in message, message
        assert "storage was freed or resized" in message, message
    else:
        dist.barrier()
        got = torch.zeros(1024)
        with pytest.raises(dist.DistBackendError) as raised:
            dist.irecv(got, peer, tag=1).wait()
        message = str(raised.value)
        assert "recv on rank 1 from rank 0 (group '0', tag 1" in message, message
        assert "storage was freed or resized" in message, message
        assert torch.all(got == 0)
    return [_exchange(rank, step) for step in range(2)]


def test_a_send_whose_storage_was_freed_before_its_bytes_moved_fails_both_ends():
    assert run_ranks(_freed_storage, 2) == [[True, True]] * 2
