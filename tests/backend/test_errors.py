"""Bad input at the call: each gets a clear exception at the right place and loses nothing;
use after abort or shutdown; which channel CPU tensors take."""

import pytest
import torch
import torch.distributed as dist

from devices import cuda_device
from harness import run_ranks, swap


def _backend():
    return dist.group.WORLD._get_backend(torch.device("cpu"))


def _bad_arguments(rank, world):
    backend = _backend()
    t = torch.zeros(4)
    checks = {
        "invalid peer": (lambda: backend.send([t], 7, 0),
                         r"send on rank \d to invalid rank 7 \(group '0' of size 2, tag 0, 16 B\)"),
        "negative peer": (lambda: backend.recv([t], -3, 0),
                          r"recv on rank \d from invalid rank -3 \(group '0' of size 2"),
        "non-contiguous": (lambda: backend.send([torch.zeros(4, 4).t()], 1 - rank, 0),
                           r"needs a contiguous tensor"),
        "sparse": (lambda: backend.send([torch.eye(3).to_sparse()], 1 - rank, 0),
                   r"supports only dense \(strided\) tensors"),
        "two tensors": (lambda: backend.send([t, t], 1 - rank, 0), r"exactly one tensor, got 2"),
        "meta device": (lambda: backend.send([torch.zeros(4, device="meta")], 1 - rank, 0),
                        r"meta tensor is not supported"),
        "negative tag": (lambda: backend.send([t], 1 - rank, -1),
                         r"tag -1: tags below 0 are smfree's own"),
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
    assert names[0] == names[1] and len(names[0]) == 7


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


@pytest.mark.parametrize("channel", ["auto", "copy_engine", "ucx"])
def test_cpu_tensors_go_over_ucx_whatever_smfree_channel_says(channel):
    results = run_ranks(_exchange_one, 2, env={"SMFREE_CHANNEL": channel})
    assert results == [[1.0] * 8, [0.0] * 8]


def test_unknown_smfree_channel_is_refused_naming_the_choices():
    with pytest.raises(AssertionError,
                       match=r"SMFREE_CHANNEL='nvlink' is not one of auto, copy_engine, ucx"):
        run_ranks(_exchange_one, 2, env={"SMFREE_CHANNEL": "nvlink"})


def test_the_old_name_smfree_transport_is_refused_naming_smfree_channel():
    with pytest.raises(AssertionError, match=r"SMFREE_TRANSPORT='ucx' is no longer read: "
                                             r"set SMFREE_CHANNEL instead"):
        run_ranks(_exchange_one, 2, env={"SMFREE_TRANSPORT": "ucx"})


def test_unknown_smfree_collectives_are_refused_at_init_naming_the_choices():
    with pytest.raises(AssertionError, match=r"SMFREE_COLLECTIVES='all_gather,allreduce': "
                                             r"'allreduce' is not one of all_gather, all_to_all"):
        run_ranks(_exchange_one, 2, env={"SMFREE_COLLECTIVES": "all_gather,allreduce"})


def test_a_collectives_min_bytes_that_is_not_a_count_is_refused_at_init():
    with pytest.raises(AssertionError, match=r"SMFREE_COLLECTIVE_MIN_BYTES='16M' is not a "
                                             r"non-negative integer"):
        run_ranks(_exchange_one, 2, env={"SMFREE_COLLECTIVE_MIN_BYTES": "16M"})


def _wrong_device(rank, world):
    dev = cuda_device(rank)
    other = cuda_device(1 - rank)
    swap(1 - rank, torch.ones(8, device=dev))
    with pytest.raises(ValueError, match=rf"tensor on {other}, but this rank uses {dev}"):
        dist.isend(torch.ones(8, device=other), 1 - rank)
    return True


@pytest.mark.gpu
@pytest.mark.distinct_gpus("puts a tensor on a GPU other than the rank's")
def test_tensor_on_another_device_than_the_groups():
    assert run_ranks(_wrong_device, 2, cuda=True) == [True, True]
