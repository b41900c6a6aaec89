# CPU time each point-to-point Work's wait() holds its caller, summed per backend and kind of
# post (isend, irecv, batch). Runs a script with torch.distributed's isend, irecv and
# batch_isend_irecv wrapped, so their Works time their wait(); at exit each rank prints, per
# backend and kind, how many waits it made, their total and mean, and how many took over 1 ms.
# NCCL's wait() only enqueues a stream wait; smfree's returns once the partner has posted
# (docs/design.md, "No stream waits for the future"), which this measures.
# E.g. on one host with 4 GPUs:
#   CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node=4 tools/probe_p2p_wait.py \
#       examples/megatron_core_gpt.py --vpp 2 --modes overlapped --steps 6 --rounds 2
import atexit
import os
import runpy
import sys
import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

totals = {}  # (backend, kind) -> [waits, seconds, waits over 1 ms]


class TimedWork:
    """A Work whose wait() adds its duration to `totals`; everything else is the Work's."""

    def __init__(self, work, key):
        self._work = work
        self._key = key

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        result = self._work.wait(*args, **kwargs)
        took = time.perf_counter() - start
        entry = totals.setdefault(self._key, [0, 0.0, 0])
        entry[0] += 1
        entry[1] += took
        entry[2] += took > 1e-3
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def backend_of(group):
    return str(dist.get_backend(group))


def timed(post, kind):
    def wrapper(*args, **kwargs):
        group = kwargs.get("group", args[2] if len(args) > 2 else None)
        return TimedWork(post(*args, **kwargs), (backend_of(group), kind))

    wrapper.unwrapped = post
    return wrapper


def timed_batch(post_batch):
    def wrapper(ops):
        # batch_isend_irecv tells sends from recvs by identity with the unwrapped functions.
        for op in ops:
            op.op = getattr(op.op, "unwrapped", op.op)
        key = (backend_of(ops[0].group), "batch")
        return [TimedWork(work, key) for work in post_batch(ops)]

    return wrapper


@atexit.register
def report():
    rank = os.environ.get("RANK", "?")
    for (backend, kind), (waits, seconds, slow) in sorted(totals.items()):
        print(f"rank {rank} {backend} {kind}: {waits} waits, {seconds * 1e3:.1f} ms in wait(), "
              f"{seconds * 1e6 / max(waits, 1):.0f} us mean, {slow} over 1 ms", flush=True)


dist.isend = timed(dist.isend, "isend")
dist.irecv = timed(dist.irecv, "irecv")
dist.batch_isend_irecv = timed_batch(dist.batch_isend_irecv)
# P2POp accepts only the unwrapped functions.
check_op = c10d._check_op
c10d._check_op = lambda op: check_op(getattr(op, "unwrapped", op))

if len(sys.argv) < 2:
    sys.exit(f"usage: {sys.argv[0]} SCRIPT [ARGS...]")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
