"""FSDP2 (fully_shard) training over smfree and over NCCL in one run, compared bitwise.

The same transformer, from the same initial weights and on the same data, is trained once with
FSDP2's mesh built on a smfree group and once on an NCCL group: FSDP2's parameter all-gathers
run on the copy engines (SMFREE_COLLECTIVES, default on), its gradient reduce-scatters go to
the NCCL communicator smfree wraps. One GPU per rank (with --device cpu, against Gloo, whose
communicator then takes every collective of smfree's group):

    torchrun --nproc-per-node=2 examples/fsdp2.py
    torchrun --nproc-per-node=4 examples/fsdp2.py --rounds 3 --json fsdp2.json
    SMFREE_COLLECTIVES=off torchrun --nproc-per-node=4 examples/fsdp2.py

Each round trains both backends, each on a fresh model, smfree first in odd rounds and the other
first in even ones (a first run may pay for what the second finds warm); --rounds R repeats
that, so the machine's drift shows in the per-round ratios. Rank 0 prints each run's losses
(mean over ranks, repr: every bit) and a table of step times, whether every rank's loss of every
step is bitwise equal between the backends, and whether the final parameters are. It also times
each of FSDP2's all-gather calls on the CPU (FSDP2 makes them with async_op=False, so each
includes its wait()): a loop whose CPU is the bottleneck pays that time in its step.

Kernels run in deterministic mode (torch.use_deterministic_algorithms), since flash
attention's backward otherwise differs from run to run and the comparison would say nothing
about the backend; --nondeterministic turns that off, for speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import smfree_pg  # registers backend "smfree"
from smfree_pg.bench.provenance import provenance

# smfree and what it is compared with, by device.
BACKENDS = {"cuda": ("smfree", "nccl"), "cpu": ("smfree", "gloo")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--device", choices=("cuda", "cpu"), default="cuda",
        help="cuda: one GPU per rank, against NCCL; cpu: against Gloo (default: %(default)s)")
    add("--layers", type=int, default=8)
    add("--hidden", type=int, default=2048)
    add("--heads", type=int, default=16)
    add("--seq", type=int, default=1024)
    add("--batch", type=int, default=4, help="micro-batch per rank")
    add("--steps", type=int, default=6, help="timed steps per run")
    add("--warmup", type=int, default=2, help="untimed steps before the timed ones")
    add("--rounds", type=int, default=1,
        help="runs of both backends on fresh models, alternating which goes first")
    add("--lr", type=float, default=3e-4)
    add("--seed", type=int, default=1234)
    add("--nondeterministic", action="store_true",
        help="let kernels pick nondeterministic algorithms (faster; losses may then differ "
        "between the backends for reasons that are not the backend's)")
    add("--json", default=None, help="also write the results here (rank 0)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("need --steps >= 1, --warmup >= 0, --rounds >= 1")
    if args.hidden % args.heads:
        parser.error("--hidden must be a multiple of --heads")
    return args


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP; SDPA picks flash attention for bf16."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(
            2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.blocks = nn.ModuleList(Block(args.hidden, args.heads) for _ in range(args.layers))
        self.norm = nn.LayerNorm(args.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build(args: argparse.Namespace, group: dist.ProcessGroup, backend: str) -> Model:
    """A fresh model from args.seed (the same weights on every rank and backend), sharded by
    FSDP2 over `group`: each block is one all-gather / reduce-scatter unit, the root another."""
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = Model(args)
    # Named per backend: meshes over the same ranks with the same names compare equal, and
    # DTensor's caches could then hand one backend's mesh (and group) to the other's tensors.
    mesh = DeviceMesh.from_group(group, device_type=args.device, mesh_dim_names=(backend,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def make_data(args: argparse.Namespace, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's (input, target) for this rank, made once so that every run sees the same."""
    generator = torch.Generator(device=args.device).manual_seed(args.seed + 1 + rank)
    shape = (args.batch, args.seq, args.hidden)
    return [tuple(torch.randn(shape, device=args.device, generator=generator) for _ in range(2))
            for _ in range(args.warmup + args.steps)]


class AllGatherClock:
    """The CPU seconds of each all-gather FSDP2 calls, through its custom all-gather hook (the
    default all-gather, timed). Absent from torch versions without the hook."""

    def __init__(self, model: Model) -> None:
        self.seconds: list[float] = []
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
        except ImportError:
            self.available = False
            return
        clock = self

        class TimedAllGather(DefaultAllGather):
            def __call__(self, *args, **kwargs):
                began = time.perf_counter()
                try:
                    return super().__call__(*args, **kwargs)
                finally:
                    clock.seconds.append(time.perf_counter() - began)

        modules = [m for m in model.modules() if hasattr(m, "set_custom_all_gather")]
        self.available = bool(modules)
        for module in modules:
            module.set_custom_all_gather(TimedAllGather())

    def take(self) -> list[float]:
        taken, self.seconds = self.seconds, []
        return taken


def synchronize(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def train(args, model: Model, data) -> tuple[torch.Tensor, list[float], list[list[float]]]:
    """This rank's loss at every step, the timed steps' seconds and, per timed step, the CPU
    seconds of each all-gather call."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    clock = AllGatherClock(model)
    losses, times, gathers = [], [], []
    for step, (inputs, targets) in enumerate(data):
        synchronize(args)
        # WORLD is the reference backend for both runs: the ranks start each step together.
        dist.barrier(**barrier_options(args))
        clock.take()
        began = time.perf_counter()
        loss = F.mse_loss(model(inputs).float(), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize(args)
        if step >= args.warmup:
            times.append(time.perf_counter() - began)
            gathers.append(clock.take() if clock.available else None)
        losses.append(loss.detach())
    return torch.stack(losses), times, gathers


def barrier_options(args) -> dict:
    return {"device_ids": [torch.cuda.current_device()]} if args.device == "cuda" else {}


def run(args, backend: str, group: dist.ProcessGroup, data) -> tuple[dict, list[torch.Tensor]]:
    """Trains a fresh model over `group`: figures of all ranks, and this rank's final shards."""
    # The last run's FSDP modules and optimizer sit in reference cycles: free their memory first.
    gc.collect()
    model = build(args, group, backend)
    counted = copy_engine_calls(args, group, backend)
    losses, times, gathers = train(args, model, data)
    counted = copy_engine_calls(args, group, backend) - counted
    shards = [p.to_local().detach().clone() for p in model.parameters()]
    # On WORLD (NCCL) for both backends. A sum of rows that are zero but on their own rank
    # gathers the losses exactly (all_gather_into_tensor is deprecated in newer torch).
    every = torch.zeros(dist.get_world_size(), losses.numel(), device=losses.device)
    every[dist.get_rank()] = losses
    dist.all_reduce(every)
    slowest = torch.tensor(times, dtype=torch.float64, device=losses.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    by_rank = every.tolist()
    steps_ms = [t * 1e3 for t in slowest.tolist()]
    return {
        "step_ms": statistics.median(steps_ms),
        "steps_ms": steps_ms,
        **all_gather_figures(gathers),
        "losses_by_rank": by_rank,
        "losses_mean": [sum(column) / len(by_rank) for column in zip(*by_rank)],
        "collectives_on_copy_engines": counted,
    }, shards


def all_gather_figures(gathers: list[list[float] | None]) -> dict:
    """FSDP2's all-gather calls per step, and the CPU ms in them per step (the median step of
    each rank; the figure is the rank that spent the most); None where torch has no hook."""
    timed = None not in gathers
    mine = [(1e3 * sum(step), len(step)) for step in gathers] if timed else None
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)  # on WORLD
    if not timed:
        return {"all_gathers_per_step": None, "all_gather_cpu_ms_per_step": None}
    per_rank = [statistics.median(ms for ms, _ in steps) for steps in every]
    return {"all_gathers_per_step": statistics.median(n for _, n in every[0]),
            "all_gather_cpu_ms_per_step": max(per_rank),
            "all_gather_cpu_ms_per_step_by_rank": per_rank}


def copy_engine_calls(args, group: dist.ProcessGroup, backend: str) -> int:
    """How many collectives smfree has run on the copy engines for `group` (0 for NCCL)."""
    if backend != "smfree":
        return 0
    return group._get_backend(torch.device(args.device))._stats()["collectives_on_copy_engines"]


def compare(args, first: list[torch.Tensor], second: list[torch.Tensor]) -> tuple[bool, float]:
    """Whether every rank's shards are bitwise equal, and the largest |difference| anywhere."""
    equal = all(torch.equal(a, b) for a, b in zip(first, second))
    largest = max(((a - b).abs().max().item() for a, b in zip(first, second) if a.numel()),
                  default=0.0)
    figures = torch.tensor([float(not equal), largest], device=args.device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return figures[0].item() == 0.0, figures[1].item()


def one_round(args, index: int, groups: dict, data) -> dict:
    """Both backends from the same start, smfree first in odd rounds; their times and whether
    they agree bitwise."""
    backends = BACKENDS[args.device]
    results, shards = {"round": index + 1}, {}
    for backend in backends if index % 2 == 0 else backends[::-1]:
        results[backend], shards[backend] = run(args, backend, groups[backend], data)
        if dist.get_rank() == 0:
            print(f"round {index + 1}/{args.rounds} {backend}: median step "
                  f"{results[backend]['step_ms']:.2f} ms, "
                  f"{results[backend]['collectives_on_copy_engines']} collectives on the copy "
                  f"engines, losses (mean over ranks) "
                  f"{' '.join(repr(loss) for loss in results[backend]['losses_mean'])}",
                  flush=True)
    smfree, reference = (results[backend] for backend in backends)
    results["ratio"] = smfree["step_ms"] / reference["step_ms"]
    results["losses_equal"] = smfree["losses_by_rank"] == reference["losses_by_rank"]
    results["params_equal"], results["params_max_abs_diff"] = compare(
        args, *(shards[backend] for backend in backends))
    return results


def report(args, rounds: list[dict], setting: dict) -> None:
    yes = {True: "yes", False: "NO"}
    backends = BACKENDS[args.device]
    ratio = "/".join(backends)
    print(f"\nFSDP2, {args.layers} blocks, hidden {args.hidden}, {args.heads} heads, seq "
          f"{args.seq}, batch {args.batch} per rank, bf16 params, fp32 reduce; "
          f"{setting['world_size']} x {setting['device']}; {args.steps} timed steps after "
          f"{args.warmup}; SMFREE_COLLECTIVES={setting['smfree_collectives'] or 'unset (default)'}")
    print(f"{'round':>5} {'backend':<7} {'step ms':>9} {'all-gathers':>11} "
          f"{'their CPU ms':>12} {ratio:>12} {'losses equal':>13} {'params equal':>13} "
          f"{'max |diff|':>11}")
    for result in rounds:
        for backend in backends:
            figures = result[backend]
            line = (f"{result['round']:>5} {backend:<7} {figures['step_ms']:9.2f} "
                    f"{number(figures['all_gathers_per_step'], 0):>11} "
                    f"{number(figures['all_gather_cpu_ms_per_step'], 2):>12}")
            if backend == "smfree":
                line += (f" {result['ratio']:12.3f} {yes[result['losses_equal']]:>13} "
                         f"{yes[result['params_equal']]:>13} "
                         f"{result['params_max_abs_diff']:11.3g}")
            print(line)
    print("all-gathers: FSDP2's calls per step; their CPU ms: per step inside them (each "
          "includes its wait()), the rank that spent the most")
    if len(rounds) > 1:
        print(f"median {ratio} over {len(rounds)} rounds: "
              f"{statistics.median(r['ratio'] for r in rounds):.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"provenance": provenance(), **setting, "args": vars(args), "rounds": rounds},
                      out, indent=1)


def number(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def start(args) -> None:
    """The process group (NCCL, or Gloo on CPU) and, on CUDA, this rank's GPU and determinism."""
    if args.device == "cpu":
        dist.init_process_group(backend="gloo")
        return
    if not args.nondeterministic:
        # cuBLAS is deterministic only with a fixed workspace, read as its first handle is made.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        # Filling every torch.empty with NaN would add kernels to each step, not determinism.
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend="nccl")


def describe(args) -> dict:
    cuda = args.device == "cuda"
    return {
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "smfree": smfree_pg.__version__,
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "world_size": dist.get_world_size(),
        # As smfree reads it: unset or empty means its default set of collectives.
        "smfree_collectives": os.environ.get("SMFREE_COLLECTIVES") or None,
        "deterministic": cuda and not args.nondeterministic,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("fsdp2: start it with torchrun, e.g. "
                         "torchrun --nproc-per-node=2 examples/fsdp2.py")
    start(args)
    if dist.get_world_size() < 2:
        raise SystemExit("fsdp2: needs at least 2 ranks, e.g. torchrun --nproc-per-node=2")
    # Two groups of all ranks: both backends start with fresh communicators.
    groups = {backend: dist.new_group(backend=backend) for backend in BACKENDS[args.device]}
    data = make_data(args, dist.get_rank())
    rounds = [one_round(args, index, groups, data) for index in range(args.rounds)]
    if dist.get_rank() == 0:
        report(args, rounds, describe(args))
    dist.barrier(**barrier_options(args))
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
