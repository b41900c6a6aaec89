# Why copy-engine traffic slows a GEMM: raw driver copies, no smfree. A bf16 GEMM 8192^3 loop
# runs on GPU 0 while 256 MiB copies go both ways between GPUs 0 and 1 on side streams, and
# nvidia-smi samples GPU 0's SM clock, power and clock-event reasons inside the GEMM loop only.
# "one": one process, peer memory; "two": two processes, CUDA IPC (as smfree copies).
# In each, GPU 1 idles or runs GEMMs too. Needs 2 GPUs:
#   python3 tools/probe_gemm_clock.py one|two
import ctypes
import datetime
import os
import statistics
import subprocess
import sys
import time

import torch

N = 8192
GEMMS = 400
COPIES = 1400  # 1400 x 256 MiB outlast the GEMM loop at ~390 GB/s
BYTES = 256 << 20
ROUNDS = 3
QUERY = "timestamp,clocks.sm,power.draw.instant,clocks_event_reasons.active"
cu = ctypes.CDLL("libcuda.so.1")


def check(result, what):
    if result != 0:
        raise RuntimeError(f"{what} failed: CUresult {result}")


def copy(dst, src, stream):
    check(cu.cuMemcpyAsync(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(BYTES),
                           ctypes.c_void_p(stream.cuda_stream)), "cuMemcpyAsync")


class Sampler:
    """nvidia-smi every 20 ms on GPU 0; keeps the samples inside [start, end] of the CPU clock."""

    def __init__(self):
        self.proc = subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={QUERY}",
                                      "--format=csv,noheader,nounits", "-lms", "20"],
                                     stdout=subprocess.PIPE, text=True)

    def summary(self, start, end):
        self.proc.terminate()
        clocks, watts, reasons = [], [], set()
        for line in self.proc.communicate()[0].splitlines():
            fields = [f.strip() for f in line.split(",")]
            try:
                t = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                clock, watt = float(fields[1]), float(fields[2])
            except (ValueError, IndexError):
                continue
            if start + 0.05 <= t <= end - 0.02:
                clocks.append(clock)
                watts.append(watt)
                reasons.add(fields[3])
        if not clocks:
            return "no samples"
        return (f"SM {statistics.median(clocks):.0f} MHz, {statistics.median(watts):.0f} W, "
                f"reasons {sorted(reasons)}")


def gemm_loop(a, b, c):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(GEMMS):
        torch.mm(a, b, out=c)
    end.record()
    return start, end


def cpu_window(start, end):
    while not start.query():
        pass
    t0 = time.time()
    while not end.query():
        pass
    return t0, time.time()


def operands(device):
    a = torch.randn(N, N, device=device, dtype=torch.bfloat16)
    return a, torch.randn_like(a), torch.empty_like(a)


def report(tag, results):
    for peer in ("idle", "gemm"):
        alone = statistics.median(results[(peer, False)])
        loaded = statistics.median(results[(peer, True)])
        print(f"{tag}, GPU 1 {peer}: GEMM alone {alone:.3f} ms, under copies {loaded:.3f} ms, "
              f"{100 * (loaded / alone - 1):+.1f} %", flush=True)


def measure_one(results, mats, side, bufs, peer, traffic):
    sampler = Sampler()
    time.sleep(0.2)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    if traffic:
        marks[0].record(side[0])
        # Alternating, so that a full queue on one stream cannot hold back the other's copies.
        for _ in range(COPIES):
            for k in (0, 1):
                with torch.cuda.device(k):
                    copy(bufs[1 - k][1].data_ptr(), bufs[k][0].data_ptr(), side[k])
        marks[1].record(side[0])
    if peer == "gemm":
        with torch.cuda.device(1):
            gemm_loop(*mats[1])
            gemm_loop(*mats[1])
    with torch.cuda.device(0):
        start, end = gemm_loop(*mats[0])
    window = cpu_window(start, end)
    for k in (0, 1):
        torch.cuda.synchronize(k)
    ms = start.elapsed_time(end) / GEMMS
    results.setdefault((peer, traffic), []).append(ms)
    line = f"GPU 1 {peer}, copies {traffic}: {ms:.3f} ms/GEMM; {sampler.summary(*window)}"
    if traffic:
        gbs = COPIES * BYTES / marks[0].elapsed_time(marks[1]) / 1e6
        line += f"; copies {gbs:.0f} GB/s each way, outlast the GEMMs: {marks[1].elapsed_time(end) <= 0}"
    print(line, flush=True)


def one_process():
    mats = [operands(f"cuda:{k}") for k in (0, 1)]
    bufs = [(torch.empty(BYTES, dtype=torch.uint8, device=f"cuda:{k}"),
             torch.empty(BYTES, dtype=torch.uint8, device=f"cuda:{k}")) for k in (0, 1)]
    side = [torch.cuda.Stream(f"cuda:{k}") for k in (0, 1)]
    bufs[1][1].copy_(bufs[0][0])  # torch enables peer access both ways
    bufs[0][1].copy_(bufs[1][0])
    for k in (0, 1):
        with torch.cuda.device(k):
            for _ in range(50):
                torch.mm(*mats[k][:2], out=mats[k][2])
        torch.cuda.synchronize(k)
    results = {}
    for _ in range(ROUNDS):
        for peer in ("idle", "gemm"):
            for traffic in (False, True):
                measure_one(results, mats, side, bufs, peer, traffic)
    report("one process", results)


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def export(tensor):
    handle = IpcHandle()
    check(cu.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(tensor.data_ptr())),
          "cuIpcGetMemHandle")
    return ctypes.string_at(ctypes.addressof(handle), 64)


def open_handle(raw):
    handle = IpcHandle()
    ctypes.memmove(ctypes.addressof(handle), raw, 64)
    pointer = ctypes.c_uint64()
    check(cu.cuIpcOpenMemHandle_v2(ctypes.byref(pointer), handle, ctypes.c_uint(1)),
          "cuIpcOpenMemHandle")
    return pointer.value


def two_process_worker(rank):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29557")
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    src = torch.empty(BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    handles = [None, None]
    dist.all_gather_object(handles, export(dst))
    peer_dst = open_handle(handles[1 - rank])
    a, b, c = operands("cuda")
    side = torch.cuda.Stream()
    for _ in range(50):
        torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    results = {}
    for _ in range(ROUNDS):
        for peer in ("idle", "gemm"):
            for traffic in (False, True):
                dist.barrier()
                sampler = Sampler() if rank == 0 else None
                time.sleep(0.2)
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                if traffic:
                    marks[0].record(side)
                    for _ in range(COPIES):
                        copy(peer_dst, src.data_ptr(), side)
                    marks[1].record(side)
                if rank == 0:
                    start, end = gemm_loop(a, b, c)
                    window = cpu_window(start, end)
                elif peer == "gemm":
                    gemm_loop(a, b, c)
                    gemm_loop(a, b, c)
                torch.cuda.synchronize()
                if rank != 0:
                    continue
                ms = start.elapsed_time(end) / GEMMS
                results.setdefault((peer, traffic), []).append(ms)
                line = f"GPU 1 {peer}, copies {traffic}: {ms:.3f} ms/GEMM; {sampler.summary(*window)}"
                if traffic:
                    gbs = COPIES * BYTES / marks[0].elapsed_time(marks[1]) / 1e6
                    line += (f"; copies {gbs:.0f} GB/s each way, outlast the GEMMs: "
                             f"{marks[1].elapsed_time(end) <= 0}")
                print(line, flush=True)
    if rank == 0:
        report("two processes", results)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("one", "two"):
        sys.exit("usage: python3 tools/probe_gemm_clock.py one|two")
    if sys.argv[1] == "one":
        one_process()
    else:
        import torch.multiprocessing as mp
        mp.spawn(two_process_worker, nprocs=2)
