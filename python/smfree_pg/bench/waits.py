"""CPU time inside `Work.wait()`: how long a rank's Python thread is held per P2P op.

NCCL's wait() only queues a stream wait, so it returns at once; a backend whose wait() holds
the CPU until a peer has posted takes that time from the schedule's next compute launch. The
time to post an op (isend, irecv, a batch) is kept apart: with waits that return at once it is
what a backend's P2P costs a CPU-bound schedule.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict

import torch.distributed as dist
from torch.distributed.pipelining import schedules


class WaitClock:
    """Seconds spent inside each wait() and each post while `recording`, by kind of post."""

    def __init__(self) -> None:
        self.waits: dict[str, list[float]] = defaultdict(list)
        self.posts: dict[str, list[float]] = defaultdict(list)
        self.recording = False

    def wait(self, work, kind: str):
        """work.wait(), timed."""
        start = time.perf_counter()
        result = work.wait()
        if self.recording:
            self.waits[kind].append(time.perf_counter() - start)
        return result

    def post(self, post, kind: str):
        """post(), timed."""
        start = time.perf_counter()
        result = post()
        if self.recording:
            self.posts[kind].append(time.perf_counter() - start)
        return result

    def clear(self) -> None:
        self.waits.clear()
        self.posts.clear()


def summarize_waits(samples: dict[str, list[float]], steps: int) -> dict:
    """{kind: {"waits", "per_step", "median_us", "mean_us", "max_us"}} of seconds per wait,
    `steps` being how many steps (or ops) the waits were spread over."""
    return {kind: {"waits": len(times),
                   "per_step": len(times) / steps,
                   "median_us": 1e6 * statistics.median(times),
                   "mean_us": 1e6 * statistics.fmean(times),
                   "max_us": 1e6 * max(times)}
            for kind, times in samples.items() if times}


class TimedWork:
    """A Work whose wait() goes through a WaitClock; everything else is the Work's."""

    def __init__(self, work, clock: WaitClock, kind: str) -> None:
        self._work = work
        self._clock = clock
        self._kind = kind

    def wait(self):
        return self._clock.wait(self._work, self._kind)

    def __getattr__(self, name):
        return getattr(self._work, name)


def kind_of(ops: list[dist.P2POp]) -> str:
    sends = {op.op is dist.isend for op in ops}
    return "send" if sends == {True} else "recv" if sends == {False} else "send+recv"


@contextlib.contextmanager
def pipelining_waits(clock: WaitClock):
    """Times every wait() of torch.distributed.pipelining's schedules.

    Every P2P op the schedules post goes through `schedules._batch_p2p` (looked up in the
    module at each call), whose Works they wait on later; wrapping its result is the one place
    that sees them all without changing what is posted.
    """
    original = schedules._batch_p2p

    def batch_p2p(p2p_ops, desc=None):
        if not p2p_ops:
            return original(p2p_ops, desc)
        kind = kind_of(p2p_ops)
        works = clock.post(lambda: original(p2p_ops, desc), kind)
        # torch < 2.6 returns one Work per batch (None for none), later ones a list.
        if isinstance(works, list):
            return [TimedWork(work, clock, kind) for work in works]
        return works if works is None else TimedWork(works, clock, kind)

    schedules._batch_p2p = batch_p2p
    try:
        yield clock
    finally:
        schedules._batch_p2p = original
