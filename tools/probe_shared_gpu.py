"""Two processes on one GPU (a CUDA context each; without MPS the GPU time-slices between
contexts). First: does a stream of one process, parked on a memory word (cuStreamWaitValue32,
as smfree's recvs wait for their sender), hold up the other process's work on that GPU?
Second: what copies into and out of memory one process opened through CUDA IPC from the other
cost, against the same copies of its own memory.

Process A parks a stream on a word of its own pinned memory and tells B; B times its ops
(queue, then synchronize: wall clock, median of `--reps`); then A releases its stream. The
same ops are timed with A idle. A second table times how long A's parked stream takes to pass
once its word is set, with B idle and with B running a copy loop. Then A exports a buffer,
B opens it and times copies (queue to done, median of `--reps`).

Run on a machine with one GPU or more (both processes use cuda:0):
    python tools/probe_shared_gpu.py
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
import torch.multiprocessing as mp

from smfree_pg.bench.cuda_driver import Mapping, check, copy_async, driver, export

WAIT_GEQ = 0x0
SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20}


def word_address(word: torch.Tensor) -> int:
    address = ctypes.c_uint64()
    check(driver().cuMemHostGetDevicePointer_v2(ctypes.byref(address),
                                                 ctypes.c_void_p(word.data_ptr()), 0),
          "cuMemHostGetDevicePointer")
    return address.value


def park(stream: torch.cuda.Stream, address: int, value: int) -> None:
    check(driver().cuStreamWaitValue32_v2(ctypes.c_void_p(stream.cuda_stream),
                                           ctypes.c_uint64(address), ctypes.c_uint32(value),
                                           ctypes.c_uint(WAIT_GEQ)), "cuStreamWaitValue32")


def write(stream: torch.cuda.Stream, address: int, value: int) -> None:
    check(driver().cuStreamWriteValue32_v2(ctypes.c_void_p(stream.cuda_stream),
                                            ctypes.c_uint64(address), ctypes.c_uint32(value),
                                            ctypes.c_uint(0)), "cuStreamWriteValue32")


def ops(device: torch.device):
    """B's ops, each queued on `stream`: name -> callable(stream)."""
    table = {}
    for label, size in SIZES.items():
        src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        table[f"device-local copy {label} (SMs)"] = (
            lambda s, d=dst, x=src: d.copy_(x, non_blocking=True))
        table[f"D2H {label} (copy engine)"] = (
            lambda s, h=host, x=src: h.copy_(x, non_blocking=True))
        table[f"H2D {label} (copy engine)"] = (
            lambda s, d=dst, h=host: d.copy_(h, non_blocking=True))
    small = torch.zeros(1024, device=device)
    table["small kernel (SMs)"] = lambda s, t=small: t.add_(1)
    word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    address = word_address(word)
    counter = iter(range(1, 1 << 30))
    table["stream write of a host word"] = lambda s: write(s, address, next(counter))
    return table


def time_op(fn, stream: torch.cuda.Stream, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            fn(stream)
        stream.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


IPC_SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20, "64 MiB": 64 << 20}


def ipc_rows(mapping, stream, reps):
    """(size, {copy: µs}) for copies between B's memory and A's, opened through IPC."""
    device = stream.device
    own = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    other = torch.empty_like(own)
    host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    rows = []
    for label, size in IPC_SIZES.items():
        copies = {
            "own -> own (SMs)": (other.data_ptr(), own.data_ptr()),
            "own -> IPC": (mapping.address, own.data_ptr()),
            "IPC -> own": (own.data_ptr(), mapping.address),
            "IPC -> pinned host": (host.data_ptr(), mapping.address),
            "pinned host -> IPC": (mapping.address, host.data_ptr()),
            "own -> pinned host": (host.data_ptr(), own.data_ptr()),
        }
        timings = {}
        for name, (dst, src) in copies.items():
            fn = lambda s, d=dst, x=src, n=size: copy_async(d, x, n, s)  # noqa: E731
            time_op(fn, stream, 3)
            timings[name] = time_op(fn, stream, reps)
        rows.append((label, timings))
    mapping.close()
    return rows


def process_a(to_b, from_b, reps):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    address = word_address(word)
    stream = torch.cuda.Stream(device)
    value = 0
    while True:
        command = from_b.get()
        if command == "stop":
            break
        if command == "park":
            value += 1
            park(stream, address, value)
            done = torch.cuda.Event()
            done.record(stream)
            time.sleep(0.01)  # the wait is on the GPU by now
            to_b.put("parked")
            assert from_b.get() == "release"
            word[0] = value
            done.synchronize()
            to_b.put("released")
        elif command == "export":
            kept = torch.empty(64 << 20, dtype=torch.uint8, device=device)
            to_b.put(export(kept))
        elif command == "release-latency":
            samples = []
            for _ in range(reps):
                value += 1
                park(stream, address, value)
                done = torch.cuda.Event()
                done.record(stream)
                time.sleep(0.002)
                start = time.perf_counter()
                word[0] = value
                while not done.query():
                    pass
                samples.append((time.perf_counter() - start) * 1e6)
            to_b.put(statistics.median(samples))


def process_b(to_a, from_a, reps, results):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device)
    table = ops(device)
    for fn in table.values():  # warm up
        time_op(fn, stream, 3)
    rows = []
    for name, fn in table.items():
        idle = time_op(fn, stream, reps)
        to_a.put("park")
        assert from_a.get() == "parked"
        parked = time_op(fn, stream, reps)
        to_a.put("release")
        assert from_a.get() == "released"
        rows.append((name, idle, parked))
    to_a.put("release-latency")
    release_idle = from_a.get()
    # The same while B keeps a copy engine busy with 1 MiB D2H copies.
    src = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    to_a.put("release-latency")
    deadline = time.perf_counter() + 30
    while True:
        with torch.cuda.stream(stream):
            host.copy_(src, non_blocking=True)
        stream.synchronize()
        try:
            release_busy = from_a.get_nowait()
            break
        except Exception:  # noqa: BLE001 - queue.Empty
            if time.perf_counter() > deadline:
                raise
    to_a.put("export")
    ipc = ipc_rows(Mapping(from_a.get(), device), stream, reps)
    to_a.put("stop")
    results.put((rows, release_idle, release_busy, ipc))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    to_a, to_b, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    a = ctx.Process(target=process_a, args=(to_b, to_a, args.reps))
    b = ctx.Process(target=process_b, args=(to_a, to_b, args.reps, results))
    a.start()
    b.start()
    rows, release_idle, release_busy, ipc = results.get(timeout=240)
    a.join(30)
    b.join(30)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
          f"B's op, queue to done, median of {args.reps} (us)")
    print(f"| B's op | A idle | A's stream parked on a word |")
    print("|---|---|---|")
    for name, idle, parked in rows:
        print(f"| {name} | {idle:.1f} | {parked:.1f} |")
    print(f"A's parked stream passes {release_idle:.1f} us after its word is set "
          f"(B idle), {release_busy:.1f} us (B copying)")
    names = list(ipc[0][1])
    print(f"\nB's copies between its memory and A's (opened through CUDA IPC), queue to done, "
          f"median of {args.reps} (us)")
    print("| size | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for label, timings in ipc:
        print(f"| {label} | " + " | ".join(f"{timings[n]:.1f}" for n in names) + " |")


if __name__ == "__main__":
    main()
