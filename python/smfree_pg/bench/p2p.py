"""The point-to-point patterns the sections post, as users post them from Python."""

from __future__ import annotations

import torch
import torch.distributed as dist

from smfree_pg.bench.context import Ctx


def oneway_step(ctx: Ctx, group, send: torch.Tensor, recv: torch.Tensor):
    """One op of the one-way test: the lower rank of the pair sends, the higher receives."""
    if ctx.rank < ctx.peer:
        return lambda: dist.isend(send, ctx.peer, group=group).wait()
    return lambda: dist.irecv(recv, ctx.peer, group=group).wait()


def exchange(group, send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    """Sends `send` to `peer` while receiving `recv` from it.

    Batched, as pipeline schedules do it: unbatched, NCCL runs each op as its own kernel on one
    stream, so the two directions would take turns (and both ranks isending a large tensor first
    hangs).
    """
    ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()

