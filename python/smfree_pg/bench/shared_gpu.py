"""Ranks sharing a GPU: ranks 0 and 1, both on cuda:0, exchange a buffer each way (each one isend
and one irecv in batch_isend_irecv, then wait) per size; a loop of `iters` exchanges is timed
until the GPU has done them, `reps` loops, the slower rank's time per loop. Beside it the copy
floors (floors.py), timed by rank 0 alone on the same GPU in the same run while rank 1 waits.
NCCL refuses two ranks on one GPU, so there is no reference backend here: smfree runs under the
environment's SMFREE_ settings (run again with others to compare them, e.g.
SMFREE_LOCAL_COPIES=driver). Every exchange's bytes are checked.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from smfree_pg.bench.cli import at_least
from smfree_pg.bench.context import Ctx, barrier, gather, log, raise_on_errors, synchronize
from smfree_pg.bench.data import mismatch, pattern
from smfree_pg.bench.floors import FLOOR_TITLES, FLOORS, measure_floors
from smfree_pg.bench.report import format_table, num
from smfree_pg.bench.sizes import format_size, parse_sizes
from smfree_pg.bench.stats import scaled, slowest, spread

NAME = "shared_gpu"
DEVICES = ("cuda",)
PLACEMENTS = ("shared",)
# Default exchanges per loop: about this many bytes each way, clamped.
BYTES_PER_LOOP = 256 << 20
MIN_ITERS, MAX_ITERS = 10, 200


def add_arguments(parser) -> None:
    group = parser.add_argument_group("shared_gpu")
    add = group.add_argument
    add("--shared-gpu-sizes", type=parse_sizes, default="4K,64K,1M,4M,16M,64M",
        help="bytes each way, comma-separated (default: %(default)s)")
    add("--shared-gpu-iters", type=int,
        help=f"exchanges per timed loop (default: about {format_size(BYTES_PER_LOOP)} each "
        f"way, clamped to {MIN_ITERS}..{MAX_ITERS})")
    add("--shared-gpu-warmup", type=int, default=5,
        help="untimed exchanges per size first (default: %(default)s)")
    add("--shared-gpu-reps", type=int, default=9,
        help="timed loops per size, of which the median is shown (default: %(default)s)")


def check_arguments(args, parser) -> None:
    if args.shared_gpu_iters is not None and args.shared_gpu_iters < 1:
        parser.error("--shared-gpu-iters must be at least 1")
    at_least(parser, args, 1, "shared_gpu_reps")
    at_least(parser, args, 0, "shared_gpu_warmup")


def default_iters(size: int) -> int:
    return max(MIN_ITERS, min(MAX_ITERS, BYTES_PER_LOOP // size))


def exchange(group, send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def exchange_seconds(ctx: Ctx, size: int, iters: int, warmup: int, reps: int
                     ) -> tuple[list[float], str | None]:
    """This rank's seconds per exchange, per loop, and what its received bytes got wrong."""
    group = ctx.groups["smfree"]
    send = pattern(ctx.rank, size // 4, ctx.device)
    recv = torch.zeros_like(send)
    for _ in range(warmup):
        exchange(group, send, recv, ctx.peer)
    samples = []
    for _ in range(reps):
        synchronize(ctx.device)
        start = time.perf_counter()
        for _ in range(iters):
            exchange(group, send, recv, ctx.peer)
        synchronize(ctx.device)
        samples.append((time.perf_counter() - start) / iters)
    return samples, mismatch(recv, ctx.peer, f"rank {ctx.rank}, {format_size(size)}")


def summarize_row(size: int, iters: int, per_rank: list[list[float]],
                  floors: dict[str, list[float]]) -> dict:
    """One size's figures, in µs: the exchange (loop by loop the slower rank's), each floor,
    and the exchange's median over each floor's."""
    exchange_us = scaled(spread(slowest(per_rank)), 1e6)
    floors_us = {name: scaled(spread(samples), 1e6) for name, samples in floors.items()}
    return {"bytes": size, "iters": iters, "exchange_us": exchange_us, "floors_us": floors_us,
            "over_floor": {name: exchange_us["median"] / floor["median"]
                           for name, floor in floors_us.items()}}


def settings() -> dict[str, str]:
    """The smfree settings the run is under (SMFREE_*, CUDA_DEVICE_MAX_CONNECTIONS)."""
    return {key: value for key, value in sorted(os.environ.items())
            if key.startswith("SMFREE_") or key == "CUDA_DEVICE_MAX_CONNECTIONS"}


def run(ctx: Ctx, args) -> dict:
    if not ctx.shared_gpu:
        raise RuntimeError("smfree bench: shared_gpu runs with every rank on one GPU")
    rows = []
    for size in args.shared_gpu_sizes:
        iters = args.shared_gpu_iters or default_iters(size)
        log(ctx, f"shared_gpu: {format_size(size)}, {args.shared_gpu_reps} x {iters} exchanges")
        barrier(ctx)
        samples, error = None, None
        if ctx.rank < 2:
            samples, error = exchange_seconds(ctx, size, iters, args.shared_gpu_warmup,
                                              args.shared_gpu_reps)
        raise_on_errors(gather(ctx, error), f"shared_gpu {format_size(size)}")
        per_rank = gather(ctx, samples)[:2]
        barrier(ctx)  # the floors run alone on the GPU
        floors = (measure_floors(ctx.device, size, iters, args.shared_gpu_reps)
                  if ctx.rank == 0 else None)
        floors = gather(ctx, floors)[0]
        rows.append(summarize_row(size, iters, per_rank, floors))
    return {"pair": [0, 1], "device": ctx.device.index, "settings": settings(),
            "floors": FLOORS,
            "units": {"exchange_us": "µs per exchange both ways, the slower rank's loop",
                      "floors_us": "µs per pass of the floor's copies, rank 0 alone",
                      "over_floor": "exchange median / floor median"},
            "rows": rows}


def print_section(section: dict) -> None:
    shown = ", ".join(f"{k}={v}" for k, v in section["settings"].items()) or "the defaults"
    print(f"\nRanks sharing a GPU: ranks 0 and 1 on cuda:{section['device']} exchange both ways "
          f"(smfree under {shown}; NCCL refuses two ranks on one GPU, so no reference), beside "
          "the copy floors timed on that GPU in this run; x = exchange / floor")
    header = ["size", "smfree µs (p25-p75)"]
    for name in FLOORS:
        header += [f"{FLOOR_TITLES[name]} µs", "x"]
    rows = []
    for row in section["rows"]:
        ours = row["exchange_us"]
        line = [format_size(row["bytes"]),
                f"{num(ours['median'])} ({num(ours['p25'])}-{num(ours['p75'])})"]
        for name in FLOORS:
            line += [num(row["floors_us"][name]["median"]), num(row["over_floor"][name], 2)]
        rows.append(line)
    print(format_table(header, rows), flush=True)
    print("floors: " + "; ".join(f"{FLOOR_TITLES[n]} = {what}"
                                 for n, what in section["floors"].items()), flush=True)
