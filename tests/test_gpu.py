"""Same-host CUDA point-to-point on the copy engines. Needs at least 2 GPUs (marked gpu)."""

import datetime
import os
import random
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from harness import received_fills, run_ranks

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count()
# The suite runs as it is on the copy engines (default) and with SMFREE_TRANSPORT=ucx.
OVER_UCX = os.environ.get("SMFREE_TRANSPORT") == "ucx"
copy_engine_only = pytest.mark.skipif(OVER_UCX, reason="tests the copy-engine protocol")
ucx_only = pytest.mark.skipif(not OVER_UCX, reason="tests CUDA over UCX (SMFREE_TRANSPORT=ucx)")
# UCX over TCP alone copies CUDA memory in small pieces; smfree then stages through host memory.
UCX_TCP_ONLY = {"tcp"} <= set(os.environ.get("UCX_TLS", "").split(",")) <= {"tcp", "cuda_copy"}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool, torch.complex64]


def filled(numel, dtype, seed, device):
    """Contents that differ per rank and per position, made on the GPU."""
    values = torch.arange(numel, dtype=torch.int64, device=device) * 7 + seed * 1_000_003
    if dtype == torch.bool:
        return values % 3 == 0
    if dtype.is_complex:
        return torch.complex((values % 1000).float(), (values % 777).float()).to(dtype)
    if dtype.is_floating_point:
        return (values % 2039).to(dtype)
    return (values % 127).to(dtype)


def exchange(mine, got, peer, batched=True):
    if batched:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer),
                                        dist.P2POp(dist.irecv, got, peer)])
    else:
        works = [dist.isend(mine, peer), dist.irecv(got, peer)]
    for work in works:
        work.wait()


def _dtypes_and_sizes(rank, world, sizes):
    dev = torch.device("cuda", rank)
    peer = 1 - rank
    checked = 0
    for dtype in DTYPES:
        mine = filled(1000, dtype, rank, dev)
        got = torch.zeros(1000, dtype=dtype, device=dev)
        exchange(mine, got, peer)
        assert torch.equal(got, filled(1000, dtype, peer, dev)), dtype
        checked += 1
    for nbytes in sizes:
        mine = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev,
                             generator=torch.Generator(dev).manual_seed(rank + nbytes))
        got = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        exchange(mine, got, peer)
        expected = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev,
                                 generator=torch.Generator(dev).manual_seed(peer + nbytes))
        assert torch.equal(got, expected), f"{nbytes} B differ"
        checked += 1
        del mine, got, expected
    torch.cuda.synchronize()
    return checked


def test_dtypes_and_sizes_zero_bytes_to_1_gib():
    sizes = [0, 1, 4097, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
    assert run_ranks(_dtypes_and_sizes, 2, sizes, cuda=True, timeout=300) == \
        [len(DTYPES) + len(sizes)] * 2


@pytest.mark.parametrize("connections", ["1", "2"])
def test_streams_sharing_one_hardware_queue(connections):
    # Megatron runs with CUDA_DEVICE_MAX_CONNECTIONS=1: every stream of a process, the DMA
    # streams included, shares one hardware queue, so a stream wait queued ahead of the copy
    # that ends it would hold that copy back forever. Back-to-back exchanges of fresh
    # tensors with CPU syncs between them, then PP = 2 traffic on two streams.
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": connections}
    sizes = [0, 1, 4097, 1 << 20]
    assert run_ranks(_dtypes_and_sizes, 2, sizes, cuda=True, env=env) == \
        [len(DTYPES) + len(sizes)] * 2
    steps = 12
    for rank, seen in enumerate(run_ranks(_pp2_one_peer, 2, steps, cuda=True, env=env)):
        assert seen == [float(s) + (1 - rank) for s in range(steps)]


def _views(rank, world):
    dev = torch.device("cuda", rank)
    peer = 1 - rank
    base = torch.arange(1000, dtype=torch.float32, device=dev) + 10_000 * rank
    target = torch.full((500,), -1.0, device=dev)
    exchange(base[100:300], target[50:250], peer, batched=False)
    expected = torch.full((500,), -1.0, device=dev)
    expected[50:250] = torch.arange(100, 300, dtype=torch.float32, device=dev) + 10_000 * peer
    return torch.equal(target, expected)


def test_views_with_storage_offsets():
    assert run_ranks(_views, 2, cuda=True) == [True, True]


def _stream_order(rank, world):
    # The sender's producer is slow and the receiver's buffer is still being read by a slow
    # consumer: the copy must wait for both, without the CPU waiting for either.
    dev = torch.device("cuda", rank)
    peer = 1 - rank
    exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), peer)  # connect first
    torch.cuda.synchronize()
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


def test_stream_semantics_of_send_and_recv():
    posted_in, (before, after) = run_ranks(_stream_order, 2, cuda=True)
    assert before == 7.0, "the recv overwrote the buffer before earlier work on it finished"
    assert after == 42.0, "data sent before the producer finished, or not received"
    # Over UCX a send's wait() returns on the CPU once it has ended, unless UCX moves it from
    # pinned host memory: then, as on the copy engines, once its copy out is queued.
    if not OVER_UCX or UCX_TCP_ONLY:
        assert posted_in < 0.05, f"isend + wait blocked the CPU for {posted_in:.3f} s"


def _recv_behind_a_busy_stream(rank, world, numel):
    # The receiver's stream is busy for about a second, and a consumer still reads the old
    # contents behind that; the sender's bytes are ready at once.
    dev = torch.device("cuda", rank)
    exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), 1 - rank)  # connect first
    torch.cuda.synchronize()
    if rank == 0:
        dist.send(_numbered(5, numel, dev), 1)
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
            torch.equal(after, _numbered(5, numel, dev)))


def test_recv_wait_leaves_the_stream_to_wait_for_the_copy():
    early, old_contents_read, received = run_ranks(
        _recv_behind_a_busy_stream, 2, (16 << 20) // 4 + 3, cuda=True)[1]
    assert old_contents_read, "the recv overwrote the buffer before earlier work on it finished"
    assert received, "the stream read the buffer before the recv had written it"
    # Over UCX a recv into CUDA memory that UCX writes itself (not staged through pinned host
    # memory) is waited for on the CPU, which needs the stream to reach the recv first.
    assert early == (not OVER_UCX or UCX_TCP_ONLY)


def _recv_whose_bytes_come_late(rank, world, numel):
    # The sender posts at once, but its stream reaches the send only about a second later.
    dev = torch.device("cuda", rank)
    exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), 1 - rank)  # connect first
    torch.cuda.synchronize()
    if rank == 0:
        payload = _numbered(9, numel, dev)  # allocated first: a cudaMalloc may wait for the GPU
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
    return waited, returned_before_the_bytes_landed, torch.equal(after, _numbered(9, numel, dev))


@ucx_only
def test_recv_wait_returns_before_the_bytes_land_where_the_stream_can_wait_for_them():
    waited, early, received = run_ranks(
        _recv_whose_bytes_come_late, 2, (16 << 20) // 4 + 3, cuda=True)[1]
    assert received, "the stream read the buffer before the recv had written it"
    # Over TCP-only UCX the stream waits for the copies in from host memory, queued behind
    # waits for each piece to land. Where UCX writes CUDA memory itself, the CPU waits.
    assert early == UCX_TCP_ONLY, (waited, early)
    if early:
        assert waited < 0.5, f"wait() held the CPU for {waited:.3f} s"


def _recv_polled_until_done(rank, world, numel):
    dev = torch.device("cuda", rank)
    if rank == 0:
        dist.send(_numbered(3, numel, dev), 1)
        torch.cuda.synchronize()
        return None
    buf = torch.full((numel,), -1, dtype=torch.int32, device=dev)
    work = dist.irecv(buf, 0)
    deadline = time.monotonic() + 60
    while not work.is_completed():
        assert time.monotonic() < deadline, "is_completed() stayed False for 60 s"
        time.sleep(0.001)
    torch.cuda.synchronize()
    return torch.equal(buf, _numbered(3, numel, dev))


def test_recv_polled_with_is_completed_ends_without_wait():
    # Staged through host memory, the recv's copies in are queued by the poll.
    assert run_ranks(_recv_polled_until_done, 2, (16 << 20) // 4 + 3, cuda=True)[1]


def _recv_waited_with_a_timeout(rank, world, numel):
    dev = torch.device("cuda", rank)
    if rank == 0:
        dist.barrier()  # the partner's wait(timeout) has expired: send only now
        dist.send(_numbered(5, numel, dev), 1)
        torch.cuda.synchronize()
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
    torch.cuda.synchronize()
    return str(expired.value), waited, torch.equal(after, _numbered(5, numel, dev))


def test_recv_wait_with_a_timeout_expires_then_the_recv_completes():
    # Staged through host memory, the recv's wait() queues its copies in once it matches: with a
    # timeout it must give up at the timeout, not at the group's (30 s), and leave the recv
    # pending for a later wait().
    expired, waited, received = run_ranks(
        _recv_waited_with_a_timeout, 2, (16 << 20) // 4 + 3, cuda=True)[1]
    assert re.search(r"wait\(timeout=200 ms\) expired; recv on rank 1 from rank 0 .* is still "
                     r"pending", expired), expired
    assert waited < 10, f"wait(timeout=200 ms) held the CPU for {waited:.1f} s"
    assert received, "the recv did not complete after its timed wait() expired"


def _any_source_into_cuda(rank, world):
    dev = torch.device("cuda", rank)
    if rank == 1:
        exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), 0)  # connect first
        torch.cuda._sleep(400_000_000)  # the copy waits for this on the GPU, not the recv's CPU
        dist.send(torch.full((1 << 20,), 5.0, device=dev), 0, tag=3)
        torch.cuda.synchronize()
        return None
    exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), 1)
    buf = torch.zeros(1 << 20, device=dev)
    source = dist.recv(buf, tag=3)  # no src: wait() on a recv from any source, then its source
    return source, buf.min().item(), buf.max().item()


def test_cuda_recv_from_any_source_reports_its_sender():
    assert run_ranks(_any_source_into_cuda, 2, cuda=True)[0] == (1, 5.0, 5.0)


def _overwrite_after_wait(rank, world, numel, rounds):
    dev = torch.device("cuda", rank)
    if rank == 0:
        for round_ in range(rounds):
            buf = torch.full((numel,), float(round_ + 1), device=dev)
            dist.isend(buf, 1).wait()
            buf.fill_(-1.0)  # on the current stream: after the send has read the buffer
        torch.cuda.synchronize()
        return None
    seen = []
    for _ in range(rounds):
        got = torch.empty(numel, device=dev)
        dist.irecv(got, 0).wait()
        seen.append((got.min().item(), got.max().item()))
    return seen


def test_send_buffer_may_be_overwritten_once_wait_returns():
    rounds = 4
    seen = run_ranks(_overwrite_after_wait, 2, 16 << 20, rounds, cuda=True)[1]
    assert seen == [(float(r + 1), float(r + 1)) for r in range(rounds)], seen


def _crossed_unbatched(rank, world, nbytes):
    dev = torch.device("cuda", rank)
    peer = 1 - rank
    mine = torch.full((nbytes // 4,), float(rank + 1), device=dev)
    got = torch.zeros(nbytes // 4, device=dev)
    send = dist.isend(mine, peer)
    recv = dist.irecv(got, peer)
    send.wait()
    recv.wait()
    return bool(torch.all(got == peer + 1))


@pytest.mark.parametrize("nbytes", [4096, 64 << 20])
def test_crossed_isend_before_irecv_unbatched(nbytes):
    assert run_ranks(_crossed_unbatched, 2, nbytes, cuda=True) == [True, True]


def _out_of_order_readiness(rank, world):
    # Rank 1 makes its stream wait for the tag-2 recv before it even posts the tag-1 recv,
    # while rank 0 sends tag 1 first. A DMA queue that waits on the receiver in posting
    # order would deadlock here.
    dev = torch.device("cuda", rank)
    if rank == 0:
        a = torch.full((1 << 16,), 1.0, device=dev)
        b = torch.full((1 << 16,), 2.0, device=dev)
        works = [dist.isend(a, 1, tag=1), dist.isend(b, 1, tag=2)]
        for work in works:
            work.wait()
        torch.cuda.synchronize()
        return None
    a = torch.zeros(1 << 16, device=dev)
    b = torch.zeros(1 << 16, device=dev)
    dist.irecv(b, 0, tag=2).wait()
    b.add_(1)  # uses b after its recv, in stream order
    dist.irecv(a, 0, tag=1).wait()
    torch.cuda.synchronize()
    return a[0].item(), b[0].item()


def test_readiness_in_another_order_than_posting():
    assert run_ranks(_out_of_order_readiness, 2, cuda=True)[1] == (1.0, 3.0)


def _pp2_one_peer(rank, world, steps):
    # PP = 2 with 1F1B-like traffic: activations forward and gradients backward to the same
    # peer, compute between, some steps batched, some not, ops on a side stream.
    dev = torch.device("cuda", rank)
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


def test_pp2_one_peer_next_and_previous_stage():
    steps = 30
    results = run_ranks(_pp2_one_peer, 2, steps, cuda=True)
    for rank, seen in enumerate(results):
        assert seen == [float(s) + (1 - rank) for s in range(steps)]


def _many_groups_many_streams(rank, world, groups_count, rounds):
    dev = torch.device("cuda", rank)
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


def test_many_groups_and_streams_any_posting_order():
    assert run_ranks(_many_groups_many_streams, 2, 4, 10, cuda=True) == [True, True]


def _all_pairs(rank, world):
    dev = torch.device("cuda", rank)
    got = {}
    works = []
    for peer in range(world):
        if peer == rank:
            continue
        got[peer] = torch.empty(1 << 18, dtype=torch.int64, device=dev)
        works.append(dist.isend(torch.full((1 << 18,), 100 * rank + peer, dtype=torch.int64,
                                           device=dev), peer))
        works.append(dist.irecv(got[peer], peer))
    for work in works:
        work.wait()
    torch.cuda.synchronize()
    return {peer: int(t[0]) for peer, t in got.items() if torch.all(t == t[0])}


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")
def test_four_ranks_every_pair():
    results = run_ranks(_all_pairs, 4, cuda=True)
    for rank, got in enumerate(results):
        assert got == {peer: 100 * peer + rank for peer in range(4) if peer != rank}


def _churn(rank, world, transfers, cache_size):
    # Random allocations and frees between transfers, so receive buffers move around and
    # the caching allocator returns segments to the driver; every payload is checksummed.
    dev = torch.device("cuda", rank)
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
def test_allocator_churn_keeps_data_right_and_mappings_bounded(cache_size, alloc_conf):
    results = run_ranks(_churn, 2, 300, cache_size, cuda=True, timeout=240,
                        env={"SMFREE_IPC_CACHE_SIZE": str(cache_size), **alloc_conf})
    for most_mappings, live_ops in results:
        assert most_mappings <= cache_size
        assert live_ops == 0


def _spanning_chunks(rank, world):
    dev = torch.device("cuda", rank)
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


def test_expandable_segments_tensor_spanning_several_chunks():
    assert run_ranks(_spanning_chunks, 2, cuda=True, env=EXPANDABLE) == [True, True]


def _memory_freed_by_its_owner(rank, world):
    dev = torch.device("cuda", rank)
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


@copy_engine_only
@pytest.mark.parametrize("alloc_conf", [{}, EXPANDABLE], ids=["cudaMalloc", "expandable"])
def test_memory_freed_by_its_owner_is_unmapped_by_its_peer(alloc_conf):
    (before, during, after), (received, returned) = run_ranks(
        _memory_freed_by_its_owner, 2, cuda=True, env=alloc_conf)
    assert received
    assert during == before + 1
    assert after <= before, "the mapping of the freed buffer is still open"
    assert returned, "the peer's mapping still holds the freed memory"


EXIT_WITHOUT_TEARDOWN = """
import sys, torch, torch.distributed as dist, smfree_pg
rank = int(sys.argv[1])
torch.cuda.set_device(rank)
dist.init_process_group("smfree", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
mine = torch.full((1 << 20,), float(rank), device="cuda")
got = torch.empty_like(mine)
for _ in range(20):
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, 1 - rank),
                                    dist.P2POp(dist.irecv, got, 1 - rank)])
for work in works:
    work.wait()
torch.cuda.synchronize()
assert got[0].item() == 1 - rank
# No destroy_process_group(), as Megatron-LM's pretrain ends; the works stay alive to the end.
"""


def test_ranks_that_exit_without_destroying_the_group_exit_cleanly(tmp_path):
    env = {**os.environ, "SMFREE_LOG_LEVEL": "error"}
    ranks = [subprocess.Popen([sys.executable, "-c", EXIT_WITHOUT_TEARDOWN, str(rank),
                               str(tmp_path / "store")], env=env, stderr=subprocess.PIPE)
             for rank in range(2)]
    try:
        errors = [rank.communicate(timeout=120)[1].decode()[-2000:] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], errors


def _zero_kernels(rank, world):
    dev = torch.device("cuda", rank)
    peer = 1 - rank
    mine = torch.ones(1 << 22, device=dev)
    got = torch.empty(1 << 22, device=dev)
    exchange(mine, got, peer)  # warm: mappings and streams exist
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            exchange(mine, got, peer)
        torch.cuda.synchronize()
    kernels = [evt.name for evt in prof.events()
               if evt.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in evt.name.lower() and "memset" not in evt.name.lower()]
    return kernels, bool(torch.all(got == 1))


def test_p2p_launches_no_kernels():
    for kernels, ok in run_ranks(_zero_kernels, 2, cuda=True):
        assert ok
        assert kernels == [], f"P2P ops launched kernels: {sorted(set(kernels))}"


def _wrong_device(rank, world):
    dev = torch.device("cuda", rank)
    other = torch.device("cuda", 1 - rank)
    exchange(torch.ones(8, device=dev), torch.empty(8, device=dev), 1 - rank)
    with pytest.raises(ValueError, match=rf"tensor on cuda:{1 - rank}, but this rank uses "
                                         rf"cuda:{rank}"):
        dist.isend(torch.ones(8, device=other), 1 - rank)
    return True


def test_tensor_on_another_device_than_the_groups():
    assert run_ranks(_wrong_device, 2, cuda=True) == [True, True]


def _cuda_mismatch(rank, world):
    dev = torch.device("cuda", rank)
    try:
        if rank == 0:
            dist.send(torch.ones(16, device=dev), 1)
        else:
            dist.recv(torch.empty(32, device=dev), 0)
        torch.cuda.synchronize()
        return None
    except dist.DistBackendError as error:
        torch.cuda.synchronize()  # the failed op left no stream parked
        return str(error)


def test_cuda_size_mismatch_fails_on_both_ranks():
    for error in run_ranks(_cuda_mismatch, 2, cuda=True):
        assert error and "rank 0 sends float32[16] (64 B) on cuda" in error
        assert "receives into float32[32] (128 B) on cuda" in error


def _peer_dies(rank, world, numel, staged):
    dev = torch.device("cuda", rank)
    exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), 1 - rank)  # connect first
    torch.cuda.synchronize()
    if rank == 1:
        mine = torch.ones(numel, device=dev)
        torch.cuda._sleep(1 << 40)  # minutes of GPU work before the source is ready
        work = dist.isend(mine, 0)
        work.wait()  # returns once the copy is submitted; on the GPU it still waits
        os._exit(1)  # dies mid-transfer: the copy will never run
    got = torch.zeros(numel, device=dev)
    if staged:
        torch.cuda._sleep(500_000_000)  # not ready when the send is cleared: it goes to a slot
    work = dist.irecv(got, 1)
    work.wait()  # returns once the copy (or the copy out of the slot) is submitted
    marker = torch.ones(1, device=dev)  # queued behind the stream's wait for it
    started = time.monotonic()
    torch.cuda.synchronize()  # returns once the sender's death released the stream
    waited = time.monotonic() - started
    errors = []
    for call in (work.wait, lambda: dist.irecv(torch.zeros(4, device=dev))):  # any source
        try:
            call()
            errors.append(None)
        except dist.DistBackendError as failure:
            errors.append(str(failure))
    staged_recvs = dist.group.WORLD._get_backend(dev)._stats()["staged_recvs"]
    return waited, marker.item(), errors, staged_recvs


@copy_engine_only
@pytest.mark.parametrize("numel,staged", [(1 << 24, False), (1 << 22, True)],
                         ids=["direct-64MiB", "staged-16MiB"])
def test_dead_peer_leaves_no_stream_parked(numel, staged):
    waited, marker, (error, refusal), staged_recvs = run_ranks(
        _peer_dies, 2, numel, staged, cuda=True, group_timeout_s=60, expect_exit=(1,))[0]
    assert waited < 30 and marker == 1.0
    assert error and "its peer process" in error
    # Its wait() had returned, so the tensor's wrong bytes refuse the group's next call.
    assert refusal and "smfree: recv on rank 0 from any rank" in refusal, refusal
    assert "failed after its wait() returned, so its tensor holds wrong bytes" in refusal, refusal
    assert "its peer process" in refusal, refusal
    assert staged_recvs == (1 if staged else 0)


# Sizes on both sides of staging's range (8 MiB to SMFREE_STAGING_BYTES, 16 MiB by default).
STAGING_SIZES = [16 << 20, 4 << 20, 1 << 20, 20 << 20, 8 << 20]


def _numbered(i, numel, dev):
    return (torch.arange(numel, dtype=torch.int64, device=dev) * 7 + i * 1_000_003).to(torch.int32)


def _one_way_into_one_buffer(rank, world, rounds):
    dev = torch.device("cuda", rank)
    backend = dist.group.WORLD._get_backend(dev)
    buffer = torch.empty(max(STAGING_SIZES) // 4, dtype=torch.int32, device=dev)
    # Connect first, with the sender's kernels loaded, and start together: the receiver's sleep
    # below must outlast the wait for the first send. Without the exchange, a first op's setup
    # fell inside it in some runs (no send staged, on 2 and 4 GPUs).
    _numbered(0, 1, dev)
    exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), 1 - rank)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        for i in range(rounds):
            numel = STAGING_SIZES[i % len(STAGING_SIZES)] // 4
            buffer[:numel].copy_(_numbered(i, numel, dev))  # must wait for the last copy
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
             if not torch.equal(got, _numbered(i, got.numel(), dev))]
    stats = backend._stats()
    return wrong, stats["staged_recvs"], stats["staging_rings"]


@copy_engine_only
@pytest.mark.parametrize("staging", ["16777216", "0"], ids=["staging", "no-staging"])
def test_sends_into_a_buffer_the_receiver_keeps_reusing(staging):
    rounds = 40
    staged_sends, (wrong, staged_recvs, rings) = run_ranks(
        _one_way_into_one_buffer, 2, rounds, cuda=True, env={"SMFREE_STAGING_BYTES": staging})
    assert wrong == []
    stageable = sum(1 for i in range(rounds)
                    if 8 << 20 <= STAGING_SIZES[i % len(STAGING_SIZES)] <= int(staging))
    assert staged_sends == staged_recvs
    assert (1 if staging != "0" else 0) <= staged_sends <= stageable
    assert rings == (1 if staging != "0" else 0)


def _receiver_dies_with_sends_waiting_for_slots(rank, world):
    dev = torch.device("cuda", rank)
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


@copy_engine_only
def test_receiver_death_fails_the_sends_held_for_a_staging_slot():
    errors, waited, stats = run_ranks(_receiver_dies_with_sends_waiting_for_slots, 2, cuda=True,
                                      group_timeout_s=60, expect_exit=(1,))[0]
    assert errors[:2] == [None, None], errors  # copied into the two slots before it died
    assert all(error and "its peer process" in error for error in errors[2:]), errors
    assert stats["staged_sends"] == 2 and stats["live_ops"] == 0
    assert waited < 30


def _dropped_tensors(rank, world):
    dev = torch.device("cuda", rank)
    if rank == 0:
        works = [dist.isend(torch.full((1 << 20,), float(i), device=dev), 1) for i in range(16)]
        for work in works:
            work.wait()
        torch.cuda.synchronize()
        return None
    return received_fills(0, 16, 1 << 20, dev)


def test_engine_holds_cuda_tensors_until_moved():
    assert run_ranks(_dropped_tensors, 2, cuda=True)[1] == [float(i) for i in range(16)]


def _swapped_cuda_data(rank, world):
    # Megatron's deallocate_output_tensor right after isend: the same-size tensor allocated
    # next on the stream gets the freed block and fills it before the copy could read it.
    dev = torch.device("cuda", rank)
    if rank == 0:
        works, junk = [], []
        for i in range(8):
            sent = torch.full((1 << 20,), float(i), device=dev)
            works.append(dist.isend(sent, 1))
            sent.data = torch.empty(1, device=dev)
            junk.append(torch.full((1 << 20,), -1.0, device=dev))
        for work in works:
            work.wait()
        torch.cuda.synchronize()
        return None
    time.sleep(1.0)
    return received_fills(0, 8, 1 << 20, dev)


def test_memory_of_a_cuda_tensor_whose_data_is_swapped_after_isend_is_held():
    assert run_ranks(_swapped_cuda_data, 2, cuda=True)[1] == [float(i) for i in range(8)]


def _peer_dies_before_its_stream_is_ready(rank, world):
    dev = torch.device("cuda", rank)
    exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), 1 - rank)  # connect first
    torch.cuda.synchronize()
    if rank == 1:
        torch.cuda._sleep(1 << 40)  # the send's stream will not reach it for minutes
        dist.isend(torch.ones(1 << 24, device=dev), 0)
        time.sleep(0.5)
        os._exit(1)
    work = dist.irecv(torch.zeros(1 << 24, device=dev), 1)
    started = time.monotonic()
    returned = False
    try:
        work.wait()
        returned = True
        torch.cuda.synchronize()  # a parked recv lets its stream go once it has failed
        dist.irecv(torch.zeros(4, device=dev))  # from any source: the dead peer is not named
        error = None
    except dist.DistBackendError as failure:
        error = str(failure)
    return time.monotonic() - started, returned, error


@ucx_only
def test_peer_killed_mid_transfer_fails_the_pending_recv():
    waited, returned, error = run_ranks(_peer_dies_before_its_stream_is_ready, 2, cuda=True,
                                        group_timeout_s=120, expect_exit=(1,))[0]
    assert error and "its peer process" in error, error
    # Staged through host memory, the recv is parked: wait() returns before the bytes come,
    # and the failure refuses the next call on the group.
    assert returned == UCX_TCP_ONLY, error
    if UCX_TCP_ONLY:
        assert "failed after its wait() returned, so its tensor holds wrong bytes" in error, error
        assert "smfree: recv on rank 0 from any rank" in error, error
    assert waited < 60


def _exchanges_and_staging(rank, world, sizes):
    dev = torch.device("cuda", rank)
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
    return {key: after[key] - before[key] if key != "ucx_host_staging_cached_bytes" else after[key]
            for key in ("ucx_host_staged_sends", "ucx_host_staged_recvs",
                        "ucx_host_staging_cached_bytes")}


@ucx_only
def test_cuda_goes_through_pinned_host_memory_exactly_where_ucx_has_only_tcp():
    sizes = [0, 1, 4097, 1 << 20, (16 << 20) + 3, 1 << 20]
    moved = sum(1 for nbytes in sizes if nbytes)
    for counts in run_ranks(_exchanges_and_staging, 2, sizes, cuda=True):
        staged = moved if UCX_TCP_ONLY else 0
        assert counts["ucx_host_staged_sends"] == staged, counts
        assert counts["ucx_host_staged_recvs"] == staged, counts
        # Host buffers come back to the cache once their transfers are done.
        assert (counts["ucx_host_staging_cached_bytes"] > 0) == UCX_TCP_ONLY, counts


def _send_once(rank, world, from_cuda):
    dev = torch.device("cuda", rank)
    try:
        if rank == 0:
            dist.send(torch.ones(1024, device=dev if from_cuda else "cpu"), 1)
        else:
            dist.recv(torch.zeros(1024, device=dev), 0)
        return None
    except dist.DistBackendError as error:
        return str(error)


def test_cpu_send_into_cuda_recv_fails_on_both_ranks():
    for error in run_ranks(_send_once, 2, False, cuda=True, group_timeout_s=30):
        assert error and "device mismatch" in error and "on cuda" in error, error


def test_ranks_on_different_transports_fail_on_both_ranks():
    errors = run_ranks(_send_once, 2, True, cuda=True, group_timeout_s=30,
                       rank_env={0: {"SMFREE_TRANSPORT": "ucx"},
                                 1: {"SMFREE_TRANSPORT": "copy_engine"}})
    for error in errors:
        assert error and "channel mismatch" in error, error
        assert "over UCX" in error and "over the copy engines" in error, error
