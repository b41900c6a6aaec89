"""Pipeline (docs/benchmarks.md): a synthetic 1F1B pipeline over every rank, smfree beside NCCL.

Rank r is stage r of the world. One step pushes `microbatches` micro-batches through the stages
with the 1F1B schedule. A stage's forward is `layers` bf16 GEMMs (tokens x hidden) @ (hidden x
hidden), its backward twice as many. Activations go to the next stage and gradients to the
previous one, batched per point of the schedule and waited on before the compute that follows,
as Megatron's `p2p_communication` does with `--batch-p2p-communication` (send_forward,
send_forward_recv_backward, ...). Every received tensor carries its micro-batch number, checked
after each step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from smfree_pg.bench.cli import at_least
from smfree_pg.bench.context import CUDA_BACKENDS, barrier, gather, log, raise_on_errors
from smfree_pg.bench.report import format_table
from smfree_pg.bench.sizes import format_size

NAME = "pipeline"
DEVICES = ("cuda",)
PLACEMENTS = ("own",)
DTYPE = torch.bfloat16


def add_arguments(parser) -> None:
    group = parser.add_argument_group("pipeline")
    group.add_argument("--pipeline-hidden", type=int, default=8192,
                       help="hidden size: GEMM width and activation columns (default: %(default)s)")
    group.add_argument("--pipeline-tokens", type=int, default=2048,
                       help="tokens per micro-batch: activation rows (default: %(default)s)")
    group.add_argument("--pipeline-layers", type=int, default=2,
                       help="forward GEMMs per stage and micro-batch (default: %(default)s)")
    group.add_argument("--pipeline-microbatches", type=int, default=8,
                       help="micro-batches per step, at most 100 (default: %(default)s)")
    group.add_argument("--pipeline-steps", type=int, default=8,
                       help="timed steps per backend, after 2 untimed (default: %(default)s)")


def check_arguments(args, parser) -> None:
    if not 1 <= args.pipeline_microbatches <= 100:
        parser.error("--pipeline-microbatches must be between 1 and 100")
    at_least(parser, args, 1, "pipeline_layers", "pipeline_steps", "pipeline_hidden",
             "pipeline_tokens")


@dataclass
class Stage:
    rank: int
    world: int
    device: torch.device
    weight: torch.Tensor
    layers: int
    shape: tuple[int, int]

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    def forward(self, x: torch.Tensor, microbatch: int) -> torch.Tensor:
        for _ in range(self.layers):
            x = x @ self.weight
        # The next stage checks it: integers up to 256 are exact in bf16. fill_ takes the value
        # as a kernel argument, so a CUDA graph can capture it.
        x[0, 0].fill_(microbatch)
        return x

    def backward(self, grad: torch.Tensor, microbatch: int) -> torch.Tensor:
        for _ in range(2 * self.layers):
            grad = grad @ self.weight
        grad[0, 0].fill_(-1 - microbatch)
        return grad


class Links:
    """The stage's point-to-point calls over one group, named as in Megatron."""

    def __init__(self, stage: Stage, group) -> None:
        self.stage = stage
        self.group = group
        self.received: list[tuple[str, torch.Tensor]] = []  # (what, marker element)

    def _communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        s = self.stage
        ops, got_prev, got_next = [], None, None
        if recv_prev:
            got_prev = torch.empty(s.shape, dtype=DTYPE, device=s.device)
            ops.append(dist.P2POp(dist.irecv, got_prev, s.rank - 1, self.group))
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next, s.rank + 1, self.group))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev, s.rank - 1, self.group))
        if recv_next:
            got_next = torch.empty(s.shape, dtype=DTYPE, device=s.device)
            ops.append(dist.P2POp(dist.irecv, got_next, s.rank + 1, self.group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        if got_prev is not None:
            self.received.append(("activation", got_prev[0, 0]))
        if got_next is not None:
            self.received.append(("gradient", got_next[0, 0]))
        return got_prev, got_next

    def recv_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs if self.stage.first else self._communicate(recv_prev=True)[0]

    def send_forward(self, y: torch.Tensor) -> None:
        if not self.stage.last:
            self._communicate(send_next=y)

    def recv_backward(self, seed: torch.Tensor) -> torch.Tensor:
        return seed if self.stage.last else self._communicate(recv_next=True)[1]

    def send_backward(self, dx: torch.Tensor) -> None:
        if not self.stage.first:
            self._communicate(send_prev=dx)

    def send_forward_recv_backward(self, y: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        if self.stage.last:
            return seed
        return self._communicate(send_next=y, recv_next=True)[1]

    def send_backward_recv_forward(self, dx: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        if self.stage.first:
            return inputs
        return self._communicate(send_prev=dx, recv_prev=True)[0]


def one_f_one_b(stage: Stage, links: Links, microbatches: int, inputs, seed) -> None:
    """One step of the non-interleaved 1F1B schedule (Megatron's forward_backward_pipelining)."""
    warmup = min(stage.world - stage.rank - 1, microbatches)
    steady = microbatches - warmup
    forward_mb = backward_mb = 0
    for _ in range(warmup):
        x = links.recv_forward(inputs)
        links.send_forward(stage.forward(x, forward_mb))
        forward_mb += 1
    x = links.recv_forward(inputs) if steady > 0 else None
    for i in range(steady):
        y = stage.forward(x, forward_mb)
        forward_mb += 1
        grad = links.send_forward_recv_backward(y, seed)
        dx = stage.backward(grad, backward_mb)
        backward_mb += 1
        if i == steady - 1:
            links.send_backward(dx)
        else:
            x = links.send_backward_recv_forward(dx, inputs)
    for _ in range(warmup):
        grad = links.recv_backward(seed)
        links.send_backward(stage.backward(grad, backward_mb))
        backward_mb += 1


def expected_markers(stage: Stage, microbatches: int) -> list[tuple[str, float]]:
    """What a stage receives in one step, in the order its schedule receives it."""
    events = []
    warmup = min(stage.world - stage.rank - 1, microbatches)
    steady = microbatches - warmup
    activations = iter(range(microbatches))
    gradients = iter(range(microbatches))
    if not stage.first:
        events += [("activation", next(activations)) for _ in range(warmup + (steady > 0))]
    for i in range(steady):
        if not stage.last:
            events.append(("gradient", -1 - next(gradients)))
        if i != steady - 1 and not stage.first:
            events.append(("activation", next(activations)))
    if not stage.last:
        events += [("gradient", -1 - next(gradients)) for _ in range(warmup)]
    return [(what, float(value)) for what, value in events]


def run_step(stage: Stage, links: Links, microbatches: int, inputs, seed) -> tuple[float, str | None]:
    """Seconds for one step on this rank, and what was received wrong, if anything."""
    links.received.clear()
    torch.cuda.synchronize()
    started = time.perf_counter()
    one_f_one_b(stage, links, microbatches, inputs, seed)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    got = [(what, float(marker)) for what, marker in links.received]
    want = expected_markers(stage, microbatches)
    error = None if got == want else f"rank {stage.rank}: received {got}, expected {want}"
    return seconds, error


def run(ctx, args) -> dict:
    hidden, tokens = args.pipeline_hidden, args.pipeline_tokens
    microbatches = args.pipeline_microbatches
    torch.manual_seed(1234 + ctx.rank)
    # Scaled so values stay near 1 through the GEMM chain.
    weight = torch.randn(hidden, hidden, device=ctx.device, dtype=DTYPE) / hidden ** 0.5
    stage = Stage(ctx.rank, ctx.world, ctx.device, weight, args.pipeline_layers, (tokens, hidden))
    inputs = torch.randn(tokens, hidden, device=ctx.device, dtype=DTYPE)
    seed = torch.randn(tokens, hidden, device=ctx.device, dtype=DTYPE)
    samples: dict[str, list[float]] = {backend: [] for backend in CUDA_BACKENDS}
    for backend in CUDA_BACKENDS:
        links = Links(stage, ctx.groups[backend])
        for step in range(2 + args.pipeline_steps):
            barrier(ctx)
            seconds, error = run_step(stage, links, microbatches, inputs, seed)
            raise_on_errors(gather(ctx, error), f"pipeline over {backend}")
            slowest = max(gather(ctx, seconds))
            if step >= 2:
                samples[backend].append(slowest)
        log(ctx, f"pipeline {backend}: median step {1e3 * statistics.median(samples[backend]):.2f} ms")
    flops_per_stage = microbatches * 3 * args.pipeline_layers * 2 * tokens * hidden * hidden
    summary = {}
    for backend, steps in samples.items():
        median = statistics.median(steps)
        summary[backend] = {
            "step_ms": 1e3 * median,
            "step_ms_all": [1e3 * s for s in steps],
            "TFLOPs_per_gpu": flops_per_stage / median / 1e12,
        }
    return {
        "stages": ctx.world,
        "microbatches": microbatches,
        "hidden": hidden,
        "tokens": tokens,
        "layers_per_stage": args.pipeline_layers,
        "activation_bytes": tokens * hidden * DTYPE.itemsize,
        "steps": args.pipeline_steps,
        "backends": summary,
    }


def print_section(section: dict) -> None:
    print(f"\nPipeline: 1F1B over {section['stages']} stages, {section['microbatches']} "
          f"micro-batches, {section['layers_per_stage']} x (3 GEMMs of {section['tokens']} x "
          f"{section['hidden']} x {section['hidden']}) per stage and micro-batch, "
          f"{format_size(section['activation_bytes'])} activations; median of "
          f"{section['steps']} steps, slowest rank")
    figures = section["backends"]
    nccl = figures.get("nccl", {}).get("step_ms")
    rows = [[backend, f"{f['step_ms']:.2f}", f"{f['TFLOPs_per_gpu']:.0f}",
             f"{f['step_ms'] / nccl:.3f}" if nccl else "-"]
            for backend, f in figures.items()]
    print(format_table(["backend", "step ms", "TFLOP/s per GPU", "step vs NCCL"], rows),
          flush=True)
