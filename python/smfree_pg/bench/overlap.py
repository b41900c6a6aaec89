"""Overlap: a bf16 GEMM loop on the compute stream while P2P moves tens
of GiB each way on a side stream; the GEMM's slowdown under smfree and under NCCL traffic, and
the GB/s moved.
"""

from __future__ import annotations

import statistics
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from smfree_pg.bench.cli import at_least
from smfree_pg.bench.context import CUDA_BACKENDS, Ctx, barrier, gather, log, raise_on_errors
from smfree_pg.bench.data import mismatch, pattern
from smfree_pg.bench.p2p import exchange
from smfree_pg.bench.report import format_table, num
from smfree_pg.bench.sizes import format_size, parse_size

NAME = "overlap"
DEVICES = ("cuda",)
PLACEMENTS = ("own",)
GEMM_WARMUP = 5


def add_arguments(parser) -> None:
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


def check_arguments(args, parser) -> None:
    at_least(parser, args, 1, "gemm_n", "gemms", "overlap_reps")
    at_least(parser, args, 0, "overlap_preheat")


@dataclass
class Traffic:
    """The P2P load of the overlap test: `chunks` exchanges with the peer, on a side stream."""

    send: torch.Tensor
    recv: torch.Tensor
    peer: int
    chunks: int
    stream: torch.cuda.Stream

    def post(self, ctx: Ctx, backend: str, after: torch.cuda.Event
             ) -> tuple[torch.cuda.Event, torch.cuda.Event, Callable[[], None]]:
        """Posts every exchange from a thread of its own (post_from_thread): wait() may hold the
        CPU until the bytes have moved (smfree over UCX)."""
        group = ctx.groups[backend]

        def exchanges() -> None:
            for _ in range(self.chunks):
                exchange(group, self.send, self.recv, self.peer)

        return post_from_thread(self.stream, after, exchanges)


def post_from_thread(stream: torch.cuda.Stream, after: torch.cuda.Event,
                     traffic: Callable[[], None]
                     ) -> tuple[torch.cuda.Event, torch.cuda.Event, Callable[[], None]]:
    """Runs `traffic` on `stream` from a thread of its own, so that the GEMM loop is queued at
    once, whatever holds the CPU while the traffic is posted (a wait(), a full launch queue).
    The traffic starts on the GPU once `after` has happened.

    Returns start/end events and a function that joins the thread, raising its error.
    """
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                stream.wait_event(after)
                start.record()
                traffic()
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


def overlap_trial(ctx: Ctx, backend: str | None, traffic, matrices, count: int, preheat: int):
    """One GEMM loop, alone (backend None) or under `traffic` over `backend`, right after
    `preheat` untimed GEMMs. `traffic`: a Traffic, or what posts like one (post(ctx, backend,
    after), with the `recv` and `peer` it checks).

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
    transfer = traffic.post(ctx, backend, hot) if moving else None
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


def trial_rounds(ctx: Ctx, traffic, matrices, args, what: str,
                 loads: tuple[str, ...] = CUDA_BACKENDS) -> dict[str, list[dict]]:
    """--overlap-reps rounds of GEMM loops, alone and under `traffic` over each of `loads`
    (the backends, or what else `traffic` posts), after a warm-up; each condition's samples."""
    a, b, c = matrices
    for _ in range(GEMM_WARMUP):
        torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    samples = {condition: [] for condition in ("alone", *loads)}
    for round_ in range(args.overlap_reps):
        for condition, runs in samples.items():
            backend = None if condition == "alone" else condition
            sample, error = overlap_trial(ctx, backend, traffic, matrices, args.gemms,
                                          args.overlap_preheat)
            raise_on_errors(gather(ctx, error), f"{what} under {condition}")
            runs.append(sample)
            extra = f", transfer {sample['transfer_ms']:.1f} ms" if "transfer_ms" in sample else ""
            log(ctx, f"{what} round {round_ + 1}/{args.overlap_reps} {condition:6} "
                     f"{sample['gemm_ms']:.3f} ms per GEMM{extra}")
    return samples


def summarize_overlap(samples: dict, n: int, bytes_each_way: int,
                      loads: tuple[str, ...] = CUDA_BACKENDS) -> dict:
    """Medians over the rounds; slowdown against the GEMM alone; GB/s each way under load.

    The paired slowdown compares each loop under traffic with the loop alone of its own
    round, which cancels the GPU's clock drifting between rounds.
    """
    alone = statistics.median(s["gemm_ms"] for s in samples["alone"])
    summary = {"alone_ms": alone, "alone_TFLOPs": 2 * n**3 / (alone * 1e-3) / 1e12,
               "alone_ms_reps": [s["gemm_ms"] for s in samples["alone"]]}
    for backend in loads:
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


def run(ctx: Ctx, args) -> dict:
    n, count = args.gemm_n, args.gemms
    chunks = -(-args.overlap_bytes // args.overlap_chunk)
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    matrices = (a, torch.randn_like(a), torch.empty_like(a))
    traffic = None
    if ctx.peer is not None:
        send = pattern(ctx.rank, args.overlap_chunk // 4, ctx.device)
        traffic = Traffic(send, torch.empty_like(send), ctx.peer, chunks,
                          torch.cuda.Stream(ctx.device))
        for backend in CUDA_BACKENDS:
            # Untimed: the first exchange maps buffers and builds communicators.
            exchange(ctx.groups[backend], traffic.send, traffic.recv, ctx.peer)
    samples = trial_rounds(ctx, traffic, matrices, args, "overlap")
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


def print_section(section: dict) -> None:
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
            str(rank), num(summary["alone_ms"], 3), num(summary["alone_TFLOPs"], 0),
            num(smfree["gemm_ms"], 3), f"{smfree['slowdown_pct']:+.1f} %",
            f"{smfree['paired_slowdown_pct']:+.1f} %",
            num(nccl["gemm_ms"], 3), f"{nccl['slowdown_pct']:+.1f} %",
            f"{nccl['paired_slowdown_pct']:+.1f} %",
            num(smfree["transfer_GBps"], 1), num(nccl["transfer_GBps"], 1),
        ])
        uncovered += [f"rank {rank} {b}" for b in CUDA_BACKENDS if not summary[b]["covered"]]
    header = ["rank", "ms/GEMM alone", "TFLOP/s", "ms/GEMM +smfree", "slowdown", "paired",
              "ms/GEMM +NCCL", "slowdown", "paired", "smfree GB/s", "NCCL GB/s"]
    print(format_table(header, rows))
    print("slowdown: of the medians; paired: median over rounds of each loop against the loop "
          "alone in its round\nGB/s: bytes each way / time of the transfer under load")
    if uncovered:
        print(f"WARNING: traffic ended before the GEMM loop ({', '.join(uncovered)}): the slowdown "
              "covers part of the loop only; raise --overlap-bytes")
    sys.stdout.flush()

