# What the receiver's `ready` hop costs a stream of copies into one reused buffer, and what a
# receiver-side staging slot saves. One process, raw driver calls, host-pinned words, GPU 0 to
# GPU 1, 200 ops per variant, best of 3. Needs 2 GPUs:
#   python3 tools/probe_staging.py
# direct: GPU 0's stream waits R >= i-1, copies src -> dst, writes D = i;
#         GPU 1's user stream waits D >= i, writes R = i (the buffer is free again).
# staged: GPU 0's stream waits EMPTIED[k] >= u, copies src -> slot k, writes FULL[k] = u+1;
#         GPU 1's copy-out stream waits R >= i-1 and FULL[k] >= u+1, copies slot k -> dst,
#         writes D = i and EMPTIED[k] = u+1; the user stream as above.
import ctypes

import torch

cu = ctypes.CDLL("libcuda.so.1")
MOST = 16 << 20
SLOTS = 2
R, D, FULL, EMPTIED = 0, 4, 64, 128  # byte offsets of the words


def check(result, what):
    if result != 0:
        raise RuntimeError(f"{what} failed: CUDA error {result}")


src = torch.ones(MOST, dtype=torch.uint8, device="cuda:0")
dst = torch.empty(MOST, dtype=torch.uint8, device="cuda:1")
slots = [torch.empty(MOST, dtype=torch.uint8, device="cuda:1") for _ in range(SLOTS)]
dst[:16].copy_(src[:16])  # enables peer access, without which copies go through the host
sender = torch.cuda.Stream("cuda:0")
user = torch.cuda.Stream("cuda:1")
copy_out = torch.cuda.Stream("cuda:1")
words = torch.zeros(1024, dtype=torch.int32)
check(torch.cuda.cudart().cudaHostRegister(words.data_ptr(), 4096, 3), "cudaHostRegister")


def wait(stream, offset, value):
    check(cu.cuStreamWaitValue32_v2(ctypes.c_void_p(stream.cuda_stream),
                                    ctypes.c_uint64(words.data_ptr() + offset),
                                    ctypes.c_uint32(value), ctypes.c_uint(0)), "wait")


def write(stream, offset, value):
    check(cu.cuStreamWriteValue32_v2(ctypes.c_void_p(stream.cuda_stream),
                                     ctypes.c_uint64(words.data_ptr() + offset),
                                     ctypes.c_uint32(value), ctypes.c_uint(0)), "write")


def copy(to, frm, size, stream):
    check(cu.cuMemcpyAsync(ctypes.c_uint64(to), ctypes.c_uint64(frm), ctypes.c_size_t(size),
                           ctypes.c_void_p(stream.cuda_stream)), "cuMemcpyAsync")


def direct(i, size):
    wait(sender, R, i - 1)
    copy(dst.data_ptr(), src.data_ptr(), size, sender)
    write(sender, D, i)
    with torch.cuda.device(1):
        wait(user, D, i)
        write(user, R, i)


def staged(i, size):
    k, use = (i - 1) % SLOTS, (i - 1) // SLOTS
    wait(sender, EMPTIED + 4 * k, use)
    copy(slots[k].data_ptr(), src.data_ptr(), size, sender)
    write(sender, FULL + 4 * k, use + 1)
    with torch.cuda.device(1):
        wait(copy_out, R, i - 1)
        wait(copy_out, FULL + 4 * k, use + 1)
        copy(dst.data_ptr(), slots[k].data_ptr(), size, copy_out)
        write(copy_out, D, i)
        write(copy_out, EMPTIED + 4 * k, use + 1)
        wait(user, D, i)
        write(user, R, i)


def microseconds_per_op(variant, size, ops):
    words.zero_()
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(1):
        start.record(user)
    for i in range(1, ops + 1):
        variant(i, size)
    with torch.cuda.device(1):
        end.record(user)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    return start.elapsed_time(end) * 1e3 / ops


for size in (16 << 20, 4 << 20, 1 << 20):
    figures = []
    for name, variant in (("direct", direct), ("staged", staged)):
        microseconds_per_op(variant, size, 20)
        best = min(microseconds_per_op(variant, size, 200) for _ in range(3))
        figures.append(f"{name} {best:6.1f} us")
    print(f"{size >> 20:>3} MiB per op: " + ", ".join(figures), flush=True)
