"""What smfree's copies within one GPU cost in GPU memory: bounced through a peer GPU, a process
holds a CUDA context (and its bounces) on that GPU too. Two ranks, one GPU each, exchange eager
messages (whose copy out of the slot is a copy within one GPU) and copy to themselves; then
nvidia-smi lists each process's memory on each GPU. Run once per way (2 GPUs):

    python tools/probe_peer_context_memory.py            # SMFREE_LOCAL_COPIES as set, default peer_gpu
    SMFREE_LOCAL_COPIES=driver python tools/probe_peer_context_memory.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import smfree_pg  # noqa: E402,F401  (registers the backend)


def rank_main(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("smfree", rank=rank, world_size=world)
    peer = 1 - rank
    src = torch.ones(1 << 20, device=f"cuda:{rank}")
    dst = torch.empty_like(src)
    for _ in range(4):
        ops = [dist.P2POp(dist.isend, src, peer), dist.P2POp(dist.irecv, dst, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        ops = [dist.P2POp(dist.isend, src, rank), dist.P2POp(dist.irecv, dst, rank)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    torch.cuda.synchronize()
    store = dist.distributed_c10d._get_default_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{r}" for r in range(world)])
    if rank == 0:
        pids = {int(store.get(f"pid/{r}")): r for r in range(world)}
        report(pids)
        store.set("reported", "1")
    store.wait(["reported"])
    dist.destroy_process_group()


def report(pids: dict[int, int]) -> None:
    buses = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                           capture_output=True, text=True, check=True).stdout
    gpu_of = {bus.strip(): int(index) for index, bus in
              (line.split(",") for line in buses.strip().splitlines())}
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory",
                           "--format=csv,noheader"], capture_output=True, text=True,
                          check=True).stdout
    print(f"SMFREE_LOCAL_COPIES={os.environ.get('SMFREE_LOCAL_COPIES', '(default)')}: "
          "memory per rank and GPU (nvidia-smi)")
    for line in apps.strip().splitlines():
        pid, bus, used = (part.strip() for part in line.split(","))
        if int(pid) in pids:
            print(f"  rank {pids[int(pid)]} on GPU {gpu_of.get(bus, bus)}: {used}", flush=True)


def main() -> None:
    if torch.cuda.device_count() < 2:
        sys.exit("needs 2 GPUs")
    mp.spawn(rank_main, args=(2, 29531), nprocs=2)


if __name__ == "__main__":
    main()
