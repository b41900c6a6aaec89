"""Pairs that cannot match: size, dtype, device or channel mismatches fail on both ranks naming
both sides; unmatched ops time out naming themselves; a send's late partner is told why."""

import re
import time

import pytest
import torch
import torch.distributed as dist

import smfree_pg
from devices import cuda_device
from harness import rank_device, run_ranks, synchronize

# Sends that wait for their receiver on every channel (no eager sends on the copy engines).
RENDEZVOUS = {"SMFREE_EAGER_BYTES": "0"}


def _mismatch(rank, world, send_shape, send_dtype, recv_shape, recv_dtype):
    dev = rank_device(rank)
    peer = 1 - rank
    errors = []
    for _ in range(2):  # twice: the pair stays in step after a mismatch
        try:
            if rank == 0:
                dist.send(torch.zeros(send_shape, dtype=send_dtype, device=dev), peer)
            else:
                dist.recv(torch.zeros(recv_shape, dtype=recv_dtype, device=dev), peer)
            errors.append(None)
        except dist.DistBackendError as error:
            errors.append(str(error))
        synchronize(dev)  # the failed op left no stream parked
    # A well-formed exchange still works after the failed ones.
    got = torch.empty(3, device=dev)
    if rank == 0:
        dist.send(torch.tensor([1.0, 2.0, 3.0], device=dev), peer)
    else:
        dist.recv(got, peer)
        assert got.tolist() == [1.0, 2.0, 3.0]
    synchronize(dev)
    return errors


@pytest.mark.parametrize(
    "send, recv, names",
    [
        (((4,), torch.float32), ((8,), torch.float32), ("float32[4] (16 B)", "float32[8] (32 B)")),
        (((4,), torch.float16), ((4,), torch.bfloat16), ("float16[4] (8 B)", "bfloat16[4] (8 B)")),
    ],
    ids=["size", "dtype"],
)
def test_mismatch_fails_on_both_ranks_naming_both_sides(channel, send, recv, names):
    # Rendezvous sends: their wait() sees the receiver's refusal. (An eager send's wait()
    # returns first; tests/cuda/test_eager.py shows where its refusal goes.)
    results = channel.run(_mismatch, 2, send[0], send[1], recv[0], recv[1], env=RENDEZVOUS)
    where = " on cuda" if channel.cuda else ""
    for errors in results:
        assert len(errors) == 2
        for error in errors:
            assert error is not None, "a mismatched pair must fail on both ranks"
            assert "size or dtype mismatch" in error
            assert f"rank 0 sends {names[0]}{where}" in error, error
            assert f"receives into {names[1]}{where}" in error, error


def _never_matched(rank, world):
    dev = rank_device(rank)
    # The barriers' group connects now, under no timeout of its own: rank 0 reaches the next
    # barrier only once its 2 s group timeout has passed.
    dist.barrier()
    if rank == 1:
        time.sleep(0.2)
        dist.barrier()  # rank 0 has timed out by the time this returns
        return None
    buf = torch.empty(256, device=dev)
    work = dist.irecv(buf, 1, tag=9)
    time.sleep(0.3)
    table = smfree_pg.dump_pending()
    started = time.monotonic()
    with pytest.raises(dist.DistBackendError) as raised:
        work.wait()
    waited = time.monotonic() - started
    dist.barrier()
    return table, str(raised.value), waited


def test_unmatched_op_times_out_naming_op_peer_tag_bytes(channel):
    table, error, waited = channel.run(_never_matched, 2, group_timeout_s=2)[0]
    assert "1 pending" in table and "recv on rank 0 from rank 1" in table and "tag 9" in table
    where = " on cuda" if channel.cuda else ""
    assert re.search(r"recv on rank 0 from rank 1 \(group '0', tag 9, float32\[256\] \(1024 B\)"
                     + where + r"\) was not matched by a send within the group timeout of "
                     r"2000 ms", error), error
    assert waited < 10


def _late_partner(rank, world):
    # Rank 0's send times out; rank 1 posts its recv only afterwards and must not get the
    # abandoned data silently, nor shift later messages.
    dev = rank_device(rank)
    dist.barrier()  # the barriers' group connects here, with both ranks present
    if rank == 0:
        with pytest.raises(dist.DistBackendError, match="was not matched by a recv"):
            dist.send(torch.full((4,), 1.0, device=dev), 1)
        dist.barrier()
        dist.send(torch.full((4,), 2.0, device=dev), 1)
        synchronize(dev)
        return None
    # The barrier has the group timeout too, which rank 0's send takes to expire: entering it
    # later keeps the two from racing.
    time.sleep(1.0)
    dist.barrier()
    with pytest.raises(dist.DistBackendError, match="the matching send gave up") as raised:
        dist.recv(torch.empty(4, device=dev), 0)
    got = torch.empty(4, device=dev)
    dist.recv(got, 0)
    return str(raised.value), got[0].item()


def test_late_partner_of_a_timed_out_send_gets_an_error_and_order_holds(channel):
    error, value = channel.run(_late_partner, 2, group_timeout_s=1.5, env=RENDEZVOUS)[1]
    # The sender's cancellation or its refusal of the clear-to-send may come first (they race
    # the barrier): either way the recv names itself and says why.
    assert "recv on rank 1 from rank 0" in error and "the matching send gave up" in error
    assert value == 2.0


def _send_once(rank, world, from_cuda):
    dev = cuda_device(rank)
    try:
        if rank == 0:
            dist.send(torch.ones(1024, device=dev if from_cuda else "cpu"), 1)
        else:
            dist.recv(torch.zeros(1024, device=dev), 0)
        return None
    except dist.DistBackendError as error:
        return str(error)


def test_cpu_send_into_cuda_recv_fails_on_both_ranks(cuda_channel):
    for error in cuda_channel.run(_send_once, 2, False, group_timeout_s=30):
        assert error and "device mismatch" in error and "on cuda" in error, error


@pytest.mark.gpu
def test_ranks_on_different_transports_fail_on_both_ranks():
    errors = run_ranks(_send_once, 2, True, cuda=True, group_timeout_s=30,
                       rank_env={0: {"SMFREE_CHANNEL": "ucx"},
                                 1: {"SMFREE_CHANNEL": "copy_engine"}})
    for error in errors:
        assert error and "channel mismatch" in error, error
        assert "over UCX" in error and "over the copy engines" in error, error
