"""Collectives on the copy engines: all-gather (into a tensor, in place as FSDP2 calls it, into a
list, coalesced), all-to-all (equal and uneven splits, lists), broadcast, gather and scatter of
CUDA tensors between ranks of one host give NCCL's bytes (where ranks share a GPU, which NCCL
refuses, the bytes computed from the inputs), run on the copy engines (the group
counts them), follow stream order with async_op, let a rank's wait() return before the other
ranks post (collective lanes: the later rank's post queues the copy), replay inside CUDA graphs
with no kernel node, launch no kernel; bad calls are refused naming the op and post nothing; a
rank that never joins fails the others' collective at the group timeout, naming it; one that dies
fails it within the failure detection's time, and later calls at once; calls with pieces under
SMFREE_COLLECTIVE_MIN_BYTES go to NCCL."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import channels
from cuda_graphs import new_graph, node_types
from cuda_profile import kernels_launched
from devices import cuda_device, gpu_count, ranks_share_a_gpu
from payloads import pattern

pytestmark = pytest.mark.gpu

COPY_ENGINE = channels.COPY_ENGINE
# Every collective on the copy engines, whatever its size (the defaults keep some on NCCL).
ALL_ON = {"SMFREE_COLLECTIVES": "all", "SMFREE_COLLECTIVE_MIN_BYTES": "0"}
DTYPES = [torch.bfloat16, torch.int64]
NUMELS = [1, 1000, 1 << 20]
NCCL_REFUSES_SHARING = "runs collectives on NCCL, which refuses two ranks on one GPU"


def _world():
    """One rank per GPU, up to 4; on one GPU, 3 ranks sharing it."""
    gpus = gpu_count()
    return min(gpus, 4) if gpus >= 2 else 3


def _uneven(src, dst):
    """Rows rank `src` sends rank `dst` in the uneven all-to-all: some are 0."""
    return (src + 2 * dst) % 3


def _all_gathers(out, rank, world, dev, group):
    for dtype in DTYPES:
        for numel in NUMELS:
            mine = pattern(numel, dtype, rank, dev)
            flat = torch.empty(numel * world, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(flat, mine, group=group)
            out[f"all_gather_into_tensor {dtype} {numel}"] = flat
            # In place, as FSDP2 calls it: the input is this rank's piece of the output.
            inplace = torch.zeros(numel * world, dtype=dtype, device=dev)
            piece = inplace.narrow(0, rank * numel, numel)
            piece.copy_(mine)
            dist.all_gather_into_tensor(inplace, piece, group=group)
            out[f"all_gather_into_tensor in place {dtype} {numel}"] = inplace
            pieces = [torch.empty(numel, dtype=dtype, device=dev) for _ in range(world)]
            dist.all_gather(pieces, mine, group=group)
            out[f"all_gather {dtype} {numel}"] = torch.stack(pieces)
    # Coalesced, as torch's coalescing manager calls it: with a device (inside a coalescing
    # block) and without.
    for device in (dev, None):
        ins = [pattern(n, torch.float32, rank + 7, dev) for n in (10, 3000)]
        outs = [torch.empty(t.numel() * world, device=dev) for t in ins]
        with dist._coalescing_manager(group=group, device=device, async_ops=True) as cm:
            for o, i in zip(outs, ins):
                dist.all_gather_into_tensor(o, i, group=group)
        cm.wait()
        out[f"coalesced all_gather_into_tensor, device {device}"] = torch.cat(outs)


def _all_to_alls(out, rank, world, dev, group):
    for numel in NUMELS:
        send = pattern(numel * world, torch.float32, rank, dev)
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=group)
        out[f"all_to_all_single {numel}"] = got
    width = 5
    ins = [_uneven(rank, p) for p in range(world)]
    outs = [_uneven(p, rank) for p in range(world)]
    send = pattern(sum(ins) * width, torch.float32, rank, dev).view(-1, width)
    got = torch.full((sum(outs), width), -1.0, device=dev)
    dist.all_to_all_single(got, send, outs, ins, group=group)
    out["all_to_all_single uneven"] = got
    sends = [pattern((rank + p + 1) * 3, torch.int64, 10 * rank + p, dev) for p in range(world)]
    gots = [torch.empty((p + rank + 1) * 3, dtype=torch.int64, device=dev) for p in range(world)]
    dist.all_to_all(gots, sends, group=group)
    out["all_to_all"] = torch.cat(gots)


def _rooted(out, rank, world, dev, group):
    t = pattern(1 << 18, torch.float32, rank, dev)
    dist.broadcast(t, src=world - 1, group=group)
    out["broadcast"] = t
    root = 1 % world
    mine = pattern(1000, torch.bfloat16, rank, dev)
    pieces = [torch.empty_like(mine) for _ in range(world)] if rank == root else None
    dist.gather(mine, pieces, dst=root, group=group)
    out["gather"] = torch.stack(pieces) if rank == root else torch.zeros(0, device=dev)
    got = torch.empty(777, device=dev)
    dist.scatter(got, [pattern(777, torch.float32, 100 + p, dev) for p in range(world)]
                 if rank == 0 else None, src=0, group=group)
    out["scatter"] = got


def _every_collective(rank, world, group):
    dev = cuda_device(rank)
    out = {}
    _all_gathers(out, rank, world, dev, group)
    _all_to_alls(out, rank, world, dev, group)
    _rooted(out, rank, world, dev, group)
    torch.cuda.synchronize()
    return {name: t.cpu() for name, t in out.items()}


def _expected(rank, world, dev):
    """What `_every_collective` gives rank `rank`, computed from the inputs (made on `dev`, the
    rank's GPU, as the ranks make them)."""
    out = {}
    for dtype in DTYPES:
        for numel in NUMELS:
            pieces = [pattern(numel, dtype, r, dev) for r in range(world)]
            out[f"all_gather_into_tensor {dtype} {numel}"] = torch.cat(pieces)
            out[f"all_gather_into_tensor in place {dtype} {numel}"] = torch.cat(pieces)
            out[f"all_gather {dtype} {numel}"] = torch.stack(pieces)
    for device in (dev, None):
        out[f"coalesced all_gather_into_tensor, device {device}"] = torch.cat(
            [pattern(n, torch.float32, r + 7, dev) for n in (10, 3000) for r in range(world)])
    for numel in NUMELS:
        out[f"all_to_all_single {numel}"] = torch.cat(
            [pattern(numel * world, torch.float32, p, dev)[rank * numel:(rank + 1) * numel]
             for p in range(world)])
    width = 5
    rows = []
    for p in range(world):
        sent = pattern(sum(_uneven(p, q) for q in range(world)) * width, torch.float32, p, dev)
        first = sum(_uneven(p, q) for q in range(rank))
        rows.append(sent.view(-1, width)[first:first + _uneven(p, rank)])
    out["all_to_all_single uneven"] = torch.cat(rows)
    out["all_to_all"] = torch.cat([pattern((p + rank + 1) * 3, torch.int64, 10 * p + rank, dev)
                                   for p in range(world)])
    out["broadcast"] = pattern(1 << 18, torch.float32, world - 1, dev)
    out["gather"] = (torch.stack([pattern(1000, torch.bfloat16, r, dev) for r in range(world)])
                     if rank == 1 % world else torch.zeros(0))
    out["scatter"] = pattern(777, torch.float32, 100 + rank, dev)
    return {name: t.cpu() for name, t in out.items()}


def _against_reference(rank, world, reference):
    """smfree's results beside NCCL's where each rank has its own GPU ("nccl"), else beside
    the bytes computed from the inputs ("computed": NCCL refuses two ranks on one GPU)."""
    ours = _every_collective(rank, world, None)
    dev = cuda_device(rank)
    if reference == "nccl":
        theirs = _every_collective(rank, world, dist.new_group(backend="nccl"))
    else:
        theirs = _expected(rank, world, dev)
    assert sorted(theirs) == sorted(ours), "the reference names other results"
    different = sorted(name for name in ours if not torch.equal(ours[name], theirs[name]))
    expected = torch.cat([pattern(1000, torch.bfloat16, r, dev) for r in range(world)]).cpu()
    gathered = ours["all_gather_into_tensor torch.bfloat16 1000"]
    stats = dist.group.WORLD._get_backend(dev)._stats()
    return different, torch.equal(gathered, expected), stats["collectives_on_copy_engines"]


@pytest.mark.parametrize("lanes", ["1", "0"])
def test_collectives_give_the_reference_bytes_on_the_copy_engines(lanes):
    world = _world()
    reference = "computed" if ranks_share_a_gpu(world) else "nccl"
    env = dict(ALL_ON, SMFREE_COLLECTIVE_LANES=lanes)  # by collective lanes, or by rendezvous
    for rank, (different, gathered, counted) in enumerate(
            COPY_ENGINE.run(_against_reference, world, reference, timeout=180, env=env)):
        assert different == [], f"rank {rank}: differs from the {reference} bytes: {different}"
        assert gathered, f"rank {rank}: all_gather_into_tensor misplaced bytes"
        # 6 all-gathers per (dtype, size), 2 coalesced, 4 all-to-alls, broadcast, gather, scatter
        assert counted == 3 * len(DTYPES) * len(NUMELS) + 2 + len(NUMELS) + 2 + 3


def _in_stream_order(rank, world):
    dev = cuda_device(rank)
    numel = 1 << 20
    mine = torch.zeros(numel, device=dev)
    flat = torch.zeros(numel * world, device=dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the input is written late on the stream
    mine.fill_(float(rank + 1))
    work = dist.all_gather_into_tensor(flat, mine, async_op=True)
    work.wait()
    seen = flat.view(world, numel)[:, ::4096].amax(dim=1).tolist()  # queued after wait()
    send = torch.zeros(numel * world, device=dev)
    got = torch.zeros_like(send)
    torch.cuda._sleep(50_000_000)
    send.fill_(float(10 * rank))
    work = dist.all_to_all_single(got, send, async_op=True)
    work.wait()
    seen_a2a = got.view(world, numel)[:, ::4096].amin(dim=1).tolist()
    return seen, seen_a2a


def test_collectives_follow_stream_order():
    world = _world()
    for seen, seen_a2a in COPY_ENGINE.run(_in_stream_order, world, env=ALL_ON):
        assert seen == [float(r + 1) for r in range(world)]
        assert seen_a2a == [float(10 * r) for r in range(world)]


LANE_STATS = ("collective_first", "collective_second", "collective_by_rendezvous")


def _late_partners(rank, world):
    # Rank 0 posts an all-gather and an all-to-all and returns from their wait()s before any
    # other rank posts (the store holds the others back, so a wait() that waited for them would
    # hang): its pieces are first, and the others' posts queue every copy. Rank 0's stream
    # reaches the posts 200 ms late, after writing its inputs and clearing its outputs, so those
    # copies are right only if they wait for its stream.
    dev = cuda_device(rank)
    backend = dist.group.WORLD._get_backend(dev)
    numel = 1 << 20
    before = backend._stats()
    if rank == 0:
        torch.cuda._sleep(200_000_000)
    mine = pattern(numel, torch.float32, rank, dev)
    flat = torch.full((numel * world,), -1.0, device=dev)
    send = pattern(numel * world, torch.float32, 50 + rank, dev)
    got = torch.full_like(send, -1.0)
    store = dist.distributed_c10d._get_default_store()
    if rank != 0:
        store.wait(["rank 0 waited"])
    dist.all_gather_into_tensor(flat, mine)
    dist.all_to_all_single(got, send)
    if rank == 0:
        store.set("rank 0 waited", "1")
    torch.cuda.synchronize()
    after = backend._stats()
    gathered = torch.cat([pattern(numel, torch.float32, r, dev) for r in range(world)])
    exchanged = torch.cat([pattern(numel * world, torch.float32, 50 + r, dev)
                           .narrow(0, rank * numel, numel) for r in range(world)])
    counts = {key: after[key] - before[key] for key in LANE_STATS}
    return torch.equal(flat, gathered), torch.equal(got, exchanged), counts


def test_a_collective_wait_returns_before_the_other_ranks_post():
    world = _world()
    results = COPY_ENGINE.run(_late_partners, world, timeout=120, env=ALL_ON)
    pieces = 4 * (world - 1)  # each call: a send to and a recv from every other rank
    for rank, (gathered, exchanged, counts) in enumerate(results):
        assert gathered and exchanged, f"rank {rank}: wrong bytes"
        assert counts["collective_by_rendezvous"] == 0, f"rank {rank}: {counts}"
        assert counts["collective_first"] + counts["collective_second"] == pieces, counts
        if rank == 0:
            assert counts["collective_first"] == pieces, counts
        else:
            assert counts["collective_second"] >= 4, counts  # its pieces with rank 0


def _captured(rank, world, replays):
    dev = cuda_device(rank)
    numel = 1 << 18
    mine = torch.zeros(numel, device=dev)
    flat = torch.zeros(numel * world, device=dev)
    send = torch.zeros(numel * world, device=dev)
    got = torch.zeros_like(send)
    bcast = torch.zeros(1000, device=dev)

    def ops():
        dist.all_gather_into_tensor(flat, mine)
        dist.all_to_all_single(got, send)
        dist.broadcast(bcast, src=0)

    ops()  # warm-up, uncaptured
    graph, kept = new_graph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        ops()
    nodes = dict(node_types(graph)) if kept else None
    seen = []
    for r in range(replays):
        mine.fill_(float(100 * r + rank))
        send.fill_(float(100 * r + 10 * rank))
        bcast.fill_(float(r + 1) if rank == 0 else -1.0)
        graph.replay()
        torch.cuda.synchronize()
        seen.append((flat.view(world, numel).amax(dim=1).tolist(),
                     got.view(world, numel).amin(dim=1).tolist(), bcast.amin().item()))
    return seen, nodes


def test_collectives_replay_in_cuda_graphs_with_no_kernel():
    world = _world()
    replays = 3
    for seen, nodes in COPY_ENGINE.run(_captured, world, replays, timeout=120, env=ALL_ON):
        assert seen == [([float(100 * r + p) for p in range(world)],
                         [float(100 * r + 10 * p) for p in range(world)], float(r + 1))
                        for r in range(replays)]
        if nodes is not None:
            assert nodes.get("kernel", 0) == 0, nodes
            assert nodes.get("memcpy", 0) > 0, nodes


def _kernels_of_collectives(rank, world):
    dev = cuda_device(rank)
    mine = torch.ones(1 << 20, device=dev)
    flat = torch.empty((1 << 20) * world, device=dev)
    send = torch.ones((1 << 18) * world, device=dev)
    got = torch.empty_like(send)

    def ops():
        dist.all_gather_into_tensor(flat, mine)
        dist.all_to_all_single(got, send)
        dist.broadcast(mine, src=0)

    ops()
    torch.cuda.synchronize()
    return sorted(set(kernels_launched(ops, 5)))


@pytest.mark.parametrize("setting", [
    "all", pytest.param("off", marks=pytest.mark.distinct_gpus(NCCL_REFUSES_SHARING))])
def test_collectives_launch_no_kernel(setting):
    world = _world()
    env = ALL_ON if setting == "all" else {"SMFREE_COLLECTIVES": "off"}
    for kernels in COPY_ENGINE.run(_kernels_of_collectives, world, env=env):
        if setting == "all":
            assert kernels == [], f"collectives launched kernels: {kernels}"
        else:  # the control: NCCL's kernels show, so the profiler sees kernels here
            assert any("nccl" in name.lower() for name in kernels), kernels


def _refusals(rank, world):
    dev = cuda_device(rank)
    mine = torch.full((8,), float(rank), device=dev)
    errors = []
    calls = [
        lambda: dist.all_gather_into_tensor(torch.empty(8 * world + 1, device=dev), mine),
        lambda: dist.all_to_all_single(torch.empty(world, device=dev),
                                       torch.empty(world, device=dev), [1] * world,
                                       [2] + [1] * (world - 1)),
        lambda: dist.all_gather_into_tensor(torch.empty(16, 8 * world, device=dev).t(),
                                            torch.empty(16, device=dev)),
        lambda: dist.all_gather([torch.empty(8, device=dev)] * (world - 1), mine),
    ]
    for call in calls:
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    flat = torch.empty(8 * world, device=dev)
    dist.all_gather_into_tensor(flat, mine)  # nothing was posted: the next call is right
    return errors, flat.view(world, 8)[:, 0].tolist()


def test_bad_collectives_are_refused_naming_the_op_and_post_nothing():
    world = _world()
    for errors, gathered in COPY_ENGINE.run(_refusals, world, env=ALL_ON):
        assert None not in errors, errors
        assert "all_gather_into_tensor" in errors[0] and "elements" in errors[0]
        assert "all_to_all_single" in errors[1] and "add up" in errors[1]
        assert "contiguous" in errors[2]
        assert "all_gather takes" in errors[3] and f"not {world - 1}" in errors[3]
        assert gathered == [float(r) for r in range(world)]


def _one_rank_missing(rank, world):
    dev = cuda_device(rank)
    store = dist.distributed_c10d._get_default_store()
    mine = torch.ones(1 << 10, device=dev)
    flat = torch.empty((1 << 10) * world, device=dev)
    dist.all_gather_into_tensor(flat, mine)  # connects every rank
    torch.cuda.synchronize()
    if rank == world - 1:
        store.wait(["collectives/failed"])  # alive, but never joins
        return None
    start = time.monotonic()
    try:
        # Its wait() returns at once (collective lanes: the other ranks' posts queue the
        # copies); the group timeout fails it, which releases the stream, and the group's next
        # call raises.
        dist.all_gather_into_tensor(flat, mine)
        torch.cuda.synchronize()
        dist.all_gather_into_tensor(flat, mine)
        error = None
    except RuntimeError as e:
        error = str(e)
    elapsed = time.monotonic() - start
    store.add("collectives/failures", 1)
    if store.add("collectives/failures", 0) == world - 1:
        store.set("collectives/failed", "1")
    return error, elapsed


def test_a_rank_that_never_joins_fails_the_collective_at_the_group_timeout():
    world = _world()
    results = COPY_ENGINE.run(_one_rank_missing, world, group_timeout_s=5, timeout=60,
                              env=ALL_ON)
    for rank, result in enumerate(results[:-1]):
        error, elapsed = result
        assert error is not None, f"rank {rank}: the all-gather did not fail"
        assert "all_gather_into_tensor" in error and f"rank {world - 1}" in error, error
        assert 4 < elapsed < 20, elapsed


def _one_rank_dies(rank, world):
    dev = cuda_device(rank)
    mine = torch.ones(1 << 20, device=dev)
    flat = torch.empty((1 << 20) * world, device=dev)
    dist.all_gather_into_tensor(flat, mine)  # connects every rank
    torch.cuda.synchronize()
    dist.barrier()
    if rank == world - 1:
        os._exit(1)  # dies without a word before the others' next all-gather
    errors = []
    start = time.monotonic()
    # The first call's wait() returns at once (collective lanes); the death fails it, and the
    # call after raises. The one after that is refused at once.
    for calls in (2, 1):
        try:
            for _ in range(calls):
                dist.all_gather_into_tensor(flat, mine)
                torch.cuda.synchronize()
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
        errors.append(time.monotonic() - start)
    return errors


def test_a_rank_that_dies_fails_the_collective_within_failure_detection():
    world = _world()
    results = COPY_ENGINE.run(_one_rank_dies, world, group_timeout_s=30, timeout=90,
                              env=ALL_ON, expect_exit=(world - 1,))
    for rank, result in enumerate(results[:-1]):
        first, first_s, second, second_s = result
        for error in (first, second):
            assert error is not None, f"rank {rank}: an all-gather with a dead rank ended well"
            assert "all_gather_into_tensor" in error, error
            assert "its peer process" in error, error
        assert first_s < 30, f"took {first_s:.1f} s: the group timeout, not failure detection"
        assert second_s - first_s < 5, "the call after the death waited instead of failing"


def _by_size(rank, world):
    dev = cuda_device(rank)
    stats = dist.group.WORLD._get_backend(dev)._stats
    counted = []
    for numel in (256, 2048):  # 1 KiB and 8 KiB pieces, around the 4 KiB setting
        mine = torch.full((numel,), float(rank), device=dev)
        flat = torch.empty(numel * world, device=dev)
        dist.all_gather_into_tensor(flat, mine)
        assert flat.view(world, numel)[:, 0].tolist() == [float(r) for r in range(world)]
        counted.append(stats()["collectives_on_copy_engines"])
    # Uneven splits: no size every rank sees alike, so the setting of the op alone decides.
    ins = [_uneven(rank, p) for p in range(world)]
    outs = [_uneven(p, rank) for p in range(world)]
    got = torch.empty(sum(outs), device=dev)
    dist.all_to_all_single(got, torch.full((sum(ins),), float(rank), device=dev), outs, ins)
    counted.append(stats()["collectives_on_copy_engines"])
    return counted, got.tolist() == [float(p) for p in range(world) for _ in range(outs[p])]


@pytest.mark.distinct_gpus(NCCL_REFUSES_SHARING)
def test_pieces_under_the_min_bytes_go_to_nccl():
    world = _world()
    env = {"SMFREE_COLLECTIVES": "all", "SMFREE_COLLECTIVE_MIN_BYTES": "4096"}
    for counted, right in COPY_ENGINE.run(_by_size, world, env=env):
        assert counted == [0, 1, 2] and right
