"""Bandwidth: time per op and GB/s for message sizes 4 KiB ... 1 GiB.

One way (rank 0 sends, rank 1 receives) and both ways at once (each rank sends and receives),
over smfree and over NCCL, posted from Python as users post them, the two backends' timed loops
taking turns; beside them a single process's peer copy (`dst.copy_(src)` from rank 0's GPU to
rank 1's, and back), the copy engines' own limit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from smfree_pg.bench.cli import at_least
from smfree_pg.bench.context import CUDA_BACKENDS, Ctx, barrier, gather, log, raise_on_errors
from smfree_pg.bench.data import mismatch, pattern
from smfree_pg.bench.p2p import exchange, oneway_step
from smfree_pg.bench.report import format_table, num
from smfree_pg.bench.sizes import format_size, parse_sizes

NAME = "bandwidth"
DEVICES = ("cuda",)
PLACEMENTS = ("own",)
MODES = ("oneway", "bidir")
MODE_TITLES = {
    "oneway": "one way (rank 0 sends, rank 1 receives)",
    "bidir": "both ways at once (each rank sends and receives)",
}
DEFAULT_SIZES = "4K,64K,1M,16M,64M,256M,1G"
# Default timed ops per loop: about this many bytes, so 1 GiB loops stay short and 4 KiB loops
# run long enough (tens of ms) that the clock and the barrier's skew average out.
BYTES_PER_LOOP = 8 << 30
MIN_ITERS, MAX_ITERS = 20, 1000


def add_arguments(parser) -> None:
    bandwidth = parser.add_argument_group("bandwidth")
    bandwidth.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES,
                           help="message sizes, comma-separated, K/M/G = KiB/MiB/GiB "
                           "(default: %(default)s)")
    bandwidth.add_argument("--iters", type=int,
                           help=f"timed ops per loop (default: about {format_size(BYTES_PER_LOOP)} "
                           f"of messages, clamped to {MIN_ITERS}..{MAX_ITERS})")
    bandwidth.add_argument("--warmup", type=int, default=5,
                           help="untimed ops before the timed loops (default: %(default)s)")
    bandwidth.add_argument("--reps", type=int, default=3,
                           help="timed loops per backend, the backends taking turns; the median "
                           "counts (default: %(default)s)")


def check_arguments(args, parser) -> None:
    if args.iters is not None and args.iters < 1:
        parser.error("--iters must be at least 1")
    at_least(parser, args, 1, "reps")
    at_least(parser, args, 0, "warmup")


def default_iters(size: int) -> int:
    return max(MIN_ITERS, min(MAX_ITERS, BYTES_PER_LOOP // size))


def seconds_per_op(step, iters: int) -> float:
    """Wall-clock time per op of `iters` ops posted back to back, until the GPU has done them."""
    start = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def p2p_step(ctx: Ctx, backend: str, mode: str, send, recv) -> Callable[[], None]:
    group = ctx.groups[backend]
    if mode == "oneway":
        return oneway_step(ctx, group, send, recv)
    return lambda: exchange(group, send, recv, ctx.peer)


def measure_p2p(ctx: Ctx, mode: str, send, recvs: dict, iters: int, args):
    """This rank's seconds per op in each timed loop, by backend, and what was wrong with the
    data, if anything.

    The backends take turns loop by loop, the first one alternating, so that a drift in the
    machine's state (clocks, other tenants) falls on both alike and each round pairs them.
    """
    if ctx.peer is None:
        for _ in range(args.reps * len(CUDA_BACKENDS)):
            barrier(ctx)
        return {backend: [] for backend in CUDA_BACKENDS}, None
    steps = {b: p2p_step(ctx, b, mode, send, recvs[b]) for b in CUDA_BACKENDS}
    for backend in CUDA_BACKENDS:
        recvs[backend].zero_()
        for _ in range(args.warmup):
            steps[backend]()
    torch.cuda.synchronize()
    times = {backend: [] for backend in CUDA_BACKENDS}
    for rep in range(args.reps):
        for backend in CUDA_BACKENDS[::-1] if rep % 2 else CUDA_BACKENDS:
            barrier(ctx)
            times[backend].append(seconds_per_op(steps[backend], iters))
    if mode == "oneway" and ctx.rank < ctx.peer:
        return times, None
    for backend in CUDA_BACKENDS:
        where = f"rank {ctx.rank}, {backend} {mode}, {format_size(send.numel() * 4)}"
        if error := mismatch(recvs[backend], ctx.peer, where):
            return times, error
    return times, None


def figure(seconds: list[float], size: int) -> dict:
    """Median time per op of the timed loops, in µs, and GB/s (bytes one way / time per op)."""
    median = statistics.median(seconds)
    return {"us": median * 1e6, "GBps": size / median / 1e9, "us_reps": [s * 1e6 for s in seconds]}


def pair_figure(per_rank: list[list[float]], size: int) -> dict:
    """Rank 0's pair: in each timed loop the slower of the two ranks counts."""
    slower = [max(a, b) for a, b in zip(per_rank[0], per_rank[1], strict=True)]
    result = figure(slower, size)
    result["rank_us_reps"] = [[s * 1e6 for s in times] for times in per_rank]
    return result


@dataclass
class PeerCopy:
    """One direction of a single-process peer copy, with streams of its own on both GPUs."""

    src: torch.Tensor
    dst: torch.Tensor
    stream: torch.cuda.Stream  # on src's GPU: torch runs the copy on that GPU's current stream
    dst_stream: torch.cuda.Stream  # on dst's GPU: torch fences the copy with that GPU's current one

    def issue(self) -> None:
        # Private streams on both sides keep the two directions from fencing each other.
        with torch.cuda.stream(self.dst_stream), torch.cuda.stream(self.stream):
            self.dst.copy_(self.src, non_blocking=True)


def time_peer_copies(copies: list[PeerCopy], iters: int) -> float:
    """Seconds per round (every copy once), by CUDA events on the first copy's stream."""
    first = copies[0].stream
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record(first)
    for copy in copies[1:]:
        copy.stream.wait_event(start)
    for _ in range(iters):
        for copy in copies:
            copy.issue()
    for copy in copies[1:]:
        done = torch.cuda.Event()
        done.record(copy.stream)
        first.wait_event(done)
    end.record(first)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def measure_copy_engine(ctx: Ctx, size: int, iters: int, args):
    """Rank 0 alone: peer copies between its GPU and rank 1's, one way and both ways at once.

    `dst.copy_(src, non_blocking=True)` across GPUs is a peer copy on the copy engines (torch
    enables peer access and issues cudaMemcpyAsync, as cudaMemcpyPeerAsync would). Returns
    (figures or None, error or None).
    """
    here, there = (torch.device("cuda", index) for index in ctx.devices[:2])
    if there == here or there.index >= torch.cuda.device_count():
        return None, None  # rank 0 cannot see rank 1's GPU (CUDA_VISIBLE_DEVICES per rank)
    from_here, from_there = pattern(0, size // 4, here), pattern(1, size // 4, there)
    forward = PeerCopy(from_here, torch.empty_like(from_there),
                       torch.cuda.Stream(here), torch.cuda.Stream(there))
    backward = PeerCopy(from_there, torch.empty_like(from_here),
                        torch.cuda.Stream(there), torch.cuda.Stream(here))
    figures = {}
    for mode, copies in (("oneway", [forward]), ("bidir", [forward, backward])):
        for copy in copies:
            copy.dst.zero_()
        synchronize(here, there)  # the zeroing ran on the default streams, the copies do not
        if args.warmup:
            time_peer_copies(copies, args.warmup)
        seconds = [time_peer_copies(copies, iters) for _ in range(args.reps)]
        for sender, copy in enumerate(copies):
            error = mismatch(copy.dst, sender, f"copy engine {mode}, {format_size(size)}")
            if error:
                return None, error
        figures[mode] = figure(seconds, size)
    return figures, None


def synchronize(*devices: torch.device) -> None:
    for device in devices:
        torch.cuda.synchronize(device)


def measure_row(ctx: Ctx, size: int, iters: int, args) -> dict:
    """smfree's and NCCL's figures for one message size, one way and both ways."""
    row = {"bytes": size, "iters": iters, "paired": {}}
    send, recvs = None, {}
    if ctx.peer is not None:
        send = pattern(ctx.rank, size // 4, ctx.device)
        recvs = {backend: torch.empty_like(send) for backend in CUDA_BACKENDS}
    for backend in CUDA_BACKENDS:
        row[backend] = {}
    for mode in MODES:
        times, error = measure_p2p(ctx, mode, send, recvs, iters, args)
        gathered = gather(ctx, (times, error))
        raise_on_errors([e for _, e in gathered], f"bandwidth {mode}")
        for backend in CUDA_BACKENDS:
            row[backend][mode] = fig = pair_figure([t[backend] for t, _ in gathered], size)
            log(ctx, f"bandwidth {format_size(size):>7} {backend:6} {mode:6} "
                     f"{fig['us']:10.1f} µs {fig['GBps']:8.2f} GB/s  ({iters} ops)")
        ratios = [nccl / smfree for smfree, nccl in
                  zip(row["smfree"][mode]["us_reps"], row["nccl"][mode]["us_reps"], strict=True)]
        row["paired"][mode] = {"ratios": ratios, "ratio": statistics.median(ratios)}
    return row


def run(ctx: Ctx, args) -> dict:
    rows = [measure_row(ctx, size, args.iters or default_iters(size), args) for size in args.sizes]
    # The copy-engine limit comes after every P2P loop: it gives rank 0 a CUDA context on rank
    # 1's GPU. The other ranks wait in a Gloo gather meanwhile, which leaves the GPUs alone.
    for row in rows:
        size = row["bytes"]
        measured = (measure_copy_engine(ctx, size, row["iters"], args) if ctx.rank == 0
                    else (None, None))
        gathered = gather(ctx, measured)
        raise_on_errors([e for _, e in gathered], "copy engine")
        row["copy_engine"] = figures = gathered[0][0]
        if figures is None:
            log(ctx, "copy engine: skipped, rank 0 cannot see rank 1's GPU")
        for mode, fig in (figures or {}).items():
            log(ctx, f"bandwidth {format_size(size):>7} copy engine {mode:6} "
                     f"{fig['us']:10.1f} µs {fig['GBps']:8.2f} GB/s")
    return {
        "pair": [0, 1],
        "warmup": args.warmup,
        "reps": args.reps,
        "units": {"us": "µs per op (oneway: per send/recv; bidir: per exchange); median of reps, "
                        "the slower rank of the pair per rep",
                  "paired": "smfree GB/s / NCCL GB/s in each rep (the backends alternate rep by "
                            "rep), and their median",
                  "GBps": "bytes one way / time per op; 1 GB = 1e9 B"},
        "rows": rows,
    }


def print_section(section: dict) -> None:
    for mode in MODES:
        rows = []
        for row in section["rows"]:
            smfree, nccl = row["smfree"][mode], row["nccl"][mode]
            ce = (row["copy_engine"] or {}).get(mode)
            rows.append([
                format_size(row["bytes"]),
                num(smfree["us"]), num(smfree["GBps"], 2),
                num(nccl["us"]), num(nccl["GBps"], 2),
                num(ce and ce["us"]), num(ce and ce["GBps"], 2),
                num(row["paired"][mode]["ratio"], 2),
                num(ce and smfree["GBps"] / ce["GBps"], 2),
            ])
        header = ["size", "smfree µs", "smfree GB/s", "NCCL µs", "NCCL GB/s", "copy eng. µs",
                  "copy eng. GB/s", "smfree/NCCL", "smfree/copy eng."]
        print(f"\nBandwidth, {MODE_TITLES[mode]}; µs per op, GB/s = bytes one way / µs per op; "
              "smfree/NCCL = median over timed loops of their ratio in the same round")
        print(format_table(header, rows), flush=True)

