"""Point-to-point ops whose peer is the rank itself, as V-shaped pipeline schedules post them:
contents, posting orders, tags, batches, errors, timeouts; on CUDA, stream order and no kernels.

torch's own dist.send and dist.recv refuse a peer that is the rank itself, whatever the backend;
isend, irecv, batch_isend_irecv and the process group's send and recv take it.
"""

import datetime
import gc
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist
import smfree_pg

from devices import cuda_device
from harness import run_ranks

# torch 2.11 binds Work.exception() to a C++ type that it cannot return to Python, whatever the
# backend ("Unable to convert function return value"); later versions return the exception.
EXCEPTION_BINDING_WORKS = "exception_ptr" not in (dist.Work.exception.__doc__ or "")


def _posting_orders(rank, world, device):
    seen = []
    for send_first in (True, False):
        mine = torch.arange(1000, dtype=torch.float32, device=device) * (rank + 2) + send_first
        got = torch.zeros(1000, device=device)
        if send_first:
            send = dist.isend(mine, rank)
            recv = dist.irecv(got, rank)
        else:
            recv = dist.irecv(got, rank)
            assert not recv.is_completed()
            send = dist.isend(mine, rank)
        send.wait()
        recv.wait()
        assert torch.equal(got, mine), f"send_first={send_first}: contents differ"
        assert torch.equal(recv.get_future().wait()[0], mine)
        send.get_future().wait()
        assert recv.is_completed() and recv.is_success() and send.is_completed()
        if EXCEPTION_BINDING_WORKS:
            assert recv.exception() is None and send.exception() is None
        seen.append(recv._source_rank())
    return seen


def test_isend_and_irecv_to_self_in_both_posting_orders():
    assert run_ranks(_posting_orders, 2, "cpu") == [[0, 0], [1, 1]]


def _blocking(rank, world):
    group = dist.group.WORLD
    mine = torch.full((4096,), float(rank) + 0.5)
    got = torch.zeros(4096)
    # A blocking send to self returns once a recv takes it, so the recv comes from another thread.
    sender = threading.Thread(target=lambda: group.send([mine], rank, 3).wait())
    sender.start()
    group.recv([got], rank, 3).wait()
    sender.join(timeout=30)
    assert not sender.is_alive()
    # And the other way round: the recv blocks first.
    later = torch.zeros(4096)
    receiver = threading.Thread(target=lambda: group.recv([later], rank, 4).wait())
    receiver.start()
    time.sleep(0.1)
    group.send([mine], rank, 4).wait()
    receiver.join(timeout=30)
    assert not receiver.is_alive()
    return got[0].item(), later[0].item(), bool(torch.equal(got, mine) and torch.equal(later, mine))


def test_blocking_send_and_recv_to_self():
    assert run_ranks(_blocking, 2) == [(0.5, 0.5, True), (1.5, 1.5, True)]


def _tags_out_of_order(rank, world):
    sends = [dist.isend(torch.full((4,), float(10 * tag + i)), rank, tag=tag)
             for i in range(3) for tag in (1, 0, 2)]
    received = {}
    # Posted in another tag order than sent: matching is per tag, in posting order within one.
    for tag in (2, 0, 1):
        for i in range(3):
            buf = torch.empty(4)
            dist.irecv(buf, rank, tag=tag).wait()
            received[(tag, i)] = buf[0].item()
    for work in sends:
        work.wait()
    return received


def test_tags_match_per_tag_in_posting_order():
    expected = {(tag, i): float(10 * tag + i) for tag in (0, 1, 2) for i in range(3)}
    assert run_ranks(_tags_out_of_order, 2) == [expected, expected]


def _batch_with_self_and_peer(rank, world, device):
    # As ZBV's middle rank: one batch sends to and receives from the other rank and itself.
    peer = 1 - rank
    results = []
    for step in range(3):
        to_peer = torch.full((512,), 100.0 * rank + step, device=device)
        to_self = torch.full((256,), -100.0 * rank - step, device=device)
        from_peer = torch.empty(512, device=device)
        from_self = torch.empty(256, device=device)
        ops = [dist.P2POp(dist.irecv, from_self, rank), dist.P2POp(dist.isend, to_peer, peer),
               dist.P2POp(dist.irecv, from_peer, peer), dist.P2POp(dist.isend, to_self, rank)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        results.append((bool(torch.all(from_peer == 100.0 * peer + step)),
                        bool(torch.all(from_self == -100.0 * rank - step))))
    return results


def test_batch_mixing_self_and_other_peer_ops():
    assert run_ranks(_batch_with_self_and_peer, 2, "cpu") == [[(True, True)] * 3] * 2


def _mismatch(rank, world):
    send = dist.isend(torch.ones(4), rank)
    got = torch.zeros(8)
    recv = dist.irecv(got, rank)
    messages = []
    for work in (send, recv):
        with pytest.raises(dist.DistBackendError) as raised:
            work.wait()
        messages.append(str(raised.value))
        assert work.is_completed() and not work.is_success()
        if EXCEPTION_BINDING_WORKS:
            assert work.exception() is not None
    assert torch.all(got == 0)  # nothing written
    # Nothing is left behind: the next pair matches.
    dist.isend(torch.full((8,), 5.0), rank)
    dist.irecv(got, rank).wait()
    assert torch.all(got == 5)
    return messages


def test_size_mismatch_fails_both_works():
    for rank, messages in enumerate(run_ranks(_mismatch, 2)):
        expected = (rf"size or dtype mismatch in group '0', tag 0: rank {rank} sends "
                    rf"float32\[4\] \(16 B\) to rank {rank}, which receives into "
                    rf"float32\[8\] \(32 B\)")
        for message in messages:
            assert re.search(expected, message), message


def _unmatched(rank, world):
    buf = torch.empty(256)
    work = dist.irecv(buf, rank, tag=9)
    expired = (rf"wait\(timeout=200 ms\) expired; recv on rank {rank} from rank {rank} "
               rf"\(group '0', tag 9, 1024 B\) is still pending")
    with pytest.raises(dist.DistBackendError, match=expired):
        work.wait(timeout=datetime.timedelta(milliseconds=200))
    assert not work.is_completed()
    table = smfree_pg.dump_pending()
    started = time.monotonic()
    with pytest.raises(dist.DistBackendError) as raised:
        work.wait()
    waited = time.monotonic() - started
    completed = work.is_completed()
    with pytest.raises(RuntimeError, match="was not matched by a send"):
        work.get_future().wait()
    # The expired recv left the line: a later pair matches each other.
    send = dist.isend(torch.full((256,), 3.0), rank, tag=9)
    dist.irecv(buf, rank, tag=9).wait()
    send.wait()
    return str(raised.value), waited, completed, buf[0].item(), table


def test_unmatched_self_recv_fails_at_the_group_timeout():
    for rank, (error, waited, completed, later, table) in enumerate(
            run_ranks(_unmatched, 2, group_timeout_s=2)):
        assert "1 pending" in table and f"recv on rank {rank} from rank {rank}" in table, table
        assert "[its send in this process is not posted yet]" in table, table
        assert re.search(rf"recv on rank {rank} from rank {rank} \(group '0', tag 9, "
                         rf"float32\[256\] \(1024 B\)\) was not matched by a send within the "
                         rf"group timeout of 2000 ms", error), error
        assert waited < 10
        assert completed and later == 3.0


def _dropped_after_isend(rank, world, swap_data):
    # The caller drops each tensor right after isend, or replaces its `.data` as Megatron's
    # deallocate_output_tensor does; fresh tensors of the same size then get the freed memory if
    # nothing holds it.
    works, junk = [], []
    for i in range(8):
        sent = torch.full((1 << 18,), float(i))
        works.append(dist.isend(sent, rank))
        if swap_data:
            sent.data = torch.empty(1)
        del sent
        gc.collect()
        junk.append(torch.full((1 << 18,), -1.0))
    values = []
    for _ in range(8):
        buf = torch.empty(1 << 18)
        dist.irecv(buf, rank).wait()
        values.append(buf[0].item() if torch.all(buf == buf[0]) else None)
    return values


@pytest.mark.parametrize("swap_data", [False, True])
def test_send_tensor_dropped_right_after_isend(swap_data):
    expected = [float(i) for i in range(8)]
    assert run_ranks(_dropped_after_isend, 2, swap_data) == [expected, expected]


def _any_source(rank, world):
    # A recv from any source takes other ranks' sends only; a self-send waits for a recv that
    # names this rank.
    peer = 1 - rank
    if rank == 1:
        dist.barrier()
        dist.isend(torch.full((4,), 1.0), 0, tag=5).wait()
        return None
    mine = dist.isend(torch.full((4,), 0.0), 0, tag=5)
    anywhere = torch.empty(4)
    recv = dist.irecv(anywhere, tag=5)
    dist.barrier()
    recv.wait()
    own = torch.empty(4)
    dist.irecv(own, 0, tag=5).wait()
    mine.wait()
    return recv._source_rank(), anywhere[0].item(), own[0].item(), peer


def test_recv_from_any_source_does_not_take_a_self_send():
    assert run_ranks(_any_source, 2)[0] == (1, 1.0, 0.0, 1)


# ----------------------------------------------------------------------------- CUDA

def _cuda_posting_orders(rank, world):
    return _posting_orders(rank, world, cuda_device(rank))


@pytest.mark.gpu
def test_cuda_isend_and_irecv_to_self_in_both_posting_orders():
    assert run_ranks(_cuda_posting_orders, 2, cuda=True) == [[0, 0], [1, 1]]


def _cuda_batch(rank, world):
    return _batch_with_self_and_peer(rank, world, cuda_device(rank))


@pytest.mark.gpu
def test_cuda_batch_mixing_self_and_other_peer_ops():
    assert run_ranks(_cuda_batch, 2, cuda=True) == [[(True, True)] * 3] * 2


def _long_kernel(device):
    """Square matrices whose product keeps the GPU busy for a while."""
    a = torch.randn(8192, 8192, device=device)
    return a, torch.randn(8192, 8192, device=device)


def _stream_order(rank, world, send_first):
    device = cuda_device(rank)
    a, b = _long_kernel(device)
    produced = torch.empty(8192, 8192, device=device)
    got = torch.empty(8192 * 8192, device=device)
    torch.cuda.synchronize()
    send_stream, recv_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def post_send():
        with torch.cuda.stream(send_stream):
            produced.fill_(-1)
            torch.matmul(a, b, out=produced)  # the send must read after this
            return dist.isend(produced.view(-1), rank)

    def post_recv():
        with torch.cuda.stream(recv_stream):
            torch.matmul(a, b).sum()  # keeps the stream busy: the fill below comes late
            got.fill_(-2)  # the recv must write after this
            return dist.irecv(got, rank)

    if send_first:
        send, recv = post_send(), post_recv()
    else:
        recv, send = post_recv(), post_send()
    with torch.cuda.stream(recv_stream):
        recv.wait()
        matches = torch.equal(got, produced.view(-1))  # ordered after the copy by wait()
    with torch.cuda.stream(send_stream):
        send.wait()
    torch.cuda.synchronize()
    return matches


@pytest.mark.gpu
@pytest.mark.parametrize("send_first", [True, False])
def test_cuda_self_copy_follows_both_streams(send_first):
    assert run_ranks(_stream_order, 2, send_first, cuda=True, timeout=180) == [True, True]


# One chunk, two in turn, and many with a short last one: a copy within one GPU goes through
# its bounce in chunks past 2 MiB, neighbouring chunks' hops on two streams (cuda/Copies.h).
CHUNKINGS = [4, 2 << 20, (2 << 20) + 4, (17 << 20) + 12, (129 << 20) + 4]


def _self_copies_of_every_chunking(rank, world):
    device = cuda_device(rank)
    wrong = []
    for size in CHUNKINGS:
        mine = torch.arange(size // 4, dtype=torch.int32, device=device) * (rank + 3) + size
        got = torch.full_like(mine, -1)
        works = [dist.irecv(got, rank), dist.isend(mine, rank)]
        for work in works:
            work.wait()
        if not torch.equal(got, mine):
            index = int((got != mine).nonzero()[0])
            wrong.append(f"{size} B: differs first at int32 {index}")
    return wrong


@pytest.mark.gpu
def test_cuda_self_copies_of_every_chunking():
    assert run_ranks(_self_copies_of_every_chunking, 2, cuda=True) == [[], []]


def _self_ops_launch_no_kernels(rank, world):
    device = cuda_device(rank)
    mine = torch.ones(1 << 22, device=device)
    got = torch.empty(1 << 22, device=device)

    def exchange():
        works = [dist.irecv(got, rank), dist.isend(mine, rank)]
        for work in works:
            work.wait()

    exchange()  # warm
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            exchange()
        torch.cuda.synchronize()
    events = [evt.name for evt in prof.events()
              if evt.device_type == torch.autograd.DeviceType.CUDA]
    # The Works' own profiler ranges (smfree:send, smfree:recv) are no kernels.
    kernels = [name for name in events
               if "memcpy" not in name.lower() and not name.startswith("smfree:")]
    copies = [name for name in events if "memcpy" in name.lower()]
    return kernels, len(copies), bool(torch.all(got == 1))


@pytest.mark.gpu
def test_cuda_self_ops_launch_no_kernels():
    for kernels, copies, ok in run_ranks(_self_ops_launch_no_kernels, 2, cuda=True):
        assert ok
        assert kernels == [], f"self ops launched kernels: {sorted(set(kernels))}"
        assert copies >= 10
