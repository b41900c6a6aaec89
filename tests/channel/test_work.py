"""The Work API and tensor lifetimes: wait(timeout), futures, is_completed() polling, tensors
dropped or swapped after isend, send buffers reused once wait() returns."""

import datetime
import gc
import re
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import channels
from harness import rank_device, received_fills, synchronize
from payloads import numbered

# torch 2.11 binds Work.exception() to a C++ type that it cannot return to Python, whatever the
# backend ("Unable to convert function return value"); later versions return the exception.
EXCEPTION_BINDING_WORKS = "exception_ptr" not in (dist.Work.exception.__doc__ or "")


def _work_api(rank, world):
    dev = rank_device(rank)
    peer = 1 - rank
    if rank == 0:
        buf = torch.empty(16, device=dev)
        work = dist.irecv(buf, peer)
        assert not work.is_completed()
        expired = (r"wait\(timeout=200 ms\) expired; recv on rank 0 from rank 1 \(group '.*', "
                   r"tag 0, 64 B\) is still pending")
        with pytest.raises(RuntimeError, match=expired):
            work.wait(timeout=datetime.timedelta(milliseconds=200))
        dist.barrier()  # the partner sends only now
        future = work.get_future()
        value = future.wait()
        assert work.is_completed() and work.is_success()
        if EXCEPTION_BINDING_WORKS:
            assert work.exception() is None
        expected = torch.arange(16, dtype=torch.float32, device=dev)
        assert torch.equal(value[0], expected)
        assert torch.equal(buf, expected)
        return True
    dist.barrier()
    dist.send(torch.arange(16, dtype=torch.float32, device=dev), peer)
    synchronize(dev)
    return True


def test_work_wait_timeout_then_completion_and_future(channel):
    channel.run(_work_api, 2)


def _recv_polled_until_done(rank, world, numel):
    dev = rank_device(rank)
    if rank == 0:
        dist.send(numbered(3, numel, dev), 1)
        synchronize(dev)
        return None
    buf = torch.full((numel,), -1, dtype=torch.int32, device=dev)
    work = dist.irecv(buf, 0)
    deadline = time.monotonic() + 60
    while not work.is_completed():
        assert time.monotonic() < deadline, "is_completed() stayed False for 60 s"
        time.sleep(0.001)
    synchronize(dev)
    return torch.equal(buf, numbered(3, numel, dev))


def test_recv_polled_with_is_completed_ends_without_wait(cuda_channel):
    # Staged through host memory, the recv's copies in are queued by the poll.
    assert cuda_channel.run(_recv_polled_until_done, 2, (16 << 20) // 4 + 3)[1]


def _recv_waited_with_a_timeout(rank, world, numel):
    dev = rank_device(rank)
    if rank == 0:
        dist.barrier()  # the partner's wait(timeout) has expired: send only now
        dist.send(numbered(5, numel, dev), 1)
        synchronize(dev)
        return None
    buf = torch.full((numel,), -1, dtype=torch.int32, device=dev)
    work = dist.irecv(buf, 0)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as expired:
        work.wait(timeout=datetime.timedelta(milliseconds=200))
    waited = time.monotonic() - started
    dist.barrier()
    work.wait()
    after = buf.clone()  # stream-ordered after the recv
    synchronize(dev)
    return str(expired.value), waited, torch.equal(after, numbered(5, numel, dev))


def test_recv_wait_with_a_timeout_expires_then_the_recv_completes(cuda_channel):
    # Staged through host memory, the recv's wait() queues its copies in once it matches: with a
    # timeout it must give up at the timeout, not at the group's (30 s), and leave the recv
    # pending for a later wait().
    expired, waited, received = cuda_channel.run(
        _recv_waited_with_a_timeout, 2, (16 << 20) // 4 + 3)[1]
    assert re.search(r"wait\(timeout=200 ms\) expired; recv on rank 1 from rank 0 .* is still "
                     r"pending", expired), expired
    assert waited < 10, f"wait(timeout=200 ms) held the CPU for {waited:.1f} s"
    assert received, "the recv did not complete after its timed wait() expired"


def _small_exchanges(rank, world):
    peer = 1 - rank
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    for i in range(40):
        got = torch.empty(1024)
        works = [dist.isend(torch.full((1024,), float(rank * 100 + i)), peer),
                 dist.irecv(got, peer)]
        for work in works:
            work.wait()
        assert torch.all(got == peer * 100 + i), f"exchange {i}"
    dist.barrier()
    return backend._stats()["live_ops"]


def test_ops_that_ucx_completes_while_posting_them_are_released():
    # Over TCP, UCX sends 4 KiB eagerly and may complete the send inside the posting call;
    # such an op must still be released, with the tensor it holds.
    assert channels.CPU_UCX.run(_small_exchanges, 2, env={"UCX_TLS": "tcp"}) == [0, 0]


def _forgotten_after_isend(rank, world, swap_data, numel):
    # The caller drops each tensor right after isend, or (swap_data) replaces its `.data` as
    # Megatron's deallocate_output_tensor does; fresh tensors of the same size then get the
    # freed memory (the same block of the caching allocator on the stream) if nothing holds it,
    # and fill it before the transfer could read it. The engine keeps the bytes alive either way.
    dev = rank_device(rank)
    peer = 1 - rank
    if rank == 0:
        works, junk = [], []
        for i in range(8):
            sent = torch.full((numel,), float(i), device=dev)
            works.append(dist.isend(sent, peer))
            if swap_data:
                sent.data = torch.empty(1, device=dev)
                junk.append(torch.full((numel,), -1.0, device=dev))
        del sent
        gc.collect()
        dist.barrier()
        for work in works:
            work.wait()
        synchronize(dev)
        return None
    dist.barrier()
    return received_fills(peer, 8, numel, dev)


def _held_numel(channel):
    return (1 << 20) if channel.cuda else (1 << 18)


def test_engine_holds_tensors_until_transfer_done(channel):
    values = channel.run(_forgotten_after_isend, 2, False, _held_numel(channel))[1]
    assert values == [float(i) for i in range(8)]


def test_memory_of_a_tensor_whose_data_is_swapped_after_isend_is_held(channel):
    values = channel.run(_forgotten_after_isend, 2, True, _held_numel(channel))[1]
    assert values == [float(i) for i in range(8)]


def _let_go_once_done(rank, world, numel):
    # After its op ends, the caller's tensor is the caller's alone, whether or not the caller
    # calls the backend again: memory it then frees goes back (to the allocator, the driver).
    dev = rank_device(rank)
    tensor = torch.full((numel,), float(rank), device=dev)
    (dist.isend if rank == 0 else dist.irecv)(tensor, 1 - rank).wait()
    synchronize(dev)
    held = weakref.ref(tensor)  # alive while any C++ reference to the tensor is
    del tensor
    deadline = time.monotonic() + 10
    while held() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    let_go = held() is None
    dist.barrier()
    return let_go


def test_the_engine_lets_go_of_a_tensor_once_its_op_ends_without_another_call(channel):
    assert channel.run(_let_go_once_done, 2, _held_numel(channel)) == [True, True]


def _overwrite_after_wait(rank, world, numel, rounds):
    dev = rank_device(rank)
    if rank == 0:
        for round_ in range(rounds):
            buf = torch.full((numel,), float(round_ + 1), device=dev)
            dist.isend(buf, 1).wait()
            buf.fill_(-1.0)  # on the current stream: after the send has read the buffer
        synchronize(dev)
        return None
    seen = []
    for _ in range(rounds):
        got = torch.empty(numel, device=dev)
        dist.irecv(got, 0).wait()
        seen.append((got.min().item(), got.max().item()))
    return seen


def test_send_buffer_may_be_overwritten_once_wait_returns(cuda_channel):
    rounds = 4
    seen = cuda_channel.run(_overwrite_after_wait, 2, 16 << 20, rounds)[1]
    assert seen == [(float(r + 1), float(r + 1)) for r in range(rounds)], seen


def _synchronize_a_batch_whose_send_ends_first(rank, world):
    dev = rank_device(rank)
    peer = 1 - rank
    store = dist.distributed_c10d._get_default_store()
    got = torch.zeros(8, device=dev)
    if rank == 0:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(8, device=dev), peer),
                                        dist.P2POp(dist.irecv, got, peer)])
        store.set("posted", "1")
        # torch binds synchronize() without releasing the GIL; the batch's send ends while it
        # waits, and the engine then drops the send's own Work, its last reference.
        for work in works:
            work.synchronize()
    else:
        store.wait(["posted"])
        dist.irecv(torch.zeros(8, device=dev), peer).wait()
        synchronize(dev)
        time.sleep(0.3)  # rank 0's send has ended; its recv is still to come
        dist.isend(torch.full((8,), 2.0, device=dev), peer).wait()
    synchronize(dev)
    return got.tolist()


def test_synchronize_on_a_batch_lets_the_engine_finish_its_other_ops(channel):
    """The engine's thread may need the GIL to let go of a finished op's Work (a tensor's last C++
    reference); synchronize() must not hold it while it waits on that thread."""
    results = channel.run(_synchronize_a_batch_whose_send_ends_first, 2, timeout=60)
    assert results[0] == [2.0] * 8
