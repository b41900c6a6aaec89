"""One rank's place in a benchmark run, and the calls its sections share to stay in step."""

from __future__ import annotations

import faulthandler
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# The backend smfree is measured against, by device: what users would run otherwise.
REFERENCE = {"cuda": "nccl", "cpu": "gloo"}
# The sections that run on CUDA only compare these two.
CUDA_BACKENDS = ("smfree", "nccl")


@dataclass
class Ctx:
    """One rank's place in the run: its device, its pair partner and the groups it uses."""

    rank: int
    world: int
    device: torch.device
    devices: list[int | None]  # every rank's CUDA device index (None on CPU)
    peer: int | None  # None: the idle rank of an odd world
    groups: dict[str, dist.ProcessGroup]  # "smfree" and the reference: the groups measured
    ctrl: dist.ProcessGroup  # Gloo: barriers and gathers that put nothing on the GPUs
    started: float
    timeout_s: float  # the groups' timeout
    shared_gpu: bool = False  # every rank on one GPU: smfree alone, NCCL refuses that

    @property
    def reference(self) -> str | None:
        return None if self.shared_gpu else REFERENCE[self.device.type]

    @property
    def backends(self) -> tuple[str, ...]:
        return ("smfree",) if self.shared_gpu else ("smfree", self.reference)

    def arm_watchdog(self) -> None:
        """Ends this rank, with every thread's traceback, if the watchdog is not armed again
        or disarmed within a minute past the group timeout.

        A rank stuck in the GPU (a stream waiting forever) never sees the group timeout; this
        ends it, so the launcher ends the others.
        """
        faulthandler.dump_traceback_later(self.timeout_s + 60, exit=True)

    def disarm_watchdog(self) -> None:
        faulthandler.cancel_dump_traceback_later()


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago: for a store of new processes."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def barrier(ctx: Ctx) -> None:
    dist.all_reduce(torch.zeros(1), group=ctx.ctrl)


def gather(ctx: Ctx, obj) -> list:
    out = [None] * ctx.world
    dist.all_gather_object(out, obj, group=ctx.ctrl)
    return out


def raise_on_errors(errors: list[str | None], what: str) -> None:
    """Every rank raises when any rank saw wrong data, so none waits for the others."""
    bad = [error for error in errors if error]
    if bad:
        raise RuntimeError(f"smfree bench: {what}: wrong data\n" + "\n".join(bad))


def log(ctx: Ctx, message: str) -> None:
    if ctx.rank == 0:
        print(f"[{time.monotonic() - ctx.started:7.1f} s] {message}", flush=True)


def synchronize(device: torch.device) -> None:
    """Waits until `device` has done what was queued on it (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
