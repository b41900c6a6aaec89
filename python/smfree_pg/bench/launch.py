"""Starting the ranks (self-spawned or under torchrun), setting up their groups, running the
chosen sections and writing the report."""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shlex
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import smfree_pg  # noqa: F401  (registers the backend)
from smfree_pg import bench
from smfree_pg.bench.cli import parse_args, plan_ranks
from smfree_pg.bench.context import REFERENCE, Ctx, barrier, free_port, log
from smfree_pg.bench.report import new_report, print_header, write_report
from smfree_pg.bench.sections import SECTIONS

# NVLink multicast stays off on shared machines (NCCL reads these at communicator init).
RANK_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}
CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(SECTIONS, bench.__doc__.split("\n\n")[0], argv)
    args.command = shlex.join(sys.orig_argv)
    args.run_suffix = ""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args.launcher = "torchrun"
        check_torchrun_connections(args.connections)
        rank = int(os.environ["RANK"])
        args.shared_gpu = shared_gpu(args, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        run_rank(rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank)),
                 "env://", args)
        return
    args.launcher = "spawn"
    nproc = spawn_count(args)
    settings = args.connections or [None]
    for setting in settings:
        run_args = copy.copy(args)
        if len(settings) > 1:
            run_args.run_suffix = f"-connections-{setting}"
            path = Path(args.json)
            run_args.json = str(path.with_name(f"{path.stem}{run_args.run_suffix}{path.suffix}"))
        with connections_env(setting):
            init_method = f"tcp://127.0.0.1:{free_port()}"
            # join=True: if a rank fails, spawn ends the others and raises its error here.
            mp.spawn(_spawned_rank, args=(nproc, init_method, run_args), nprocs=nproc, join=True)


def spawn_count(args) -> int:
    """Ranks to spawn; sets args.shared_gpu (CUDA: whether they share cuda:0)."""
    args.shared_gpu = False
    if args.device == "cpu":
        if args.nproc is not None and args.nproc < 2:
            sys.exit("smfree bench: needs at least 2 ranks")
        return args.nproc or 2
    if args.nproc is not None and args.nproc < 2:
        sys.exit("smfree bench: needs at least 2 ranks")
    nproc, args.shared_gpu = plan_ranks(args, SECTIONS, torch.cuda.device_count(), args.nproc)
    return nproc


def shared_gpu(args, local_ranks: int) -> bool:
    """Under torchrun: whether this host's ranks share cuda:0 (cli.plan_ranks)."""
    if args.device == "cpu":
        return False
    return plan_ranks(args, SECTIONS, torch.cuda.device_count(), local_ranks)[1]


@contextlib.contextmanager
def connections_env(setting: str | None):
    """CUDA_DEVICE_MAX_CONNECTIONS for the ranks spawned inside: CUDA reads it when a process
    creates its context, so it must be in their environment from the start. None leaves the
    environment alone; 'default' unsets it."""
    if setting is None:
        yield
        return
    saved = os.environ.get(CONNECTIONS)
    if setting == "default":
        os.environ.pop(CONNECTIONS, None)
    else:
        os.environ[CONNECTIONS] = setting
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(CONNECTIONS, None)
        else:
            os.environ[CONNECTIONS] = saved


def check_torchrun_connections(settings: list[str] | None) -> None:
    """torchrun started the ranks: the setting is theirs already, and --connections can only
    confirm it."""
    if settings is None:
        return
    have = os.environ.get(CONNECTIONS, "default")
    if settings != [have]:
        sys.exit(f"smfree bench: under torchrun the ranks' {CONNECTIONS} is {have}, not "
                 f"{','.join(settings)}: set it in torchrun's environment (one setting per "
                 "launch), or let the bench spawn its ranks")


def _spawned_rank(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    # What torchrun tells its ranks: how many share this host, from which smfree chooses whether
    # its threads spin (README, SMFREE_SPIN_US).
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    run_rank(rank, world, rank, init_method, args)


def run_rank(rank: int, world: int, local_rank: int, init_method: str, args) -> None:
    for key, value in RANK_ENV.items():
        os.environ.setdefault(key, value)
    device = rank_device(rank, local_rank, world, args.device, args.shared_gpu)
    timeout = timedelta(minutes=args.timeout_min)
    ctx = setup(rank, world, device, init_method, timeout, args.shared_gpu)
    report = new_report(ctx, args)
    if rank == 0:
        print_header(report["meta"])
    for name in args.only:
        section = SECTIONS[name]
        ctx.arm_watchdog()
        log(ctx, f"{name}: start")
        report[name] = section.run(ctx, args)
        ctx.disarm_watchdog()
        if rank == 0:
            write_report(args.json, report)
            section.print_section(report[name])
    barrier(ctx)
    if rank == 0:
        print(f"\nfigures written to {args.json}", flush=True)
    dist.destroy_process_group()


def rank_device(rank: int, local_rank: int, world: int, kind: str, shared_gpu: bool
                ) -> torch.device:
    if kind == "cpu":
        # The ranks share the host's cores: each gets its share, not all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        return torch.device("cpu")
    if shared_gpu:
        local_rank = 0
    elif local_rank >= torch.cuda.device_count():
        raise RuntimeError(f"smfree bench: rank {rank} wants cuda:{local_rank}, but "
                           f"{torch.cuda.device_count()} CUDA devices are visible")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def setup(rank, world, device, init_method, timeout, shared_gpu) -> Ctx:
    if shared_gpu:
        # NCCL refuses two ranks on one GPU: no reference group, Gloo under smfree's.
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timeout)
    elif device.type == "cuda":
        # device_id binds the default group to this GPU and builds NCCL's communicator now.
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                                timeout=timeout, device_id=device)
    else:
        dist.init_process_group(REFERENCE["cpu"], init_method=init_method, rank=rank,
                                world_size=world, timeout=timeout)
    ranks = list(range(world))
    smfree = dist.new_group(ranks, timeout=timeout, backend="smfree")
    ctrl = dist.new_group(ranks, timeout=timeout, backend="gloo")
    if device.type == "cuda" and not shared_gpu:
        # One collective over all ranks first: NCCL wants that before pairs talk alone.
        dist.all_reduce(torch.ones(1, device=device))
        torch.cuda.synchronize()
    devices = [None] * world
    dist.all_gather_object(devices, device.index, group=ctrl)
    peer = rank ^ 1 if (rank ^ 1) < world else None
    groups = {"smfree": smfree}
    if not shared_gpu:
        groups[REFERENCE[device.type]] = dist.group.WORLD
    return Ctx(rank, world, device, devices, peer, groups, ctrl, time.monotonic(),
               timeout.total_seconds(), shared_gpu)
