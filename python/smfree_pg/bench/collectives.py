"""Collectives: smfree's copy-engine collectives (SMFREE_COLLECTIVES) against NCCL's, every rank.

- calls: all_gather_into_tensor, all_to_all_single, broadcast, gather and scatter
  (`--collectives-ops`) as users call them (async_op=False, on the current stream),
  `--collectives-iters` back to back; µs per call (median of the rounds, the slowest rank per
  round), the paired ratio smfree/NCCL and the aggregate GB/s.
  `size` is one piece: all-gather's input per rank (its output is world x size); all-to-all's
  piece per pair of ranks (input and output are world x size, piece r to or from rank r).
  Either way every call moves world x (world - 1) x size bytes between GPUs. The uneven
  all-to-all is an MoE layer's token exchange: rank s sends rank d a piece of
  2 x size x (1 + (s + d) % world) / (world + 1) bytes (rounded down to int32s), from 2 / (world
  + 1) to 2 x world / (world + 1) times `size`, each rank's input `world x size` on average.
  Broadcast, gather and scatter are rooted at rank 0 and move (world - 1) x size bytes between
  GPUs; gather's and scatter's lists are views of one tensor.
- floor: the same pieces moved by bare peer copies (`dst.copy_(src)`, one stream per pair of
  GPUs), all GPUs driven from rank 0's process: what the copy engines do with no handshake. A
  rank's own piece (out of place, all-to-all) is a copy within its GPU, which the CUDA 13.0
  driver runs on SMs: the floor moves it as its two copy-engine hops through the next GPU, both
  under way at once (the first into that GPU, the second out of a copy already there), which is
  what a bounce whose chunks overlap tends to.
- NCCL's copy-engine path: NCCL 2.28's own copy-engine all-gather and all-to-all (zero-CTA
  policy, symmetric memory) where this torch reaches them, in processes of their own
  (nccl_copy_engines.py): µs per call, or where they fail.
- GEMM: the overlap section's GEMM loop while a side stream loops each collective at
  `--collectives-overlap-size`, about `--overlap-bytes` out of each rank; the GEMM's slowdown.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from smfree_pg.bench import nccl_copy_engines, overlap
from smfree_pg.bench.alltoall import figure, schedule, traffic_chunks
from smfree_pg.bench.bandwidth import PeerCopy, seconds_per_op, time_peer_copies
from smfree_pg.bench.cli import at_least
from smfree_pg.bench.context import CUDA_BACKENDS, Ctx, barrier, gather, log, raise_on_errors
from smfree_pg.bench.pieces import (ALL_GATHER, ALL_TO_ALL, BROADCAST, GATHER, GATHERS,
                                    IN_PLACE, NO_OWN_COPY, ROOT, SCATTER, UNEVEN, Layout,
                                    make_input, wrong_piece)
from smfree_pg.bench.report import format_table, num
from smfree_pg.bench.sizes import format_size, parse_size, parse_sizes
from smfree_pg.bench.stats import paired_ratios

NAME = "collectives"
DEVICES = ("cuda",)
PLACEMENTS = ("own",)
# --collectives-ops's names for them.
OP_NAMES = {"all_gather": ALL_GATHER, "all_gather_in_place": IN_PLACE, "all_to_all": ALL_TO_ALL,
            "all_to_all_uneven": UNEVEN, "broadcast": BROADCAST, "gather": GATHER,
            "scatter": SCATTER}
def add_arguments(parser) -> None:
    group = parser.add_argument_group("collectives (uses the overlap options too)")
    group.add_argument("--collectives-sizes", type=parse_sizes, default="64K,1M,16M,64M,256M",
                       help="bytes per piece: all-gather's input per rank, all-to-all's piece "
                       "per pair of ranks (its input is world x that) (default: %(default)s)")
    group.add_argument("--collectives-ops", type=parse_ops, default=",".join(OP_NAMES),
                       help="ops to time, comma-separated (default: %(default)s); the GEMM runs "
                       "beside all_gather, all_to_all and all_to_all_uneven among them")
    group.add_argument("--collectives-iters", type=int, default=10,
                       help="calls per timed loop (default: %(default)s)")
    group.add_argument("--collectives-reps", type=int, default=3,
                       help="rounds of timed loops, smfree and NCCL taking turns; the median "
                       "counts (default: %(default)s)")
    group.add_argument("--collectives-overlap-size", type=parse_size, default="64M",
                       help="bytes per piece of the collectives looped beside the GEMM "
                       "(default: %(default)s)")


def parse_ops(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in OP_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown op(s) {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(OP_NAMES)}")
    return [OP_NAMES[name] for name in names]


def check_arguments(args, parser) -> None:
    at_least(parser, args, 1, "collectives_iters", "collectives_reps")


def call(layout: Layout, rank: int, group, out: torch.Tensor, inp: torch.Tensor) -> None:
    op, n = layout.op, layout.n
    if op in GATHERS:
        dist.all_gather_into_tensor(out, inp, group=group)
    elif op == BROADCAST:
        dist.broadcast(out, ROOT, group=group)  # input_of put the root's input there
    elif op == GATHER:
        dist.gather(inp, list(out.split(n)) if rank == ROOT else None, ROOT, group=group)
    elif op == SCATTER:
        dist.scatter(out, list(inp.split(n)) if rank == ROOT else None, ROOT, group=group)
    else:
        out_splits, in_splits = layout.splits(rank)
        dist.all_to_all_single(out, inp, output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=group)


def input_of(op: str, out: torch.Tensor, inp: torch.Tensor, rank: int) -> torch.Tensor:
    """The input a call of `op` into `out` takes: `inp`, or for IN_PLACE `out`'s piece holding
    it; a broadcast's is its tensor, holding the root's input."""
    if op == BROADCAST:
        if rank == ROOT:
            out.copy_(inp)
        return out
    if op != IN_PLACE:
        return inp
    piece = out.narrow(0, rank * inp.numel(), inp.numel())
    piece.copy_(inp)
    return piece


def timed_loop(ctx: Ctx, step, iters: int) -> float:
    """Seconds per call of `iters` back to back, until the GPU has done them; slowest rank."""
    torch.cuda.synchronize()
    barrier(ctx)
    return max(gather(ctx, seconds_per_op(step, iters)))


def measure_calls(ctx: Ctx, op: str, size: int, args) -> dict:
    """smfree's and NCCL's timed loops of `op`, taking turns round by round; checked after."""
    layout = Layout(op, ctx.world, size // 4)
    inp = make_input(layout, ctx.rank, ctx.device)
    outs = {b: torch.empty(layout.out_numel(ctx.rank), dtype=torch.int32, device=ctx.device)
            for b in CUDA_BACKENDS}
    ins = {}
    for backend in CUDA_BACKENDS:
        # Untimed: the first call maps buffers and builds communicators.
        call(layout, ctx.rank, ctx.groups[backend], outs[backend],
             input_of(op, outs[backend], inp, ctx.rank))
        outs[backend].zero_()  # so that the check below sees what the timed calls wrote
        ins[backend] = input_of(op, outs[backend], inp, ctx.rank)
    seconds = {backend: [] for backend in CUDA_BACKENDS}
    for rep in range(args.collectives_reps):
        for backend in CUDA_BACKENDS[::-1] if rep % 2 else CUDA_BACKENDS:
            group, out, piece = ctx.groups[backend], outs[backend], ins[backend]
            seconds[backend].append(timed_loop(
                ctx, lambda: call(layout, ctx.rank, group, out, piece), args.collectives_iters))
    for backend in CUDA_BACKENDS:
        where = f"rank {ctx.rank}, {op} over {backend}, {format_size(size)}"
        error = wrong_piece(layout, outs[backend], ctx.rank, range(ctx.world), where)
        raise_on_errors(gather(ctx, error), f"{op} over {backend}")
    row = {"op": op, "bytes": size,
           **{b: figure(s, layout.piece_bytes(), ctx.world) for b, s in seconds.items()},
           "paired": paired_ratios(seconds["smfree"], seconds["nccl"])}
    log(ctx, f"{op} {format_size(size):>7}: smfree {row['smfree']['us']:9.1f} µs, NCCL "
             f"{row['nccl']['us']:9.1f} µs, smfree/NCCL {row['paired']['median']:.3f}")
    return row


def floor_copies(op: str, size: int, devices: list[int]):
    """The op's pieces between other GPUs as peer copies, each pair on streams of its own, in
    alltoall.schedule's order, then each own piece's two hops; and every GPU's output."""
    world = len(devices)
    layout = Layout(op, world, size // 4)
    gpus = [torch.device("cuda", index) for index in devices]
    inputs = [make_input(layout, s, gpus[s]) for s in range(world)]
    outs = [torch.zeros(layout.out_numel(d), dtype=torch.int32, device=gpu)
            for d, gpu in enumerate(gpus)]

    def copy(src: torch.Tensor, dst: torch.Tensor) -> PeerCopy:
        return PeerCopy(src, dst, torch.cuda.Stream(src.device), torch.cuda.Stream(dst.device))

    copies = []
    for step in range(world - 1):
        for s in range(world):
            d = schedule(s, world)[step][0]
            if layout.counts[s][d]:
                copies.append(copy(layout.sent(inputs[s], s, d), layout.received(outs[d], s, d)))
    if op in NO_OWN_COPY:
        return layout, copies, outs
    for d in range(world):
        if layout.counts[d][d]:
            via = gpus[(d + 1) % world]
            own = layout.sent(inputs[d], d, d)
            copies.append(copy(own, torch.empty_like(own, device=via)))
            copies.append(copy(own.to(via), layout.received(outs[d], d, d)))
    return layout, copies, outs


def measure_floor(ctx: Ctx, op: str, size: int, args):
    """Rank 0 alone: (figures, error) of the bare copies, or (None, None) where it cannot see
    every rank's GPU (a CUDA_VISIBLE_DEVICES per rank)."""
    devices = ctx.devices
    if len(set(devices)) < ctx.world or max(devices) >= torch.cuda.device_count():
        return None, None
    layout, copies, outs = floor_copies(op, size, devices)
    for index in devices:
        torch.cuda.synchronize(index)  # the zeroing ran on the default streams, the copies not
    time_peer_copies(copies, 1)  # untimed: peer access is enabled on first use
    seconds = [time_peer_copies(copies, args.collectives_iters)
               for _ in range(args.collectives_reps)]
    for d, out in enumerate(outs):
        # In place, or a broadcast's root, a rank's own piece is where it belongs already.
        senders = [s for s in range(ctx.world) if op not in NO_OWN_COPY or s != d]
        if error := wrong_piece(layout, out, d, senders, f"floor {op} into GPU {d}"):
            return None, error
    return figure(seconds, layout.piece_bytes(), ctx.world), None


def add_floors(ctx: Ctx, rows: list[dict], args) -> str | None:
    """Each row's floor, after a barrier; the other ranks wait in a Gloo gather meanwhile, which
    leaves the GPUs to rank 0. Returns why there is none, if so."""
    torch.cuda.synchronize()
    barrier(ctx)
    for row in rows:
        measured = (measure_floor(ctx, row["op"], row["bytes"], args) if ctx.rank == 0
                    else (None, None))
        gathered = gather(ctx, measured)
        raise_on_errors([error for _, error in gathered], f"floor of {row['op']}")
        row["floor"] = gathered[0][0]
        if row["floor"] is None:
            break
        log(ctx, f"{row['op']} {format_size(row['bytes']):>7}: floor "
                 f"{row['floor']['us']:9.1f} µs")
    if all(row.get("floor") for row in rows):
        return None
    for row in rows:
        row["floor"] = None
    reason = (f"rank 0 sees {torch.cuda.device_count()} GPUs; the floor needs every rank's "
              "GPU (all of them visible to every rank)")
    log(ctx, f"collectives floor: skipped, {reason}")
    return reason


class CollectiveTraffic:
    """The overlap section's load as `calls` collectives on a side stream; overlap_trial checks
    `recv`, the piece from `peer` (the next rank), against pattern(peer)."""

    def __init__(self, ctx: Ctx, op: str, size: int, calls: int) -> None:
        self.layout = Layout(op, ctx.world, size // 4)
        self.rank, self.calls = ctx.rank, calls
        self.inp = make_input(self.layout, ctx.rank, ctx.device, distinct=False)
        self.out = torch.empty(self.layout.out_numel(ctx.rank), dtype=torch.int32,
                               device=ctx.device)
        self.peer = (ctx.rank + 1) % ctx.world
        self.recv = self.layout.received(self.out, self.peer, ctx.rank)
        self.stream = torch.cuda.Stream(ctx.device)
        for backend in CUDA_BACKENDS:
            call(self.layout, self.rank, ctx.groups[backend], self.out, self.inp)  # untimed

    def bytes_out(self) -> int:
        """Bytes out of this rank to the others per call."""
        counts = self.layout.counts[self.rank]
        return 4 * sum(count for d, count in enumerate(counts) if d != self.rank)

    def post(self, ctx: Ctx, backend: str, after: torch.cuda.Event):
        """Posts from a thread (post_from_thread): a call may hold the CPU until bytes moved."""
        group = ctx.groups[backend]

        def calls() -> None:
            for _ in range(self.calls):
                call(self.layout, self.rank, group, self.out, self.inp)

        return overlap.post_from_thread(self.stream, after, calls)


def measure_gemm(ctx: Ctx, op: str, matrices, args) -> dict:
    size = args.collectives_overlap_size
    calls = traffic_chunks(args.overlap_bytes, size, ctx.world)
    traffic = CollectiveTraffic(ctx, op, size, calls)
    samples = overlap.trial_rounds(ctx, traffic, matrices, args, f"{op} GEMM")
    bytes_out = calls * traffic.bytes_out()
    return {"op": op, "bytes": size, "calls": calls, "bytes_out_per_rank": bytes_out,
            "ranks": gather(ctx, overlap.summarize_overlap(samples, args.gemm_n, bytes_out))}


def run(ctx: Ctx, args) -> dict:
    if ctx.world < 2:
        raise RuntimeError("smfree bench: the collectives section needs at least 2 ranks")
    rows = []
    for op in args.collectives_ops:
        for size in args.collectives_sizes:
            ctx.arm_watchdog()  # a whole section may run longer than the group timeout
            rows.append(measure_calls(ctx, op, size, args))
    a = torch.randn(args.gemm_n, args.gemm_n, device=ctx.device, dtype=torch.bfloat16)
    matrices = (a, torch.randn_like(a), torch.empty_like(a))
    gemm = []
    for op in (ALL_GATHER, ALL_TO_ALL, UNEVEN):
        if op in args.collectives_ops:
            ctx.arm_watchdog()
            gemm.append(measure_gemm(ctx, op, matrices, args))
    ctx.arm_watchdog()
    nccl_ce = nccl_copy_engines.measure(ctx, args.collectives_ops, args.collectives_sizes,
                                        args.collectives_iters, args.collectives_reps)
    # The floor comes last: it gives rank 0 a CUDA context on every rank's GPU.
    ctx.arm_watchdog()
    floor_skipped = add_floors(ctx, rows, args)
    return {
        "world": ctx.world,
        "iters": args.collectives_iters,
        "reps": args.collectives_reps,
        "smfree_collectives": os.environ.get("SMFREE_COLLECTIVES", "unset (default)"),
        "units": {"bytes": "bytes per piece: all-gather's input per rank; all-to-all's piece per "
                           "pair of ranks (input and output are world x bytes); uneven: the mean "
                           "piece, 2 x bytes x (1 + (s + d) % world) / (world + 1) from s to d",
                  "us": "µs per call, async_op=False on the current stream, iters back to back; "
                        "median of reps, the slowest rank per rep",
                  "GBps_aggregate": "what crosses between GPUs per call / µs per call "
                                    "(world * (world - 1) * bytes, even); 1 GB = 1e9 B",
                  "paired": "smfree time / NCCL time in each rep, their median and spread",
                  "floor": "the same pieces between GPUs as bare peer copies from rank 0's "
                           "process, one stream per pair; an own piece (out of place, "
                           "all-to-all) as its two hops through the next GPU at once; null: "
                           "skipped",
                  "nccl_copy_engines": "NCCL's own copy-engine collectives (zero-CTA policy, "
                                       "symmetric memory): µs per call as above, or the first "
                                       "rank's failure",
                  "gemm": "per op and rank: ms per GEMM alone and under each backend's calls; "
                          "slowdown_pct in %; transfer_GBps: bytes out of a rank / traffic time"},
        "rows": rows,
        "floor_skipped": floor_skipped,
        "nccl_copy_engines": nccl_ce,
        "gemm_n": args.gemm_n,
        "gemms": args.gemms,
        "gemm": gemm,
    }


def print_nccl_copy_engines(section: dict) -> None:
    """NCCL's copy-engine rows beside the same op's ordinary NCCL and smfree times."""
    ce = section["nccl_copy_engines"]
    if not ce["rows"] and not ce["error"]:
        return
    print("\nNCCL's own copy-engine collectives (zero-CTA policy, symmetric memory; processes of "
          "their own): µs per call as above")
    ordinary = {(row["op"], row["bytes"]): row for row in section["rows"]}
    rows = []
    for row in ce["rows"]:
        same = ordinary.get((row["op"], row["bytes"]))
        rows.append([row["op"], format_size(row["bytes"]), num(row["us"]),
                     num(same and same["nccl"]["us"]), num(same and same["smfree"]["us"])])
    if rows:
        print(format_table(["op", "size", "NCCL copy engines µs", "NCCL µs", "smfree µs"], rows))
    if ce["error"]:
        print(f"NCCL's copy-engine path failed: {ce['error']}")


def print_section(section: dict) -> None:
    world = section["world"]
    print(f"\nCollectives (SMFREE_COLLECTIVES: {section['smfree_collectives']}): µs per call, "
          f"{section['iters']} back to back, median of {section['reps']} rounds, slowest rank; "
          f"size: all-gather's input per rank, all-to-all's piece per pair")
    rows = []
    for row in section["rows"]:
        smfree, nccl, floor = row["smfree"], row["nccl"], row.get("floor")
        rows.append([row["op"], format_size(row["bytes"]), num(smfree["us"]), num(nccl["us"]),
                     f"{row['paired']['median']:.3f}", num(floor and floor["us"]),
                     num(floor and smfree["us"] / floor["us"], 2),
                     num(smfree["GBps_aggregate"]), num(nccl["GBps_aggregate"]),
                     num(floor and floor["GBps_aggregate"])])
    print(format_table(["op", "size", "smfree µs", "NCCL µs", "smfree/NCCL", "floor µs",
                        "smfree/floor", "smfree GB/s", "NCCL GB/s", "floor GB/s"], rows))
    print(f"GB/s: what crosses between GPUs ({world} x {world - 1} x size, even; {world - 1} x "
          "size, rooted at rank 0) / µs per call; "
          "uneven: rank s sends rank d 2 x size x (1 + (s + d) % world) / (world + 1); "
          "smfree/NCCL: median over rounds of "
          "the ratio in the same round; floor: bare peer copies of the same pieces, an own piece "
          "as its two hops through the next GPU at once")
    if section["floor_skipped"]:
        print(f"floor skipped: {section['floor_skipped']}")
    print_nccl_copy_engines(section)
    print(f"\nCollectives under GEMM: bf16 GEMM {section['gemm_n']}^3 x {section['gemms']} while "
          "a side stream loops the collective; paired slowdown, median over rounds")
    rows = [[g["op"], format_size(g["bytes"]), str(rank), num(s["alone_ms"], 3),
             *(f"{s[b]['paired_slowdown_pct']:+.1f} %" for b in CUDA_BACKENDS),
             *(num(s[b]["transfer_GBps"]) for b in CUDA_BACKENDS),
             "yes" if all(s[b]["covered"] for b in CUDA_BACKENDS) else "no: raise --overlap-bytes"]
            for g in section["gemm"] for rank, s in enumerate(g["ranks"])]
    print(format_table(["op", "size", "rank", "ms/GEMM alone", "slowdown +smfree",
                        "slowdown +NCCL", "smfree GB/s out", "NCCL GB/s out",
                        "traffic covered the loop"], rows))
    sys.stdout.flush()
