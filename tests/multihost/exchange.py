"""Rank-side helpers of the multi-host tests: payloads whose every byte is checked, and
progress reports that the test driver waits on before it injects a fault."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def payload(sender: int, index: int, numel: int, dtype=torch.int32) -> torch.Tensor:
    """Contents that differ per sender, per message and per position: a message that lands
    from the wrong sender, out of order or at a wrong offset does not compare equal."""
    values = torch.arange(numel, dtype=torch.int64) * 2_654_435_761 + sender * 1_000_003 + index
    return (values % 2_147_483_629).to(dtype)


def intact(got: torch.Tensor, sender: int, index: int) -> bool:
    return torch.equal(got, payload(sender, index, got.numel(), got.dtype))


def report_progress(count: int) -> None:
    """Tells the test driver (Job.progress) how far this rank is."""
    path = os.path.join(os.environ["MULTIHOST_WORKDIR"], f"progress.{dist.get_rank()}")
    with open(path + ".tmp", "w") as f:
        f.write(str(count))
    os.replace(path + ".tmp", path)


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def exchanges(peer: int, count: int, numel: int, pause_s: float = 0.0,
              group=None) -> dict:
    """Swaps `count` messages with `peer` (an isend and an irecv each), checking
    every received byte, until the count or the first error. Returns the counts, and the
    error's first line and wall-clock time (time.time()) if one came."""
    rank = dist.get_rank()
    stats = {"sent": 0, "delivered": 0, "corrupt": 0, "error": None, "error_at": None,
             "full_error": None}
    for index in range(count):
        got = torch.empty(numel, dtype=torch.int32)
        try:
            send = dist.isend(payload(rank, index, numel), peer, group)
            recv = dist.irecv(got, peer, group)
            send.wait()
            stats["sent"] += 1
            recv.wait()
        except Exception as error:  # noqa: BLE001 - the test reads it
            stats.update(error=first_line(error), error_at=time.time(), full_error=str(error))
            return stats
        if intact(got, peer, index):
            stats["delivered"] += 1
        else:
            stats["corrupt"] += 1
        if index % 10 == 9:
            report_progress(index + 1)
        if pause_s:
            time.sleep(pause_s)
    report_progress(count)
    return stats
