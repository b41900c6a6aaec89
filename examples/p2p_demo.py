"""Point-to-point demo: smfree beside the stock backend, in one run.

Ranks are paired (0<->1, 2<->3, ...; with an odd world size the last rank idles). For each
message size, both ranks of a pair exchange a buffer in each direction per iteration with
`dist.batch_isend_irecv`. A repetition times a few iterations over the reference backend
("gloo" on CPU, "nccl" on GPU), then over smfree; the demo runs several repetitions and rank 0
prints one table of medians over them: time per exchange, GB/s one way (1 GB = 1e9 B), and
smfree's GB/s as a fraction of the reference's, with the range (min-max) of each. Times are
those of the slowest pair. On shared or small CPU machines the figures vary from run to run;
the range shows by how much.

With one GPU, both ranks of the pair share it and exchange CUDA tensors there. NCCL refuses two
ranks on one GPU, so no reference exists: smfree's figures stand beside the bare copy floors
measured on that GPU in the same run, by rank 0 alone (one device-to-pinned-host copy then one
pinned-host-to-device copy; the two overlapped on two streams; one copy within the GPU).

Run it with torchrun, e.g.

    torchrun --nproc-per-node=2 examples/p2p_demo.py
    torchrun --nproc-per-node=2 examples/p2p_demo.py --sizes 4K,1M,64M --repeats 9 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from smfree_pg.bench.floors import FLOOR_TITLES, FLOORS, measure_floors

DEFAULT_SIZES = "4K,64K,1M,16M,64M"
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# Keeps the default run short on a small CPU box: fewer iterations per repetition for bigger
# messages.
DEFAULT_BYTES_PER_REPEAT = 64 << 20
MAX_DEFAULT_ITERS = 20
MIN_DEFAULT_ITERS = 2
DEFAULT_REPEATS = 5


def parse_size(text: str) -> int:
    """'64K' -> 65536. Sizes are in bytes, with optional K/M/G (powers of 1024)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (text[:-1], text[-1]) if text[-1:] in UNITS else (text, "")
    size = int(number) * UNITS[unit]
    # The buffers hold int32, so the pattern can number every element.
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return size


def format_size(size: int) -> str:
    for unit in ("G", "M", "K"):
        if size % UNITS[unit] == 0:
            return f"{size // UNITS[unit]} {unit}iB"
    return f"{size} B"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=lambda text: [parse_size(part) for part in text.split(",")],
        default=DEFAULT_SIZES,
        help=f"comma-separated message sizes, e.g. 4K,1M (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--iters",
        type=int,
        help=f"timed iterations per repetition (default: {MAX_DEFAULT_ITERS}, fewer for big sizes)",
    )
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help=f"repetitions per size, of which the medians are printed "
                             f"(default {DEFAULT_REPEATS})")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per size")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, not {args.repeats}")
    return args


def default_iters(size: int) -> int:
    return max(MIN_DEFAULT_ITERS, min(MAX_DEFAULT_ITERS, DEFAULT_BYTES_PER_REPEAT // size))


def peer_of(rank: int, world: int) -> int | None:
    """The rank this one exchanges with, or None for the odd one out."""
    peer = rank ^ 1
    return peer if peer < world else None


def pattern(rank: int, world: int, elements: int, device: torch.device) -> torch.Tensor:
    """A buffer that differs per sending rank and per position, to catch misplaced bytes."""
    return torch.arange(elements, dtype=torch.int32, device=device).mul_(world).add_(rank)


def synchronize(device: torch.device) -> None:
    # CUDA ops return once queued; the clock must see them finished.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group) -> None:
    ops = [
        dist.P2POp(dist.isend, send, peer, group),
        dist.P2POp(dist.irecv, recv, peer, group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def time_exchanges(send, recv, peer, group, iters: int, warmup: int) -> float:
    """Seconds per exchange, averaged over `iters` after `warmup` untimed ones."""
    for _ in range(warmup):
        exchange(send, recv, peer, group)
    synchronize(send.device)
    start = time.perf_counter()
    for _ in range(iters):
        exchange(send, recv, peer, group)
    synchronize(send.device)
    return (time.perf_counter() - start) / iters


def measure(group, size: int, iters: int, warmup: int, device: torch.device) -> tuple[float, str]:
    """(this rank's seconds per exchange, error message or '') for one size on one group.

    The idle rank of an odd world returns (0.0, '') so that it does not weigh in the max.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = peer_of(rank, world)
    # Pairs start together, so no pair's time includes waiting for another's previous size.
    dist.barrier()
    if peer is None:
        return 0.0, ""
    elements = size // 4
    send = pattern(rank, world, elements, device)
    recv = torch.zeros_like(send)
    seconds = time_exchanges(send, recv, peer, group, iters, warmup)
    # Every exchange writes the same bytes into `recv`, which started as zeros.
    expected = pattern(peer, world, elements, device)
    if torch.equal(recv, expected):
        return seconds, ""
    first_bad = int((recv != expected).nonzero()[0])
    return seconds, (
        f"rank {rank}: wrong data from rank {peer} over {dist.get_backend(group)}, "
        f"{format_size(size)}: first bad int32 at index {first_bad}: "
        f"got {int(recv[first_bad])}, expected {int(expected[first_bad])}"
    )


def slowest(seconds: float, failed: bool, device: torch.device) -> tuple[float, bool]:
    """The max over all ranks of the time, and whether any rank saw wrong data."""
    # Over the default group: NCCL takes the rank's GPU, Gloo (CPU, or ranks sharing a GPU) the
    # CPU.
    tally = device if dist.get_backend() == "nccl" else torch.device("cpu")
    figures = torch.tensor([seconds, float(failed)], dtype=torch.float64, device=tally)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return figures[0].item(), bool(figures[1].item())


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def run_benchmark(groups: dict, args, device: torch.device, ref: str | None) -> list[dict]:
    """One row per size: per backend, the median microseconds and GB/s over the repetitions and
    the range of the microseconds; smfree's GB/s over the reference's, per repetition, as median
    and range; without a reference (ranks sharing a GPU), the copy floors instead (floors_row).
    Exits 1 on wrong data."""
    rows = []
    for size in args.sizes:
        iters = args.iters or default_iters(size)
        seconds = {name: [] for name in groups}
        # The backends alternate within a repetition, so that a ratio compares times measured
        # moments apart, under the same load.
        for _ in range(args.repeats):
            for name, group in groups.items():
                elapsed, error = measure(group, size, iters, args.warmup, device)
                if error:
                    print(f"p2p_demo: {error}", file=sys.stderr, flush=True)
                elapsed, failed = slowest(elapsed, bool(error), device)
                if failed:
                    fail(f"wrong data over {name} at {format_size(size)} "
                         f"(see the ranks' messages)")
                seconds[name].append(elapsed)
        row = {"bytes": size, "iters": iters, "repeats": args.repeats}
        for name, times in seconds.items():
            row[name] = figures(size, times)
        if ref is None:
            row.update(floors_row(row["smfree"], floor_seconds(device, size, iters, args.repeats)))
        else:
            ratios = [r / s for r, s in zip(seconds[ref], seconds["smfree"])]
            row["ratio"] = {"median": median(ratios), "min": min(ratios), "max": max(ratios)}
        rows.append(row)
    return rows


def figures(size: int, times: list[float]) -> dict:
    """Median µs and GB/s over the repetitions' seconds per exchange, and the range of the µs."""
    middle = median(times)
    return {"us": middle * 1e6, "GBps": size / middle / 1e9,
            "us_min": min(times) * 1e6, "us_max": max(times) * 1e6}


def floor_seconds(device: torch.device, size: int, iters: int, repeats: int) -> dict:
    """Per copy floor, rank 0's seconds per pass in each repetition, timed while the other
    ranks wait: the floors see the GPU alone."""
    dist.barrier()
    samples = measure_floors(device, size, iters, repeats) if dist.get_rank() == 0 else None
    dist.barrier()
    return samples


def floors_row(smfree: dict, samples: dict | None) -> dict:
    """The copy floors' figures (rank 0's; None elsewhere), and smfree's median time over each
    floor's."""
    if samples is None:
        return {"floors": None, "over_floor": None}
    floors = {name: {"us": median(times) * 1e6, "us_min": min(times) * 1e6,
                     "us_max": max(times) * 1e6} for name, times in samples.items()}
    return {"floors": floors,
            "over_floor": {name: smfree["us"] / floor["us"] for name, floor in floors.items()}}


def fail(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"p2p_demo: FAILED: {message}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    sys.exit(1)


def spread(figures: dict) -> str:
    return f"{figures['us']:.1f} ({figures['us_min']:.1f}-{figures['us_max']:.1f})"


def print_table(rows: list[dict], ref: str | None, header: str) -> None:
    if ref is None:
        columns = ["size", "smfree µs (range)", "smfree GB/s"]
        for name in FLOORS:
            columns += [f"{FLOOR_TITLES[name]} µs (range)", "x"]
        lines = [[format_size(row["bytes"]), spread(row["smfree"]),
                  f"{row['smfree']['GBps']:.3f}"] +
                 [cell for name in FLOORS
                  for cell in (spread(row["floors"][name]), f"{row['over_floor'][name]:.2f}")]
                 for row in rows]
    else:
        columns = ["size", "smfree µs (range)", "smfree GB/s", f"{ref} µs (range)",
                   f"{ref} GB/s", "ratio (range)"]
        lines = [
            [
                format_size(row["bytes"]),
                spread(row["smfree"]),
                f"{row['smfree']['GBps']:.3f}",
                spread(row[ref]),
                f"{row[ref]['GBps']:.3f}",
                f"{row['ratio']['median']:.2f} "
                f"({row['ratio']['min']:.2f}-{row['ratio']['max']:.2f})",
            ]
            for row in rows
        ]
    widths = [
        max(len(column), *(len(line[i]) for line in lines)) for i, column in enumerate(columns)
    ]
    print(header)
    print(" | ".join(column.rjust(width) for column, width in zip(columns, widths)))
    print("-+-".join("-" * width for width in widths))
    for line in lines:
        print(" | ".join(cell.rjust(width) for cell, width in zip(line, widths)))
    repeats = rows[0]["repeats"] if rows else 0
    if ref is None:
        print(f"medians of {repeats} repetitions, (min-max) over them; x = smfree µs / floor µs; "
              "GB/s = bytes one way / time per exchange")
        print("No NCCL reference: NCCL refuses two ranks on one GPU. The floors, timed on this "
              "GPU in this run by rank 0 alone: " +
              "; ".join(f"{FLOOR_TITLES[name]} = {what}" for name, what in FLOORS.items()))
    else:
        print(f"medians of {repeats} repetitions, (min-max) over them; ratio = smfree GB/s / "
              f"{ref} GB/s; GB/s = bytes one way / time per exchange")
    print("On shared or small CPU machines these figures vary from run to run (the ranges show "
          "by how much); compare them within one run, not across runs.")


def describe(device: torch.device, world: int, shared: bool) -> str:
    name = (f"{torch.cuda.get_device_name(device)} (copy-engine path"
            f"{', every rank on this one GPU' if shared else ''})"
            if device.type == "cuda" else "CPU")
    pairs = world // 2
    idle = f", rank {world - 1} idle" if world % 2 else ""
    return (
        f"p2p_demo: device {name}, torch {torch.__version__}, world size {world} "
        f"({pairs} pair{'s' if pairs != 1 else ''}{idle}); "
        f"times are the max over all pairs (all_reduce MAX), bidirectional exchange"
    )


def choose_device(gpus: int, local_rank: int, local_ranks: int) -> tuple[torch.device, str]:
    """This rank's device, and a note saying why when ranks share a GPU.

    The GPU run gives each rank of a host a GPU of its own, so that NCCL, the reference, can
    run. With one GPU every rank shares it, smfree alone (NCCL refuses two ranks on one GPU).
    """
    if gpus >= local_ranks:
        return torch.device("cuda", local_rank), ""
    if gpus == 1:
        return torch.device("cuda", 0), (
            f"1 GPU for {local_ranks} ranks on this host: they share it. NCCL refuses two ranks "
            "on one GPU, so there is no NCCL reference here: smfree is shown beside the bare "
            "copy floors measured on this GPU in this run")
    if gpus == 0:
        return torch.device("cpu"), ""
    raise SystemExit(f"p2p_demo: {local_ranks} ranks on this host but {gpus} GPUs; "
                     f"run it with --nproc-per-node={gpus}")


def setup() -> tuple[str | None, torch.device]:
    """Starts the default group and returns (the reference backend, None where ranks share a
    GPU, and the device)."""
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("p2p_demo: start it with torchrun, e.g. "
                         "torchrun --nproc-per-node=2 examples/p2p_demo.py")
    local_rank = int(os.environ["LOCAL_RANK"])
    device, note = choose_device(
        torch.cuda.device_count(), local_rank, int(os.environ["LOCAL_WORLD_SIZE"])
    )
    if note and local_rank == 0:
        print(f"p2p_demo: {note}", flush=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shared = device.type == "cuda" and torch.cuda.device_count() < int(
        os.environ["LOCAL_WORLD_SIZE"])
    # Where ranks share a GPU, Gloo (on the CPU) runs the demo's barriers and tallies.
    ref = None if shared else ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend=ref or "gloo")
    return ref, device


def main() -> None:
    args = parse_args()
    ref, device = setup()
    world = dist.get_world_size()
    if world < 2:
        fail("needs at least 2 ranks, e.g. torchrun --nproc-per-node=2")


    import smfree_pg  # noqa: F401  (registers backend "smfree")

    smfree = dist.new_group(list(range(world)), backend="smfree")
    groups = {"smfree": smfree} if ref is None else {ref: dist.group.WORLD, "smfree": smfree}
    rows = run_benchmark(groups, args, device, ref)

    if dist.get_rank() == 0:
        header = describe(device, world, ref is None)
        print_table(rows, ref, header)
        if args.json:
            report = {"header": header, "reference": ref, "rows": rows}
            if ref is None:
                report["floors"] = FLOORS
            with open(args.json, "w") as out:
                json.dump(report, out, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
