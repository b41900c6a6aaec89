"""What a P2P op costs the calling thread: the time inside isend()/irecv() (the post) and inside
each Work.wait(), per op, for CPU tensors and for CUDA tensors on a GPU all ranks share.

Two ranks exchange one message each way per step (irecv posted first, then isend, then both
waits; CUDA steps end with a stream synchronize outside the timed calls); medians and p90 of 400
steps after 50 warm-ups, bytes checked at the end. Run it once per build in one session to
compare builds:
    LABEL=before torchrun --nproc-per-node=2 tools/probe_post_path.py
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

import smfree_pg  # noqa: F401  (registers the backend)

SIZES = [4 << 10, 1 << 20]
WARMUP, STEPS = 50, 400


def timed(call):
    start = time.perf_counter()
    result = call()
    return result, (time.perf_counter() - start) * 1e6


def step(send, recv, peer, cuda):
    recv_work, recv_post = timed(lambda: dist.irecv(recv, peer))
    send_work, send_post = timed(lambda: dist.isend(send, peer))
    _, recv_wait = timed(recv_work.wait)
    _, send_wait = timed(send_work.wait)
    if cuda:
        torch.cuda.synchronize()
    return {"isend": send_post, "irecv": recv_post, "send wait": send_wait,
            "recv wait": recv_wait}


def measure(device, size, peer, rank):
    send = torch.full((size // 4,), float(rank + 1), device=device)
    recv = torch.empty(size // 4, device=device)
    cuda = device.type == "cuda"
    samples = [step(send, recv, peer, cuda) for _ in range(WARMUP + STEPS)][WARMUP:]
    if not torch.equal(recv, torch.full_like(recv, float(peer + 1))):
        raise SystemExit(f"rank {rank}: wrong bytes at {size} B on {device}")
    table = {}
    for key in samples[0]:
        values = sorted(s[key] for s in samples)
        table[key] = (statistics.median(values), values[int(len(values) * 0.9)])
    return table


def main():
    dist.init_process_group("smfree")
    rank = dist.get_rank()
    peer = 1 - rank
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        devices.append(torch.device("cuda", 0))
    label = os.environ.get("LABEL", "")
    for device in devices:
        for size in SIZES:
            table = measure(device, size, peer, rank)
            dist.barrier()
            if rank == 0:
                cells = "  ".join(f"{key} {median:.1f} (p90 {p90:.1f})"
                                  for key, (median, p90) in table.items())
                print(f"{label:8s} {device.type:4s} {size >> 10:5d} KiB  {cells}  µs", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
