"""Bad input and failures: each gets a clear exception at the right place, nothing hangs."""

import datetime
import os
import re
import select
import time

import pytest
import torch
import torch.distributed as dist

import smfree_pg
from harness import run_ranks, swap


def _backend():
    return dist.group.WORLD._get_backend(torch.device("cpu"))


def _bad_arguments(rank, world):
    backend = _backend()
    t = torch.zeros(4)
    checks = {
        "invalid peer": (lambda: backend.send([t], 7, 0), r"invalid peer rank 7 \(group of size 2\)"),
        "negative peer": (lambda: backend.recv([t], -3, 0), r"invalid peer rank -3"),
        "non-contiguous": (lambda: backend.send([torch.zeros(4, 4).t()], 1 - rank, 0),
                           r"needs a contiguous tensor"),
        "sparse": (lambda: backend.send([torch.eye(3).to_sparse()], 1 - rank, 0),
                   r"supports only dense \(strided\) tensors"),
        "two tensors": (lambda: backend.send([t, t], 1 - rank, 0), r"exactly one tensor, got 2"),
        "meta device": (lambda: backend.send([torch.zeros(4, device="meta")], 1 - rank, 0),
                        r"meta tensor is not supported"),
    }
    for name, (call, message) in checks.items():
        with pytest.raises(ValueError, match=message):
            call()
    # Nothing was lost: the pair still works afterwards.
    got = torch.empty(4)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, torch.full((4,), float(rank)), 1 - rank),
         dist.P2POp(dist.irecv, got, 1 - rank)])
    for work in works:
        work.wait()
    assert torch.all(got == 1 - rank)
    return sorted(checks)


def test_bad_arguments_raise_value_errors_and_lose_nothing():
    names = run_ranks(_bad_arguments, 2)
    assert names[0] == names[1] and len(names[0]) == 6


def _mismatch(rank, world, send_shape, send_dtype, recv_shape, recv_dtype):
    peer = 1 - rank
    errors = []
    for _ in range(2):  # twice: the pair stays in step after a mismatch
        try:
            if rank == 0:
                dist.send(torch.zeros(send_shape, dtype=send_dtype), peer)
            else:
                dist.recv(torch.zeros(recv_shape, dtype=recv_dtype), peer)
            errors.append(None)
        except dist.DistBackendError as error:
            errors.append(str(error))
    # A well-formed exchange still works after the failed ones.
    got = torch.empty(3)
    if rank == 0:
        dist.send(torch.tensor([1.0, 2.0, 3.0]), peer)
    else:
        dist.recv(got, peer)
        assert got.tolist() == [1.0, 2.0, 3.0]
    return errors


@pytest.mark.parametrize(
    "send, recv, names",
    [
        (((4,), torch.float32), ((8,), torch.float32), ("float32[4] (16 B)", "float32[8] (32 B)")),
        (((4,), torch.float16), ((4,), torch.bfloat16), ("float16[4] (8 B)", "bfloat16[4] (8 B)")),
    ],
    ids=["size", "dtype"],
)
def test_mismatch_fails_on_both_ranks_naming_both_sides(send, recv, names):
    results = run_ranks(_mismatch, 2, send[0], send[1], recv[0], recv[1])
    for errors in results:
        assert len(errors) == 2
        for error in errors:
            assert error is not None, "a mismatched pair must fail on both ranks"
            assert "size or dtype mismatch" in error
            assert f"rank 0 sends {names[0]}" in error and f"receives into {names[1]}" in error


def _never_matched(rank, world):
    if rank == 1:
        time.sleep(0.2)
        dist.barrier()  # rank 0 has timed out by the time this returns
        return None
    buf = torch.empty(256)
    work = dist.irecv(buf, 1, tag=9)
    time.sleep(0.3)
    table = smfree_pg.dump_pending()
    started = time.monotonic()
    with pytest.raises(dist.DistBackendError) as raised:
        work.wait()
    waited = time.monotonic() - started
    dist.barrier()
    return table, str(raised.value), waited


def test_unmatched_op_times_out_naming_op_peer_tag_bytes():
    table, error, waited = run_ranks(_never_matched, 2, group_timeout_s=2)[0]
    assert "1 pending" in table and "recv on rank 0 from rank 1" in table and "tag 9" in table
    assert re.search(r"recv on rank 0 from rank 1 \(group '0', tag 9, float32\[256\] \(1024 B\)\) "
                     r"was not matched by a send within the group timeout of 2000 ms", error), error
    assert waited < 10


def _late_partner(rank, world):
    # Rank 0's send times out; rank 1 posts its recv only afterwards and must not get the
    # abandoned data silently, nor shift later messages.
    dist.barrier()  # the barriers' Gloo group connects here, with both ranks present
    if rank == 0:
        with pytest.raises(dist.DistBackendError, match="was not matched by a recv"):
            dist.send(torch.full((4,), 1.0), 1)
        dist.barrier()
        dist.send(torch.full((4,), 2.0), 1)
        return None
    # The barrier has the group timeout too, which rank 0's send takes to expire: entering it
    # later keeps the two from racing.
    time.sleep(1.0)
    dist.barrier()
    with pytest.raises(dist.DistBackendError, match="the matching send gave up") as raised:
        dist.recv(torch.empty(4), 0)
    got = torch.empty(4)
    dist.recv(got, 0)
    return str(raised.value), got[0].item()


def test_late_partner_of_a_timed_out_send_gets_an_error_and_order_holds():
    error, value = run_ranks(_late_partner, 2, group_timeout_s=1.5)[1]
    # The sender's cancellation or its refusal of the clear-to-send may come first (they race
    # the barrier): either way the recv names itself and says why.
    assert "recv on rank 1 from rank 0" in error and "the matching send gave up" in error
    assert value == 2.0


def _swap_with_the_other_survivor(rank):
    return swap(1 - rank, torch.full((2,), float(rank)))


def _peer_dies(rank, world):
    if rank == 2:
        dist.barrier()
        os._exit(1)  # dies without a word, holding an op rank 0 waits for
    dist.barrier()
    started = time.monotonic()
    error = None
    if rank == 0:
        try:
            dist.recv(torch.empty(64), 2)
        except dist.DistBackendError as failure:
            error = str(failure)
    elapsed = time.monotonic() - started
    # The survivors still talk to each other.
    got = _swap_with_the_other_survivor(rank)
    assert torch.all(got == 1 - rank)
    if rank == 0:
        with pytest.raises(dist.DistBackendError, match="refused: its peer process"):
            dist.send(torch.empty(1), 2)
    return error, elapsed


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


@pytest.mark.parametrize("tls", ["tcp", "shm"])
def test_rank_outlives_a_peer_that_exited_after_talking_to_it(tls):
    # UCX reports a failure on an endpoint the engine has dropped: to nothing, not to freed
    # memory (it cannot force-close endpoints to same-host peers, so they stay open).
    assert run_ranks(_outlive_a_peer, 2, env={"UCX_TLS": tls}, expect_exit=(1,))[0] == (1, 1)


def test_peer_that_left_before_it_was_first_reached_is_refused_by_name():
    results = run_ranks(_peer_gone_before_first_contact, 3, group_timeout_s=20,
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
    error = run_ranks(_peer_closed_before_first_contact, 2, env=env)[0]
    assert re.search(r"send on rank 0 to rank 1 \(group '.*', tag 0, 16 B\) refused: its peer "
                     r"process \(pid \d+ on host .*\) failed: cannot reach it \(did it close its "
                     r"groups\?\): UCX ucp_ep_create failed", error), error


def test_recv_from_any_source_passes_over_a_peer_that_closed_its_groups():
    error, source, got = run_ranks(_peer_closed_before_first_contact, 3)[0]
    assert "rank 0 to rank 2" in error and "cannot reach it" in error
    assert source == 1 and got == [7.0] * 4


def test_killed_peer_fails_pending_ops_within_timeout():
    results = run_ranks(_peer_dies, 3, group_timeout_s=20, expect_exit=(2,))
    error, elapsed = results[0]
    assert error is not None and "recv on rank 0 from rank 2" in error
    assert "its peer process (pid" in error and "failed" in error
    assert elapsed < 20, f"took {elapsed:.1f} s: the group timeout, not failure detection"


def _use_after_stop(rank, world, how):
    backend = _backend()
    peer = 1 - rank
    pending = dist.irecv(torch.empty(8), peer, tag=3) if rank == 0 else None
    dist.barrier()
    getattr(backend, how)()
    if pending is not None:
        with pytest.raises(dist.DistBackendError, match=r"failed: group '0' was (aborted|shut down)"):
            pending.wait()
    state = "aborted" if how == "abort" else "shut down"
    with pytest.raises(RuntimeError, match=f"smfree: send on group '0' after it was {state}"):
        backend.send([torch.empty(8)], peer, 0)
    return True


@pytest.mark.parametrize("how", ["abort", "shutdown"])
def test_use_after_abort_or_shutdown(how):
    run_ranks(_use_after_stop, 2, how)


def _exchange_one(rank, world):
    got = torch.zeros(8)
    ops = [dist.P2POp(dist.isend, torch.full((8,), float(rank)), 1 - rank),
           dist.P2POp(dist.irecv, got, 1 - rank)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got.tolist()


@pytest.mark.parametrize("transport", ["auto", "copy_engine", "ucx"])
def test_cpu_tensors_go_over_ucx_whatever_smfree_transport_says(transport):
    results = run_ranks(_exchange_one, 2, env={"SMFREE_TRANSPORT": transport})
    assert results == [[1.0] * 8, [0.0] * 8]


def test_unknown_smfree_transport_is_refused_naming_the_choices():
    with pytest.raises(AssertionError,
                       match=r"SMFREE_TRANSPORT='nvlink' is not one of auto, copy_engine, ucx"):
        run_ranks(_exchange_one, 2, env={"SMFREE_TRANSPORT": "nvlink"})
