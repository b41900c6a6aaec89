"""wait() has a deadline even when the engine stops progressing: past the group timeout and a
margin it raises, naming the op, instead of waiting for a progress thread that may never come."""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

WAIT = datetime.timedelta(seconds=60)


def _stalled_engine(rank, world):
    store = dist.distributed_c10d._get_default_store()
    peer = 1 - rank
    if rank == 0:
        entered, release = threading.Event(), threading.Event()

        def block(future):
            # A Work's future callback runs on the engine's progress thread: this one holds it.
            entered.set()
            release.wait(60)

        first = dist.isend(torch.ones(1024), peer, tag=1)
        held = first.get_future().then(block)
        store.set("posted", "1")
        assert entered.wait(60)
        second = dist.isend(torch.ones(1024), peer, tag=2)
        try:
            with pytest.raises(dist.DistBackendError) as raised:
                second.wait()
        finally:
            release.set()
        held.wait()
        message = str(raised.value)
        assert "wait() on send on rank 0 to rank 1 (group '0', tag 2, 4096 B)" in message, message
        assert "the smfree engine stopped progressing" in message, message
        store.set("resumed", "1")
    else:
        store.wait(["posted"], WAIT)
        dist.irecv(torch.empty(1024), peer, tag=1).wait()
        store.wait(["resumed"], WAIT)
    # The engine runs again: the next exchange is intact.
    mine = torch.arange(256, dtype=torch.float32) + 1000 * rank
    got = torch.zeros(256)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, tag=3),
                                    dist.P2POp(dist.irecv, got, peer, tag=3)])
    for work in works:
        work.wait()
    return bool(torch.equal(got, torch.arange(256, dtype=torch.float32) + 1000 * peer))


def test_wait_raises_when_the_engine_stops_progressing():
    assert run_ranks(_stalled_engine, 2, group_timeout_s=2) == [True, True]
