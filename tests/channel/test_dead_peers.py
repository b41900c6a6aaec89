"""Peers that die or leave: pending ops fail naming the peer within the failure detection's
time, survivors keep talking, nothing stays parked on a stream."""

import datetime
import os
import re
import select
import time

import pytest
import torch
import torch.distributed as dist

import channels
from harness import rank_device, swap, synchronize
from payloads import connect


def _swap_with_the_other_survivor(rank):
    return swap(1 - rank, torch.full((2,), float(rank), device=rank_device(rank)))


def _peer_dies(rank, world):
    dev = rank_device(rank)
    if rank == 2:
        dist.barrier()
        os._exit(1)  # dies without a word, holding an op rank 0 waits for
    dist.barrier()
    started = time.monotonic()
    error = None
    if rank == 0:
        try:
            dist.recv(torch.empty(64, device=dev), 2)
        except dist.DistBackendError as failure:
            error = str(failure)
    elapsed = time.monotonic() - started
    # The survivors still talk to each other.
    got = _swap_with_the_other_survivor(rank)
    assert torch.all(got == 1 - rank)
    if rank == 0:
        with pytest.raises(dist.DistBackendError, match="refused: its peer process"):
            dist.send(torch.empty(1, device=dev), 2)
    synchronize(dev)
    return error, elapsed


def test_killed_peer_fails_pending_ops_within_timeout(channel):
    results = channel.run(_peer_dies, 3, group_timeout_s=20, expect_exit=(2,))
    error, elapsed = results[0]
    assert error is not None and "recv on rank 0 from rank 2" in error
    assert "its peer process (pid" in error and "failed" in error
    assert elapsed < 20, f"took {elapsed:.1f} s: the group timeout, not failure detection"


def _await_exit(pid, timeout_s):
    # A pidfd turns readable once every thread has exited, as the engine's watch sees it.
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        readable, _, _ = select.select([fd], [], [], timeout_s)
        assert readable, f"pid {pid} did not exit"
    finally:
        os.close(fd)


def _peer_gone_before_first_contact(rank, world):
    store = dist.distributed_c10d._get_default_store()
    if rank == 2:
        store.set("pid2", str(os.getpid()))
        dist.barrier()
        os._exit(1)  # before anyone reached it
    dist.barrier()
    _await_exit(int(store.get("pid2")), 10)
    errors = []
    if rank == 0:
        for call in (lambda: dist.send(torch.ones(4), 2), lambda: dist.recv(torch.empty(4), 2)):
            with pytest.raises(dist.DistBackendError) as raised:
                call()
            errors.append(str(raised.value))
    return errors, _swap_with_the_other_survivor(rank).tolist()


def _outlive_a_peer(rank, world):
    store = dist.distributed_c10d._get_default_store()
    peer = 1 - rank
    got = swap(peer, torch.full((1 << 20,), float(rank)))
    if rank == 1:
        store.set("pid1", str(os.getpid()))
        os._exit(0)
    _await_exit(int(store.get("pid1")), 10)
    # Long enough for the engine to drop the endpoints to the dead peer and for UCX to see
    # the sockets close.
    time.sleep(2.0)
    return got.min().item(), got.max().item()


# The tests below follow UCX's own endpoints to a peer (over the transports they name): CPU
# tensors.
@pytest.mark.parametrize("tls", ["tcp", "shm"])
def test_rank_outlives_a_peer_that_exited_after_talking_to_it(tls):
    # UCX reports a failure on an endpoint the engine has dropped: to nothing, not to freed
    # memory (it cannot force-close endpoints to same-host peers, so they stay open).
    assert channels.CPU_UCX.run(_outlive_a_peer, 2, env={"UCX_TLS": tls},
                                expect_exit=(1,))[0] == (1, 1)


def test_peer_that_left_before_it_was_first_reached_is_refused_by_name():
    results = channels.CPU_UCX.run(_peer_gone_before_first_contact, 3, group_timeout_s=20,
                                   expect_exit=(2,))
    errors, got = results[0]
    assert re.search(r"send on rank 0 to rank 2 \(group '.*', tag 0, 16 B\) refused: its peer "
                     r"process \(pid \d+ on host .*\) failed: the process exited", errors[0])
    assert re.search(r"recv on rank 0 from rank 2 \(group '.*', tag 0, 16 B\) refused: its peer "
                     r"process \(pid \d+ on host .*\) failed: the process exited", errors[1])
    assert got == [1.0, 1.0] and results[1] == ([], [0.0, 0.0])


def _peer_closed_before_first_contact(rank, world):
    store = dist.distributed_c10d._get_default_store()
    if rank == world - 1:
        dist.destroy_process_group()  # its engine, and the shared memory UCX offered, are gone
        store.set("closed", "1")
        store.wait(["checked"], datetime.timedelta(seconds=30))  # alive while the others try
        return None
    store.get("closed")
    result = None
    if rank == 0:
        with pytest.raises(dist.DistBackendError) as raised:
            dist.send(torch.ones(4), world - 1)
        result = str(raised.value)
        if world == 3:
            # A recv from any source passes the closed rank over and takes rank 1's message.
            got = torch.empty(4)
            result = (result, dist.recv(got), got.tolist())
        store.set("checked", "1")
    else:
        dist.send(torch.full((4,), 7.0), 0)  # returns once rank 0 has taken it
    return result


@pytest.mark.parametrize("env", [{"UCX_TLS": "sm,self"}, {"UCX_TLS": "tcp"}], ids=["shm", "tcp"])
def test_peer_that_closed_its_groups_before_it_was_first_reached_is_named(env):
    # UCX needs the peer's shared memory segments, or its listening socket over TCP.
    error = channels.CPU_UCX.run(_peer_closed_before_first_contact, 2, env=env)[0]
    assert re.search(r"send on rank 0 to rank 1 \(group '.*', tag 0, 16 B\) refused: its peer "
                     r"process \(pid \d+ on host .*\) failed: cannot reach it \(did it close its "
                     r"groups\?\): UCX ucp_ep_create failed", error), error


def test_recv_from_any_source_passes_over_a_peer_that_closed_its_groups():
    error, source, got = channels.CPU_UCX.run(_peer_closed_before_first_contact, 3)[0]
    assert "rank 0 to rank 2" in error and "cannot reach it" in error
    assert source == 1 and got == [7.0] * 4


def _peer_dies_with_its_copy_queued(rank, world, numel, staged):
    dev = rank_device(rank)
    connect(rank, dev)
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


@pytest.mark.parametrize("cuda_channel", channels.params(channels.COPY_ENGINE))
@pytest.mark.parametrize("numel,staged", [(1 << 24, False), (1 << 22, True)],
                         ids=["direct-64MiB", "staged-16MiB"])
def test_dead_peer_leaves_no_stream_parked(cuda_channel, numel, staged):
    # Eager slots of 8 MiB leave the 16 MiB send to staging (slots take up to 16 MiB by default),
    # turned on: off by default, where copies within one GPU bounce.
    env = {"SMFREE_EAGER_BYTES": str(8 << 20), "SMFREE_STAGING_BYTES": str(16 << 20)} \
        if staged else None
    waited, marker, (error, refusal), staged_recvs = cuda_channel.run(
        _peer_dies_with_its_copy_queued, 2, numel, staged, env=env, group_timeout_s=60,
        expect_exit=(1,))[0]
    assert waited < 30 and marker == 1.0
    assert error and "its peer process" in error
    # Its wait() had returned, so the tensor's wrong bytes refuse the group's next call.
    assert refusal and "smfree: recv on rank 0 from any rank" in refusal, refusal
    assert "failed after its wait() returned, so its tensor holds wrong bytes" in refusal, refusal
    assert "its peer process" in refusal, refusal
    assert staged_recvs == (1 if staged else 0)


def _peer_dies_before_its_stream_is_ready(rank, world):
    dev = rank_device(rank)
    connect(rank, dev)
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


@pytest.mark.parametrize("cuda_channel", channels.CUDA_OVER_UCX)
def test_peer_killed_mid_transfer_fails_the_pending_recv(cuda_channel):
    waited, returned, error = cuda_channel.run(_peer_dies_before_its_stream_is_ready, 2,
                                               group_timeout_s=120, expect_exit=(1,))[0]
    assert error and "its peer process" in error, error
    # Staged through host memory, the recv is parked: wait() returns before the bytes come,
    # and the failure refuses the next call on the group.
    assert returned == cuda_channel.host_relayed, error
    if cuda_channel.host_relayed:
        assert "failed after its wait() returned, so its tensor holds wrong bytes" in error, error
        assert "smfree: recv on rank 0 from any rank" in error, error
    assert waited < 60
