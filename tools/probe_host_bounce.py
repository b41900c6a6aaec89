"""What a copy within one GPU costs when both of its hops cross pinned host memory (the bounce
of a GPU that reaches no peer GPU: ranks sharing one GPU), by chunk size: the two hops whole,
one after the other (the serial floor), and two lanes of chunks a hop apart (what smfree
queues: one lane's hop in beside the other's hop out, on the copy engines of the two
directions). Each alone and with two such copies at once (two ranks' sends sharing the
GPU's copy engines). Also how long a stream parked on a word (cuStreamWaitValue32) takes to
pass once another stream writes the word, with the word in pinned host memory and in device
memory, after short and long parks. Raw driver copies, no smfree; one GPU:
    python3 tools/probe_host_bounce.py [sizes in MiB, default 1,4,16,64]
"""

import ctypes
import statistics
import sys
import time

import torch

from smfree_pg.bench.cuda_driver import check, copy_async, driver

MiB = 1 << 20
ITERS, REPS = 10, 5
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)


class Copy:
    """One copy within the GPU through a pinned host bounce, on its caller stream and a lane
    stream beside it."""

    def __init__(self, size):
        self.size = size
        self.src = torch.randint(0, 1 << 30, (size // 4,), dtype=torch.int32, device=dev)
        self.dst = torch.empty_like(self.src)
        self.bounce = torch.empty(max(size, 8 * MiB), dtype=torch.uint8, pin_memory=True)
        self.stream, self.lane = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def serial(self):
        b, s = self.bounce.data_ptr(), self.stream
        copy_async(b, self.src.data_ptr(), self.size, s)
        copy_async(self.dst.data_ptr(), b, self.size, s)

    def lanes(self, chunk):
        started, done = torch.cuda.Event(), torch.cuda.Event()
        src, dst, b = self.src.data_ptr(), self.dst.data_ptr(), self.bounce.data_ptr()
        for index, at in enumerate(range(0, self.size, chunk)):
            lane, n = index % 2, min(chunk, self.size - at)
            on = self.lane if lane else self.stream
            if index == 1:
                self.lane.wait_event(started)
            copy_async(b + lane * chunk, src + at, n, on)
            if index == 0:
                started.record(self.stream)
            copy_async(dst + at, b + lane * chunk, n, on)
        if self.size > chunk:
            done.record(self.lane)
            self.stream.wait_event(done)


def timed(copies, queue):
    """µs per round (each copy queued once), median of REPS loops of ITERS rounds."""
    out = []
    for rep in range(REPS + 1):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record(copies[0].stream)
        for c in copies[1:]:
            c.stream.wait_event(start)
        for _ in range(ITERS):
            for c in copies:
                queue(c)
        end = torch.cuda.Event(enable_timing=True)
        for c in copies[1:]:
            e = torch.cuda.Event()
            e.record(c.stream)
            copies[0].stream.wait_event(e)
        end.record(copies[0].stream)
        end.synchronize()
        if rep:
            out.append(start.elapsed_time(end) * 1e3 / ITERS)
    return statistics.median(out)


def bounce_table(sizes):
    print(f"{torch.cuda.get_device_name(0)}: a copy within the GPU through pinned host memory; "
          f"µs per copy (per pair of copies for 'x2'), median of {REPS} loops of {ITERS}")
    print("| size | serial | " + " | ".join(f"lanes {c} MiB" for c in (0.5, 1, 2, 4)) +
          " | serial x2 | lanes 1 MiB x2 | lanes 2 MiB x2 |")
    print("|---" * 9 + "|")
    for size in sizes:
        a, b = Copy(size), Copy(size)
        row = [timed([a], Copy.serial)]
        for chunk in (MiB // 2, MiB, 2 * MiB, 4 * MiB):
            row.append(timed([a], lambda c, k=chunk: c.lanes(k)))
            if not torch.equal(a.dst, a.src):
                raise SystemExit(f"lanes {chunk}: wrong bytes")
            a.dst.zero_()
        row.append(timed([a, b], Copy.serial))
        row.append(timed([a, b], lambda c: c.lanes(MiB)))
        row.append(timed([a, b], lambda c: c.lanes(2 * MiB)))
        print(f"| {size // MiB} MiB | " + " | ".join(f"{v:.1f}" for v in row) + " |")


def park(stream, address, value):
    check(driver().cuStreamWaitValue32_v2(ctypes.c_void_p(stream.cuda_stream),
                                           ctypes.c_uint64(address), ctypes.c_uint32(value),
                                           ctypes.c_uint(0)), "cuStreamWaitValue32")


def write(stream, address, value):
    check(driver().cuStreamWriteValue32_v2(ctypes.c_void_p(stream.cuda_stream),
                                            ctypes.c_uint64(address), ctypes.c_uint32(value),
                                            ctypes.c_uint(0)), "cuStreamWriteValue32")


def wake_table():
    """A stream parks on a word; another writes it after a delay (a sleep kernel-free wait on
    the CPU); the GPU time from the write to the parked stream passing."""
    host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    address = ctypes.c_uint64()
    check(driver().cuMemHostGetDevicePointer_v2(ctypes.byref(address),
                                                 ctypes.c_void_p(host.data_ptr()), 0),
          "cuMemHostGetDevicePointer")
    device_word = torch.zeros(1, dtype=torch.int32, device=dev)
    words = {"pinned host": address.value, "device": device_word.data_ptr()}
    waiter, writer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    gate = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    gate_address = ctypes.c_uint64()
    check(driver().cuMemHostGetDevicePointer_v2(ctypes.byref(gate_address),
                                                 ctypes.c_void_p(gate.data_ptr()), 0),
          "cuMemHostGetDevicePointer")
    print("\nA parked stream passing once another stream writes its word (µs, GPU events, "
          "median of 20)")
    print("| word in | parked 0.05 ms | parked 2 ms |")
    print("|---|---|---|")
    value = 0
    for name, word in words.items():
        row = []
        for park_s in (0.00005, 0.002):
            samples = []
            for _ in range(20):
                value += 1
                park(waiter, word, value)
                passed = torch.cuda.Event(enable_timing=True)
                passed.record(waiter)
                park(writer, gate_address.value, value)  # the writer waits for the CPU
                written = torch.cuda.Event(enable_timing=True)
                written.record(writer)
                write(writer, word, value)
                time.sleep(park_s)
                gate[0] = value
                passed.synchronize()
                samples.append(written.elapsed_time(passed) * 1e3)
            row.append(statistics.median(samples))
        print(f"| {name} | {row[0]:.1f} | {row[1]:.1f} |")


def main():
    sizes = [int(s) * MiB for s in (sys.argv[1] if len(sys.argv) > 1 else "1,4,16,64").split(",")]
    bounce_table(sizes)
    wake_table()


main()
