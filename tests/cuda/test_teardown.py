"""CUDA ranks that end as Megatron-LM's pretrain does, without destroy_process_group()."""

import os
import subprocess
import sys

import pytest

from devices import rank_gpu

pytestmark = pytest.mark.gpu

EXIT_WITHOUT_TEARDOWN = """
import sys, torch, torch.distributed as dist, smfree_pg
rank = int(sys.argv[1])
torch.cuda.set_device(int(sys.argv[3]))
dist.init_process_group("smfree", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
mine = torch.full((1 << 20,), float(rank), device="cuda")
# A buffer per recv: recvs in flight may not share bytes.
gots = [torch.empty_like(mine) for _ in range(20)]
works = []
for got in gots:
    works += dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, 1 - rank),
                                     dist.P2POp(dist.irecv, got, 1 - rank)])
for work in works:
    work.wait()
torch.cuda.synchronize()
assert all(got[0].item() == 1 - rank for got in gots)
# No destroy_process_group(), as Megatron-LM's pretrain ends; the works stay alive to the end.
"""


def test_cuda_ranks_that_exit_without_destroying_the_group_exit_cleanly(cuda_channel, tmp_path):
    env = {**os.environ, "SMFREE_LOG_LEVEL": "error", **cuda_channel.env}
    ranks = [subprocess.Popen([sys.executable, "-c", EXIT_WITHOUT_TEARDOWN, str(rank),
                               str(tmp_path / "store"), str(rank_gpu(rank))], env=env,
                              stderr=subprocess.PIPE)
             for rank in range(2)]
    try:
        errors = [rank.communicate(timeout=120)[1].decode()[-2000:] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], errors
