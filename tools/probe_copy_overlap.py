# Which part of smfree's copy costs a concurrent GEMM: the direction (push vs pull) or the
# flag operations around each copy? Raw driver calls, no smfree: two ranks exchange
# 120 x 256 MiB through CUDA IPC on a side stream while a bf16 GEMM 8192^3 loop runs,
# 9 rounds of every variant, GEMM alone measured before each. Needs 2 GPUs:
#   python3 tools/probe_copy_overlap.py
import ctypes, os, sys, statistics
import torch, torch.distributed as dist, torch.multiprocessing as mp

cu = ctypes.CDLL("libcuda.so.1")
class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]
def ck(r, what):
    if r != 0: raise RuntimeError(f"{what} -> {r}")

def export(t):
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    ck(cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(t.data_ptr())), "range")
    h = Handle()
    ck(cu.cuIpcGetMemHandle(ctypes.byref(h), base), "ipcget")
    return ctypes.string_at(ctypes.addressof(h), 64), t.data_ptr() - base.value

def open_(blob):
    raw, off = blob
    h = Handle(); ctypes.memmove(ctypes.addressof(h), raw, 64)
    p = ctypes.c_uint64()
    ck(cu.cuIpcOpenMemHandle_v2(ctypes.byref(p), h, ctypes.c_uint(1)), "ipcopen")
    return p.value + off

def worker(rank):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    N = 256 << 20
    src = torch.ones(N, dtype=torch.uint8, device="cuda")
    dst = torch.empty(N, dtype=torch.uint8, device="cuda")
    blobs = [None, None]
    dist.all_gather_object(blobs, (export(src), export(dst)))
    peer_src, peer_dst = open_(blobs[1 - rank][0]), open_(blobs[1 - rank][1])
    flag = torch.zeros(16, dtype=torch.int32, pin_memory=True)
    fptr = flag.data_ptr()
    M = 8192
    A = torch.randn(M, M, device="cuda", dtype=torch.bfloat16); B = torch.randn(M, M, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    sh = ctypes.c_void_p(side.cuda_stream)
    def gemms():
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(40): torch.mm(A, B)
        e.record(); return s, e
    for _ in range(5): torch.mm(A, B)
    def traffic(kind, flags, fence):
        for i in range(120):
            if flags:
                for w in range(2):
                    ck(cu.cuStreamWaitValue32_v2(sh, ctypes.c_uint64(fptr + 4 * w), ctypes.c_uint32(0), ctypes.c_uint(0)), "wait")
            d, s_ = (peer_dst, src.data_ptr()) if kind == "push" else (dst.data_ptr(), peer_src)
            ck(cu.cuMemcpyAsync(ctypes.c_uint64(d), ctypes.c_uint64(s_), ctypes.c_size_t(N), sh), "copy")
            if flags:
                for w in range(4):
                    ck(cu.cuStreamWriteValue32_v2(sh, ctypes.c_uint64(fptr + 8 + 4 * w), ctypes.c_uint32(i + 1),
                                                  ctypes.c_uint(0 if fence else 1)), "write")
    res = {}
    variants = [("push", False, True), ("pull", False, True), ("push", True, True), ("pull", True, True)]
    for rnd in range(9):
        for kind, flags, fence in variants:
            name = f"{kind}{'+flags' if flags else ''}{'' if fence else '(nofence)'}"
            torch.cuda.synchronize(); dist.barrier()
            s, e = gemms(); torch.cuda.synchronize(); alone = s.elapsed_time(e) / 40
            dist.barrier()
            t0 = torch.cuda.Event(enable_timing=True); t1 = torch.cuda.Event(enable_timing=True)
            t0.record(side)
            try:
                traffic(kind, flags, fence)
            except RuntimeError as err:
                res.setdefault(name, []).append(str(err)); torch.cuda.synchronize(); continue
            t1.record(side)
            s, e = gemms(); torch.cuda.synchronize()
            under = s.elapsed_time(e) / 40
            moved = 120 * N / (t0.elapsed_time(t1) * 1e-3) / 1e9
            covered = e.elapsed_time(t1) >= 0
            res.setdefault(name, []).append((100 * (under / alone - 1), moved, covered))
    if rank in (0, 1):
        for name, vals in res.items():
            if isinstance(vals[0], str): print(rank, name, vals[0]); continue
            print(f"rank {rank} {name:18s} slowdown median {statistics.median(v[0] for v in vals):+5.1f} %  "
                  f"all {[round(v[0],1) for v in vals]}  GB/s {statistics.median(v[1] for v in vals):.0f} covered {all(v[2] for v in vals)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(worker, nprocs=2)
