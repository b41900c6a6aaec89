"""CUDA graphs: same-host CUDA P2P captured on each rank (torch.cuda.graph) and replayed with the
right bytes every time, 4 B to 256 MiB, batched or in an order only eager sends complete, several
graphs per process between ordinary ops on the same peer and tag; smfree puts no kernel node in
a graph; what cannot be captured is refused at the call; a peer that stops replaying, or dies,
is reported within the group timeout and no replay is left waiting."""

import datetime
import os
import signal
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import channels
from cuda_graphs import new_graph, node_types
from devices import cuda_device, gpu_count, rank_gpu
from harness import swap

pytestmark = pytest.mark.gpu

COPY_ENGINE = channels.COPY_ENGINE
SIZES = [4, 64 << 10, 1 << 20, 8 << 20, 64 << 20, 256 << 20]  # bytes


def _exchange(src, dst, peer, order):
    if order == "batch":
        ops = [dist.P2POp(dist.isend, src, peer), dist.P2POp(dist.irecv, dst, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    else:  # both ranks send, each waiting for its send, before either receives
        dist.send(src, peer)
        _sync("sent", 1 - peer)  # so no recv is posted while a send waits for it (a slot)
        dist.recv(dst, peer)


_SYNCS = Counter()


def _sync(key, rank):
    """Both ranks here, through the store: nothing on the GPU."""
    _SYNCS[key] += 1
    key = f"{key}/{_SYNCS[key]}"
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/0", f"{key}/1"])


def _capture(fn, mode):
    graph, kept = new_graph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, capture_error_mode=mode):
        fn()
    return graph, kept


def _captured_exchanges(rank, world, order, mode, replays):
    dev = cuda_device(rank)
    peer = 1 - rank
    pairs = [(torch.zeros(size // 4, device=dev), torch.zeros(size // 4, device=dev))
             for size in SIZES]
    for src, dst in pairs:  # warm-up: ordinary ops, as before any capture
        _exchange(src, dst, peer, "batch")
    torch.cuda.synchronize()
    graphs, nodes = [], Counter()
    for src, dst in pairs:  # a graph per size, each capturing one exchange
        graph, kept = _capture(lambda: _exchange(src, dst, peer, order), mode)
        if kept:
            nodes += node_types(graph)
        graphs.append(graph)
    seen = {size: [] for size in SIZES}
    ordinary = []
    for r in range(replays):
        for size, graph, (src, dst) in zip(SIZES, graphs, pairs):
            src.fill_(float(1000 * rank + r))
            graph.replay()
            seen[size].append((dst.min().item(), dst.max().item()))
            # An ordinary op on the same peer and tag between replays: it takes its own message,
            # never the graph's.
            got = swap(peer, torch.full((16,), float(-r - 1 - 100 * rank), device=dev))
            ordinary.append((got.min().item(), got.max().item()))
    torch.cuda.synchronize()
    stats = dist.group.WORLD._get_backend(dev)._stats()
    return (seen, ordinary, dict(nodes), stats["captured_slots"], stats["captured_slot_bytes"],
            stats["captured_direct_sends"])


@pytest.mark.parametrize("order,connections,mode", [
    ("batch", "8", "global"), ("sends_waited_first", "8", "thread_local"),
    ("batch", "1", "thread_local"), ("sends_waited_first", "1", "global")])
def test_captured_exchanges_replay_the_right_bytes(order, connections, mode):
    replays = 4
    results = COPY_ENGINE.run(_captured_exchanges, 2, order, mode, replays, timeout=240,
                              env={"CUDA_DEVICE_MAX_CONNECTIONS": connections})
    # A batch posts its recvs first, so each send copies straight into its recv's buffer; a
    # send waited for before its peer's recv is posted goes through a slot of its own.
    direct = order == "batch"
    for rank, (seen, ordinary, nodes, slots, slot_bytes, direct_sends) in enumerate(results):
        peer = 1 - rank
        for size in SIZES:
            assert seen[size] == [(1000.0 * peer + r,) * 2 for r in range(replays)], size
        assert ordinary == [(float(-r - 1 - 100 * peer),) * 2
                            for r in range(replays) for _ in SIZES]
        if nodes:  # this torch kept the graphs: smfree put no kernel node in them
            assert set(nodes) <= {"memcpy", "batch_mem_op", "empty", "event_record",
                                  "wait_event"}, nodes
            assert nodes["memcpy"] == _memcpy_nodes(rank, peer, direct=direct), nodes
            assert nodes["batch_mem_op"] >= 2 * len(SIZES), nodes
        if direct:
            assert (slots, slot_bytes, direct_sends) == (0, 0, len(SIZES))
        else:
            assert (slots, slot_bytes, direct_sends) == (len(SIZES), sum(SIZES), 0)


def _chunks(size):
    """Passes of a copy within one GPU through its bounce: a power of two from 1 MiB to 16 MiB."""
    bounce = 1 << 20
    while bounce < size and bounce < 16 << 20:
        bounce *= 2
    return -(-size // bounce)


def _copy_nodes(to_gpu, from_gpu, size, local_copies):
    """Memcpy nodes of one copy of `size` bytes from one GPU's memory to another's (or the
    same's): one, or two per chunk through a bounce where it stays within one GPU (unless
    SMFREE_LOCAL_COPIES=driver)."""
    if local_copies == "driver" or to_gpu != from_gpu:
        return 1
    return 2 * _chunks(size)


def _slot_gpu(sender_gpu, local_copies):
    """Where a send's slot lies: with peer_gpu on the GPU after the sender's (every GPU of the
    test machine reaches every other), with one GPU or another setting on the sender's own."""
    gpus = gpu_count()
    if local_copies == "peer_gpu" and gpus > 1:
        return (sender_gpu + 1) % gpus
    return sender_gpu


def _memcpy_nodes(rank, peer, sizes=SIZES, local_copies="peer_gpu", direct=False):
    """Memcpy nodes of one rank's graphs of one exchange per size, by SMFREE_LOCAL_COPIES.
    direct: the send's copy straight into the peer's buffer, none for the recv. Through slots:
    the send's copy into its slot, the recv's copy out of its sender's slot. A copy within one
    GPU bounces (through a peer GPU's memory, or through host memory where there is no peer GPU
    or with host), in two copies per chunk; ranks that share a GPU copy within it."""
    mine, theirs = rank_gpu(rank), rank_gpu(peer)
    if direct:
        return sum(_copy_nodes(theirs, mine, size, local_copies) for size in sizes)
    return sum(_copy_nodes(_slot_gpu(mine, local_copies), mine, size, local_copies) +
               _copy_nodes(mine, _slot_gpu(theirs, local_copies), size, local_copies)
               for size in sizes)


def _graph_of_one_exchange(rank, numel, order="batch"):
    dev = cuda_device(rank)
    peer = 1 - rank
    src = torch.full((numel,), float(rank), device=dev)
    dst = torch.zeros(numel, device=dev)
    _exchange(src, dst, peer, "batch")
    graph, _ = _capture(lambda: _exchange(src, dst, peer, order), "global")
    graph.replay()  # both ranks: the first replay goes through
    torch.cuda.synchronize()
    return graph, dst


def _replays_under_the_profiler(rank, world, numel, replays, order):
    graph, dst = _graph_of_one_exchange(rank, numel, order)
    peer = 1 - rank
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    names = Counter(evt.name for evt in prof.events()
                    if evt.device_type == torch.autograd.DeviceType.CUDA)
    kernels = {name: n for name, n in names.items()
               if "memcpy" not in name.lower() and "memset" not in name.lower()}
    copies = sum(n for name, n in names.items() if "memcpy" in name.lower())
    return kernels, copies, dst.min().item() == dst.max().item() == float(peer)


@pytest.mark.parametrize("order,local_copies", [
    ("batch", "peer_gpu"), ("sends_waited_first", "driver"),
    ("sends_waited_first", "peer_gpu"), ("sends_waited_first", "host")])
def test_replays_run_copies_and_no_kernel(order, local_copies):
    replays = 10
    numel = 1 << 18
    results = COPY_ENGINE.run(_replays_under_the_profiler, 2, numel, replays, order,
                              env={"SMFREE_LOCAL_COPIES": local_copies})
    for rank, (kernels, copies, ok) in enumerate(results):
        assert ok
        assert kernels == {}, f"a replay ran kernels: {kernels}"
        assert copies == replays * _memcpy_nodes(rank, 1 - rank, [4 * numel], local_copies,
                                                 direct=order == "batch")


def _freed_after_its_send(rank, world, numel, replays):
    # Megatron frees a sent activation right after its send (deallocate_pipeline_outputs), and
    # inside a capture the graph's pool hands that memory to the next allocation: the send must
    # still read what was there at its post, at every replay.
    dev = cuda_device(rank)
    peer = 1 - rank
    base = torch.zeros(numel, device=dev)
    got = torch.zeros(numel, device=dev)
    _exchange(base, got, peer, "batch")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        sent = base + float(rank + 1)
        work = dist.isend(sent, peer)
        del sent
        for _ in range(4):  # allocations that may take the freed block, written at once
            torch.full((numel,), -7.0, device=dev).mul_(2)
        dist.recv(got, peer)
        work.wait()
    seen = []
    for r in range(replays):
        base.fill_(float(10 * r))
        graph.replay()
        seen.append((got.min().item(), got.max().item()))
    return seen


def test_a_send_freed_inside_the_capture_still_sends_its_bytes():
    replays = 3
    for rank, seen in enumerate(COPY_ENGINE.run(_freed_after_its_send, 2, 1 << 20, replays)):
        peer = 1 - rank
        assert seen == [(10.0 * r + peer + 1,) * 2 for r in range(replays)]


def _synchronized_inside_the_capture(rank, world, numel, replays):
    # synchronize() on a captured op makes the stream wait for it, as wait() does: a captured
    # recv's copy goes into the graph either way.
    dev = cuda_device(rank)
    peer = 1 - rank
    src = torch.zeros(numel, device=dev)
    got = torch.zeros(numel, device=dev)
    _exchange(src, got, peer, "batch")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, src, peer),
                                            dist.P2POp(dist.irecv, got, peer)]):
            work.synchronize()
    seen = []
    for r in range(replays):
        src.fill_(float(10 * r + rank))
        graph.replay()
        seen.append((got.min().item(), got.max().item()))
    return seen


def test_synchronize_inside_a_capture_waits_as_wait_does():
    replays = 3
    for rank, seen in enumerate(COPY_ENGINE.run(_synchronized_inside_the_capture, 2, 4096,
                                                replays)):
        assert seen == [(10.0 * r + 1 - rank,) * 2 for r in range(replays)]


def _store():
    return dist.distributed_c10d._get_default_store()


def _next_call_error(device):
    """What the group's next call raises, if anything."""
    try:
        dist.send(torch.zeros(1, device=device), 0)
    except RuntimeError as e:
        return str(e)
    return None


def _timed_replay(graph):
    start = time.monotonic()
    graph.replay()
    torch.cuda.synchronize()
    return time.monotonic() - start


def _peer_stops_replaying(rank, world, numel):
    graph, dst = _graph_of_one_exchange(rank, numel)
    ok = dst.min().item() == dst.max().item() == float(1 - rank)
    store = _store()
    if rank == 0:
        # Replays no more, and stays alive meanwhile.
        store.wait(["done"], datetime.timedelta(seconds=60))
        return ok, None, None, None
    # Rank 1 replays again: its recv waits for a send rank 0 never replays, until the
    # watchdog releases it at the group timeout.
    stuck = _timed_replay(graph)
    # Its group now refuses calls, naming the op; later replays are released at once.
    error = _next_call_error(dst.device)
    again = _timed_replay(graph)
    store.set("done", "1")
    return ok, stuck, error, again


def test_a_peer_that_stops_replaying_is_reported_at_the_group_timeout():
    timeout_s = 4
    results = COPY_ENGINE.run(_peer_stops_replaying, 2, 1 << 16, group_timeout_s=timeout_s,
                              timeout=120)
    assert all(ok for ok, *_ in results)
    _, stuck, error, again = results[1]
    assert timeout_s <= stuck < timeout_s + 3, stuck
    # Its batch's send copies straight into rank 0's buffer: it waits first, for rank 0's
    # graph to reach the recv.
    assert error and "captured send on rank 1 to rank 0" in error, error
    assert "to reach the recv of this replay's bytes" in error, error
    assert "failed at a replay of its CUDA graph" in error, error
    assert again < 1.5, again


def _peer_dies(rank, world, numel):
    graph, dst = _graph_of_one_exchange(rank, numel)
    store = _store()
    if rank == 0:
        store.set("captured", "1")
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["captured"])
    time.sleep(0.5)  # the peer is gone
    released = _timed_replay(graph)
    return released, _next_call_error(dst.device)


def test_a_dead_peer_leaves_no_replay_waiting():
    results = COPY_ENGINE.run(_peer_dies, 2, 1 << 16, group_timeout_s=60, timeout=120,
                              expect_exit=(0,))
    released, error = results[1]
    assert released < 2, released  # well inside the group timeout of 60 s
    assert error and "failed" in error and "pid" in error, error


def _refusals_and_what_works(rank, world):
    dev = cuda_device(rank)
    peer = 1 - rank
    refused = {}

    def refusal(name, fn):
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph):
                fn()
            refused[name] = None
        except RuntimeError as e:
            refused[name] = str(e)

    buf = torch.zeros(4, device=dev)
    refusal("any_source", lambda: dist.irecv(buf))  # no source rank
    early = dist.isend(torch.ones(4, device=dev), peer) if rank == 0 else \
        dist.irecv(buf, peer)
    refusal("waited_inside", early.wait)
    early.wait()  # outside a capture it works

    # A captured recv not waited for inside its capture cannot be waited for outside it.
    graph = torch.cuda.CUDAGraph()
    late = []
    with torch.cuda.graph(graph):
        if rank == 0:
            dist.send(torch.ones(4, device=dev), peer)
        else:
            late.append(dist.irecv(buf, peer))
    if late:
        try:
            late[0].wait()
            refused["waited_outside"] = None
        except RuntimeError as e:
            refused["waited_outside"] = str(e)
    del graph

    # What works inside a capture: CPU tensors (they move at the call), ops to the rank
    # itself and NCCL's collectives (replayed).
    cpu = torch.full((3,), float(rank))
    cpu_got = torch.zeros(3)
    mine = torch.zeros(8, device=dev)
    own = torch.zeros(8, device=dev)
    total = torch.zeros(8, device=dev)
    dist.all_reduce(total)  # the wrapped NCCL communicator exists before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        swap_cpu = [dist.P2POp(dist.isend, cpu, peer), dist.P2POp(dist.irecv, cpu_got, peer)]
        for work in dist.batch_isend_irecv(swap_cpu):
            work.wait()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, rank),
                                        dist.P2POp(dist.irecv, own, rank)])
        for work in works:
            work.wait()
        total.copy_(mine)
        dist.all_reduce(total)
    replayed = []
    for r in range(3):
        mine.fill_(float(10 * r + rank))
        graph.replay()
        replayed.append((own.min().item(), own.max().item(), total.min().item()))
    return refused, cpu_got.tolist(), replayed


@pytest.mark.distinct_gpus("all-reduces through NCCL, which refuses two ranks on one GPU")
def test_what_cannot_be_captured_is_refused_at_the_call():
    for rank, (refused, cpu_got, replayed) in enumerate(
            COPY_ENGINE.run(_refusals_and_what_works, 2, timeout=120)):
        assert "cannot be captured in a CUDA graph" in refused["any_source"]
        assert "recv from any source" in refused["any_source"]
        assert "posted outside the capture" in refused["waited_inside"]
        if rank == 1:
            assert "wait for it inside its capture" in refused["waited_outside"]
        assert cpu_got == [float(1 - rank)] * 3
        # Each replay copies to itself and all-reduces the two ranks' values.
        assert replayed == [(10.0 * r + rank, 10.0 * r + rank, 20.0 * r + 1) for r in range(3)]


def _ucx_capture_refused(rank, world):
    dev = cuda_device(rank)
    graph = torch.cuda.CUDAGraph()
    error = None
    try:
        with torch.cuda.graph(graph):
            dist.isend(torch.ones(4, device=dev), 1 - rank).wait()
    except RuntimeError as e:
        error = str(e)
    # Neither rank leaves before both were refused: a peer gone first fails the other's call
    # for that reason instead.
    swap(1 - rank, torch.zeros(1))
    return error


def test_cuda_over_ucx_is_refused_in_a_capture():
    for error in channels.CUDA_UCX_TCP.run(_ucx_capture_refused, 2):
        assert error and "SMFREE_CHANNEL=ucx" in error and "cannot be captured" in error
