"""CUDA tensors between emulated hosts, one GPU each (CUDA_VISIBLE_DEVICES per host; the hosts
share it where the machine has one GPU): smfree
takes its real cross-host path, UCX over TCP through pinned host memory, with SMFREE_CHANNEL
unset; and a link cut during CUDA exchanges is reported naming the peer's host.

The namespace hosts are one machine, and UCX's cuda_ipc reaches one GPU from the other across
network namespaces (seen on 2 H100s: "UCX reaches … over tcp/eth0, cuda_ipc/cuda"), which no
two real hosts offer. Each host's ranks leave it out (UCX_TLS=^cuda_ipc), as between hosts."""

import time

import pytest
import torch
import torch.distributed as dist

from devices import rank_gpu
from exchange import first_line, payload, report_progress
from hosts import Hosts

pytestmark = pytest.mark.gpu

SIZES = [0, 1, 4099, (1 << 20) + 3, (16 << 20) + 5, 64 << 20]  # int32 elements: up to 256 MiB
JOB_TIMEOUT_S = 120
AS_HOSTS = {"UCX_TLS": "^cuda_ipc"}


def _one_gpu_each():
    """Each host's environment: its rank's GPU alone (devices.rank_gpu)."""
    return {host: {"CUDA_VISIBLE_DEVICES": str(rank_gpu(host)), **AS_HOSTS} for host in (0, 1)}


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
    return {"intact": intact, "staged": stats["ucx_relayed_sends"],
            "ipc_mappings": stats["ipc_mappings"]}


@pytest.fixture(scope="module")
def cuda_between_hosts():
    """Each rank's findings from one job of _cuda_sizes on two hosts of one GPU each."""
    with Hosts(2) as hosts:
        job = hosts.launch(_cuda_sizes, 1, host_env=_one_gpu_each())
        values = job.values(JOB_TIMEOUT_S)
        assert hosts.leftover_processes() == []
    return values


def test_cuda_tensors_between_hosts_arrive_intact_without_ipc(cuda_between_hosts):
    for rank, value in enumerate(cuda_between_hosts):
        assert all(value["intact"]), f"rank {rank}: {value['intact']}"
        assert value["ipc_mappings"] == 0, f"rank {rank}: CUDA IPC was used between hosts"


def test_cuda_tensors_between_hosts_are_staged_through_host_memory(cuda_between_hosts):
    for rank, value in enumerate(cuda_between_hosts):
        # Every non-empty exchange, and rank 0's one unbatched send.
        expected = sum(1 for numel in SIZES if numel) + (1 if rank == 0 else 0)
        assert value["staged"] == expected, f"rank {rank}: {value['staged']} sends staged"


def _rate(rank, world, device, numel, rounds):
    """GB/s of `rounds` exchanges of `numel` int32 each way with the other host, and the CPU
    time each rank spent in wait() per exchange."""
    if device == "cuda":
        torch.cuda.set_device(0)
    peer = 1 - rank
    mine = payload(rank, 0, numel).to(device)
    got = torch.empty(numel, dtype=torch.int32, device=device)
    waited = 0.0
    for index in range(rounds + 2):  # 2 to warm up
        if index == 2:
            start, waited = time.perf_counter(), 0.0
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer),
                                        dist.P2POp(dist.irecv, got, peer)])
        before = time.perf_counter()
        for work in works:
            work.wait()
        waited += time.perf_counter() - before
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    intact = torch.equal(got.cpu(), payload(peer, 0, numel))
    return {"gbps": 2 * rounds * numel * 4 / seconds / 1e9,
            "wait_us": waited / rounds * 1e6, "intact": intact}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_exchange_rate_between_hosts_cuda_staged_beside_host_memory(device):
    """Prints the rate of 64 MiB exchanges: CUDA tensors (staged through pinned host memory)
    and, as the wire's floor, CPU tensors over the same link."""
    numel, rounds = 16 << 20, 10
    with Hosts(2) as hosts:
        job = hosts.launch(_rate, 1, device, numel, rounds, host_env=_one_gpu_each())
        values = job.values(JOB_TIMEOUT_S)
    for rank, value in enumerate(values):
        print(f"\nRATE {device} 64 MiB each way, rank {rank}: {value['gbps']:.2f} GB/s both ways, "
              f"{value['wait_us']:.0f} µs in wait() per exchange")
        assert value["intact"]


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
        job = hosts.launch(_cuda_until_cut, 1, group_timeout_s=15, host_env=_one_gpu_each())
        job.wait_all_progress(20)
        hosts.link_down(1)
        values = job.values(JOB_TIMEOUT_S)
        assert hosts.leftover_processes() == []
    for rank, value in enumerate(values):
        print(f"\nCUDA LINK CUT rank {rank}: {value}")
        assert value["corrupt"] == 0
        assert f"on host {hosts.hostnames[1 - rank]}" in value["full_error"]
        assert "UCX" in value["full_error"]
