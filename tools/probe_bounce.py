# What a copy within one GPU costs on copy engines alone, by how its two hops through a peer
# GPU are queued: the serial hops on one stream; two streams handing each chunk over (the
# second hop pulled by the GPU itself or pushed by the peer); two lanes of chunks a hop apart,
# handing over only at their start and end (what smfree does); both hops whole at once (the
# floor); one hop; and the driver's copy (SMs). Also each beside a 2-GPU exchange of the same
# size both ways, as an all-gather's own piece runs. Raw driver copies, no smfree. Needs 2 GPUs:
#   python3 tools/probe_bounce.py [sizes in MiB, default 16,32,64,256]
import statistics
import sys

import torch

from smfree_pg.bench.cuda_driver import copy_async

MiB = 1 << 20
ITERS, REPS = 10, 5
g0, g1 = torch.device("cuda", 0), torch.device("cuda", 1)
torch.cuda.set_device(g0)
for a, b in ((g0, g1), (g1, g0)):
    torch.ones(1, device=b).copy_(torch.ones(1, device=a))  # torch enables peer access
S, H = torch.cuda.Stream(g0), torch.cuda.Stream(g0)
P = torch.cuda.Stream(g1)
X0, X1 = torch.cuda.Stream(g0), torch.cuda.Stream(g1)


def serial(dst, src, bounce, size, chunk):
    for at in range(0, size, chunk):
        n = min(chunk, size - at)
        copy_async(bounce, src + at, n, S)
        copy_async(dst + at, bounce, n, S)


def pipelined(dst, src, bounce, size, chunk, second):
    """Halves of the bounce in turn: hop 1 on S, hop 2 on `second` (H on GPU 0: a pull; P on
    GPU 1: a push)."""
    filled = [torch.cuda.Event(), torch.cuda.Event()]
    emptied = [torch.cuda.Event(), torch.cuda.Event()]
    for index, at in enumerate(range(0, size, chunk)):
        half, n = index % 2, min(chunk, size - at)
        if index >= 2:
            S.wait_event(emptied[half])
        copy_async(bounce + half * chunk, src + at, n, S)
        filled[half].record(S)
        second.wait_event(filled[half])
        copy_async(dst + at, bounce + half * chunk, n, second)
        emptied[half].record(second)
    done = torch.cuda.Event()
    done.record(second)
    S.wait_event(done)


def lanes(dst, src, bounce, size, chunk):
    """Even chunks on S through the bounce's first half, odd ones on H through its second,
    H starting once S's first hop is done."""
    started, done = torch.cuda.Event(), torch.cuda.Event()
    for index, at in enumerate(range(0, size, chunk)):
        lane, n = index % 2, min(chunk, size - at)
        on = H if lane else S
        if index == 1:
            H.wait_event(started)
        copy_async(bounce + lane * chunk, src + at, n, on)
        if index == 0:
            started.record(S)
        copy_async(dst + at, bounce + lane * chunk, n, on)
    done.record(H)
    S.wait_event(done)


def whole_at_once(dst, src, bounce, size, filled_bounce):
    start = torch.cuda.Event()
    start.record(S)
    H.wait_event(start)
    copy_async(bounce, src, size, S)
    copy_async(dst, filled_bounce, size, H)
    done = torch.cuda.Event()
    done.record(H)
    S.wait_event(done)


def timed(queue, exchange=None):
    """µs per call, median of REPS loops of ITERS calls; with `exchange`, both ways at once."""
    out = []
    for rep in range(REPS + 1):
        torch.cuda.synchronize(g0), torch.cuda.synchronize(g1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(S)
        if exchange:
            X0.wait_event(start), X1.wait_event(start)
        for _ in range(ITERS):
            queue()
            if exchange:
                exchange()
        if exchange:
            for x in (X0, X1):
                e = torch.cuda.Event()
                e.record(x)
                S.wait_event(e)
        end.record(S)
        end.synchronize()
        if rep:
            out.append(start.elapsed_time(end) * 1e3 / ITERS)
    return statistics.median(out)


def main():
    sizes = [int(s) * MiB for s in (sys.argv[1] if len(sys.argv) > 1 else "16,32,64,256").split(",")]
    print(f"{torch.cuda.get_device_name(0)}; hops through cuda:1; µs per copy, median of {REPS}"
          f" loops of {ITERS}; +x: beside an exchange of the same size both ways")
    for size in sizes:
        src = torch.randint(0, 1 << 30, (size // 4,), dtype=torch.int32, device=g0)
        dst = torch.empty_like(src)
        bounce = torch.empty(max(size, 32 * MiB) // 4, dtype=torch.int32, device=g1)
        filled = src.to(g1)
        peer_in, peer_out = torch.empty_like(filled), filled.clone()
        mine_out = torch.empty_like(src)
        p, d, b, f = src.data_ptr(), dst.data_ptr(), bounce.data_ptr(), filled.data_ptr()

        def exchange():
            copy_async(peer_in.data_ptr(), p, size, X0)
            copy_async(mine_out.data_ptr(), peer_out.data_ptr(), size, X1)

        variants = {
            "one hop": lambda: copy_async(b, p, size, S),
            "driver (SMs)": lambda: copy_async(d, p, size, S),
            "serial, 16 MiB": lambda: serial(d, p, b, size, 16 * MiB),
            "both whole at once": lambda: whole_at_once(d, p, b, size, f),
        }
        for chunk in (8, 16):
            if chunk * MiB < size:
                variants[f"handover, {chunk} MiB"] = (
                    lambda c=chunk: pipelined(d, p, b, size, c * MiB, H))
                variants[f"handover push, {chunk} MiB"] = (
                    lambda c=chunk: pipelined(d, p, b, size, c * MiB, P))
                variants[f"lanes, {chunk} MiB"] = lambda c=chunk: lanes(d, p, b, size, c * MiB)
        rows = []
        for name, queue in variants.items():
            alone = timed(queue)
            if name not in ("one hop", "driver (SMs)") and not torch.equal(dst, src):
                raise SystemExit(f"{name} {size // MiB} MiB: wrong bytes")
            dst.zero_()
            rows.append((name, alone, timed(queue, exchange)))
        print(f"\n{size // MiB} MiB   exchange alone {timed(lambda: None, exchange):8.1f}")
        for name, alone, beside in rows:
            print(f"  {name:22s} {alone:8.1f}   +x {beside:8.1f}")


main()
