"""CUDA tensors between emulated hosts, one GPU each (CUDA_VISIBLE_DEVICES per host): smfree
takes its real cross-host path, UCX over TCP through pinned host memory, with SMFREE_TRANSPORT
unset; and a link cut during CUDA exchanges is reported naming the peer's host."""

import pytest
import torch
import torch.distributed as dist

from exchange import first_line, payload, report_progress
from hosts import Hosts

pytestmark = pytest.mark.gpu

SIZES = [0, 1, 4099, (1 << 20) + 3, (16 << 20) + 5, 64 << 20]  # int32 elements: up to 256 MiB
JOB_TIMEOUT_S = 120


def _backend():
    return dist.group.WORLD._get_backend(torch.device("cuda"))


def _cuda_exchange(rank, peer, index, numel):
    dev = torch.device("cuda", 0)
    mine = payload(rank, index, numel).to(dev)
    got = torch.full((numel,), -1, dtype=torch.int32, device=dev)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer),
                                        dist.P2POp(dist.irecv, got, peer)]):
        work.wait()
    return torch.equal(got.cpu(), payload(peer, index, numel))


def _cuda_sizes(rank, world):
    torch.cuda.set_device(0)  # the host's only GPU
    peer = 1 - rank
    intact = [_cuda_exchange(rank, peer, index, numel) for index, numel in enumerate(SIZES)]
    # Unbatched, one direction at a time, from a side stream.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        buf = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
        if rank == 0:
            dist.send(payload(0, 99, 1 << 20).cuda(), 1)
        else:
            dist.recv(buf, 0)
    stream.synchronize()
    if rank == 1:
        intact.append(torch.equal(buf.cpu(), payload(0, 99, 1 << 20)))
    stats = _backend()._stats()
    return {"intact": intact, "staged": stats["ucx_host_staged_sends"],
            "ipc_mappings": stats["ipc_mappings"]}


@pytest.fixture(scope="module")
def cuda_between_hosts():
    """Each rank's findings from one job of _cuda_sizes on two hosts of one GPU each."""
    with Hosts(2) as hosts:
        job = hosts.launch(_cuda_sizes, 1, host_env={0: {"CUDA_VISIBLE_DEVICES": "0"},
                                                     1: {"CUDA_VISIBLE_DEVICES": "1"}})
        values = job.values(JOB_TIMEOUT_S)
        assert hosts.leftover_processes() == []
    return values


def test_cuda_tensors_between_hosts_arrive_intact_without_ipc(cuda_between_hosts):
    for rank, value in enumerate(cuda_between_hosts):
        assert all(value["intact"]), f"rank {rank}: {value['intact']}"
        assert value["ipc_mappings"] == 0, f"rank {rank}: CUDA IPC was used between hosts"


# Seen on 2 H100s (UCX 1.22.0, UCX_TLS unset): every byte arrived, but through UCX's own CUDA
# pipeline: the decision to stage (UcxChannel::stagesCudaToward, taken when the peer is
# connected) did not find the peer reached over TCP only. Strict, so the fix shows.
@pytest.mark.xfail(strict=True, reason="CUDA sends between namespace hosts are not staged "
                   "through host memory (UCX moves them itself)")
def test_cuda_tensors_between_hosts_are_staged_through_host_memory(cuda_between_hosts):
    for rank, value in enumerate(cuda_between_hosts):
        assert value["staged"] > 0, f"rank {rank}: no send went through host staging"


def _cuda_until_cut(rank, world):
    torch.cuda.set_device(0)
    stats = {"sent": 0, "delivered": 0, "corrupt": 0, "error": None, "full_error": None}
    for index in range(100_000):
        try:
            ok = _cuda_exchange(rank, 1 - rank, index, 1 << 18)
        except Exception as error:  # noqa: BLE001 - the test reads it
            stats.update(error=first_line(error), full_error=str(error))
            break
        stats["sent"] += 1
        stats["delivered" if ok else "corrupt"] += 1
        report_progress(index + 1)
    return stats


def test_cuda_link_cut_is_reported_naming_the_peer_host():
    with Hosts(2) as hosts:
        job = hosts.launch(_cuda_until_cut, 1, group_timeout_s=15,
                           host_env={0: {"CUDA_VISIBLE_DEVICES": "0"},
                                     1: {"CUDA_VISIBLE_DEVICES": "1"}})
        job.wait_all_progress(20)
        hosts.link_down(1)
        values = job.values(JOB_TIMEOUT_S)
        assert hosts.leftover_processes() == []
    for rank, value in enumerate(values):
        print(f"\nCUDA LINK CUT rank {rank}: {value}")
        assert value["corrupt"] == 0
        assert f"on host {hosts.hostnames[1 - rank]}" in value["full_error"]
        assert "UCX" in value["full_error"]
