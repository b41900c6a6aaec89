# Do two copies queued by one process overlap when one of them writes memory that the process
# opened through CUDA IPC? A collective lane's later rank is in that place: it pulls the piece it
# receives out of its peer's buffer and pushes the piece it sends into it. Process 1 (GPU 1) opens
# process 0's buffers (GPU 0, the caching allocator's cudaMalloc memory, shared by
# torch.multiprocessing) and times, alone and two at once, copies between them, its own buffer on
# GPU 1 and one of its own on GPU 0, on streams of GPU 1 and of GPU 0 (a context it holds there),
# with peer access enabled both ways. Raw driver copies, no smfree. Needs 2 GPUs:
#   python3 tools/probe_ipc_copy_overlap.py [MiB per copy, default 256]
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

from smfree_pg.bench.cuda_driver import copy_async

S = (int(sys.argv[1]) if len(sys.argv) > 1 else 256) << 20
REPS, WARMUP = 8, 2


def owner(queue, done):
    """Process 0: its buffers on GPU 0, shared with process 1."""
    torch.cuda.set_device(0)
    out0 = torch.full((2 * S,), 1, dtype=torch.uint8, device="cuda:0")
    other0 = torch.zeros(2 * S, dtype=torch.uint8, device="cuda:0")
    queue.put(out0)
    queue.put(other0)
    done.wait()


def lane(queue, done, results):
    """Process 1: copies between process 0's buffers and its own."""
    torch.cuda.set_device(1)
    out1 = torch.full((2 * S,), 2, dtype=torch.uint8, device="cuda:1")
    ipc0 = queue.get()  # process 0's buffers, opened through CUDA IPC here
    other_ipc0 = queue.get()
    own0 = torch.full((2 * S,), 3, dtype=torch.uint8, device="cuda:0")  # this process's, GPU 0
    for a, b in ((0, 1), (1, 0)):
        torch.ones(1, device=f"cuda:{b}").copy_(torch.ones(1, device=f"cuda:{a}"))  # peer access
    pull1, push1 = torch.cuda.Stream(device=1), torch.cuda.Stream(device=1)
    on_gpu0 = torch.cuda.Stream(device=0)
    pull_ipc = (out1[:S], ipc0[:S])  # piece A, 0 -> 1, out of IPC memory
    push_ipc = (ipc0[S:], out1[S:])  # piece B, 1 -> 0, into IPC memory
    cases = {
        "pull out of IPC memory alone": [(*pull_ipc, pull1)],
        "push into IPC memory alone": [(*push_ipc, push1)],
        "both, two GPU 1 streams": [(*pull_ipc, pull1), (*push_ipc, push1)],
        "the pull on a GPU 0 stream alone": [(*pull_ipc, on_gpu0)],
        "the pull on a GPU 0 stream + the push": [(*pull_ipc, on_gpu0), (*push_ipc, push1)],
        "pull + push into another IPC buffer": [(*pull_ipc, pull1),
                                                (other_ipc0[S:], out1[S:], push1)],
        "pull + push into own memory on GPU 0": [(*pull_ipc, pull1), (own0[S:], out1[S:], push1)],
        "pull out of own GPU 0 memory + push into IPC": [(out1[:S], own0[:S], pull1),
                                                         (*push_ipc, push1)],
        "no IPC: pull and push own GPU 0 memory": [(out1[:S], own0[:S], pull1),
                                                   (own0[S:], out1[S:], push1)],
    }
    for name, copies in cases.items():
        times = []
        for rep in range(REPS):
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            start = time.perf_counter()
            for dst, src, stream in copies:
                copy_async(dst.data_ptr(), src.data_ptr(), S, stream)
            for _, _, stream in copies:
                stream.synchronize()
            if rep >= WARMUP:
                times.append(time.perf_counter() - start)
        right = all(torch.equal(dst.cpu(), src.cpu()) for dst, src, _ in copies)
        results.put(f"{S >> 20} MiB  {name:46s} {statistics.median(times) * 1e6:7.0f} us  "
                    f"bytes {'right' if right else 'WRONG'}")
    results.put(None)
    done.set()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=owner, args=(queue, done)),
             ctx.Process(target=lane, args=(queue, done, results))]
    for proc in procs:
        proc.start()
    while (line := results.get(timeout=120)) is not None:
        print(line, flush=True)
    for proc in procs:
        proc.join(30)
