"""smfree's benchmark (docs/benchmarks.md): smfree beside NCCL in one run on one host.

1. bandwidth: time per op and GB/s for message sizes 4 KiB ... 1 GiB, one way (rank 0 sends,
   rank 1 receives) and both ways at once (each rank sends and receives), over smfree and over
   NCCL, posted from Python as users post them, the two backends' timed loops taking turns;
   beside them a single process's peer copy (`dst.copy_(src)` from rank 0's GPU to rank 1's,
   and back), the copy engines' own limit.
2. overlap: a bf16 GEMM loop on the compute stream while P2P moves tens of GiB each way on a
   side stream; the GEMM's slowdown under smfree and under NCCL traffic, and the GB/s moved.
3. profile: a torch.profiler trace of a few P2P ops over each backend; the CUDA kernels they
   launched and the memory copies the profiler saw.
4. pipeline: a synthetic 1F1B pipeline over every rank (rank r is stage r), GEMM stages with
   activations forward and gradients backward; step time over smfree and over NCCL
   (bench_pipeline.py).

Ranks pair up (0<->1, 2<->3, ...; with an odd world size the last rank idles) and all pairs run
at once; rank 0 prints its pair's figures and writes every figure to a JSON file (schema in
`new_report`), from which `python -m smfree_pg.plot` draws PNG plots. 1 GB = 1e9 bytes.

Needs at least 2 CUDA GPUs on one host. It spawns one rank per visible GPU itself:

    python -m smfree_pg.bench
    python -m smfree_pg.bench --only bandwidth --sizes 4K,1M,256M --json out/bw.json

or runs under torchrun, which it detects (RANK and WORLD_SIZE set) and then does not spawn:

    torchrun --nproc-per-node=4 -m smfree_pg.bench --only overlap
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

import smfree_pg
from smfree_pg import bench_pipeline

SCHEMA = "smfree-bench/1"
SECTIONS = ("bandwidth", "overlap", "profile", "pipeline")
BACKENDS = ("smfree", "nccl")
MODES = ("oneway", "bidir")
MODE_TITLES = {
    "oneway": "one way (rank 0 sends, rank 1 receives)",
    "bidir": "both ways at once (each rank sends and receives)",
}
DEFAULT_SIZES = "4K,64K,1M,16M,64M,256M,1G"
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# Default timed ops per loop: about this many bytes, so 1 GiB loops stay short and 4 KiB loops
# run long enough (tens of ms) that the clock and the barrier's skew average out.
BYTES_PER_LOOP = 8 << 30
MIN_ITERS, MAX_ITERS = 20, 1000
GEMM_WARMUP = 5
# NVLink multicast stays off on shared machines (NCCL reads these at communicator init).
RANK_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}
ENV_PREFIXES = ("SMFREE_", "NCCL_", "UCX_", "TORCH_NCCL_", "TORCH_SYMM_MEM_",
                "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")
# Profiler categories (kineto's activity types in the Chrome trace) of what runs on the GPU.
GPU_KINDS = {"kernel": "kernels", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


# ---------------------------------------------------------------------------------- arguments

def parse_size(text: str) -> int:
    """'64K' -> 65536: bytes, with an optional K, M or G (powers of 1024), a multiple of 4."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (text[:-1], text[-1]) if text[-1:] in UNITS else (text, "")
    try:
        size = int(number) * UNITS.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    # Buffers hold an int32 pattern, so every size must be whole int32s.
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return size


def parse_sizes(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",")]


def parse_sections(text: str) -> list[str]:
    chosen = {part.strip() for part in text.split(",")}
    unknown = chosen - set(SECTIONS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return [section for section in SECTIONS if section in chosen]


def format_size(size: int) -> str:
    for unit in ("G", "M", "K"):
        if size and size % UNITS[unit] == 0:
            return f"{size // UNITS[unit]} {unit}iB"
    return f"{size} B"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m smfree_pg.bench",
        description=__doc__.split("\n\n")[0],
    )
    add = parser.add_argument
    add("--only", type=parse_sections, default=",".join(SECTIONS),
        help="sections to run, comma-separated (default: %(default)s)")
    add("--json", default="bench-out/bench.json", metavar="PATH",
        help="where rank 0 writes every figure; profiler traces go beside it "
        "(default: %(default)s)")
    add("--nproc", type=int, help="ranks to spawn (default: visible GPUs, at least 2); "
        "ignored under torchrun")
    add("--timeout-min", type=float, default=5.0,
        help="group timeout in minutes; a section still running a minute past it ends "
        "the rank (default: %(default)s)")
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
    overlap = parser.add_argument_group("overlap")
    overlap.add_argument("--gemm-n", type=int, default=8192,
                         help="GEMM size: N x N times N x N (default: %(default)s)")
    overlap.add_argument("--gemms", type=int, default=40,
                         help="GEMMs per timed loop (default: %(default)s)")
    overlap.add_argument("--overlap-bytes", type=parse_size, default="32G",
                         help="P2P bytes each way during one GEMM loop, enough to outlast "
                         "it (default: %(default)s)")
    overlap.add_argument("--overlap-chunk", type=parse_size, default="256M",
                         help="bytes per P2P exchange during the GEMM loop (default: %(default)s)")
    overlap.add_argument("--overlap-preheat", type=int, default=200,
                         help="untimed GEMMs right before each timed loop, so that every loop "
                         "finds the GPU as hot as training keeps it; the traffic starts with the "
                         "timed loop (default: %(default)s)")
    overlap.add_argument("--overlap-reps", type=int, default=3,
                         help="rounds of (alone, smfree, NCCL); the median counts "
                         "(default: %(default)s)")
    bench_pipeline.add_arguments(parser)
    profile = parser.add_argument_group("profile")
    profile.add_argument("--profile-size", type=parse_size, default="16M",
                         help="bytes per op (default: %(default)s)")
    profile.add_argument("--profile-ops", type=int, default=4,
                         help="one-way ops, then as many exchanges, inside the trace "
                         "(default: %(default)s)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("iters", "nproc"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    for name in ("reps", "gemm_n", "gemms", "overlap_reps", "profile_ops"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.overlap_preheat < 0 or args.timeout_min <= 0:
        parser.error("--warmup and --overlap-preheat must be >= 0 and --timeout-min > 0")
    return args


def default_iters(size: int) -> int:
    return max(MIN_ITERS, min(MAX_ITERS, BYTES_PER_LOOP // size))


# -------------------------------------------------------------------------------- launching

def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.command = shlex.join(sys.orig_argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args.launcher = "torchrun"
        rank = int(os.environ["RANK"])
        run_rank(rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank)),
                 "env://", args)
        return
    args.launcher = "spawn"
    gpus = torch.cuda.device_count()
    nproc = args.nproc or max(2, gpus)
    if nproc < 2 or gpus < nproc:
        sys.exit(f"smfree bench: needs {max(2, nproc)} CUDA GPUs (one per rank), found {gpus}")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    # join=True: if a rank fails, spawn ends the others and raises its error here.
    mp.spawn(_spawned_rank, args=(nproc, init_method, args), nprocs=nproc, join=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned_rank(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    run_rank(rank, world, rank, init_method, args)


@dataclass
class Ctx:
    """One rank's place in the run: its GPU, its pair partner and the groups it uses."""

    rank: int
    world: int
    device: torch.device
    devices: list[int]  # every rank's CUDA device index
    peer: int | None  # None: the idle rank of an odd world
    groups: dict[str, dist.ProcessGroup]  # "smfree", "nccl": the groups measured
    ctrl: dist.ProcessGroup  # Gloo: barriers and gathers that put nothing on the GPUs
    started: float


def run_rank(rank: int, world: int, local_rank: int, init_method: str, args) -> None:
    for key, value in RANK_ENV.items():
        os.environ.setdefault(key, value)
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(f"smfree bench: rank {rank} wants cuda:{local_rank}, but "
                           f"{torch.cuda.device_count()} CUDA devices are visible")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    timeout = timedelta(minutes=args.timeout_min)
    ctx = setup(rank, world, device, init_method, timeout)
    report = new_report(ctx, args)
    if rank == 0:
        print_header(report["meta"])
    sections = {"bandwidth": run_bandwidth, "overlap": run_overlap, "profile": run_profile,
                "pipeline": run_pipeline}
    for name in args.only:
        # A rank stuck in the GPU (a stream waiting forever) never sees the group timeout; this
        # ends it, with every thread's traceback, so the launcher ends the others.
        faulthandler.dump_traceback_later(timeout.total_seconds() + 60, exit=True)
        log(ctx, f"{name}: start")
        report[name] = sections[name](ctx, args)
        faulthandler.cancel_dump_traceback_later()
        if rank == 0:
            write_report(args.json, report)
            PRINTERS[name](report[name])
    barrier(ctx)
    if rank == 0:
        print(f"\nfigures written to {args.json}", flush=True)
    dist.destroy_process_group()


def setup(rank, world, device, init_method, timeout) -> Ctx:
    # device_id binds the default group to this GPU and builds NCCL's communicator now.
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                            timeout=timeout, device_id=device)
    ranks = list(range(world))
    smfree = dist.new_group(ranks, timeout=timeout, backend="smfree")
    ctrl = dist.new_group(ranks, timeout=timeout, backend="gloo")
    # One collective over all ranks first: NCCL wants that before pairs talk alone.
    dist.all_reduce(torch.ones(1, device=device))
    torch.cuda.synchronize()
    devices = [None] * world
    dist.all_gather_object(devices, device.index, group=ctrl)
    peer = rank ^ 1 if (rank ^ 1) < world else None
    return Ctx(rank, world, device, devices, peer, {"smfree": smfree, "nccl": dist.group.WORLD},
               ctrl, time.monotonic())


def barrier(ctx: Ctx) -> None:
    dist.all_reduce(torch.zeros(1), group=ctx.ctrl)


def gather(ctx: Ctx, obj) -> list:
    out = [None] * ctx.world
    dist.all_gather_object(out, obj, group=ctx.ctrl)
    return out


def raise_on_errors(errors: list[str | None], what: str) -> None:
    """Every rank raises when any rank saw wrong data, so none waits for the others."""
    bad = [error for error in errors if error]
    if bad:
        raise RuntimeError(f"smfree bench: {what}: wrong data\n" + "\n".join(bad))


def log(ctx: Ctx, message: str) -> None:
    if ctx.rank == 0:
        print(f"[{time.monotonic() - ctx.started:7.1f} s] {message}", flush=True)


def pattern(rank: int, numel: int, device: torch.device) -> torch.Tensor:
    """int32s that differ per sending rank and per position, to catch stale or misplaced bytes."""
    salt = 0x5BD1E995 ^ rank
    return torch.arange(numel, dtype=torch.int32, device=device).bitwise_xor_(salt)


def mismatch(received: torch.Tensor, sender: int, what: str) -> str | None:
    """None if `received` holds `sender`'s pattern, else where it first differs."""
    expected = pattern(sender, received.numel(), received.device)
    if torch.equal(received, expected):
        return None
    index = int((received != expected).nonzero()[0])
    return (f"{what}: data from rank {sender} differ first at int32 {index} of "
            f"{received.numel()}: got {int(received[index])}, expected {int(expected[index])}")


# -------------------------------------------------------------------------------- bandwidth

def oneway_step(ctx: Ctx, group, send: torch.Tensor, recv: torch.Tensor):
    """One op of the one-way test: the lower rank of the pair sends, the higher receives."""
    if ctx.rank < ctx.peer:
        return lambda: dist.isend(send, ctx.peer, group=group).wait()
    return lambda: dist.irecv(recv, ctx.peer, group=group).wait()


def exchange(group, send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    """Sends `send` to `peer` while receiving `recv` from it.

    Batched, as pipeline schedules do it: unbatched, NCCL runs each op as its own kernel on one
    stream, so the two directions would take turns (and both ranks isending a large tensor first
    hangs).
    """
    ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


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
        for _ in range(args.reps * len(BACKENDS)):
            barrier(ctx)
        return {backend: [] for backend in BACKENDS}, None
    steps = {b: p2p_step(ctx, b, mode, send, recvs[b]) for b in BACKENDS}
    for backend in BACKENDS:
        recvs[backend].zero_()
        for _ in range(args.warmup):
            steps[backend]()
    torch.cuda.synchronize()
    times = {backend: [] for backend in BACKENDS}
    for rep in range(args.reps):
        for backend in BACKENDS[::-1] if rep % 2 else BACKENDS:
            barrier(ctx)
            times[backend].append(seconds_per_op(steps[backend], iters))
    if mode == "oneway" and ctx.rank < ctx.peer:
        return times, None
    for backend in BACKENDS:
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
        recvs = {backend: torch.empty_like(send) for backend in BACKENDS}
    for backend in BACKENDS:
        row[backend] = {}
    for mode in MODES:
        times, error = measure_p2p(ctx, mode, send, recvs, iters, args)
        gathered = gather(ctx, (times, error))
        raise_on_errors([e for _, e in gathered], f"bandwidth {mode}")
        for backend in BACKENDS:
            row[backend][mode] = fig = pair_figure([t[backend] for t, _ in gathered], size)
            log(ctx, f"bandwidth {format_size(size):>7} {backend:6} {mode:6} "
                     f"{fig['us']:10.1f} µs {fig['GBps']:8.2f} GB/s  ({iters} ops)")
        ratios = [nccl / smfree for smfree, nccl in
                  zip(row["smfree"][mode]["us_reps"], row["nccl"][mode]["us_reps"], strict=True)]
        row["paired"][mode] = {"ratios": ratios, "ratio": statistics.median(ratios)}
    return row


def run_bandwidth(ctx: Ctx, args) -> dict:
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


# ---------------------------------------------------------------------------------- overlap

@dataclass
class Traffic:
    """The P2P load of the overlap test: `chunks` exchanges with the peer, on a side stream."""

    send: torch.Tensor
    recv: torch.Tensor
    peer: int
    chunks: int
    stream: torch.cuda.Stream

    def post(self, group, after: torch.cuda.Event
             ) -> tuple[torch.cuda.Event, torch.cuda.Event, Callable[[], None]]:
        """Posts every exchange from a thread of its own, so that the GEMM loop is queued at once
        even where wait() holds the CPU until the bytes have moved (smfree over UCX). The
        exchanges start on the GPU once `after` has happened.

        Returns start/end events and a function that joins the thread, raising its error.
        """
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                with torch.cuda.device(self.send.device), torch.cuda.stream(self.stream):
                    self.stream.wait_event(after)
                    start.record()
                    for _ in range(self.chunks):
                        exchange(group, self.send, self.recv, self.peer)
                    end.record()
            except BaseException as error:  # noqa: BLE001 - raised again by join()
                errors.append(error)

        thread = threading.Thread(target=run, name="bench-traffic")
        thread.start()

        def join() -> None:
            thread.join()
            if errors:
                raise errors[0]

        return start, end, join


def gemm_loop(a, b, c, count: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        torch.mm(a, b, out=c)
    end.record()
    return start, end


def overlap_trial(ctx: Ctx, backend: str | None, traffic: Traffic | None, matrices, count: int,
                  preheat: int):
    """One GEMM loop, alone (backend None) or under `traffic` over `backend`, right after
    `preheat` untimed GEMMs.

    A loop that followed an idle GPU ran about 5 % faster, at the same reported SM clock, than
    one that followed other GEMMs: without the preheat, the order of the conditions in a round
    showed up as a slowdown.

    Returns (figures, data error or None).
    """
    moving = backend is not None and traffic is not None
    if moving:
        traffic.recv.zero_()
    torch.cuda.synchronize()
    barrier(ctx)
    hot = gemm_loop(*matrices, preheat)[1]
    transfer = traffic.post(ctx.groups[backend], hot) if moving else None
    gemm = gemm_loop(*matrices, count)
    if moving:
        transfer[2]()
    torch.cuda.synchronize()
    sample = {"gemm_ms": gemm[0].elapsed_time(gemm[1]) / count}
    if not moving:
        return sample, None
    sample["transfer_ms"] = transfer[0].elapsed_time(transfer[1])
    # The slowdown is the whole loop's only if the traffic was still running when it ended.
    sample["covered"] = gemm[1].elapsed_time(transfer[1]) >= 0
    return sample, mismatch(traffic.recv, traffic.peer, f"rank {ctx.rank}, overlap over {backend}")


def summarize_overlap(samples: dict, n: int, bytes_each_way: int) -> dict:
    """Medians over the rounds; slowdown against the GEMM alone; GB/s each way under load.

    The paired slowdown compares each loop under traffic with the loop alone of its own
    round, which cancels the GPU's clock drifting between rounds.
    """
    alone = statistics.median(s["gemm_ms"] for s in samples["alone"])
    summary = {"alone_ms": alone, "alone_TFLOPs": 2 * n**3 / (alone * 1e-3) / 1e12,
               "alone_ms_reps": [s["gemm_ms"] for s in samples["alone"]]}
    for backend in BACKENDS:
        runs = samples[backend]
        gemm = statistics.median(s["gemm_ms"] for s in runs)
        transfer = statistics.median(s["transfer_ms"] for s in runs)
        summary[backend] = {
            "gemm_ms": gemm,
            "slowdown_pct": 100 * (gemm / alone - 1),
            "paired_slowdown_pct": 100 * statistics.median(
                s["gemm_ms"] / a["gemm_ms"] - 1 for s, a in zip(runs, samples["alone"])),
            "transfer_ms": transfer,
            "transfer_GBps": bytes_each_way / (transfer * 1e-3) / 1e9,
            "covered": all(s["covered"] for s in runs),
            "gemm_ms_reps": [s["gemm_ms"] for s in runs],
            "transfer_ms_reps": [s["transfer_ms"] for s in runs],
        }
    return summary


def run_overlap(ctx: Ctx, args) -> dict:
    n, count = args.gemm_n, args.gemms
    chunks = -(-args.overlap_bytes // args.overlap_chunk)
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    matrices = (a, torch.randn_like(a), torch.empty_like(a))
    traffic = None
    if ctx.peer is not None:
        send = pattern(ctx.rank, args.overlap_chunk // 4, ctx.device)
        traffic = Traffic(send, torch.empty_like(send), ctx.peer, chunks,
                          torch.cuda.Stream(ctx.device))
        for backend in BACKENDS:
            # Untimed: the first exchange maps buffers and builds communicators.
            exchange(ctx.groups[backend], traffic.send, traffic.recv, ctx.peer)
    for _ in range(GEMM_WARMUP):
        torch.mm(a, matrices[1], out=matrices[2])
    torch.cuda.synchronize()
    samples = {condition: [] for condition in ("alone", *BACKENDS)}
    for round_ in range(args.overlap_reps):
        for condition, runs in samples.items():
            backend = None if condition == "alone" else condition
            sample, error = overlap_trial(ctx, backend, traffic, matrices, count,
                                          args.overlap_preheat)
            raise_on_errors(gather(ctx, error), f"overlap under {condition}")
            runs.append(sample)
            extra = f", transfer {sample['transfer_ms']:.1f} ms" if "transfer_ms" in sample else ""
            log(ctx, f"overlap round {round_ + 1}/{args.overlap_reps} {condition:6} "
                     f"{sample['gemm_ms']:.3f} ms per GEMM{extra}")
    bytes_each_way = chunks * args.overlap_chunk
    summary = summarize_overlap(samples, n, bytes_each_way) if ctx.peer is not None else None
    return {
        "gemm_n": n,
        "gemms": count,
        "preheat_gemms": args.overlap_preheat,
        "dtype": "bfloat16",
        "chunk_bytes": args.overlap_chunk,
        "chunks": chunks,
        "bytes_each_way": bytes_each_way,
        "reps": args.overlap_reps,
        "ranks": gather(ctx, summary),
    }


# ---------------------------------------------------------------------------------- profile

def classify_trace(trace: dict) -> dict:
    """The GPU activities of a torch.profiler Chrome trace, counted by kind and name.

    Kineto labels each activity with its category: "kernel" (a kernel ran on SMs),
    "gpu_memcpy", "gpu_memset"; other GPU-side categories (synchronisation, annotations) are
    kept apart under "other_gpu", named "category: name".
    """
    found = {kind: Counter() for kind in (*GPU_KINDS.values(), "other_gpu")}
    memcpy_bytes = 0
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        category = str(event.get("cat", "")).lower()
        name = str(event.get("name", ""))
        if category in GPU_KINDS:
            found[GPU_KINDS[category]][name] += 1
        elif category.startswith("gpu_") or category == "cuda_sync":
            found["other_gpu"][f"{category}: {name}"] += 1
        if category == "gpu_memcpy":
            memcpy_bytes += int((event.get("args") or {}).get("bytes", 0))
    counts = {kind: dict(sorted(names.items())) for kind, names in found.items()}
    for kind in (*GPU_KINDS.values(), "other_gpu"):
        counts[f"{kind.rstrip('s')}_count"] = sum(found[kind].values())
    counts["memcpy_bytes"] = memcpy_bytes
    return counts


def profile_backend(ctx: Ctx, backend: str, args, out_dir: Path):
    """Traces `profile_ops` one-way ops and as many exchanges; (counts or None, data error)."""
    if ctx.peer is None:
        barrier(ctx)
        return None, None
    group = ctx.groups[backend]
    send = pattern(ctx.rank, args.profile_size // 4, ctx.device)
    recv = torch.empty_like(send)
    oneway = oneway_step(ctx, group, send, recv)

    def ops():
        for _ in range(args.profile_ops):
            oneway()
        for _ in range(args.profile_ops):
            exchange(group, send, recv, ctx.peer)

    ops()  # untraced: first use maps buffers and builds communicators
    recv.zero_()
    torch.cuda.synchronize()
    barrier(ctx)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ops()
        torch.cuda.synchronize()
    error = mismatch(recv, ctx.peer, f"rank {ctx.rank}, profile over {backend}")
    trace = out_dir / f"profile-{backend}-rank{ctx.rank}.json"
    prof.export_chrome_trace(str(trace))
    counts = classify_trace(json.loads(trace.read_text()))
    # The same trace through prof.events(): every activity the profiler put on a CUDA device.
    counts["cuda_events"] = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    counts["trace"] = str(trace)
    return counts, error


def run_profile(ctx: Ctx, args) -> dict:
    out_dir = Path(args.json).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"bytes": args.profile_size, "oneway_ops": args.profile_ops,
              "exchanges": args.profile_ops,
              # per rank of a pair: one isend or irecv per one-way op, both per exchange
              "p2p_ops": 3 * args.profile_ops}
    for backend in BACKENDS:
        counts, error = profile_backend(ctx, backend, args, out_dir)
        gathered = gather(ctx, (counts, error))
        raise_on_errors([e for _, e in gathered], f"profile over {backend}")
        result[backend] = [c for c, _ in gathered]
        if counts is not None:
            log(ctx, f"profile {backend}: {counts['kernel_count']} kernels, "
                     f"{counts['memcpy_count']} memcpy on rank {ctx.rank}")
    return result


# ----------------------------------------------------------------------------------- output

def ucx_version() -> str | None:
    """Where smfree's UCX comes from: the libucx wheel's version, or UCX_HOME."""
    wheels = sorted(f"{d.metadata['Name']} {d.version}" for d in metadata.distributions()
                    if (d.metadata["Name"] or "").lower().startswith("libucx"))
    if wheels:
        return ", ".join(wheels)
    return f"UCX_HOME={os.environ['UCX_HOME']}" if "UCX_HOME" in os.environ else None


def nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def new_report(ctx: Ctx, args) -> dict:
    """The JSON report before any section ran.

    Top level: "schema", "meta" (device, versions, command, options), then one key per section
    run: "bandwidth" (rows per size: "smfree"/"nccl"/"copy_engine" -> "oneway"/"bidir" ->
    {"us", "GBps", ...}), "overlap" (per rank: GEMM alone and under each backend's traffic) and
    "profile" (per backend, per rank: kernel and memcpy counts by name, trace path). Idle ranks
    appear as null.
    """
    a, b = ctx.devices[:2]
    options = {k: v for k, v in vars(args).items() if k not in ("command", "launcher")}
    meta = {
        "command": args.command,
        "launcher": args.launcher,
        "world_size": ctx.world,
        "pairs": [[r, r + 1] for r in range(0, ctx.world - 1, 2)],
        "devices": ctx.devices,
        "gpu": torch.cuda.get_device_name(ctx.device),
        "gpus_visible": torch.cuda.device_count(),
        "peer_access_0_1": torch.cuda.can_device_access_peer(a, b)
        if a != b and b < torch.cuda.device_count() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version(),
        "smfree": smfree_pg.__version__,
        "ucx": ucx_version(),
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "options": options,
    }
    return {"schema": SCHEMA, "meta": meta}


def write_report(path: str, report: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(title)] + [len(row[i]) for row in rows]) for i, title in enumerate(header)]
    lines = [" | ".join(t.rjust(w) for t, w in zip(header, widths, strict=True)),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_header(meta: dict) -> None:
    print(f"smfree bench: {meta['gpu']} (world size {meta['world_size']}, pairs "
          f"{', '.join(f'{a}<->{b}' for a, b in meta['pairs'])}; figures are rank 0's pair)")
    print(f"torch {meta['torch']} (CUDA {meta['cuda']}), NCCL {meta['nccl']}, "
          f"smfree {meta['smfree']}, UCX {meta['ucx'] or 'unknown'}, Python {meta['python']}, "
          f"peer access 0<->1: {meta['peer_access_0_1']}")
    print(f"command ({meta['launcher']}): {meta['command']}")
    settings = ", ".join(f"{k}={v}" for k, v in meta["env"].items())
    print(f"environment: {settings or 'no SMFREE_/UCX_/NCCL_ settings'}", flush=True)


def print_bandwidth(section: dict) -> None:
    for mode in MODES:
        rows = []
        for row in section["rows"]:
            smfree, nccl = row["smfree"][mode], row["nccl"][mode]
            ce = (row["copy_engine"] or {}).get(mode)
            rows.append([
                format_size(row["bytes"]),
                _num(smfree["us"]), _num(smfree["GBps"], 2),
                _num(nccl["us"]), _num(nccl["GBps"], 2),
                _num(ce and ce["us"]), _num(ce and ce["GBps"], 2),
                _num(row["paired"][mode]["ratio"], 2),
                _num(ce and smfree["GBps"] / ce["GBps"], 2),
            ])
        header = ["size", "smfree µs", "smfree GB/s", "NCCL µs", "NCCL GB/s", "copy eng. µs",
                  "copy eng. GB/s", "smfree/NCCL", "smfree/copy eng."]
        print(f"\nBandwidth, {MODE_TITLES[mode]}; µs per op, GB/s = bytes one way / µs per op; "
              "smfree/NCCL = median over timed loops of their ratio in the same round")
        print(format_table(header, rows), flush=True)


def print_overlap(section: dict) -> None:
    print(f"\nOverlap: bf16 GEMM {section['gemm_n']}^3 x {section['gemms']} while each rank "
          f"exchanges {section['chunks']} x {format_size(section['chunk_bytes'])} with its peer, "
          f"each loop right after {section['preheat_gemms']} untimed GEMMs "
          f"(median of {section['reps']} rounds)")
    rows, uncovered = [], []
    for rank, summary in enumerate(section["ranks"][:2]):
        if summary is None:
            continue
        smfree, nccl = summary["smfree"], summary["nccl"]
        rows.append([
            str(rank), _num(summary["alone_ms"], 3), _num(summary["alone_TFLOPs"], 0),
            _num(smfree["gemm_ms"], 3), f"{smfree['slowdown_pct']:+.1f} %",
            f"{smfree['paired_slowdown_pct']:+.1f} %",
            _num(nccl["gemm_ms"], 3), f"{nccl['slowdown_pct']:+.1f} %",
            f"{nccl['paired_slowdown_pct']:+.1f} %",
            _num(smfree["transfer_GBps"], 1), _num(nccl["transfer_GBps"], 1),
        ])
        uncovered += [f"rank {rank} {b}" for b in BACKENDS if not summary[b]["covered"]]
    header = ["rank", "ms/GEMM alone", "TFLOP/s", "ms/GEMM +smfree", "slowdown", "paired",
              "ms/GEMM +NCCL", "slowdown", "paired", "smfree GB/s", "NCCL GB/s"]
    print(format_table(header, rows))
    print("slowdown: of the medians; paired: median over rounds of each loop against the loop "
          "alone in its round\nGB/s: bytes each way / time of the transfer under load")
    if uncovered:
        print(f"WARNING: traffic ended before the GEMM loop ({', '.join(uncovered)}): the slowdown "
              "covers part of the loop only; raise --overlap-bytes")
    sys.stdout.flush()


def print_profile(section: dict) -> None:
    print(f"\nProfile: {section['oneway_ops']} one-way ops and {section['exchanges']} exchanges "
          f"of {format_size(section['bytes'])} ({section['p2p_ops']} P2P ops per rank)")
    rows, names = [], []
    for backend in BACKENDS:
        for rank, counts in enumerate(section[backend][:2]):
            if counts is None:
                continue
            rows.append([backend, str(rank), str(counts["kernel_count"]),
                         str(counts["memcpy_count"]), f"{counts['memcpy_bytes'] / 2**20:.1f}",
                         str(counts["memset_count"]), str(counts["other_gpu_count"]),
                         str(counts["cuda_events"])])
            for kind in ("kernels", "memcpy", "memset", "other_gpu"):
                listed = "; ".join(f"{name} x{n}" for name, n in counts[kind].items()) or "none"
                names.append(f"  {backend} rank {rank} {kind}: {listed}")
    header = ["backend", "rank", "kernels", "memcpy", "memcpy MiB", "memset", "other GPU",
              "CUDA events"]
    print(format_table(header, rows))
    print("\n".join(names), flush=True)


def run_pipeline(ctx: Ctx, args) -> dict:
    return bench_pipeline.run_pipeline(ctx, args, barrier, gather, raise_on_errors, log, BACKENDS)


def print_pipeline(section: dict) -> None:
    bench_pipeline.print_pipeline(section, format_table, format_size)


PRINTERS = {"bandwidth": print_bandwidth, "overlap": print_overlap, "profile": print_profile,
            "pipeline": print_pipeline}


if __name__ == "__main__":
    main()
