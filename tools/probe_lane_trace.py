# Which copies each rank queues for an in-place all-gather, on which stream and when: CUDA
# activity from torch.profiler over 4 back-to-back calls (after 3 warm-up calls and 10 timed
# ones), printed per rank with the group's counters (collective_first / collective_second: the
# pieces this rank posted first or second in a collective lane). One GPU per rank:
#   SMFREE_COLLECTIVES=all torchrun --nproc-per-node=2 tools/probe_lane_trace.py [MiB, default 256]
# and again with SMFREE_COLLECTIVE_LANES=0 (every piece pushed by its sender).
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import smfree_pg  # noqa: F401  (registers the backend)

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
dist.init_process_group("smfree", device_id=dev)
size = (int(sys.argv[1]) if len(sys.argv) > 1 else 256) << 20
out = torch.zeros(size * world // 2, dtype=torch.bfloat16, device=dev)
mine = out.narrow(0, rank * size // 2, size // 2)


def loop(calls):
    for _ in range(calls):
        dist.all_gather_into_tensor(out, mine)
    torch.cuda.synchronize()


loop(3)
dist.barrier()
start = time.perf_counter()
loop(10)
dist.barrier()
per_call = (time.perf_counter() - start) / 10
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    loop(4)
rows = sorted((e.start_ns(), e.duration_ns(), e.device_index(), e.device_resource_id(), e.name())
              for e in prof.profiler.kineto_results.events()
              if e.device_type() == torch.autograd.DeviceType.CUDA)
base = rows[0][0] if rows else 0
stats = dist.group.WORLD._get_backend(dev)._stats()
lines = [f"rank {rank}: {per_call * 1e6:.0f} us per call (10 calls); "
         f"collective_first {stats['collective_first']}, collective_second "
         f"{stats['collective_second']}, collective_by_rendezvous {stats['collective_by_rendezvous']}"]
lines += [f"  rank {rank} +{(s - base) / 1e3:9.1f} us {d / 1e3:8.1f} us  cuda:{dv} stream {st}  {n[:60]}"
          for s, d, dv, st, n in rows]
for r in range(world):
    dist.barrier()
    if r == rank:
        print("\n".join(lines), flush=True)
dist.destroy_process_group()
