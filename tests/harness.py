"""Runs a test function on N spawned ranks of a fresh process group, with a hard timeout.

Each rank calls `fn(rank, world_size, *args)` after `init_process_group`; its return value
comes back to the test. A rank that raises fails the test with its traceback; ranks that
hang past `timeout` are killed and fail the test, so no test can hang CI. Before the kill, each
hung rank dumps its Python threads' stacks, which go into the failure message.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

DEFAULT_TIMEOUT_S = 90
# How long a hung rank gets to write its stacks before it is killed.
STACK_DUMP_GRACE_S = 2


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None


def _stack_file(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f"stacks.{rank}")


def _run_rank(fn, rank, world_size, init_file, backend, group_timeout_s, env, bind_device, args,
              results):
    # Open as long as the rank lives: faulthandler writes to it from its signal handler.
    stacks = open(_stack_file(os.path.dirname(init_file), rank), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ.setdefault("SMFREE_LOG_LEVEL", "error")
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    import smfree_pg  # noqa: F401  (registers the backend)
    from devices import cuda_device

    try:
        if env.get("SMFREE_TEST_CUDA") == "1":
            torch.cuda.set_device(cuda_device(rank))
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=group_timeout_s),
            # Binds the default group to the rank's GPU, which makes NCCL split new groups.
            device_id=cuda_device(rank) if bind_device else None,
        )
        value = fn(rank, world_size, *args)
        results.put(RankResult(rank, value=value))
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        results.put(RankResult(rank, error=traceback.format_exc()))
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a rank that killed a peer may fail to tear down
        pass


def run_ranks(
    fn: Callable,
    world_size: int,
    *args,
    backend: str = "smfree",
    group_timeout_s: float = 30,
    timeout: float = DEFAULT_TIMEOUT_S,
    expect_exit: tuple[int, ...] = (),
    cuda: bool = False,
    env: dict | None = None,
    rank_env: dict[int, dict] | None = None,
    bind_device: bool = False,
) -> list:
    """Values returned by `fn` on each rank, in rank order.

    Ranks listed in `expect_exit` may end without a result (they kill themselves). With
    `cuda`, rank r uses its GPU (devices.cuda_device: shared where there are fewer GPUs than
    ranks). `env` is added to each rank's environment, then
    `rank_env[r]` to rank r's. `bind_device` passes rank r's GPU as the default group's
    device_id.
    """
    env = dict(env or {})
    if cuda:
        env.update(SMFREE_TEST_CUDA="1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_run_rank,
                args=(fn, rank, world_size, init_file, backend, group_timeout_s,
                      {**env, **(rank_env or {}).get(rank, {})}, bind_device, args, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        collected = _collect(results, procs, world_size, timeout, expect_exit, tmp)
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    failures = [r for r in collected.values() if r.error]
    if failures:
        raise AssertionError(
            "\n".join(f"--- rank {r.rank} failed:\n{r.error}" for r in sorted(failures, key=lambda r: r.rank))
        )
    return [collected[rank].value if rank in collected else None for rank in range(world_size)]


def _collect(results, procs, world_size, timeout, expect_exit, tmp):
    collected: dict[int, RankResult] = {}
    expected = set(range(world_size)) - set(expect_exit)
    deadline = _now() + timeout
    while not expected.issubset(collected):
        remaining = deadline - _now()
        if remaining <= 0:
            missing = sorted(expected - set(collected))
            stacks = _dump_stacks(procs, tmp)
            for proc in procs:
                proc.kill()
            # A rank that failed first is often why the others wait: its error comes first.
            failed = "".join(f"--- rank {r.rank} failed first:\n{r.error}\n"
                             for r in sorted(collected.values(), key=lambda r: r.rank) if r.error)
            raise AssertionError(
                f"ranks {missing} did not finish within {timeout} s (killed)\n{failed}{stacks}")
        try:
            result = results.get(timeout=min(remaining, 1.0))
            collected[result.rank] = result
        except queue.Empty:
            dead = [
                rank for rank, proc in enumerate(procs)
                if rank in expected and rank not in collected and proc.exitcode not in (None, 0)
            ]
            if dead:
                raise AssertionError(f"ranks {dead} died (exit codes "
                                     f"{[procs[r].exitcode for r in dead]}) without a result")
    return collected


def _dump_stacks(procs, tmp: str) -> str:
    """The Python stacks of every rank still running, as each wrote them on SIGUSR1."""
    alive = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in alive:
        os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(STACK_DUMP_GRACE_S)
    dumps = []
    for rank in alive:
        try:
            with open(_stack_file(tmp, rank)) as f:
                dumps.append(f"--- rank {rank} stacks:\n{f.read()}")
        except OSError as e:
            dumps.append(f"--- rank {rank} stacks unavailable: {e}")
    return "\n".join(dumps)


def _now() -> float:
    return time.monotonic()


def swap(peer: int, mine):
    """In a rank: sends `mine` to `peer` and receives a tensor like it from `peer`, in one
    batch; returns what was received."""
    import torch
    import torch.distributed as dist

    got = torch.empty_like(mine)
    ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, got, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got


def received_fills(peer: int, count: int, numel: int, device=None) -> list:
    """In a rank: receives `count` tensors from `peer`; the value each was filled with, or None
    where its elements differ."""
    import torch
    import torch.distributed as dist

    values = []
    for _ in range(count):
        buf = torch.empty(numel, device=device)
        dist.recv(buf, peer)
        values.append(buf[0].item() if torch.all(buf == buf[0]) else None)
    return values


def rank_device(rank: int):
    """In a rank: its GPU (devices.cuda_device) where the test runs it on CUDA
    (run_ranks(cuda=True)), else the CPU."""
    import torch

    from devices import cuda_device

    if os.environ.get("SMFREE_TEST_CUDA") == "1":
        return cuda_device(rank)
    return torch.device("cpu")


def synchronize(device) -> None:
    """In a rank: waits for the device's queued work (nothing to wait for on the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
