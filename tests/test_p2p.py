"""Point-to-point ops on CPU tensors: contents, sizes, dtypes, posting orders, Work API."""

import gc
import time

import pytest
import torch
import torch.distributed as dist

from harness import received_fills, run_ranks

# torch 2.11 binds Work.exception() to a C++ type that it cannot return to Python, whatever the
# backend ("Unable to convert function return value"); later versions return the exception.
EXCEPTION_BINDING_WORKS = "exception_ptr" not in (dist.Work.exception.__doc__ or "")

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
]


def byte_pattern(nbytes, seed):
    """Bytes that differ per rank; a prime period shows any block landing at a wrong offset."""
    block = ((torch.arange(4099, dtype=torch.int32) * 7 + seed * 13) % 251).to(torch.uint8)
    return block.repeat(nbytes // 4099 + 1)[:nbytes]


def pattern(numel, dtype, seed):
    """Contents that differ per rank and per position, for any dtype."""
    if dtype == torch.uint8:
        return byte_pattern(numel, seed)
    values = torch.arange(numel, dtype=torch.int64) * 7 + seed * 1_000_003
    if dtype == torch.bool:
        return (values % 3 == 0)
    if dtype.is_complex:
        return torch.complex((values % 1000).float(), (values % 777).float()).to(dtype)
    if dtype.is_floating_point:
        return (values % 2039).to(dtype)
    info = torch.iinfo(dtype)
    return (values % (info.max - max(info.min, 0) + 1) + max(info.min, 0)).to(dtype)


def _every_dtype(rank, world):
    peer = 1 - rank
    for dtype in DTYPES:
        mine = pattern(1000, dtype, rank)
        got = torch.zeros(1000, dtype=dtype)
        if rank == 0:
            dist.send(mine, peer)
            dist.recv(got, peer)
        else:
            dist.recv(got, peer)
            dist.send(mine, peer)
        assert torch.equal(got, pattern(1000, dtype, peer)), f"{dtype} contents differ"
    return len(DTYPES)


def test_every_dtype_roundtrips():
    assert run_ranks(_every_dtype, 2) == [len(DTYPES)] * 2


def _sizes(rank, world, sizes):
    peer = 1 - rank
    for nbytes in sizes:
        mine = pattern(nbytes, torch.uint8, rank)
        got = torch.zeros(nbytes, dtype=torch.uint8)
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, got, peer)]
        )
        for work in works:
            work.wait()
        assert torch.equal(got, pattern(nbytes, torch.uint8, peer)), f"{nbytes} B differ"
    return sizes


def test_sizes_from_zero_bytes_to_256_mib():
    sizes = [0, 1, 7, 4096, 65537, 1 << 20, 16 << 20, 256 << 20]
    assert run_ranks(_sizes, 2, sizes, timeout=180) == [sizes, sizes]


def _views(rank, world):
    peer = 1 - rank
    base = torch.arange(100, dtype=torch.float32) + 1000 * rank
    target = torch.full((50,), -1.0)
    target_view = target[5:15]
    assert target_view.storage_offset() == 5
    if rank == 0:
        dist.send(base[10:20], peer)
        dist.recv(target_view, peer)
    else:
        dist.recv(target_view, peer)
        dist.send(base[10:20], peer)
    expected = torch.full((50,), -1.0)
    expected[5:15] = torch.arange(10, 20, dtype=torch.float32) + 1000 * peer
    assert torch.equal(target, expected), "view recv wrote outside its window or got wrong data"
    # A 2-D row (offset view) into a flat buffer: shapes may differ when bytes and dtype agree.
    grid = (torch.arange(12, dtype=torch.int32) + 100 * rank).reshape(3, 4)
    flat = torch.zeros(4, dtype=torch.int32)
    ops = [dist.P2POp(dist.isend, grid[1], peer), dist.P2POp(dist.irecv, flat, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert flat.tolist() == [4 + 100 * peer, 5 + 100 * peer, 6 + 100 * peer, 7 + 100 * peer]
    return True


def test_views_with_storage_offsets():
    run_ranks(_views, 2)


def _crossed_unbatched(rank, world, nbytes):
    # Both ranks isend first, then irecv, unbatched: a design that blocks a send until the
    # matching recv is posted on the same thread deadlocks here.
    peer = 1 - rank
    mine = pattern(nbytes, torch.uint8, rank)
    got = torch.empty(nbytes, dtype=torch.uint8)
    send = dist.isend(mine, peer)
    recv = dist.irecv(got, peer)
    send.wait()
    recv.wait()
    assert torch.equal(got, pattern(nbytes, torch.uint8, peer))
    return True


@pytest.mark.parametrize("nbytes", [64, 8 << 20])
def test_crossed_isend_before_irecv_unbatched(nbytes):
    run_ranks(_crossed_unbatched, 2, nbytes)


def _interleaved_tags(rank, world):
    peer = 1 - rank
    if rank == 0:
        works = [dist.isend(torch.full((4,), float(10 * tag + i)), peer, tag=tag)
                 for i in range(3) for tag in (1, 0, 2)]
        for work in works:
            work.wait()
        return None
    received = {}
    # Posted in a different tag order than sent: matching is per tag, FIFO within a tag.
    for tag in (2, 0, 1):
        for i in range(3):
            buf = torch.empty(4)
            dist.recv(buf, peer, tag=tag)
            received[(tag, i)] = buf[0].item()
    return received


def test_interleaved_tags_match_per_tag_in_posting_order():
    _, received = run_ranks(_interleaved_tags, 2)
    assert received == {(tag, i): float(10 * tag + i) for tag in (0, 1, 2) for i in range(3)}


def _next_and_previous_is_one_peer(rank, world, steps):
    # PP = 2: the next stage and the previous stage are the same rank. Activations go
    # forward on rank 0 -> 1, gradients back on 1 -> 0, both in flight at once, with
    # batched and unbatched posts mixed as a 1F1B schedule does.
    peer = 1 - rank
    seen = []
    for step in range(steps):
        act_out = torch.full((256,), float(step) + 0.5 * rank)
        grad_out = torch.full((256,), -float(step) - 0.5 * rank)
        act_in = torch.empty(256)
        grad_in = torch.empty(256)
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
    return seen


def test_pp2_one_peer_is_next_and_previous_stage():
    steps = 20
    seen0, seen1 = run_ranks(_next_and_previous_is_one_peer, 2, steps)
    assert seen0 == [-float(s) - 0.5 for s in range(steps)]
    assert seen1 == [float(s) for s in range(steps)]


def _ring_batch(rank, world):
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    mine = torch.full((1024,), float(rank))
    got = torch.empty(1024)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.irecv, got, prev), dist.P2POp(dist.isend, mine, nxt)]
    )
    assert len(works) == 1, "a coalescing backend returns one Work for the batch"
    works[0].wait()
    return got[0].item()


@pytest.mark.parametrize("world", [3, 4])
def test_batch_isend_irecv_ring(world):
    assert run_ranks(_ring_batch, world) == [float((r - 1) % world) for r in range(world)]


def _all_pairs(rank, world):
    # Every rank exchanges with every other rank at once, all ops posted before any wait.
    ops = []
    got = {}
    for peer in range(world):
        if peer != rank:
            got[peer] = torch.empty(333, dtype=torch.int64)
            ops.append(dist.isend(torch.full((333,), 100 * rank + peer, dtype=torch.int64), peer))
            ops.append(dist.irecv(got[peer], peer))
    for work in ops:
        work.wait()
    return {peer: int(t[0]) for peer, t in got.items() if torch.all(t == t[0])}


def test_all_pairs_four_ranks():
    results = run_ranks(_all_pairs, 4)
    for rank, got in enumerate(results):
        assert got == {peer: 100 * peer + rank for peer in range(4) if peer != rank}


def _empty_batch(rank, world):
    group = dist.group.WORLD
    with dist.distributed_c10d._coalescing_manager(group, torch.device("cpu"), async_ops=True) as cm:
        pass
    assert len(cm.works) == 1 and cm.works[0] is not None
    cm.works[0].wait()
    return cm.works[0].is_completed()


def test_empty_batch_gets_a_completed_work():
    assert run_ranks(_empty_batch, 2) == [True, True]


def _batch_with_a_refused_op(rank, world):
    peer = 1 - rank
    with pytest.raises(ValueError, match="invalid peer rank 7"):
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((4,), 99.0), peer),
                                dist.P2POp(dist.irecv, torch.zeros(4), 7)])
    # Had the refused batch's send been posted, this recv would take its 99s.
    got = torch.zeros(4)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((4,), float(rank)), peer),
                                        dist.P2POp(dist.irecv, got, peer)]):
        work.wait()
    return got.tolist()


def test_batch_with_a_refused_op_posts_none_and_the_next_batch_works():
    assert run_ranks(_batch_with_a_refused_op, 2) == [[1.0] * 4, [0.0] * 4]


def _wait_inside_the_block(rank, world):
    peer = 1 - rank
    got = torch.zeros(4)
    group = dist.group.WORLD
    with dist.distributed_c10d._coalescing_manager(group, torch.device("cpu"), async_ops=True) as cm:
        send = dist.isend(torch.full((4,), float(rank)), peer)
        with pytest.raises(RuntimeError, match="inside its coalescing block"):
            send.wait()
        dist.irecv(got, peer)
    cm.wait()
    send.wait()  # posted once the block ended
    return got.tolist()


def test_wait_on_an_op_inside_its_coalescing_block_raises_instead_of_hanging():
    assert run_ranks(_wait_inside_the_block, 2) == [[1.0] * 4, [0.0] * 4]


def _any_source(rank, world):
    if rank != 0:
        time.sleep(0.05 * rank)
        dist.send(torch.full((8,), float(rank)), 0, tag=5)
        return None
    senders = []
    for _ in range(world - 1):
        buf = torch.empty(8)
        src = dist.recv(buf, tag=5)  # no src: receive from any rank
        assert torch.all(buf == float(src)), f"data {buf[0].item()} did not come from rank {src}"
        senders.append(src)
    # The lower-level Work reports the source too.
    buf = torch.empty(8)
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
        dist.send(torch.full((8,), 42.0), 0, tag=6)
    return None


def test_recv_from_any_source():
    results = run_ranks(_any_source_peer, 4)
    senders, source, value = results[0]
    assert senders == [1, 2, 3]
    assert (source, value) == (3, 42.0)


def _any_source_and_specific_share_a_line(rank, world):
    # An any-source recv posted first takes the first send; the specific recv posted after
    # it takes the second: posting order decides between them.
    if rank == 1:
        dist.send(torch.tensor([1.0]), 0)
        dist.send(torch.tensor([2.0]), 0)
        return None
    first, second = torch.empty(1), torch.empty(1)
    any_work = dist.group.WORLD.recv_anysource([first], 0)
    specific = dist.irecv(second, 1)
    any_work.wait()
    specific.wait()
    return first.item(), second.item()


def test_any_source_and_specific_recvs_follow_posting_order():
    assert run_ranks(_any_source_and_specific_share_a_line, 2)[0] == (1.0, 2.0)


def _work_api(rank, world):
    peer = 1 - rank
    if rank == 0:
        buf = torch.empty(16)
        work = dist.irecv(buf, peer)
        assert not work.is_completed()
        expired = (r"wait\(timeout=200 ms\) expired; recv on rank 0 from rank 1 \(group '.*', "
                   r"tag 0, 64 B\) is still pending")
        with pytest.raises(RuntimeError, match=expired):
            work.wait(timeout=__import__("datetime").timedelta(milliseconds=200))
        dist.barrier()  # the partner sends only now
        future = work.get_future()
        value = future.wait()
        assert work.is_completed() and work.is_success()
        if EXCEPTION_BINDING_WORKS:
            assert work.exception() is None
        assert torch.equal(value[0], torch.arange(16, dtype=torch.float32))
        assert torch.equal(buf, torch.arange(16, dtype=torch.float32))
        return True
    dist.barrier()
    dist.send(torch.arange(16, dtype=torch.float32), peer)
    return True


def test_work_wait_timeout_then_completion_and_future():
    run_ranks(_work_api, 2)


def _forgotten_after_isend(rank, world, swap_data):
    # The caller drops each tensor right after isend, or (swap_data) replaces its `.data` as
    # Megatron's deallocate_output_tensor does; fresh tensors of the same size then get the
    # freed memory if nothing holds it. The engine keeps the bytes alive either way.
    peer = 1 - rank
    if rank == 0:
        works, junk = [], []
        for i in range(8):
            sent = torch.full((1 << 18,), float(i))
            works.append(dist.isend(sent, peer))
            if swap_data:
                sent.data = torch.empty(1)
                junk.append(torch.full((1 << 18,), -1.0))
        del sent
        gc.collect()
        dist.barrier()
        for work in works:
            work.wait()
        return None
    dist.barrier()
    return received_fills(peer, 8, 1 << 18)


def test_engine_holds_tensors_until_transfer_done():
    assert run_ranks(_forgotten_after_isend, 2, False)[1] == [float(i) for i in range(8)]


def test_memory_of_a_tensor_whose_data_is_swapped_after_isend_is_held():
    assert run_ranks(_forgotten_after_isend, 2, True)[1] == [float(i) for i in range(8)]


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
    assert run_ranks(_small_exchanges, 2, env={"UCX_TLS": "tcp"}) == [0, 0]


def _batch_whose_group_closes_before_it_ends(rank, world):
    peer = 1 - rank
    group = dist.group.WORLD
    # Connected both ways before either side closes: the close, not a peer already gone, is
    # what the batch meets.
    got = torch.empty(1)
    for work in [dist.isend(torch.ones(1), peer), dist.irecv(got, peer)]:
        work.wait()
    with pytest.raises(dist.DistBackendError, match="is closed"):
        with dist.distributed_c10d._coalescing_manager(group, torch.device("cpu"),
                                                      async_ops=True):
            send = dist.isend(torch.ones(4), peer)
            group._get_backend(torch.device("cpu")).shutdown()
    with pytest.raises(dist.DistBackendError, match="not posted"):
        send.wait()  # fails instead of waiting for an op that was never posted
    return send.is_completed()


def test_ops_of_a_batch_that_cannot_be_posted_fail_instead_of_hanging():
    assert run_ranks(_batch_whose_group_closes_before_it_ends, 2) == [True, True]
