"""Pipelining: torch.distributed.pipelining's schedules over smfree and over the reference.

One rank per pipeline rank (the first `stages` ranks of the world; the others wait), or
`--pipelining-pipelines` such pipelines side by side on consecutive ranks, as data-parallel
replicas of one pipeline run at once on a node (every figure then covers all of them). Each rank
holds an MLP of `layers` Linear(hidden, hidden) layers, split over its stages: one for GPipe and
1F1B, two for the interleaved and zero-bubble schedules (stage r + k * stages, and for ZBV the
V shape r, 2 * stages - 1 - r). A micro-batch's activation is `size` bytes: size / (hidden x
element size) rows. The same model (same seed), inputs and schedule run over smfree and over the
reference (NCCL on CUDA, Gloo on CPU): untimed warm-up steps, then rounds in which each backend
runs its steps back to back, the first backend alternating round by round. A step's time is
the slowest rank's, from a barrier to the device having done its work.

Besides the step time: the CPU time each wait() on a schedule's P2P Work held its rank (by
kind of post: send, recv, both in one batch), and whether both backends gave the same losses
and the same gradients (bit for bit).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import pipelining

from smfree_pg.bench.cli import at_least, parse_names
from smfree_pg.bench.context import Ctx, barrier, gather, log, synchronize
from smfree_pg.bench.report import format_table, num
from smfree_pg.bench.sizes import format_size, parse_sizes
from smfree_pg.bench.stats import paired_ratios, scaled, slowest, spread
from smfree_pg.bench.waits import WaitClock, pipelining_waits, summarize_waits

NAME = "pipelining"
DEVICES = ("cuda", "cpu")
PLACEMENTS = ("own",)
# Schedule name (torch's own) -> (class name, stages per rank, placement of a rank's stages).
KNOWN_SCHEDULES = {
    "GPipe": ("ScheduleGPipe", 1, "loop"),
    "1F1B": ("Schedule1F1B", 1, "loop"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2, "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2, "v"),
}
# The ones this torch has; the rest are named in the report as unavailable.
SCHEDULES = [name for name, (cls, _, _) in KNOWN_SCHEDULES.items() if hasattr(pipelining, cls)]
DEFAULT_STAGES = (2, 4)
DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}
SEED = 1234


def add_arguments(parser) -> None:
    group = parser.add_argument_group("pipelining")
    add = group.add_argument
    add("--pipelining-schedules", type=lambda text: parse_names(text, SCHEDULES, "schedule"),
        default=SCHEDULES, metavar="NAMES",
        help=f"schedules, comma-separated (default: those this torch has: {','.join(SCHEDULES)})")
    add("--pipelining-stages", type=parse_counts, metavar="COUNTS",
        help="pipeline ranks, comma-separated, each at least 2 and at most the world size "
        f"(default: those of {','.join(map(str, DEFAULT_STAGES))} the world holds)")
    add("--pipelining-pipelines", type=int, default=1,
        help="pipelines run side by side, each on the next `stages` ranks (default: %(default)s)")
    add("--pipelining-sizes", type=parse_sizes, default="32K,1M,8M,64M",
        help="activation bytes per micro-batch, comma-separated (default: %(default)s)")
    add("--pipelining-hidden", type=int, default=1024,
        help="MLP width: activations are rows x hidden (default: %(default)s)")
    add("--pipelining-layers", type=int, default=4,
        help="Linear layers per rank, split over its stages (default: %(default)s)")
    add("--pipelining-microbatches", type=int, default=8,
        help="micro-batches per step (default: %(default)s)")
    add("--pipelining-warmup", type=int, default=3,
        help="untimed steps per backend first, at least 1: the first infers the stages' "
        "shapes (default: %(default)s)")
    add("--pipelining-rounds", type=int, default=6,
        help="rounds, the first backend alternating (default: %(default)s)")
    add("--pipelining-steps", type=int, default=8,
        help="timed steps per backend and round (default: %(default)s)")


def parse_counts(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of stage counts: {text!r}") from None


def check_arguments(args, parser) -> None:
    at_least(parser, args, 1, "pipelining_hidden", "pipelining_microbatches", "pipelining_rounds",
             "pipelining_steps", "pipelining_warmup", "pipelining_pipelines")
    if args.pipelining_layers < 2 or args.pipelining_layers % 2:
        parser.error("--pipelining-layers must be even (two stages per rank share them)")
    if args.pipelining_stages is not None and min(args.pipelining_stages) < 2:
        parser.error("--pipelining-stages: a pipeline needs at least 2 ranks")
    itemsize = DTYPES[args.device].itemsize
    for size in args.pipelining_sizes:
        if size % (args.pipelining_hidden * itemsize):
            parser.error(f"--pipelining-sizes: {format_size(size)} is not a whole number of "
                         f"rows of {args.pipelining_hidden} {DTYPES[args.device]} "
                         "(--pipelining-hidden)")


def stage_counts(args, world: int) -> list[int]:
    pipelines = args.pipelining_pipelines
    if args.pipelining_stages is None:
        return [stages for stages in DEFAULT_STAGES if stages * pipelines <= world]
    if too_many := [stages for stages in args.pipelining_stages if stages * pipelines > world]:
        raise ValueError(f"smfree bench: --pipelining-stages {too_many} x --pipelining-pipelines "
                         f"{pipelines} need more ranks than the {world} of this run")
    return args.pipelining_stages


def stage_indices(rank: int, stages: int, per_rank: int, placement: str) -> list[int]:
    """The pipeline stages rank `rank` holds, of stages x per_rank."""
    if placement == "v":
        return [rank, 2 * stages - 1 - rank]
    return [rank + k * stages for k in range(per_rank)]


def mlp(hidden: int, layers: int, seed: int, device, dtype) -> nn.Module:
    torch.manual_seed(seed)
    modules = []
    for i in range(layers):
        if i:
            modules.append(nn.ReLU())
        modules.append(nn.Linear(hidden, hidden))
    return nn.Sequential(*modules).to(device=device, dtype=dtype)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target.float())


class Pipeline:
    """One schedule on one group: this rank's stages, their schedule, the step's inputs."""

    def __init__(self, name: str, group, ctx: Ctx, stages: int, rows: int, args) -> None:
        cls, per_rank, placement = KNOWN_SCHEDULES[name]
        dtype = DTYPES[ctx.device.type]
        hidden, total = args.pipelining_hidden, stages * per_rank
        # The stages infer their shapes in the first (untimed) step. Given up front, torch 2.13's
        # zero-bubble schedules left the weight gradients of every stage but the first unset.
        self.stages = [
            pipelining.PipelineStage(
                mlp(hidden, args.pipelining_layers // per_rank, SEED + index, ctx.device, dtype),
                index, total, ctx.device, group=group)
            for index in stage_indices(dist.get_rank(group), stages, per_rank, placement)]
        schedule_class = getattr(pipelining, cls)
        self.schedule = schedule_class(self.stages[0] if per_rank == 1 else self.stages,
                                       args.pipelining_microbatches, loss_fn=mse)
        generator = torch.Generator(ctx.device).manual_seed(SEED)
        shape = (args.pipelining_microbatches * rows, hidden)
        self.inputs = torch.randn(shape, generator=generator, device=ctx.device, dtype=dtype)
        self.target = torch.randn(shape, generator=generator, device=ctx.device, dtype=dtype)
        self.first = any(stage.is_first for stage in self.stages)
        self.last = any(stage.is_last for stage in self.stages)
        self.losses: list[list[float]] = []  # per step, per micro-batch (the last stage's rank)
        self.step_losses: list[torch.Tensor] = []
        # per step, the sum of this rank's gradients and how many parameters have none
        self.gradients: list[float] = []

    def step(self) -> None:
        """One step; the losses and gradients are read afterwards, outside the timed step."""
        self.step_losses = []
        self.schedule.step(*([self.inputs] if self.first else []),
                           target=self.target if self.last else None,
                           losses=self.step_losses if self.last else None)

    def record(self) -> None:
        """Keeps the step's losses and a checksum of the gradients, then zeroes them (so every
        step computes the same gradients from the same weights)."""
        if self.last:
            self.losses.append([float(loss.detach()) for loss in self.step_losses])
        parameters = [p for stage in self.stages for p in stage.submod.parameters()]
        # A parameter the schedule left without a gradient counts too: both backends must agree.
        self.gradients.append(float(sum(p.grad.double().sum() for p in parameters
                                        if p.grad is not None)))
        self.gradients.append(float(sum(p.grad is None for p in parameters)))
        for parameter in parameters:
            parameter.grad = None


def run_step(ctx: Ctx, pipeline: Pipeline | None, clock: WaitClock
             ) -> tuple[float, dict, dict]:
    """(seconds, {kind: seconds in each wait()}, {kind: seconds in each post}) of one step on
    this rank; off the pipeline, only the barrier that starts a step."""
    synchronize(ctx.device)
    barrier(ctx)
    if pipeline is None:
        return 0.0, {}, {}
    clock.clear()
    clock.recording = True
    start = time.perf_counter()
    pipeline.step()
    synchronize(ctx.device)
    seconds = time.perf_counter() - start
    clock.recording = False
    pipeline.record()
    return (seconds, {kind: list(times) for kind, times in clock.waits.items()},
            {kind: list(times) for kind, times in clock.posts.items()})


def subgroups(ctx: Ctx, stages: int, pipelines: int) -> dict[str, dist.ProcessGroup | None]:
    """Each backend's group over this rank's pipeline, ranks p * stages .. (p + 1) * stages - 1
    (None on the ranks of no pipeline). Every rank creates every pipeline's groups, in order."""
    if stages == ctx.world:
        return dict(ctx.groups)
    timeout = timedelta(seconds=ctx.timeout_s)
    mine = {backend: None for backend in ctx.backends}
    for pipeline in range(pipelines):
        ranks = list(range(pipeline * stages, (pipeline + 1) * stages))
        for backend in ctx.backends:
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if ctx.rank in ranks:
                mine[backend] = group
    return mine


def measure(ctx: Ctx, name: str, groups: dict, stages: int, rows: int, clock: WaitClock,
            args) -> dict | None:
    """One schedule at one size over both backends: this rank's samples (None off the
    pipeline). Every rank takes part in every step's barrier."""
    member = groups["smfree"] is not None
    pipelines = {backend: Pipeline(name, groups[backend], ctx, stages, rows, args) if member
                 else None for backend in ctx.backends}
    samples = {backend: {"step_s": [], "wait_step_s": [], "post_step_s": [], "waits": {},
                         "posts": {}}
               for backend in ctx.backends}
    for backend in ctx.backends:
        for _ in range(args.pipelining_warmup):
            run_step(ctx, pipelines[backend], clock)
    for round_ in range(args.pipelining_rounds):
        for backend in ctx.backends[::-1] if round_ % 2 else ctx.backends:
            for _ in range(args.pipelining_steps):
                seconds, waits, posts = run_step(ctx, pipelines[backend], clock)
                kept = samples[backend]
                kept["step_s"].append(seconds)
                for what, times_by_kind in (("wait", waits), ("post", posts)):
                    kept[f"{what}_step_s"].append(sum(map(sum, times_by_kind.values())))
                    for kind, times in times_by_kind.items():
                        kept[f"{what}s"].setdefault(kind, []).extend(times)
    if not member:
        return None
    for backend, pipeline in pipelines.items():
        samples[backend]["losses"] = pipeline.losses if pipeline.last else None
        samples[backend]["gradients"] = pipeline.gradients
    return samples


def compare(ours: list[float], reference: list[float]) -> dict:
    """Whether two runs' values agree bit for bit, and by how much they differ at most."""
    ours, reference = list(ours), list(reference)
    if len(ours) != len(reference):
        raise ValueError(f"compared {len(ours)} values with {len(reference)}")
    return {"identical": ours == reference,
            "max_abs_diff": max((abs(a - b) for a, b in zip(ours, reference)), default=0.0)}


def summarize(per_rank: list[dict | None], backends: tuple[str, str], steps_per_round: int
              ) -> dict:
    """A row's figures from the pipeline ranks' samples: per backend the slowest rank's step
    time and its spread, the CPU time per wait() by kind over every rank, the most time a rank
    spent in wait() per step; the paired ratio; the loss and gradient comparison."""
    members = [samples for samples in per_rank if samples is not None]
    row: dict = {}
    rounds = {}
    for backend in backends:
        steps = slowest([m[backend]["step_s"] for m in members])
        row[backend] = {"step_ms": scaled(spread(steps), 1e3),
                        "step_ms_all": [1e3 * s for s in steps]}
        for what in ("wait", "post"):
            by_kind: dict[str, list[float]] = {}
            for m in members:
                for kind, times in m[backend][f"{what}s"].items():
                    by_kind.setdefault(kind, []).extend(times)
            every = [t for times in by_kind.values() for t in times]
            row[backend][f"{what}_us"] = summarize_waits({**by_kind, "all": every},
                                                         steps=len(steps) * len(members))
            row[backend][f"{what}_ms_per_step"] = scaled(spread(slowest(
                [m[backend][f"{what}_step_s"] for m in members])), 1e3)
        rounds[backend] = [statistics.median(steps[i:i + steps_per_round])
                           for i in range(0, len(steps), steps_per_round)]
    ours, reference = backends
    row["ratio"] = row[ours]["step_ms"]["median"] / row[reference]["step_ms"]["median"]
    row["paired"] = paired_ratios(rounds[ours], rounds[reference])
    last = next(m for m in members if m[ours]["losses"] is not None)
    row["losses"] = {**compare(itertools.chain(*last[ours]["losses"]),
                               itertools.chain(*last[reference]["losses"])),
                     **{b: statistics.fmean(last[b]["losses"][0]) for b in backends}}
    row["gradients"] = compare(itertools.chain(*(m[ours]["gradients"] for m in members)),
                               itertools.chain(*(m[reference]["gradients"] for m in members)))
    return row


def run(ctx: Ctx, args) -> dict:
    dtype = DTYPES[ctx.device.type]
    rows_out = []
    clock = WaitClock()
    with pipelining_waits(clock):
        for stages in stage_counts(args, ctx.world):
            groups = subgroups(ctx, stages, args.pipelining_pipelines)
            for name, size in itertools.product(args.pipelining_schedules, args.pipelining_sizes):
                ctx.arm_watchdog()  # a whole section may run longer than the group timeout
                rows = size // (args.pipelining_hidden * dtype.itemsize)
                samples = measure(ctx, name, groups, stages, rows, clock, args)
                row = {"stages": stages, "pipelines": args.pipelining_pipelines, "schedule": name,
                       "stages_per_rank": KNOWN_SCHEDULES[name][1], "bytes": size, "rows": rows,
                       **summarize(gather(ctx, samples), ctx.backends, args.pipelining_steps)}
                rows_out.append(row)
                log(ctx, f"pipelining {stages} stages {name:21} {format_size(size):>7} "
                         + "  ".join(f"{b} {row[b]['step_ms']['median']:8.3f} ms "
                                     f"±{row[b]['step_ms']['iqr_pct']:.1f} %"
                                     for b in ctx.backends)
                         + f"  ratio {row['paired']['median']:.3f}")
                release(ctx.device)
    return {
        "reference": ctx.reference,
        "schedules": args.pipelining_schedules,
        "unavailable": [name for name in KNOWN_SCHEDULES if name not in SCHEDULES],
        "stages": stage_counts(args, ctx.world),
        "pipelines": args.pipelining_pipelines,
        "microbatches": args.pipelining_microbatches,
        "hidden": args.pipelining_hidden,
        "layers_per_rank": args.pipelining_layers,
        "dtype": str(dtype).removeprefix("torch."),
        "warmup_steps": args.pipelining_warmup,
        "rounds": args.pipelining_rounds,
        "steps_per_round": args.pipelining_steps,
        "units": {
            "step_ms": "ms per step, the slowest rank's of every pipeline, from a barrier "
                       "until its device is done; median, quartiles, extremes over every "
                       "timed step; iqr_pct and range_pct as % of the median",
            "paired": "per round, the median step over smfree / over the reference (the "
                      "backends alternate which runs first), and the spread of those ratios",
            "ratio": "median step over smfree / median step over the reference",
            "wait_us": "CPU µs inside each wait() on a schedule's P2P Work, by kind of post "
                       "(send, recv, send+recv: one batch), over every pipeline rank; per_step: "
                       "waits per step and rank",
            "wait_ms_per_step": "ms a step spent inside wait(), the most of any rank",
            "post_us": "CPU µs posting each of a schedule's P2P ops or batches (isend, irecv, "
                       "batch_isend_irecv), by kind, as wait_us",
            "post_ms_per_step": "ms a step spent posting, the most of any rank",
            "losses": "the last stage's losses of every step, smfree against the reference",
            "gradients": "per step and rank, the sum of the gradients and the count of "
                         "parameters without one, smfree against the reference",
        },
        "rows": rows_out,
    }


def release(device: torch.device) -> None:
    """Frees one row's models and activations before the next row builds its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


TITLES = {"smfree": "smfree", "nccl": "NCCL", "gloo": "Gloo"}


def print_section(section: dict) -> None:
    ref = TITLES[section["reference"]]
    backends = ("smfree", section["reference"])
    print(f"\nPipelining: torch.distributed.pipelining, {section['microbatches']} micro-batches, "
          f"{section['layers_per_rank']} x Linear({section['hidden']}, {section['hidden']}) per "
          f"rank ({section['dtype']}); step = slowest rank, median of {section['rounds']} rounds x "
          f"{section['steps_per_round']} steps per backend, the backends alternating; "
          "± = IQR as % of the median; paired = median over rounds of "
          f"smfree/{ref} [p25-p75]")
    if section["unavailable"]:
        print(f"not in this torch: {', '.join(section['unavailable'])}")
    rows, waits, posts = [], [], []
    for row in section["rows"]:
        where = [stages_cell(row), row["schedule"], format_size(row["bytes"])]
        paired = row["paired"]
        rows.append(where + [
            cell for b in backends
            for cell in (num(row[b]["step_ms"]["median"], 3),
                         f"{row[b]['step_ms']['iqr_pct']:.1f} %")
        ] + [num(row["ratio"], 3),
             f"{paired['median']:.3f} [{paired['p25']:.3f}-{paired['p75']:.3f}]",
             agreement(row["losses"]), agreement(row["gradients"])])
        for what, table in (("wait", waits), ("post", posts)):
            table.append(where + [
                cell for b in backends
                for cell in (*(wait_cell(row[b][f"{what}_us"].get(kind))
                               for kind in ("all", "send", "recv", "send+recv")),
                             num(row[b][f"{what}_ms_per_step"]["median"], 3))
            ])
    print(format_table(["stages", "schedule", "activation", "smfree ms", "±", f"{ref} ms", "±",
                        f"smfree/{ref}", "paired", "losses", "gradients"], rows))
    columns = ["stages", "schedule", "activation"] + [
        f"{TITLES[b]} {what}" for b in backends
        for what in ("all", "send", "recv", "send+recv", "ms/step")]
    for title, table in (("CPU time inside wait() per op, median µs (waits per step); ms/step: "
                          "a step's time in wait(), the most of any rank", waits),
                         ("CPU time posting ops (isend, irecv, a batch), median µs (posts per "
                          "step); ms/step: a step's time posting, the most of any rank", posts)):
        print(f"\n{title}")
        print(format_table(columns, table), flush=True)


def stages_cell(row: dict) -> str:
    """"4", or "4 x 2" for two pipelines of 4 stages side by side."""
    pipelines = row.get("pipelines", 1)
    return f"{row['stages']}" + (f" x {pipelines}" if pipelines > 1 else "")


def agreement(comparison: dict) -> str:
    if comparison["identical"]:
        return "identical"
    return f"differ ≤ {comparison['max_abs_diff']:.2g}"


def wait_cell(figure: dict | None) -> str:
    return "-" if figure is None else f"{figure['median_us']:.1f} ({figure['per_step']:.3g})"
