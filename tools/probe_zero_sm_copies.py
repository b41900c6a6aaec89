"""Which copy forms need an SM on this driver, and what a device-local copy costs when it is
made of copies that cross a device boundary (one process, 2 or more GPUs).

    python tools/probe_zero_sm_copies.py [--hold-ms 300] [--sizes 4K,64K,...]

1. Under a kernel that holds every SM of every GPU (smfree_pg.bench.starve), each copy form is
   queued on another stream: "CE" if it ended during the hold, "SM" if only after.
2. Without a hold, µs per copy of `size` bytes within GPU 0 (one after another, each waiting
   for the last), by route: the driver's local copy (SMs); bounced through a peer GPU's memory
   (two NVLink copies) or pinned host memory (two PCIe copies), on one stream or in pipelined
   chunks on two; and the peer copy GPU 1 -> GPU 0, D2H and H2D alone, for scale.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from smfree_pg.bench import starve  # noqa: E402
from smfree_pg.bench.cuda_driver import check, copy_async, driver  # noqa: E402
from smfree_pg.bench.sizes import format_size, parse_sizes  # noqa: E402


class Memcpy2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
                ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
                ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


class ArrayDescriptor(ctypes.Structure):
    _fields_ = [("Width", ctypes.c_size_t), ("Height", ctypes.c_size_t),
                ("Format", ctypes.c_int), ("NumChannels", ctypes.c_uint)]


DEVICE, ARRAY = 2, 3
ROW = 64 * 1024  # bytes per array row: 4096 elements of 4 x uint32


def array_copy(device: int, size: int):
    """Linear -> CUDA array -> linear within `device`, as two cuMemcpy2DAsync."""
    with torch.cuda.device(device):
        desc = ArrayDescriptor(ROW // 16, size // ROW, 0x03, 4)
        array = ctypes.c_void_p()
        check(driver().cuArrayCreate_v2(ctypes.byref(array), ctypes.byref(desc)), "cuArrayCreate")

    def into(dst: int, src: int, stream) -> None:
        c = Memcpy2D(srcMemoryType=DEVICE, srcDevice=src, srcPitch=ROW,
                     dstMemoryType=ARRAY, dstArray=array, WidthInBytes=ROW, Height=size // ROW)
        with torch.cuda.device(device):
            check(driver().cuMemcpy2DAsync_v2(ctypes.byref(c), ctypes.c_void_p(stream.cuda_stream)),
                  "cuMemcpy2DAsync (into an array)")

    def out(dst: int, src: int, stream) -> None:
        c = Memcpy2D(srcMemoryType=ARRAY, srcArray=array, dstMemoryType=DEVICE, dstDevice=dst,
                     dstPitch=ROW, WidthInBytes=ROW, Height=size // ROW)
        with torch.cuda.device(device):
            check(driver().cuMemcpy2DAsync_v2(ctypes.byref(c), ctypes.c_void_p(stream.cuda_stream)),
                  "cuMemcpy2DAsync (out of an array)")
    return into, out


def starvation(hold_ms: float) -> None:
    n = torch.cuda.device_count()
    size = 4 << 20
    a0 = torch.full((size,), 7, dtype=torch.uint8, device="cuda:0")
    b0 = torch.zeros_like(a0)
    a1 = torch.zeros(size, dtype=torch.uint8, device="cuda:1")
    host = torch.zeros(size, dtype=torch.uint8).pin_memory()
    into, out = array_copy(0, size)
    s0 = torch.cuda.Stream(device=0)
    s1 = torch.cuda.Stream(device=1)
    forms = {
        "local D2D on GPU 0 (cuMemcpyAsync)": (s0, lambda: copy_async(b0.data_ptr(), a0.data_ptr(), size, s0)),
        "peer push GPU 0 -> 1 on GPU 0": (s0, lambda: copy_async(a1.data_ptr(), a0.data_ptr(), size, s0)),
        "peer pull GPU 0 -> 1 on GPU 1": (s1, lambda: copy_async(a1.data_ptr(), a0.data_ptr(), size, s1)),
        "peer push GPU 1 -> 0 on GPU 1": (s1, lambda: copy_async(b0.data_ptr(), a1.data_ptr(), size, s1)),
        "D2H pinned, GPU 0": (s0, lambda: copy_async(host.data_ptr(), a0.data_ptr(), size, s0)),
        "H2D pinned, GPU 0": (s0, lambda: copy_async(b0.data_ptr(), host.data_ptr(), size, s0)),
        "linear -> array on GPU 0 (cuMemcpy2DAsync)": (s0, lambda: into(0, a0.data_ptr(), s0)),
        "array -> linear on GPU 0 (cuMemcpy2DAsync)": (s0, lambda: out(b0.data_ptr(), 0, s0)),
        "GPU 0 -> GPU 1 -> GPU 0 (two peer copies, GPU 0's stream)": (s0, lambda: (
            copy_async(a1.data_ptr(), a0.data_ptr(), size, s0),
            copy_async(b0.data_ptr(), a1.data_ptr(), size, s0))),
        "GPU 0 -> host -> GPU 0 (D2H, H2D, GPU 0's stream)": (s0, lambda: (
            copy_async(host.data_ptr(), a0.data_ptr(), size, s0),
            copy_async(b0.data_ptr(), host.data_ptr(), size, s0))),
    }
    print(f"== starvation: every SM of {n} GPUs held {hold_ms:.0f} ms; 4 MiB copies")
    for name, (stream, issue) in forms.items():
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        holds = [starve.Hold(d, hold_ms) for d in range(n)]
        try:
            issue()
        except RuntimeError as error:
            print(f"  {name:62s} unavailable: {error}")
            for h in holds:
                h.finish()
            continue
        hold = holds[stream.device.index]
        hold.mark(name, stream)
        hold.control(torch.cuda.Stream(device=stream.device))
        result = hold.finish()
        for h in holds:
            h.finish()
        verdict = "CE" if result.during(name) else "SM"
        ok = "" if not result.during("control") else "  (control ended during the hold: NOT HELD)"
        print(f"  {name:62s} {result.ends[name]:7.1f} ms  {verdict}{ok}", flush=True)


class Gate:
    """A stream held on a host word until the CPU has queued what is timed, so that CPU time
    spent queueing is not timed. If queueing blocks (the stream's queue is full), a thread
    opens the gate after `patience` seconds and the result is marked CPU-bound."""

    def __init__(self) -> None:
        self.word = torch.zeros(1, dtype=torch.int32).pin_memory()
        self.address = ctypes.c_uint64()
        check(driver().cuMemHostGetDevicePointer_v2(ctypes.byref(self.address),
                                                    ctypes.c_void_p(self.word.data_ptr()), 0),
              "cuMemHostGetDevicePointer")
        self.value = 0

    def close(self, stream: torch.cuda.Stream) -> None:
        self.value += 1
        with torch.cuda.device(stream.device):
            check(driver().cuStreamWaitValue32_v2(ctypes.c_void_p(stream.cuda_stream), self.address,
                                                  ctypes.c_uint32(self.value), 0),
                  "cuStreamWaitValue32")

    def open_after(self, queued: threading.Event, patience: float) -> bool:
        timely = queued.wait(patience)
        self.word[0] = self.value
        return timely


GATE: Gate | None = None


def timed(fn, reps: int, first: torch.cuda.Stream, last: torch.cuda.Stream) -> str:
    """µs per call of fn(), each starting once the previous one ended, timed on the GPU."""
    if first.device != last.device:
        raise ValueError("time routes that start and end on one device")
    global GATE
    GATE = GATE or Gate()
    fn()  # warm-up
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    GATE.close(first)
    start.record(first)
    queued = threading.Event()
    result = {}
    opener = threading.Thread(target=lambda: result.update(timely=GATE.open_after(queued, 0.5)))
    opener.start()
    done = None
    for _ in range(reps):
        if done is not None:
            first.wait_event(done)
        fn()
        done = torch.cuda.Event()
        done.record(last)
    end.record(last)
    queued.set()
    opener.join()
    end.synchronize()
    us = start.elapsed_time(end) * 1e3 / reps
    return f"{us:9.1f} µs" + ("" if result["timely"] else " (CPU-bound)"), us


def pipelined(dst: int, src: int, size: int, bounce: list[int], chunk: int,
              hop1: torch.cuda.Stream, hop2: torch.cuda.Stream) -> None:
    """src -> bounce[k % 2] on hop1, then bounce -> dst on hop2, chunk by chunk; a bounce
    buffer is refilled only once hop2 has emptied it."""
    emptied = [None, None]
    for k, at in enumerate(range(0, size, chunk)):
        n = min(chunk, size - at)
        b = bounce[k % 2]
        if emptied[k % 2] is not None:
            hop1.wait_event(emptied[k % 2])
        copy_async(b, src + at, n, hop1)
        full = torch.cuda.Event()
        full.record(hop1)
        hop2.wait_event(full)
        copy_async(dst + at, b, n, hop2)
        emptied[k % 2] = torch.cuda.Event()
        emptied[k % 2].record(hop2)
    hop1.wait_event(emptied[(len(range(0, size, chunk)) - 1) % 2])


def routes(sizes: list[int]) -> None:
    n = torch.cuda.device_count()
    big = max(sizes)
    src = torch.full((big,), 3, dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    peer = torch.zeros(big, dtype=torch.uint8, device="cuda:1")
    peer_src = torch.full((big,), 5, dtype=torch.uint8, device="cuda:1")
    third = torch.zeros(big, dtype=torch.uint8, device="cuda:2") if n > 2 else None
    host = torch.zeros(big, dtype=torch.uint8).pin_memory()
    host2 = torch.zeros(big, dtype=torch.uint8).pin_memory()
    s0, s0b = torch.cuda.Stream(device=0), torch.cuda.Stream(device=0)
    s1, s1b = torch.cuda.Stream(device=1), torch.cuda.Stream(device=1)
    S, D = src.data_ptr(), dst.data_ptr()
    P, P2 = peer.data_ptr(), peer.data_ptr() + big // 2
    H, H2 = host.data_ptr(), host2.data_ptr()

    def cases(size: int):
        yield "local copy (driver: SMs)", s0, s0, lambda: copy_async(D, S, size, s0)
        yield "peer copy GPU 1 -> 0 (one hop)", s1, s1, lambda: copy_async(D, peer_src.data_ptr(), size, s1)
        yield "D2H GPU 0 (one hop)", s0, s0, lambda: copy_async(H, S, size, s0)
        yield "H2D GPU 0 (one hop)", s0, s0, lambda: copy_async(D, H, size, s0)
        yield "via GPU 1, one stream of GPU 0", s0, s0, lambda: (
            copy_async(P, S, size, s0), copy_async(D, P, size, s0))
        yield "via GPU 1, one stream of GPU 1", s1, s1, lambda: (
            copy_async(P, S, size, s1), copy_async(D, P, size, s1))
        for chunk in (256 << 10, 1 << 20, 4 << 20):
            if chunk < size <= 32 * chunk:
                yield (f"via GPU 1, {format_size(chunk)} chunks, GPU 0 push / GPU 1 push", s0, s0,
                       lambda c=chunk: pipelined(D, S, size, [P, P2], c, s0, s1))
                yield (f"via GPU 1, {format_size(chunk)} chunks, GPU 0 two streams", s0, s0,
                       lambda c=chunk: pipelined(D, S, size, [P, P2], c, s0, s0b))
        if third is not None:
            T = third.data_ptr()
            yield "via GPU 2, one stream of GPU 0", s0, s0, lambda: (
                copy_async(T, S, size, s0), copy_async(D, T, size, s0))
        yield "via host, one stream of GPU 0", s0, s0, lambda: (
            copy_async(H, S, size, s0), copy_async(D, H, size, s0))
        for chunk in (64 << 10, 256 << 10, 1 << 20):
            if chunk < size <= 32 * chunk:
                yield (f"via host, {format_size(chunk)} chunks, GPU 0 two streams", s0, s0,
                       lambda c=chunk: pipelined(D, S, size, [H, H2], c, s0, s0b))

    for size in sizes:
        reps = max(3, min(50, (512 << 20) // size))
        print(f"== {format_size(size)}: µs per copy within GPU 0 ({reps} in a row)", flush=True)
        for name, first, last, fn in cases(size):
            try:
                text, us = timed(fn, reps, first, last)
            except (RuntimeError, ValueError) as error:
                print(f"  {name:60s} failed: {error}")
                continue
            print(f"  {name:60s} {text}  {size / us / 1e3:7.1f} GB/s", flush=True)
        torch.cuda.synchronize()
        if not bool((dst[:size] == 3).all()):
            print("  !! contents wrong after the routes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold-ms", type=float, default=300)
    parser.add_argument("--sizes", type=parse_sizes, default="4K,64K,256K,1M,4M,16M,64M")
    parser.add_argument("--skip-starvation", action="store_true")
    args = parser.parse_args()
    n = torch.cuda.device_count()
    if n < 2:
        sys.exit("needs 2 GPUs")
    version = ctypes.c_int()
    driver().cuDriverGetVersion(ctypes.byref(version))
    print(f"{n} x {torch.cuda.get_device_name(0)}; driver CUDA {version.value}; torch {torch.__version__}")
    # torch enables peer access between two devices at its first copy between them.
    for a in range(n):
        for b in range(n):
            if a != b:
                torch.empty(1, device=f"cuda:{a}").copy_(torch.ones(1, device=f"cuda:{b}"))
    if not args.skip_starvation:
        starvation(args.hold_ms)
    routes(args.sizes)


if __name__ == "__main__":
    main()
