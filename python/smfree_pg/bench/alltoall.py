"""All-to-all: every rank exchanges with every other rank at once, as expert-parallel layers do.

- exchanges: one batch_isend_irecv per rank, `size` bytes to each other rank and `size` bytes
  from each; µs per exchange (`--alltoall-iters` back to back, the slowest rank), the aggregate
  GB/s over all pairs, smfree against NCCL round by round.
- GEMM: the overlap section's GEMM loop while each rank sends about `--overlap-bytes` in
  all-to-all exchanges of `--alltoall-chunk` bytes per peer on a side stream; the GEMM's
  slowdown and the GB/s out of each rank.
- smfree's counters afterwards, per rank: what its mappings and staging rings hold once every
  rank has exchanged with every other.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from smfree_pg.bench import overlap
from smfree_pg.bench.cli import at_least
from smfree_pg.bench.context import CUDA_BACKENDS, Ctx, barrier, gather, log, raise_on_errors
from smfree_pg.bench.data import mismatch, pattern
from smfree_pg.bench.report import format_table, num
from smfree_pg.bench.sizes import format_size, parse_size, parse_sizes
from smfree_pg.bench.stats import paired_ratios

NAME = "alltoall"
DEVICES = ("cuda",)
PLACEMENTS = ("own",)
# The smfree counters printed: what holds memory or mappings.
MEMORY_STAT_WORDS = ("bytes", "ring", "mapping", "ipc")


def add_arguments(parser) -> None:
    group = parser.add_argument_group("alltoall (uses the overlap options too)")
    group.add_argument("--alltoall-sizes", type=parse_sizes, default="4M,16M,64M,256M",
                       help="bytes each rank sends to each other rank per exchange "
                       "(default: %(default)s)")
    group.add_argument("--alltoall-iters", type=int, default=10,
                       help="exchanges per timed loop (default: %(default)s)")
    group.add_argument("--alltoall-reps", type=int, default=3,
                       help="rounds of timed loops, smfree then NCCL; the median counts "
                       "(default: %(default)s)")
    group.add_argument("--alltoall-chunk", type=parse_size, default="64M",
                       help="bytes to each peer per exchange during the GEMM loop, in place of "
                       "--overlap-chunk: every peer's receive buffer is live at once "
                       "(default: %(default)s)")


def check_arguments(args, parser) -> None:
    at_least(parser, args, 1, "alltoall_iters", "alltoall_reps")


def schedule(rank: int, world: int) -> list[tuple[int, int]]:
    """(to, from) per step: sends to rank + step while receiving from rank - step, so that in
    each step every rank has one sender, rather than every rank starting with rank 0."""
    return [((rank + step) % world, (rank - step) % world) for step in range(1, world)]


def all_to_all(group, rank: int, send: torch.Tensor, recvs: dict[int, torch.Tensor]) -> None:
    """Sends `send` to every other rank while receiving recvs[sender] from each, one batch."""
    ops = []
    for to, source in schedule(rank, len(recvs) + 1):
        ops += [dist.P2POp(dist.isend, send, to, group),
                dist.P2POp(dist.irecv, recvs[source], source, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def traffic_chunks(total: int, chunk: int, world: int) -> int:
    """Exchanges of `chunk` bytes per peer until about `total` bytes have left each rank."""
    return -(-total // (chunk * (world - 1)))


def figure(seconds: list[float], size: int, world: int) -> dict:
    """µs per exchange (median of the rounds) and its GB/s, over all pairs and out of a rank."""
    median = statistics.median(seconds)
    return {"us": median * 1e6,
            "GBps_aggregate": world * (world - 1) * size / median / 1e9,
            "GBps_out_per_rank": (world - 1) * size / median / 1e9,
            "us_reps": [s * 1e6 for s in seconds]}


def memory_stats(stats: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in sorted(stats.items()) if any(w in k for w in MEMORY_STAT_WORDS)}


def recv_buffers(ctx: Ctx, like: torch.Tensor) -> dict[int, torch.Tensor]:
    return {sender: torch.empty_like(like) for sender in range(ctx.world) if sender != ctx.rank}


def first_mismatch(recvs: dict[int, torch.Tensor], where: str) -> str | None:
    return next(filter(None, (mismatch(recv, sender, where) for sender, recv in recvs.items())),
                None)


def timed_loop(ctx: Ctx, backend: str, send, recvs, iters: int) -> float:
    """Seconds per exchange of `iters` back to back, until the GPU has done them; slowest rank."""
    torch.cuda.synchronize()
    barrier(ctx)
    start = time.perf_counter()
    for _ in range(iters):
        all_to_all(ctx.groups[backend], ctx.rank, send, recvs)
    torch.cuda.synchronize()
    return max(gather(ctx, (time.perf_counter() - start) / iters))


def measure_size(ctx: Ctx, size: int, args) -> dict:
    send = pattern(ctx.rank, size // 4, ctx.device)
    recvs = recv_buffers(ctx, send)
    for backend in CUDA_BACKENDS:
        # Untimed: the first exchange maps buffers and builds communicators.
        for recv in recvs.values():
            recv.zero_()
        all_to_all(ctx.groups[backend], ctx.rank, send, recvs)
        torch.cuda.synchronize()
        where = f"rank {ctx.rank}, alltoall over {backend}, {format_size(size)}"
        raise_on_errors(gather(ctx, first_mismatch(recvs, where)), f"alltoall over {backend}")
    seconds = {backend: [] for backend in CUDA_BACKENDS}
    for _ in range(args.alltoall_reps):
        for backend in CUDA_BACKENDS:
            seconds[backend].append(timed_loop(ctx, backend, send, recvs, args.alltoall_iters))
    row = {"bytes": size, **{b: figure(s, size, ctx.world) for b, s in seconds.items()},
           "paired": paired_ratios(seconds["smfree"], seconds["nccl"])}
    log(ctx, f"alltoall {format_size(size):>7}: smfree {row['smfree']['us']:9.1f} µs "
             f"{row['smfree']['GBps_aggregate']:7.1f} GB/s, NCCL {row['nccl']['us']:9.1f} µs "
             f"{row['nccl']['GBps_aggregate']:7.1f} GB/s aggregate")
    return row


class AllToAllTraffic:
    """The overlap section's load as all-to-all: `chunks` exchanges with every peer, on a side
    stream. overlap_trial checks `recv`, what came from `peer` (the next rank)."""

    def __init__(self, ctx: Ctx, chunk: int, chunks: int) -> None:
        self.send = pattern(ctx.rank, chunk // 4, ctx.device)
        self.recvs = recv_buffers(ctx, self.send)
        self.peer = (ctx.rank + 1) % ctx.world
        self.recv = self.recvs[self.peer]
        self.chunks = chunks
        self.stream = torch.cuda.Stream(ctx.device)
        for backend in CUDA_BACKENDS:
            all_to_all(ctx.groups[backend], ctx.rank, self.send, self.recvs)  # untimed

    def post(self, ctx: Ctx, backend: str, after: torch.cuda.Event):
        """Posts from a thread (post_from_thread): wait() may hold the CPU until bytes moved."""
        group = ctx.groups[backend]

        def exchanges() -> None:
            for _ in range(self.chunks):
                all_to_all(group, ctx.rank, self.send, self.recvs)

        return overlap.post_from_thread(self.stream, after, exchanges)


def measure_gemm(ctx: Ctx, args) -> dict:
    n, chunk = args.gemm_n, args.alltoall_chunk
    chunks = traffic_chunks(args.overlap_bytes, chunk, ctx.world)
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    matrices = (a, torch.randn_like(a), torch.empty_like(a))
    traffic = AllToAllTraffic(ctx, chunk, chunks)
    samples = overlap.trial_rounds(ctx, traffic, matrices, args, "alltoall GEMM")
    bytes_out = chunks * chunk * (ctx.world - 1)
    return {"gemm_n": n, "gemms": args.gemms, "preheat_gemms": args.overlap_preheat,
            "chunk_bytes": chunk, "chunks": chunks, "bytes_out_per_rank": bytes_out,
            "reps": args.overlap_reps,
            "ranks": gather(ctx, overlap.summarize_overlap(samples, n, bytes_out))}


def run(ctx: Ctx, args) -> dict:
    if ctx.world < 2:
        raise RuntimeError("smfree bench: the alltoall section needs at least 2 ranks")
    rows = [measure_size(ctx, size, args) for size in args.alltoall_sizes]
    gemm = measure_gemm(ctx, args)
    stats = ctx.groups["smfree"]._get_backend(ctx.device)._stats()
    return {
        "world": ctx.world,
        "iters": args.alltoall_iters,
        "reps": args.alltoall_reps,
        "units": {"bytes": "bytes each rank sends to each other rank per exchange",
                  "us": "µs per exchange (every rank sends to and receives from every other); "
                        "median of reps, the slowest rank per rep",
                  "GBps_aggregate": "world * (world - 1) * bytes / time per exchange: every "
                                    "message counted once; 1 GB = 1e9 B",
                  "GBps_out_per_rank": "(world - 1) * bytes / time per exchange",
                  "paired": "smfree time / NCCL time in each rep (same round) and their "
                            "median and spread (stats.spread)",
                  "gemm": "ms per GEMM; slowdown_pct in %; transfer_ms: the traffic's time; "
                          "transfer_GBps: bytes_out_per_rank / transfer_ms, GB/s out of a rank",
                  "smfree_stats": "per rank, smfree's engine-wide counters after the section: "
                                  "counts, and bytes where the key says so"},
        "rows": rows,
        "gemm": gemm,
        "smfree_stats": gather(ctx, stats),
    }


def print_section(section: dict) -> None:
    world = section["world"]
    print(f"\nAll-to-all: every rank exchanges `size` with each of the other {world - 1} at "
          f"once, one batch_isend_irecv; µs per exchange ({section['iters']} back to back, "
          f"median of {section['reps']} rounds, slowest rank)")
    rows = [[format_size(row["bytes"]), num(row["smfree"]["us"], 1), num(row["nccl"]["us"], 1),
             num(row["smfree"]["GBps_aggregate"], 1), num(row["nccl"]["GBps_aggregate"], 1),
             f"{row['paired']['median']:.3f}"] for row in section["rows"]]
    print(format_table(["size", "smfree µs", "NCCL µs", "smfree agg. GB/s", "NCCL agg. GB/s",
                        "smfree/NCCL"], rows))
    print(f"agg. GB/s: {world} x {world - 1} x size / µs per exchange; smfree/NCCL: median over "
          "rounds of the time ratio in the same round (< 1: smfree faster)")
    gemm = section["gemm"]
    print(f"\nAll-to-all under GEMM: bf16 GEMM {gemm['gemm_n']}^3 x {gemm['gemms']} while each "
          f"rank runs {gemm['chunks']} exchanges of {format_size(gemm['chunk_bytes'])} per peer "
          f"(median of {gemm['reps']} rounds)")
    rows = [[str(rank), num(s["alone_ms"], 3),
             *(f"{s[b]['paired_slowdown_pct']:+.1f} %" for b in CUDA_BACKENDS),
             *(num(s[b]["transfer_GBps"], 1) for b in CUDA_BACKENDS),
             "yes" if all(s[b]["covered"] for b in CUDA_BACKENDS) else "no: raise --overlap-bytes"]
            for rank, s in enumerate(gemm["ranks"])]
    print(format_table(["rank", "ms/GEMM alone", "slowdown +smfree", "slowdown +NCCL",
                        "smfree GB/s out", "NCCL GB/s out", "traffic covered the loop"], rows))
    print("smfree's counters after the section:")
    for rank, stats in enumerate(section["smfree_stats"]):
        shown = ", ".join(f"{k}={format_size(v) if 'bytes' in k else v}"
                          for k, v in memory_stats(stats).items())
        print(f"  rank {rank}: {shown}")
    sys.stdout.flush()
