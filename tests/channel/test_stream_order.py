"""CUDA ops in stream order: a send waits for its producer and a recv for its buffer's earlier
readers on the GPU, not on the CPU; work queued after a recv sees its bytes."""

import time

import pytest
import torch
import torch.distributed as dist

import channels
from harness import rank_device
from payloads import connect, numbered


def _stream_order(rank, world):
    # The sender's producer is slow and the receiver's buffer is still being read by a slow
    # consumer: the copy must wait for both, without the CPU waiting for either.
    dev = rank_device(rank)
    peer = 1 - rank
    connect(rank, dev)
    buf = torch.full((1 << 20,), 7.0, device=dev)
    if rank == 0:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the producer runs
        buf.fill_(42.0)
        started = time.monotonic()
        work = dist.isend(buf, peer)
        work.wait()
        posted_in = time.monotonic() - started
        torch.cuda.synchronize()
        return posted_in
    torch.cuda._sleep(200_000_000)
    snapshot = buf.clone()  # reads the old contents after the sleep
    work = dist.irecv(buf, peer)
    work.wait()
    after = buf.clone()  # stream-ordered after the recv
    torch.cuda.synchronize()
    return snapshot[0].item(), after[0].item()


def test_stream_semantics_of_send_and_recv(cuda_channel):
    posted_in, (before, after) = cuda_channel.run(_stream_order, 2)
    assert before == 7.0, "the recv overwrote the buffer before earlier work on it finished"
    assert after == 42.0, "data sent before the producer finished, or not received"
    # Over UCX a send's wait() returns on the CPU once it has ended, unless UCX moves it from
    # pinned host memory: then, as on the copy engines, once its copy out is queued.
    if not cuda_channel.over_ucx or cuda_channel.host_relayed:
        assert posted_in < 0.05, f"isend + wait blocked the CPU for {posted_in:.3f} s"


def _recv_behind_a_busy_stream(rank, world, numel):
    # The receiver's stream is busy for about a second, and a consumer still reads the old
    # contents behind that; the sender's bytes are ready at once.
    dev = rank_device(rank)
    connect(rank, dev)
    if rank == 0:
        dist.send(numbered(5, numel, dev), 1)
        torch.cuda.synchronize()
        return None
    buf = torch.full((numel,), -1, dtype=torch.int32, device=dev)
    torch.cuda._sleep(2_000_000_000)
    reached = torch.cuda.Event()
    reached.record()
    snapshot = buf.clone()
    dist.irecv(buf, 0).wait()
    returned_before_the_stream_got_there = not reached.query()
    after = buf.clone()  # stream-ordered after the recv
    torch.cuda.synchronize()
    return (returned_before_the_stream_got_there, bool(torch.all(snapshot == -1)),
            torch.equal(after, numbered(5, numel, dev)))


def test_recv_wait_leaves_the_stream_to_wait_for_the_copy(cuda_channel):
    early, old_contents_read, received = cuda_channel.run(
        _recv_behind_a_busy_stream, 2, (16 << 20) // 4 + 3)[1]
    assert old_contents_read, "the recv overwrote the buffer before earlier work on it finished"
    assert received, "the stream read the buffer before the recv had written it"
    # Over UCX a recv into CUDA memory that UCX writes itself (not staged through pinned host
    # memory) is waited for on the CPU, which needs the stream to reach the recv first.
    assert early == (not cuda_channel.over_ucx or cuda_channel.host_relayed)


def _recv_whose_bytes_come_late(rank, world, numel):
    # The sender posts at once, but its stream reaches the send only about a second later.
    dev = rank_device(rank)
    connect(rank, dev)
    if rank == 0:
        payload = numbered(9, numel, dev)  # allocated first: a cudaMalloc may wait for the GPU
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)
        dist.isend(payload, 1).wait()
        torch.cuda.synchronize()
        return None
    buf = torch.full((numel,), -1, dtype=torch.int32, device=dev)
    work = dist.irecv(buf, 0)
    started = time.monotonic()
    work.wait()
    waited = time.monotonic() - started
    landed = torch.cuda.Event()
    landed.record()
    returned_before_the_bytes_landed = not landed.query()
    after = buf.clone()  # stream-ordered after the recv
    torch.cuda.synchronize()
    return waited, returned_before_the_bytes_landed, torch.equal(after, numbered(9, numel, dev))


@pytest.mark.parametrize("cuda_channel", channels.CUDA_OVER_UCX)
def test_recv_wait_returns_before_the_bytes_land_where_the_stream_can_wait_for_them(cuda_channel):
    waited, early, received = cuda_channel.run(
        _recv_whose_bytes_come_late, 2, (16 << 20) // 4 + 3)[1]
    assert received, "the stream read the buffer before the recv had written it"
    # Over TCP-only UCX the stream waits for the copies in from host memory, queued behind
    # waits for each piece to land. Where UCX writes CUDA memory itself, the CPU waits.
    assert early == cuda_channel.host_relayed, (waited, early)
    if early:
        assert waited < 0.5, f"wait() held the CPU for {waited:.3f} s"


def _any_source_into_cuda(rank, world):
    dev = rank_device(rank)
    connect(rank, dev)
    if rank == 1:
        torch.cuda._sleep(400_000_000)  # the copy waits for this on the GPU, not the recv's CPU
        dist.send(torch.full((1 << 20,), 5.0, device=dev), 0, tag=3)
        torch.cuda.synchronize()
        return None
    buf = torch.zeros(1 << 20, device=dev)
    source = dist.recv(buf, tag=3)  # no src: wait() on a recv from any source, then its source
    return source, buf.min().item(), buf.max().item()


def test_cuda_recv_from_any_source_reports_its_sender(cuda_channel):
    assert cuda_channel.run(_any_source_into_cuda, 2)[0] == (1, 5.0, 5.0)
