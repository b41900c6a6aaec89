"""Captured (docs/benchmarks.md): point-to-point traffic captured in CUDA graphs and replayed,
smfree against NCCL captured, in one run.

- exchanges: one batched exchange with the pair's peer (`size` bytes each way) captured per
  backend and size; µs per replay from CUDA events around `--captured-replays` back-to-back
  replays, the slower rank of the pair.
- step: the pipeline section's 1F1B step (every rank a stage, `--pipeline-microbatches`
  micro-batches, its GEMMs and P2P) captured whole per backend with
  capture_error_mode="thread_local", as megatron-core's full-iteration graph does; ms per
  replay, the slowest rank, beside the same step uncaptured; what each replay received is
  checked.
- overlap: the overlap section's GEMM loop while a captured exchange of `--overlap-chunk` bytes
  is replayed on a side stream until `--overlap-bytes` have moved each way; the GEMM's slowdown.

The exchanges and the overlap also measure the floor, bare copies captured without any
handshake (`BareCopies`): a single copy of the peer's tensor, the least any path moves and what
smfree's batched exchange moves (each send copies straight into its recv's buffer), and two
copies, the path of a send captured before its recv (into a slot, with the driver's copy, then
the peer's slot read over NVLink).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from smfree_pg.bench import cuda_driver, overlap, pipeline
from smfree_pg.bench.cli import at_least
from smfree_pg.bench.context import CUDA_BACKENDS, Ctx, barrier, gather, log, raise_on_errors
from smfree_pg.bench.data import mismatch, pattern
from smfree_pg.bench.p2p import exchange
from smfree_pg.bench.report import format_table, num
from smfree_pg.bench.sizes import format_size, parse_sizes

NAME = "captured"
DEVICES = ("cuda",)
PLACEMENTS = ("own",)
CAPTURE_MODE = "thread_local"
# The floor probes, measured beside the backends (BareCopies).
PROBES = ("two_copies", "one_copy")
PROBE_TITLES = {"two_copies": "bare 2 copies", "one_copy": "bare 1 copy"}
# What the GEMM runs under, besides alone.
LOADS = (*CUDA_BACKENDS, *PROBES)


def add_arguments(parser) -> None:
    group = parser.add_argument_group("captured (uses the pipeline and overlap options too)")
    group.add_argument("--captured-sizes", type=parse_sizes, default="4K,64K,1M,16M,64M,256M",
                       help="bytes each way of the captured exchanges (default: %(default)s)")
    group.add_argument("--captured-replays", type=int, default=50,
                       help="replays per timed loop of an exchange (default: %(default)s)")
    group.add_argument("--captured-reps", type=int, default=5,
                       help="timed loops per exchange and backend, alternating backends; the "
                       "median counts (default: %(default)s)")


def check_arguments(args, parser) -> None:
    at_least(parser, args, 1, "captured_replays", "captured_reps")


def capture(fn, stream: torch.cuda.Stream | None = None) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode=CAPTURE_MODE):
        fn()
    return graph


def timed_replays(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Seconds per replay, by CUDA events around back-to-back replays."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


class BareCopies:
    """The copies of a captured exchange without its handshake, one graph per probe: what the
    copy engines take for the same bytes when nothing waits for the peer.

    "one_copy" reads the peer's `send` into `recv` directly, as much as smfree's batched
    exchange moves; "two_copies" is the path through a slot (`send` into a slot on this GPU,
    then the peer's slot read into `recv` over NVLink).
    Both ranks fill their slots before capture and every copy moves the same bytes, so each
    replay delivers the peer's pattern although nothing orders the two ranks' copies.
    """

    def __init__(self, ctx: Ctx, send: torch.Tensor, recv: torch.Tensor,
                 stream: torch.cuda.Stream | None = None) -> None:
        self.recv = recv
        self.slot = send.clone()
        torch.cuda.synchronize()
        exports = gather(ctx, (cuda_driver.export(send), cuda_driver.export(self.slot)))
        self.peer_send, self.peer_slot = (cuda_driver.Mapping(exported, ctx.device)
                                          for exported in exports[ctx.peer])
        size = send.numel() * send.element_size()

        def two_copies() -> None:
            self.slot.copy_(send)
            cuda_driver.copy_async(recv.data_ptr(), self.peer_slot.address, size,
                                   torch.cuda.current_stream())

        def one_copy() -> None:
            cuda_driver.copy_async(recv.data_ptr(), self.peer_send.address, size,
                                   torch.cuda.current_stream())

        self.graphs = {"two_copies": capture(two_copies, stream),
                       "one_copy": capture(one_copy, stream)}

    def close(self, ctx: Ctx) -> None:
        """Unmaps the peer's buffers; every rank calls it before its own buffers go."""
        torch.cuda.synchronize()
        self.peer_send.close()
        self.peer_slot.close()
        barrier(ctx)


def measure_exchange(ctx: Ctx, size: int, args) -> dict:
    """µs per replay of a captured exchange of `size` bytes each way, per backend and probe."""
    send = pattern(ctx.rank, size // 4, ctx.device)
    recvs = {backend: torch.zeros_like(send) for backend in CUDA_BACKENDS}
    graphs = {}
    for backend in CUDA_BACKENDS:
        group = ctx.groups[backend]
        exchange(group, send, recvs[backend], ctx.peer)  # untimed, uncaptured: the warm-up
        barrier(ctx)
        graphs[backend] = capture(lambda: exchange(group, send, recvs[backend], ctx.peer))
    bare = BareCopies(ctx, send, torch.zeros_like(send))
    graphs.update(bare.graphs)
    for condition, graph in graphs.items():
        recv = bare.recv if condition in PROBES else recvs[condition]
        recv.zero_()
        graph.replay()
        torch.cuda.synchronize()
        raise_on_errors(gather(ctx, mismatch(recv, ctx.peer,
                                             f"rank {ctx.rank}, captured {condition} exchange")),
                        f"captured exchange over {condition}")
    seconds = {condition: [] for condition in graphs}
    for _ in range(args.captured_reps):
        for condition, graph in graphs.items():
            barrier(ctx)
            seconds[condition].append(max(gather(ctx, timed_replays(graph,
                                                                     args.captured_replays))))
    graphs.clear()
    bare.close(ctx)
    row = {"bytes": size}
    for condition, times in seconds.items():
        us = 1e6 * statistics.median(times)
        row[condition] = {"us": us, "GBps_each_way": size / (us * 1e-6) / 1e9,
                          "us_reps": [1e6 * t for t in times]}
    ratios = [s / n for s, n in zip(seconds["smfree"], seconds["nccl"])]
    row["paired"] = {"ratios": ratios, "ratio": statistics.median(ratios)}
    log(ctx, f"captured exchange {format_size(size):>7}: smfree {row['smfree']['us']:9.1f} µs, "
             f"NCCL {row['nccl']['us']:9.1f} µs, bare copies "
             f"{row['two_copies']['us']:9.1f} (2) {row['one_copy']['us']:9.1f} (1) µs per replay")
    return row


def replay_step(ctx: Ctx, graph, markers, stage, microbatches) -> tuple[float, str | None]:
    torch.cuda.synchronize()
    started = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    got = [(what, float(marker)) for what, marker in markers]
    want = pipeline.expected_markers(stage, microbatches)
    return seconds, None if got == want else f"rank {ctx.rank}: received {got}, expected {want}"


def measure_step(ctx: Ctx, args) -> dict:
    """The pipeline section's step, uncaptured and captured, per backend: ms, slowest rank."""
    hidden, tokens = args.pipeline_hidden, args.pipeline_tokens
    microbatches = args.pipeline_microbatches
    torch.manual_seed(1234 + ctx.rank)
    weight = torch.randn(hidden, hidden, device=ctx.device, dtype=pipeline.DTYPE) / hidden ** 0.5
    stage = pipeline.Stage(ctx.rank, ctx.world, ctx.device, weight, args.pipeline_layers,
                           (tokens, hidden))
    inputs = torch.randn(tokens, hidden, device=ctx.device, dtype=pipeline.DTYPE)
    seed = torch.randn(tokens, hidden, device=ctx.device, dtype=pipeline.DTYPE)
    figures = {}
    for backend in CUDA_BACKENDS:
        links = pipeline.Links(stage, ctx.groups[backend])
        uncaptured = []
        for step in range(2 + args.pipeline_steps):
            barrier(ctx)
            seconds, error = pipeline.run_step(stage, links, microbatches, inputs, seed)
            raise_on_errors(gather(ctx, error), f"uncaptured step over {backend}")
            if step >= 2:
                uncaptured.append(max(gather(ctx, seconds)))
        barrier(ctx)
        links.received.clear()
        graph = capture(lambda: pipeline.one_f_one_b(stage, links, microbatches, inputs, seed))
        markers = list(links.received)  # views of the graph's buffers: each replay refills them
        captured = []
        for step in range(2 + args.pipeline_steps):
            barrier(ctx)
            seconds, error = replay_step(ctx, graph, markers, stage, microbatches)
            raise_on_errors(gather(ctx, error), f"captured step over {backend}")
            if step >= 2:
                captured.append(max(gather(ctx, seconds)))
        del graph
        figures[backend] = {"captured_ms": 1e3 * statistics.median(captured),
                            "uncaptured_ms": 1e3 * statistics.median(uncaptured),
                            "captured_ms_all": [1e3 * s for s in captured],
                            "uncaptured_ms_all": [1e3 * s for s in uncaptured]}
        log(ctx, f"captured step {backend}: {figures[backend]['captured_ms']:.2f} ms "
                 f"(uncaptured {figures[backend]['uncaptured_ms']:.2f} ms)")
    return {"stages": ctx.world, "microbatches": microbatches, "hidden": hidden,
            "tokens": tokens, "layers_per_stage": args.pipeline_layers,
            "activation_bytes": tokens * hidden * pipeline.DTYPE.itemsize,
            "steps": args.pipeline_steps, "backends": figures}


class CapturedTraffic:
    """The overlap section's traffic, as replays of a captured exchange on a side stream."""

    def __init__(self, ctx: Ctx, chunk: int, replays: int) -> None:
        self.peer = ctx.peer
        self.send = pattern(ctx.rank, chunk // 4, ctx.device)
        self.recv = torch.empty_like(self.send)
        self.replays = replays
        self.stream = torch.cuda.Stream(ctx.device)
        self.graphs = {}
        for backend in CUDA_BACKENDS:
            group = ctx.groups[backend]
            exchange(group, self.send, self.recv, self.peer)  # untimed, uncaptured
            barrier(ctx)
            self.graphs[backend] = capture(
                lambda: exchange(group, self.send, self.recv, self.peer), self.stream)
        self.bare = BareCopies(ctx, self.send, self.recv, self.stream)
        self.graphs.update(self.bare.graphs)

    def post(self, ctx: Ctx, backend: str, after: torch.cuda.Event):
        """Replays from a thread: launches wait once the launch queue is full, and the GEMM loop
        must be queued at once."""
        graph = self.graphs[backend]

        def replays() -> None:
            for _ in range(self.replays):
                graph.replay()

        return overlap.post_from_thread(self.stream, after, replays)


def measure_overlap(ctx: Ctx, args) -> dict:
    n = args.gemm_n
    replays = -(-args.overlap_bytes // args.overlap_chunk)
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    matrices = (a, torch.randn_like(a), torch.empty_like(a))
    traffic = CapturedTraffic(ctx, args.overlap_chunk, replays)
    samples = overlap.trial_rounds(ctx, traffic, matrices, args, "captured overlap", LOADS)
    traffic.graphs.clear()
    traffic.bare.close(ctx)
    bytes_each_way = replays * args.overlap_chunk
    return {"gemm_n": n, "gemms": args.gemms, "preheat_gemms": args.overlap_preheat,
            "chunk_bytes": args.overlap_chunk, "replays": replays,
            "bytes_each_way": bytes_each_way, "reps": args.overlap_reps,
            "ranks": gather(ctx, overlap.summarize_overlap(samples, n, bytes_each_way, LOADS))}


def run(ctx: Ctx, args) -> dict:
    if ctx.world % 2:
        raise RuntimeError("smfree bench: the captured section pairs every rank with a peer: "
                           "it needs an even number of ranks")
    return {"capture_error_mode": CAPTURE_MODE,
            "replays": args.captured_replays,
            "reps": args.captured_reps,
            "exchanges": [measure_exchange(ctx, size, args) for size in args.captured_sizes],
            "step": measure_step(ctx, args),
            "overlap": measure_overlap(ctx, args)}


def print_section(section: dict) -> None:
    print(f"\nCaptured exchanges: one batched exchange with the peer per graph, µs per replay "
          f"({section['replays']} back-to-back replays, median of {section['reps']}, slower "
          f"rank; capture_error_mode={section['capture_error_mode']})")
    rows = [[format_size(row["bytes"]), num(row["smfree"]["us"], 1), num(row["nccl"]["us"], 1),
             num(row["smfree"]["GBps_each_way"], 1), num(row["nccl"]["GBps_each_way"], 1),
             f"{row['paired']['ratio']:.3f}", *(num(row[probe]["us"], 1) for probe in PROBES)]
            for row in section["exchanges"]]
    print(format_table(["size", "smfree µs", "NCCL µs", "smfree GB/s", "NCCL GB/s",
                        "smfree/NCCL", *(f"{PROBE_TITLES[p]} µs" for p in PROBES)], rows))
    print("bare: the same bytes copied by graphs of copies alone, no handshake (the floor)")
    step = section["step"]
    print(f"\nCaptured step: 1F1B over {step['stages']} stages, {step['microbatches']} "
          f"micro-batches, {format_size(step['activation_bytes'])} activations, replayed whole "
          f"(median of {step['steps']}, slowest rank)")
    nccl = step["backends"]["nccl"]
    rows = [[backend, num(f["captured_ms"], 2), f"{f['captured_ms'] / nccl['captured_ms']:.3f}",
             num(f["uncaptured_ms"], 2), f"{f['uncaptured_ms'] / nccl['uncaptured_ms']:.3f}"]
            for backend, f in step["backends"].items()]
    print(format_table(["backend", "captured ms", "vs NCCL", "uncaptured ms", "vs NCCL"], rows))
    lap = section["overlap"]
    print(f"\nCaptured overlap: bf16 GEMM {lap['gemm_n']}^3 x {lap['gemms']} while a captured "
          f"exchange of {format_size(lap['chunk_bytes'])} is replayed {lap['replays']} times "
          f"(median of {lap['reps']} rounds)")
    rows = []
    for rank, summary in enumerate(lap["ranks"][:2]):
        rows.append([str(rank), num(summary["alone_ms"], 3),
                     *(f"{summary[load]['paired_slowdown_pct']:+.1f} %" for load in LOADS),
                     *(num(summary[load]["transfer_GBps"], 1) for load in LOADS),
                     "yes" if all(summary[load]["covered"] for load in LOADS)
                     else "no: raise --overlap-bytes"])
    titles = {"smfree": "smfree", "nccl": "NCCL", **PROBE_TITLES}
    print(format_table(["rank", "ms/GEMM alone", *(f"slowdown +{titles[load]}" for load in LOADS),
                        *(f"{titles[load]} GB/s" for load in LOADS), "traffic covered the loop"],
                       rows))
    sys.stdout.flush()
