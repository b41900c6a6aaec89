"""Two ranks on cuda:0 exchange a buffer both ways, one exchange at a time (batch_isend_irecv
of one isend and one irecv, wait both, synchronize), 4 KiB to 64 MiB: µs per exchange, median
of 20 after 5 warm-ups, bytes checked. Run once per setting to compare them on a shared GPU,
e.g. with and without CUDA MPS:
    LABEL=defaults torchrun --nproc-per-node=2 tools/probe_shared_gpu_exchange.py
    SMFREE_LOCAL_COPIES=driver LABEL=driver torchrun --nproc-per-node=2 tools/probe_shared_gpu_exchange.py
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

import smfree_pg  # noqa: F401  (registers the backend)

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def exchange_us(send: torch.Tensor, recv: torch.Tensor, peer: int) -> float:
    start = time.perf_counter()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer),
                                    dist.P2POp(dist.irecv, recv, peer)])
    for work in works:
        work.wait()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6


def main():
    dist.init_process_group("smfree")
    rank = dist.get_rank()
    peer = 1 - rank
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    medians = []
    for size in SIZES:
        send = torch.full((size // 4,), float(rank + 1), device=device)
        recv = torch.empty(size // 4, device=device)
        samples = [exchange_us(send, recv, peer) for _ in range(25)][5:]
        if not torch.equal(recv, torch.full_like(recv, float(peer + 1))):
            raise SystemExit(f"rank {rank}: wrong bytes at {size} B")
        medians.append(statistics.median(samples))
    if rank == 0:
        label = os.environ.get("LABEL", "")
        print(f"{label:24s} " + " ".join(f"{s >> 10}K: {m:.1f}" for s, m in zip(SIZES, medians)),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
