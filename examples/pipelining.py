"""torch.distributed.pipelining over smfree: a small model split into stages, trained for one
step with GPipe, 1F1B and Interleaved1F1B, each step checked against the same model run in one
process (losses and every parameter's gradient).

The stages exchange activations and gradients with smfree's send/recv; nothing else changes
from a pipelining program over NCCL or Gloo. Run it with torchrun, on CPU or with one GPU per
rank:

    torchrun --nproc-per-node=2 examples/pipelining.py
    torchrun --nproc-per-node=4 examples/pipelining.py --schedules interleaved1f1b

GPipe and 1F1B put one stage on each rank; Interleaved1F1B puts two on each (stage i on rank
i mod world size). The model is in float64 so that the comparison can be tight: the pipeline
sums the microbatches' gradients in another order than the one-process run.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

# schedule name -> (class, stages per rank)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved1f1b": (ScheduleInterleaved1F1B, 2),
}
WIDTH = 32
BATCH = 16
MICROBATCHES = 4
# Agreement with the one-process run, in float64.
TOLERANCE = 1e-10


def build_model(layers: int) -> nn.Sequential:
    """The same weights on every rank and in the reference: a stack of Linear + Tanh."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(layers)]
    return nn.Sequential(*blocks).double()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64)
    targets = torch.randn(BATCH, WIDTH, generator=generator, dtype=torch.float64)
    return inputs, targets


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def layers_of(stage: int, stages: int, layers: int) -> range:
    per_stage = layers // stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def gradients(model: nn.Module, layer_names: list[int]) -> dict[str, torch.Tensor]:
    """Gradients by the full model's parameter names ("3.0.weight"), on CPU."""
    grads = {}
    for position, layer in enumerate(layer_names):
        for name, parameter in model[position].named_parameters():
            grads[f"{layer}.{name}"] = parameter.grad.detach().cpu()
    return grads


def pipeline_step(schedule: str, rank: int, world: int, device: torch.device,
                  group=None) -> tuple[list[float] | None, dict[str, torch.Tensor]]:
    """One training step of `schedule` on this rank: (the microbatches' losses on the rank of
    the last stage, else None; the gradients of this rank's parameters)."""
    schedule_class, per_rank = SCHEDULES[schedule]
    stages = world * per_rank
    layers = 2 * stages
    model = build_model(layers)
    # Stage i on rank i mod world, the layout Interleaved1F1B requires.
    stage_ids = [rank + k * world for k in range(per_rank)]
    modules, pipeline_stages, owned = [], [], []
    for stage_id in stage_ids:
        ids = list(layers_of(stage_id, stages, layers))
        module = nn.Sequential(*(copy.deepcopy(model[i]) for i in ids)).to(device)
        modules.append((module, ids))
        owned += ids
        pipeline_stages.append(PipelineStage(module, stage_id, stages, device, group=group))
    # scale_grads: the gradients are those of the mean of the microbatches' losses.
    runner = schedule_class(pipeline_stages if per_rank > 1 else pipeline_stages[0],
                            n_microbatches=MICROBATCHES, loss_fn=loss_fn, scale_grads=True)
    inputs, targets = batch()
    is_first, is_last = rank == 0, rank == (stages - 1) % world
    losses: list[torch.Tensor] = []
    kwargs = {"target": targets.to(device), "losses": losses} if is_last else {}
    runner.step(*((inputs.to(device),) if is_first else ()), **kwargs)
    grads = {}
    for module, ids in modules:
        grads.update(gradients(module, ids))
    return ([loss.item() for loss in losses] if is_last else None), grads


def reference_step(schedule: str, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same step in one process: the microbatches' losses and every parameter's gradient."""
    stages = world * SCHEDULES[schedule][1]
    layers = 2 * stages
    model = build_model(layers)
    inputs, targets = batch()
    losses = [loss_fn(model(x), y)
              for x, y in zip(inputs.chunk(MICROBATCHES), targets.chunk(MICROBATCHES))]
    (sum(losses) / MICROBATCHES).backward()
    return [loss.item() for loss in losses], gradients(model, list(range(layers)))


def largest_difference(schedule: str, rank: int, world: int, device: torch.device) -> tuple:
    """Runs the step; (largest |loss difference|, largest |gradient difference|) on this rank."""
    losses, grads = pipeline_step(schedule, rank, world, device)
    want_losses, want_grads = reference_step(schedule, world)
    loss_error = max((abs(a - b) for a, b in zip(losses, want_losses)), default=0.0) \
        if losses is not None else 0.0
    grad_error = max((grads[name] - want_grads[name]).abs().max().item() for name in grads)
    return loss_error, grad_error, losses


def choose_device() -> torch.device:
    local_rank, local_ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if torch.cuda.device_count() >= local_ranks:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated, of {', '.join(SCHEDULES)} (default: all)")
    args = parser.parse_args()
    names = args.schedules.split(",")
    unknown = [name for name in names if name not in SCHEDULES]
    if unknown:
        parser.error(f"unknown schedule {', '.join(unknown)}; choose from {', '.join(SCHEDULES)}")
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("pipelining: start it with torchrun, e.g. "
                         "torchrun --nproc-per-node=2 examples/pipelining.py")

    import smfree_pg  # noqa: F401  (registers backend "smfree")

    device = choose_device()
    dist.init_process_group(backend="smfree")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit("pipelining: needs at least 2 ranks, e.g. torchrun --nproc-per-node=2")
    if rank == 0:
        print(f"pipelining: {world} ranks on {device.type}, torch {torch.__version__}, "
              f"{MICROBATCHES} microbatches of {BATCH // MICROBATCHES}, float64", flush=True)
    failed = False
    for name in names:
        loss_error, grad_error, losses = largest_difference(name, rank, world, device)
        figures = torch.tensor([loss_error, grad_error], dtype=torch.float64, device=device)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        # The losses are on the rank of the last stage; rank 0 prints them.
        box = [losses]
        dist.broadcast_object_list(box, src=world - 1, device=device)
        loss_error, grad_error = figures.tolist()
        ok = loss_error <= TOLERANCE and grad_error <= TOLERANCE
        failed |= not ok
        if rank == 0:
            stages = world * SCHEDULES[name][1]
            print(f"{name:>16}: {stages} stages, losses "
                  f"{' '.join(f'{loss:.6f}' for loss in box[0])}; largest difference from one "
                  f"process: loss {loss_error:.1e}, gradient {grad_error:.1e}: "
                  f"{'same' if ok else 'DIFFERENT'}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
