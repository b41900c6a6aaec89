"""Eager sends on the copy engines: a small send is copied into its receiver's memory at its
post, so its wait() returns before the receiver has posted; without a free slot it goes by
rendezvous, or, claimed eager by its receiver, is copied once the slot is empty: no post waits,
whatever the posting order and count; under one hardware queue nothing deadlocks; a receiver's
refusal or a timeout reaches the sender after its wait() returned; the rings' memory is
bounded."""

import datetime

import pytest
import torch
import torch.distributed as dist

import channels
from devices import cuda_device, rank_gpu
from harness import synchronize
from payloads import sends_then_recvs

pytestmark = pytest.mark.gpu

COPY_ENGINE = channels.COPY_ENGINE
EAGER_MAX = 16 << 20  # SMFREE_EAGER_BYTES's default


def _store():
    return dist.distributed_c10d._get_default_store()


def _warm_up(rank, dev, numel, sender=0):
    # The first send to a peer goes by rendezvous; its clear-to-send brings the eager ring.
    peer = 1 - rank
    if rank == sender:
        dist.send(torch.zeros(numel, device=dev), peer)
    else:
        dist.recv(torch.empty(numel, device=dev), peer)


def _send_returns_before_the_recv_is_posted(rank, world, numel, rounds):
    dev = cuda_device(rank)
    peer = 1 - rank
    _warm_up(rank, dev, numel, sender=0)
    _warm_up(rank, dev, numel, sender=1)
    store = _store()
    seen = []
    for r in range(rounds):
        # Both ranks send first, each waiting for its send, and only then receive: with a
        # rendezvous each send would wait for a recv that is never posted.
        mine = torch.full((numel,), float(10 * r + rank), device=dev)
        dist.send(mine, peer)
        store.set(f"sent/{r}/{rank}", "1")
        store.wait([f"sent/{r}/{peer}"])
        mine.fill_(-1.0)  # the send's wait() fenced the stream: its bytes are already taken
        got = torch.empty(numel, device=dev)
        dist.recv(got, peer)
        seen.append((got.min().item(), got.max().item()))
    synchronize(dev)
    stats = dist.group.WORLD._get_backend(dev)._stats()
    return seen, stats["eager_sends"], stats["eager_recvs"]


@pytest.mark.parametrize("connections", ["1", "8"])
@pytest.mark.parametrize("numel", [1, 64 << 10, 1 << 18, EAGER_MAX // 4],
                         ids=["4B", "256KiB", "1MiB", "16MiB"])
def test_send_wait_returns_before_its_recv_is_posted(numel, connections):
    rounds = 20
    results = COPY_ENGINE.run(_send_returns_before_the_recv_is_posted, 2, numel, rounds,
                              env={"CUDA_DEVICE_MAX_CONNECTIONS": connections})
    for rank, (seen, sends, recvs) in enumerate(results):
        peer = 1 - rank
        assert seen == [(float(10 * r + peer),) * 2 for r in range(rounds)]
        assert sends == rounds and recvs == rounds


STATS = ("eager_sends", "eager_recvs", "eager_recvs_queued_by_wait", "eager_sends_held",
         "eager_sends_by_rendezvous")


def _more_messages_than_slots(rank, world, count, numel):
    # A lane holds kEagerSlots messages. The receiver waits for its last recv first, before
    # any send is posted, its stream held by a kernel: that wait() claims every message eager
    # and queues every copy out in the lane's order, so no slot is awaited behind the copy that
    # frees it; the sends beyond the slots find them full and are held, then copied by the
    # sender's progress thread as the receiver's GPU empties them.
    dev = cuda_device(rank)
    peer = 1 - rank
    for _ in range(2):  # the lane opens (rendezvous), then its first eager message shows it
        _warm_up(rank, dev, numel)
    backend = dist.group.WORLD._get_backend(dev)
    before = backend._stats()
    store = _store()
    if rank == 0:
        store.wait(["waited"])
        payloads = [torch.full((numel,), float(i), device=dev) for i in range(count)]
        works = [dist.isend(p, peer) for p in payloads]
        for work in works:
            work.wait()
        got = None
    else:
        got = [torch.empty(numel, device=dev) for _ in range(count)]
        works = [dist.irecv(g, peer) for g in got]
        torch.cuda._sleep(500_000_000)  # keeps the slots full while the sender posts
        works[-1].wait()
        store.set("waited", "1")
        for work in reversed(works[:-1]):
            work.wait()
        got = [(g.min().item(), g.max().item()) for g in got]
    synchronize(dev)
    after = backend._stats()
    return got, {key: after[key] - before[key] for key in STATS}


@pytest.mark.parametrize("connections", ["1", "8"])
def test_more_messages_than_slots_waited_last_first(connections):
    count = 40
    sender, receiver = COPY_ENGINE.run(_more_messages_than_slots, 2, count, 4096,
                                       env={"CUDA_DEVICE_MAX_CONNECTIONS": connections})
    got, received = receiver
    _, sent = sender
    assert got == [(float(i), float(i)) for i in range(count)]
    assert sent["eager_sends"] == count and received["eager_recvs"] == count
    # The last recv's wait() claimed the lane's messages eager and queued every copy out; the
    # sends past the first slots found them full and were held, none went by rendezvous.
    assert received["eager_recvs_queued_by_wait"] == count
    assert sent["eager_sends_held"] == count - 8 and sent["eager_sends_by_rendezvous"] == 0


# The program of a user who posts everything first: 18 sends of 4 B to 64 MiB on one tag, 14
# of them eager-sized, then 18 recvs (as float32 element counts).
MIXED_18 = [1, 4 << 20, 256, 16 << 10, 8 << 20, 256 << 10, 1 << 20, 16 << 20, 2 << 20, 1,
            4 << 10, 4 << 20, 64 << 10, 8 << 20, 512 << 10, 3, 16 << 20, 2 << 20]


def _posts_before_recvs(rank, world, numels):
    # Both ranks post every send, then, once both have, every recv, then wait for the recvs
    # last first and for the sends. The receiver takes nothing before the sender's posts are
    # done: the lane's 8 slots fill, and its later eager-sized sends go by rendezvous.
    dev = cuda_device(rank)
    peer = 1 - rank
    _warm_up(rank, dev, 1, sender=0)
    _warm_up(rank, dev, 1, sender=1)
    backend = dist.group.WORLD._get_backend(dev)
    before = backend._stats()
    store = _store()

    def both_posted():
        store.set(f"posted/{rank}", "1")
        store.wait([f"posted/{peer}"])

    wrong = sends_then_recvs(rank, peer, numels, dev, once_posted=both_posted)
    after = backend._stats()
    return wrong, {key: after[key] - before[key] for key in STATS}


@pytest.mark.parametrize("connections", ["1", "8"])
@pytest.mark.parametrize("program", ["mixed-18", "100", "1000"])
def test_sends_posted_before_any_recv_never_block_their_post(program, connections):
    numels = MIXED_18 if program == "mixed-18" else [1 << (i % 19) for i in range(int(program))]
    eager = sum(1 for n in numels if 4 * n <= EAGER_MAX)
    for wrong, stats in COPY_ENGINE.run(_posts_before_recvs, 2, numels, timeout=240,
                                        env={"CUDA_DEVICE_MAX_CONNECTIONS": connections}):
        assert wrong == []
        assert stats["eager_sends"] == 8 and stats["eager_sends_held"] == 0
        assert stats["eager_sends_by_rendezvous"] == eager - 8


def _many_lanes(rank, world, tags, rounds):
    # More lanes than one per tag and group of a pipeline: every tag of two groups, with
    # any-source recvs on one tag among them, each lane posted ahead of its recvs.
    dev = cuda_device(rank)
    peer = 1 - rank
    other = dist.new_group([0, 1])
    store = _store()
    wrong = []
    for r in range(rounds):  # the first round opens the lanes
        sends = [dist.isend(torch.full((64,), float(100 * r + 10 * g + t), device=dev), peer,
                            group=group, tag=t)
                 for g, group in enumerate((None, other)) for t in range(tags) for _ in range(3)]
        store.set(f"posted/{r}/{rank}", "1")
        store.wait([f"posted/{r}/{peer}"])
        got = {}
        works = []
        for g, group in enumerate((None, other)):
            for t in range(tags):
                for i in range(3):
                    buf = torch.empty(64, device=dev)
                    anysource = g == 1 and t == 0
                    works.append(dist.irecv(buf, None if anysource else peer, group=group, tag=t))
                    got[(g, t, i)] = buf
        for work in reversed(works):
            work.wait()
        for work in sends:
            work.wait()
        wrong += [key for key, buf in got.items()
                  if not torch.all(buf == float(100 * r + 10 * key[0] + key[1]))]
    synchronize(dev)
    stats = dist.group.WORLD._get_backend(dev)._stats()
    return wrong, stats["eager_lanes"], stats["eager_sends"]


def test_many_tags_and_groups_with_any_source_recvs_all_complete():
    tags = 6
    # Small slots: every lane gets its ring within the default bound.
    for wrong, lanes, sends in COPY_ENGINE.run(_many_lanes, 2, tags, 3, timeout=180,
                                               env={"SMFREE_EAGER_BYTES": str(64 << 10)}):
        assert wrong == []
        assert lanes == 2 * tags * 2  # both groups' tags, each way: beyond 4 per sending process
        assert sends > 0


def _bounded_rings(rank, world):
    # Room for one eager ring of 8 x 1 MiB: the lane of tag 0 gets it, tag 1's is refused and
    # its sends go by rendezvous.
    dev = cuda_device(rank)
    peer = 1 - rank
    for _ in range(2):
        for tag in (0, 1):
            if rank == 0:
                for i in range(4):
                    dist.send(torch.full((1024,), float(10 * tag + i), device=dev), peer, tag=tag)
            else:
                for i in range(4):
                    buf = torch.empty(1024, device=dev)
                    dist.recv(buf, peer, tag=tag)
                    assert buf[0].item() == float(10 * tag + i)
    synchronize(dev)
    stats = dist.group.WORLD._get_backend(dev)._stats()
    import smfree_pg
    return stats["ring_bytes"], stats["eager_lanes"], smfree_pg.dump_pending()


def test_rings_stay_within_their_memory_bound_and_lanes_beyond_go_by_rendezvous():
    env = {"SMFREE_RING_MEMORY_BYTES": str(8 << 20), "SMFREE_EAGER_BYTES": str(1 << 20)}
    sender, receiver = COPY_ENGINE.run(_bounded_rings, 2, env=env)
    ring_bytes, lanes, pending = receiver
    assert ring_bytes == 8 << 20
    assert (f"rings for peers' sends: cuda:{rank_gpu(1)} 8 MiB of 8 MiB "
            "(SMFREE_RING_MEMORY_BYTES)") in pending
    assert lanes == 1  # tag 1's lane has no ring
    assert sender[0] == 0 and "rings" not in sender[2]


def _recv_returns_before_its_send_is_posted(rank, world, numel, rounds):
    dev = cuda_device(rank)
    peer = 1 - rank
    for _ in range(2):
        _warm_up(rank, dev, numel)
    store = _store()
    seen = []
    for r in range(rounds):
        if rank == 1:
            got = torch.empty(numel, device=dev)
            dist.recv(got, peer)  # returns at once: the stream waits for the bytes
            store.set(f"waited/{r}", "1")
            seen.append((got.min().item(), got.max().item()))  # synchronizes with the stream
        else:
            store.wait([f"waited/{r}"])
            dist.send(torch.full((numel,), float(r), device=dev), peer)
    synchronize(dev)
    return seen


@pytest.mark.parametrize("connections", ["1", "8"])
def test_recv_wait_returns_before_its_send_is_posted(connections):
    rounds = 12
    got = COPY_ENGINE.run(_recv_returns_before_its_send_is_posted, 2, 64 << 10, rounds,
                          env={"CUDA_DEVICE_MAX_CONNECTIONS": connections})[1]
    assert got == [(float(r), float(r)) for r in range(rounds)]


def _error_of(work):
    """A recv's error: from its wait(), or, where its wait() had already queued the copy out
    (the lane said the message was eager), from the op's end afterwards."""
    try:
        work.wait()
    except dist.DistBackendError as error:
        return str(error)
    with pytest.raises(dist.DistBackendError) as raised:
        work.synchronize()
    return str(raised.value)


def _lane_shown_eager(rank, numel):
    """Rank 0's lane to rank 1 opened, and shown eager by one message: the device, the peer and
    the store."""
    dev = cuda_device(rank)
    for _ in range(2):
        _warm_up(rank, dev, numel)
    return dev, 1 - rank, _store()


def _refused_eager_send(rank, world):
    dev, peer, store = _lane_shown_eager(rank, 4)
    if rank == 1:
        store.wait(["waited"])
        return _error_of(dist.irecv(torch.empty(8, device=dev), peer))
    work = dist.isend(torch.ones(4, device=dev), peer)
    work.wait()  # returns before the receiver has posted: the bytes are in its slot
    store.set("waited", "1")
    with pytest.raises(dist.DistBackendError) as late:
        work.synchronize()  # waits for the op's end, and raises how it ended
    with pytest.raises(dist.DistBackendError) as refused:
        dist.send(torch.ones(4, device=dev), peer)
    return str(late.value), str(refused.value)


def test_receiver_refusal_of_an_eager_send_reaches_the_sender_after_its_wait():
    (late, refused), receiver_error = COPY_ENGINE.run(_refused_eager_send, 2)
    assert "size or dtype mismatch" in receiver_error, receiver_error
    assert "rank 0 sends float32[4] (16 B) on cuda" in receiver_error, receiver_error
    assert "size or dtype mismatch" in late, late
    # The group's next call names the send that failed after its wait() returned.
    assert "failed after its wait() returned" in refused and "mismatch" in refused, refused


def _unclaimed_eager_send(rank, world):
    dev, peer, store = _lane_shown_eager(rank, 4)
    if rank == 0:
        work = dist.isend(torch.ones(4, device=dev), peer)
        work.wait()  # returns at once; nobody will receive it in time
        with pytest.raises(dist.DistBackendError) as late:
            work.synchronize()
        with pytest.raises(dist.DistBackendError) as refused:
            dist.send(torch.ones(4, device=dev), peer)
        store.set("expired", "1")
        return str(late.value), str(refused.value)
    store.wait(["expired"], datetime.timedelta(seconds=60))  # past the group timeout
    return _error_of(dist.irecv(torch.empty(4, device=dev), peer))


def _dropped_after_isend(rank, world, numel):
    # The caller drops each tensor right after isend, or replaces its `.data` (as Megatron's
    # deallocate_output_tensor does), and fresh tensors take the freed memory at once: the
    # eager copies, queued behind the caller's stream, still read the sent bytes.
    dev = cuda_device(rank)
    peer = 1 - rank
    _warm_up(rank, dev, numel)
    if rank == 0:
        works, junk = [], []
        for i in range(8):
            sent = torch.full((numel,), float(i), device=dev)
            works.append(dist.isend(sent, peer))
            sent.data = torch.empty(1, device=dev)
            junk.append(torch.full((numel,), -1.0, device=dev))
        del sent
        for work in works:
            work.wait()
        synchronize(dev)
        return None
    got = [torch.empty(numel, device=dev) for _ in range(8)]
    for buf in got:
        dist.recv(buf, peer)
    return [(g.min().item(), g.max().item()) for g in got]


def test_eager_sends_hold_the_bytes_of_tensors_dropped_after_isend():
    got = COPY_ENGINE.run(_dropped_after_isend, 2, 64 << 10)[1]
    assert got == [(float(i), float(i)) for i in range(8)]
