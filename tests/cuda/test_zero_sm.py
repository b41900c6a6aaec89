"""Zero SMs: with the default settings (copies within one GPU bounced through a peer GPU, or
through host memory where there is none), and with them bounced through host memory, every
same-host CUDA op finishes while a kernel holds every SM of the ranks' GPUs (a copy the driver
ran as a kernel of its own would wait for the hold to end): eager, rendezvous and any-source
exchanges, exchanges captured in CUDA graphs (batched,
which copy straight into the recv's buffer, and unbatched, through slots; 4 KiB to 256 MiB),
ops to the rank itself, the collectives on the copy engines (all-gather out of place and in
place, all-to-all, broadcast; uncaptured and captured). A kernel queued the same way must end only after the hold,
or the GPUs were not held; a bare copy to host memory must end during it; every op's bytes are
checked after.

Ranks sharing one GPU cannot show it this way: the GPU time-slices the processes' contexts
(without CUDA MPS), so a rank's kernel never holds the SMs for good; on one H200 shared by 2
ranks the control kernel ended during the hold.

With the default hardware queues only: under CUDA_DEVICE_MAX_CONNECTIONS=1 every stream shares
one queue, which runs a stream memory operation only once every kernel queued before it (on
any stream) has ended, so an op's flags wait for the hold there whatever runs its copies
(docs/design.md, "Zero SMs")."""

import pytest
import torch.distributed as dist

import channels
from devices import cuda_device
from smfree_pg.bench.starvation import StoreSync, held_paths

pytestmark = pytest.mark.gpu

COPY_ENGINE = channels.COPY_ENGINE


def _every_path_held(rank, world):
    return held_paths(dist.group.WORLD, rank, 1 - rank, cuda_device(rank),
                      StoreSync([0, 1], rank, "zero-sm"),
                      sizes=[4 << 10, 1 << 20, 16 << 20, 64 << 20],  # eager, and rendezvous
                      captured_sizes=[4 << 10, 1 << 20, 64 << 20, 256 << 20], hold_ms=600)


@pytest.mark.distinct_gpus("the GPU time-slices contexts that share it, so no kernel holds its "
                           "SMs for good (the control kernel ended during the hold)")
@pytest.mark.parametrize("local_copies", ["default", "host"])
def test_every_same_host_op_finishes_while_every_sm_is_held(local_copies):
    # Every collective on the copy engines, whatever its size (the defaults keep some on NCCL).
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "8", "SMFREE_COLLECTIVES": "all",
           "SMFREE_COLLECTIVE_MIN_BYTES": "0"}
    if local_copies != "default":
        env["SMFREE_LOCAL_COPIES"] = local_copies
    results = COPY_ENGINE.run(_every_path_held, 2, timeout=300, env=env)
    for rank, seen in enumerate(results):
        for name, times in seen.items():
            assert not times["control_during"], (
                f"rank {rank}, {name}: the control kernel ended during the hold: not held {times}")
        needed = {name: times for name, times in seen.items() if not times["during"]}
        assert not needed, f"rank {rank}: ops that waited for the hold (needed an SM): {needed}"
