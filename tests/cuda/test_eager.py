"""Eager sends on the copy engines: a small send is copied into its receiver's memory at its
post, so its wait() returns before the receiver has posted; without a free slot it waits for
the receiver as before; under one hardware queue nothing deadlocks; a receiver's refusal or a
timeout reaches the sender after its wait() returned."""

import datetime

import pytest
import torch
import torch.distributed as dist

import channels
from harness import synchronize

pytestmark = pytest.mark.gpu

COPY_ENGINE = channels.COPY_ENGINE
EAGER_MAX = 8 << 20  # SMFREE_EAGER_BYTES's default


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
    dev = torch.device("cuda", rank)
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
                         ids=["4B", "256KiB", "1MiB", "8MiB"])
def test_send_wait_returns_before_its_recv_is_posted(numel, connections):
    COPY_ENGINE.skip_unless_ranks(2)
    rounds = 20
    results = COPY_ENGINE.run(_send_returns_before_the_recv_is_posted, 2, numel, rounds,
                              env={"CUDA_DEVICE_MAX_CONNECTIONS": connections})
    for rank, (seen, sends, recvs) in enumerate(results):
        peer = 1 - rank
        assert seen == [(float(10 * r + peer),) * 2 for r in range(rounds)]
        assert sends == rounds and recvs == rounds


def _more_messages_than_slots(rank, world, count, numel):
    # A lane holds kEagerSlots messages: the sender's posts beyond them wait for the receiver
    # to empty slots. The receiver waits for its last recv first, before any send is posted:
    # that wait() queues every copy out in the lane's order, so no slot is awaited behind the
    # copy that frees it.
    dev = torch.device("cuda", rank)
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
        works[-1].wait()
        store.set("waited", "1")
        for work in reversed(works[:-1]):
            work.wait()
        got = [(g.min().item(), g.max().item()) for g in got]
    synchronize(dev)
    after = backend._stats()
    return got, {key: after[key] - before[key]
                 for key in ("eager_sends", "eager_recvs", "eager_recvs_queued_by_wait")}


@pytest.mark.parametrize("connections", ["1", "8"])
def test_more_messages_than_slots_waited_last_first(connections):
    COPY_ENGINE.skip_unless_ranks(2)
    count = 40
    sender, receiver = COPY_ENGINE.run(_more_messages_than_slots, 2, count, 4096,
                                       env={"CUDA_DEVICE_MAX_CONNECTIONS": connections})
    got, received = receiver
    _, sent = sender
    assert got == [(float(i), float(i)) for i in range(count)]
    assert sent["eager_sends"] == count and received["eager_recvs"] == count
    # The last recv's wait() found the lane eager, and queued every copy out itself.
    assert received["eager_recvs_queued_by_wait"] == count


def _recv_returns_before_its_send_is_posted(rank, world, numel, rounds):
    dev = torch.device("cuda", rank)
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
    COPY_ENGINE.skip_unless_ranks(2)
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
    dev = torch.device("cuda", rank)
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
    COPY_ENGINE.skip_unless_ranks(2)
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
    dev = torch.device("cuda", rank)
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
    COPY_ENGINE.skip_unless_ranks(2)
    got = COPY_ENGINE.run(_dropped_after_isend, 2, 64 << 10)[1]
    assert got == [(float(i), float(i)) for i in range(8)]
