"""Round trip: the latency of a dependent exchange, and the CPU time wait() holds per op.

In each pair, the lower rank sends its buffer, waits, receives the reply, waits; the higher rank
receives, waits, and sends back what it received, waits. A loop of `iters` round trips is timed
until the device has done them (µs per round trip, the lower rank's clock), the backends' loops
taking turns, the first alternating; the ratio pairs each loop with the other backend's of the
same round. Every wait() is timed on the CPU, by kind (send, recv). The lower rank checks that
its own pattern came back.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from smfree_pg.bench.cli import at_least
from smfree_pg.bench.context import Ctx, barrier, gather, log, raise_on_errors, synchronize
from smfree_pg.bench.data import mismatch, pattern
from smfree_pg.bench.report import format_table, num
from smfree_pg.bench.sizes import format_size, parse_sizes
from smfree_pg.bench.stats import paired_ratios, scaled, spread
from smfree_pg.bench.waits import WaitClock, summarize_waits

NAME = "roundtrip"
DEVICES = ("cuda", "cpu")
PLACEMENTS = ("own",)
# Default round trips per loop: about this many bytes each way, clamped.
BYTES_PER_LOOP = 1 << 30
MIN_ITERS, MAX_ITERS = 20, 500
TITLES = {"smfree": "smfree", "nccl": "NCCL", "gloo": "Gloo"}


def add_arguments(parser) -> None:
    group = parser.add_argument_group("roundtrip")
    add = group.add_argument
    add("--roundtrip-sizes", type=parse_sizes, default="4K,32K,256K,1M,8M,16M,32M,64M",
        help="message sizes, comma-separated (default: %(default)s)")
    add("--roundtrip-iters", type=int,
        help=f"round trips per timed loop (default: about {format_size(BYTES_PER_LOOP)} each "
        f"way, clamped to {MIN_ITERS}..{MAX_ITERS})")
    add("--roundtrip-warmup", type=int, default=5,
        help="untimed round trips per backend first (default: %(default)s)")
    add("--roundtrip-reps", type=int, default=9,
        help="timed loops per backend, the backends taking turns (default: %(default)s)")


def check_arguments(args, parser) -> None:
    if args.roundtrip_iters is not None and args.roundtrip_iters < 1:
        parser.error("--roundtrip-iters must be at least 1")
    at_least(parser, args, 1, "roundtrip_reps")
    at_least(parser, args, 0, "roundtrip_warmup")


def default_iters(size: int) -> int:
    return max(MIN_ITERS, min(MAX_ITERS, BYTES_PER_LOOP // size))


def round_trip(ctx: Ctx, group, send: torch.Tensor, recv: torch.Tensor, clock: WaitClock) -> None:
    """One dependent round trip; the higher rank sends back the buffer it received into."""
    if ctx.rank < ctx.peer:
        clock.wait(dist.isend(send, ctx.peer, group=group), "send")
        clock.wait(dist.irecv(recv, ctx.peer, group=group), "recv")
    else:
        clock.wait(dist.irecv(recv, ctx.peer, group=group), "recv")
        clock.wait(dist.isend(recv, ctx.peer, group=group), "send")


def timed_loop(ctx: Ctx, group, send, recv, clock: WaitClock, iters: int) -> float:
    """Seconds per round trip of `iters` of them, until the device has done them."""
    synchronize(ctx.device)
    barrier(ctx)
    clock.recording = True
    start = time.perf_counter()
    for _ in range(iters):
        round_trip(ctx, group, send, recv, clock)
    synchronize(ctx.device)
    seconds = (time.perf_counter() - start) / iters
    clock.recording = False
    return seconds


def measure(ctx: Ctx, size: int, iters: int, args) -> tuple[dict | None, str | None]:
    """This rank's seconds per round trip in each loop and its waits, by backend; and what was
    wrong with the data, if anything."""
    if ctx.peer is None:
        for _ in range(args.roundtrip_reps * len(ctx.backends)):
            barrier(ctx)
        return None, None
    send = pattern(ctx.rank, size // 4, ctx.device)
    recvs = {backend: torch.empty_like(send) for backend in ctx.backends}
    clocks = {backend: WaitClock() for backend in ctx.backends}
    for backend in ctx.backends:
        for _ in range(args.roundtrip_warmup):
            round_trip(ctx, ctx.groups[backend], send, recvs[backend], clocks[backend])
        recvs[backend].zero_()  # what the timed loops receive is checked after them
    synchronize(ctx.device)
    loops = {backend: [] for backend in ctx.backends}
    for rep in range(args.roundtrip_reps):
        for backend in ctx.backends[::-1] if rep % 2 else ctx.backends:
            loops[backend].append(timed_loop(ctx, ctx.groups[backend], send, recvs[backend],
                                             clocks[backend], iters))
    # The lower rank gets its own pattern back; the higher one the lower one's.
    sender = ctx.rank if ctx.rank < ctx.peer else ctx.peer
    for backend in ctx.backends:
        where = f"rank {ctx.rank}, round trip over {backend}, {format_size(size)}"
        if error := mismatch(recvs[backend], sender, where):
            return None, error
    return {backend: {"loop_s": loops[backend], "waits": dict(clocks[backend].waits)}
            for backend in ctx.backends}, None


def summarize(pair: list[dict], backends: tuple[str, str], round_trips: int) -> dict:
    """A size's figures from the two ranks of pair 0: the lower rank's time per round trip,
    the waits of both ranks by kind."""
    row = {}
    for backend in backends:
        waits: dict[str, list[float]] = {}
        for rank in pair:
            for kind, times in rank[backend]["waits"].items():
                waits.setdefault(kind, []).extend(times)
        loops = pair[0][backend]["loop_s"]
        row[backend] = {"us": scaled(spread(loops), 1e6), "us_reps": [1e6 * s for s in loops],
                        "wait_us": summarize_waits(waits, steps=2 * round_trips)}
    ours, reference = backends
    row["paired"] = paired_ratios(pair[0][ours]["loop_s"], pair[0][reference]["loop_s"])
    return row


def run(ctx: Ctx, args) -> dict:
    rows = []
    for size in args.roundtrip_sizes:
        iters = args.roundtrip_iters or default_iters(size)
        samples, error = measure(ctx, size, iters, args)
        gathered = gather(ctx, (samples, error))
        raise_on_errors([e for _, e in gathered], "round trip")
        row = {"bytes": size, "iters": iters,
               **summarize([s for s, _ in gathered[:2]], ctx.backends,
                           iters * args.roundtrip_reps)}
        rows.append(row)
        log(ctx, f"roundtrip {format_size(size):>7} "
                 + "  ".join(f"{b} {row[b]['us']['median']:9.1f} µs ±{row[b]['us']['iqr_pct']:.1f} %"
                             for b in ctx.backends)
                 + f"  ratio {row['paired']['median']:.3f}  ({iters} round trips)")
    return {
        "pair": [0, 1],
        "reference": ctx.reference,
        "warmup": args.roundtrip_warmup,
        "reps": args.roundtrip_reps,
        "units": {"us": "µs per round trip, rank 0's loop time / round trips; median, "
                        "quartiles, extremes over the loops, iqr_pct and range_pct as % of "
                        "the median",
                  "paired": "per loop, smfree's µs / the reference's in the same round (the "
                            "backends alternate which runs first), and their spread",
                  "wait_us": "CPU µs inside each wait(), by kind, over both ranks of the pair; "
                             "per_step: waits per round trip and rank"},
        "rows": rows,
    }


def print_section(section: dict) -> None:
    ref = TITLES[section["reference"]]
    backends = ("smfree", section["reference"])
    print(f"\nRound trip (rank 0 sends, rank 1 sends it back; each op waited on): µs per round "
          f"trip, median of {section['reps']} loops, ± = IQR as % of the median; paired = "
          f"median over loops of smfree/{ref} [p25-p75]; wait = CPU µs inside wait() per op, "
          "median over both ranks")
    rows = []
    for row in section["rows"]:
        paired = row["paired"]
        rows.append([format_size(row["bytes"])] + [
            cell for b in backends
            for cell in (num(row[b]["us"]["median"]), f"{row[b]['us']['iqr_pct']:.1f} %")
        ] + [f"{paired['median']:.3f} [{paired['p25']:.3f}-{paired['p75']:.3f}]"] + [
            num(row[b]["wait_us"].get(kind, {}).get("median_us"))
            for b in backends for kind in ("send", "recv")
        ])
    print(format_table(["size", "smfree µs", "±", f"{ref} µs", "±", f"smfree/{ref}",
                        "smfree wait send", "recv", f"{ref} wait send", "recv"], rows),
          flush=True)
