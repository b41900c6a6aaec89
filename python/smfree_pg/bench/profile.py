"""Zero-SM evidence: a torch.profiler trace of a few P2P ops over each
backend; the CUDA kernels they launched and the memory copies the profiler saw.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from smfree_pg.bench.cli import at_least
from smfree_pg.bench.context import CUDA_BACKENDS, Ctx, barrier, gather, log, raise_on_errors
from smfree_pg.bench.data import mismatch, pattern
from smfree_pg.bench.p2p import exchange, oneway_step
from smfree_pg.bench.report import format_table
from smfree_pg.bench.sizes import format_size, parse_size

NAME = "profile"
DEVICES = ("cuda",)
PLACEMENTS = ("own",)
# Profiler categories (kineto's activity types in the Chrome trace) of what runs on the GPU.
GPU_KINDS = {"kernel": "kernels", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


def add_arguments(parser) -> None:
    profile = parser.add_argument_group("profile")
    profile.add_argument("--profile-size", type=parse_size, default="16M",
                         help="bytes per op (default: %(default)s)")
    profile.add_argument("--profile-ops", type=int, default=4,
                         help="one-way ops, then as many exchanges, inside the trace "
                         "(default: %(default)s)")


def check_arguments(args, parser) -> None:
    at_least(parser, args, 1, "profile_ops")


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
    trace = out_dir / f"profile-{backend}-rank{ctx.rank}{args.run_suffix}.json"
    prof.export_chrome_trace(str(trace))
    counts = classify_trace(json.loads(trace.read_text()))
    # The same trace through prof.events(): every activity the profiler put on a CUDA device.
    counts["cuda_events"] = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    counts["trace"] = str(trace)
    return counts, error


def run(ctx: Ctx, args) -> dict:
    out_dir = Path(args.json).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"bytes": args.profile_size, "oneway_ops": args.profile_ops,
              "exchanges": args.profile_ops,
              # per rank of a pair: one isend or irecv per one-way op, both per exchange
              "p2p_ops": 3 * args.profile_ops}
    for backend in CUDA_BACKENDS:
        counts, error = profile_backend(ctx, backend, args, out_dir)
        gathered = gather(ctx, (counts, error))
        raise_on_errors([e for _, e in gathered], f"profile over {backend}")
        result[backend] = [c for c, _ in gathered]
        if counts is not None:
            log(ctx, f"profile {backend}: {counts['kernel_count']} kernels, "
                     f"{counts['memcpy_count']} memcpy on rank {ctx.rank}")
    return result


def print_section(section: dict) -> None:
    print(f"\nProfile: {section['oneway_ops']} one-way ops and {section['exchanges']} exchanges "
          f"of {format_size(section['bytes'])} ({section['p2p_ops']} P2P ops per rank)")
    rows, names = [], []
    for backend in CUDA_BACKENDS:
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

