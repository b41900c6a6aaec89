"""Several groups at once, smfree subgroups under another default backend, many threads."""

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from devices import cuda_device
from harness import run_ranks


def _two_groups_at_once(rank, world):
    # Pairs (0,1) and (2,3) plus WORLD, all with tag 0 and in flight together:
    # messages must stay in their group.
    pair = dist.new_group([0, 1], backend="smfree")
    other = dist.new_group([2, 3], backend="smfree")
    mine = pair if rank < 2 else other
    peer_in_pair = rank ^ 1
    world_peer = (rank + 2) % world
    got_pair = torch.empty(8)
    got_world = torch.empty(8)
    works = [
        dist.isend(torch.full((8,), 100.0 + rank), peer_in_pair, group=mine),
        dist.isend(torch.full((8,), 200.0 + rank), world_peer),
        dist.irecv(got_world, world_peer),
        dist.irecv(got_pair, peer_in_pair, group=mine),
    ]
    for work in works:
        work.wait()
    return got_pair[0].item(), got_world[0].item()


def test_two_groups_used_at_once_keep_messages_apart():
    results = run_ranks(_two_groups_at_once, 4)
    for rank, (pair_value, world_value) in enumerate(results):
        assert pair_value == 100.0 + (rank ^ 1)
        assert world_value == 200.0 + (rank + 2) % 4


def _pipeline_groups_only(rank, world):
    # The default group stays on Gloo; only the pipeline group uses smfree.
    assert dist.get_backend() == "gloo"
    pp = dist.new_group(list(range(world)), backend="smfree")
    assert dist.get_backend(pp) == "smfree"
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(16)
    ops = [dist.P2POp(dist.isend, torch.full((16,), float(rank)), nxt, group=pp),
           dist.P2POp(dist.irecv, got, prev, group=pp)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    total = torch.ones(1)
    dist.all_reduce(total, group=pp)
    return got[0].item(), total.item()


def test_smfree_pipeline_group_under_a_gloo_default_group():
    world = 3
    results = run_ranks(_pipeline_groups_only, world, backend="gloo")
    assert results == [(float((r - 1) % world), float(world)) for r in range(world)]


def _subgroups_under_a_bound_nccl_default(rank, world):
    # A smfree group and then an NCCL group over ranks 0 and 1, as a pipeline bench makes them:
    # with the default group bound to a GPU, torch makes rank 2 split the default communicator
    # at each, so the members' NCCL communicators must be split from it at the same points.
    dev = cuda_device(rank)
    pp = dist.new_group([0, 1], backend="smfree")
    reference = dist.new_group([0, 1], backend="nccl")
    everyone = torch.ones(1, device=dev)
    dist.all_reduce(everyone)  # the default communicator, still in step on every rank
    if rank == 2:
        return everyone.item(), None, None, None
    got = torch.empty(16, device=dev)
    ops = [dist.P2POp(dist.isend, torch.full((16,), float(rank), device=dev), 1 - rank, pp),
           dist.P2POp(dist.irecv, got, 1 - rank, pp)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    sums = [torch.ones(1, device=dev) for _ in range(2)]
    dist.all_reduce(sums[0], group=pp)  # smfree's own NCCL communicator, the split one
    dist.all_reduce(sums[1], group=reference)
    torch.cuda.synchronize(dev)
    return everyone.item(), got[0].item(), sums[0].item(), sums[1].item()


@pytest.mark.gpu
@pytest.mark.distinct_gpus("NCCL, the default group, refuses two ranks on one GPU", gpus=3)
def test_subgroups_under_an_nccl_default_group_bound_to_a_gpu():
    results = run_ranks(_subgroups_under_a_bound_nccl_default, 3, backend="nccl", cuda=True,
                        bind_device=True, timeout=120)
    assert results == [(3.0, 1.0, 2.0, 2.0), (3.0, 0.0, 2.0, 2.0), (3.0, None, None, None)]


def _many_threads_many_groups(rank, world, threads, rounds):
    groups = [dist.new_group([0, 1], backend="smfree") for _ in range(threads)]
    peer = 1 - rank
    failures = []

    def exchange(index):
        group = groups[index]
        try:
            for step in range(rounds):
                got = torch.empty(64, dtype=torch.int64)
                value = 1000 * index + step
                send = dist.isend(torch.full((64,), value + rank, dtype=torch.int64), peer,
                                  group=group)
                recv = dist.irecv(got, peer, group=group)
                send.wait()
                recv.wait()
                if not torch.all(got == value + peer):
                    failures.append((index, step, got[0].item()))
        except Exception as error:  # noqa: BLE001 - reported to the test below
            failures.append((index, repr(error)))

    workers = [threading.Thread(target=exchange, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return failures


def test_many_threads_on_many_groups():
    assert run_ranks(_many_threads_many_groups, 2, 6, 50) == [[], []]


def _reinitialize(rank, world, store_dir):
    # destroy_process_group and a new init in the same process: a fresh engine or the same
    # one, the groups must not collide with the old ones of the same name. Rank 1 lingers in
    # each round, so rank 0 already waits for its address when rank 1 joins the next round's
    # group, and sends as soon as it is published.
    import datetime
    import os
    import time

    timeout = datetime.timedelta(seconds=20)  # new_group's default would be 30 minutes
    values = []
    for round_ in range(3):
        if round_ > 0:
            store = os.path.join(store_dir, str(round_))
            dist.init_process_group("smfree", init_method=f"file://{store}", rank=rank,
                                    world_size=world, timeout=timeout)
        pp = dist.new_group(list(range(world)), backend="smfree", timeout=timeout)
        got = torch.empty(4)
        ops = [dist.P2POp(dist.isend, torch.full((4,), float(10 * round_ + rank)), 1 - rank, pp),
               dist.P2POp(dist.irecv, got, 1 - rank, pp)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        values.append(got[0].item())
        if rank == 1:
            time.sleep(1.0)
        dist.destroy_process_group()
    dist.init_process_group("smfree", init_method=f"file://{os.path.join(store_dir, 'last')}",
                            rank=rank, world_size=world)  # for the harness to tear down
    return values


def test_destroy_and_initialize_again(tmp_path):
    results = run_ranks(_reinitialize, 2, str(tmp_path))
    assert results == [[10.0 * r + 1 for r in range(3)], [10.0 * r for r in range(3)]]


EXIT_WITHOUT_TEARDOWN = """
import datetime, os, sys
import torch
import torch.distributed as dist
import smfree_pg
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("smfree", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
got = torch.empty(1 << 18)
for round_ in range(5):
    ops = [dist.P2POp(dist.isend, torch.full((1 << 18,), float(10 * round_ + rank)), 1 - rank),
           dist.P2POp(dist.irecv, got, 1 - rank)]
    works = dist.batch_isend_irecv(ops)
    for work in works:
        work.wait()
    assert torch.all(got == 10 * round_ + 1 - rank), got
names = sorted({open(f"/proc/self/task/{t}/comm").read().strip()
                for t in os.listdir("/proc/self/task")})
print("engine threads:", *(n for n in names if n.startswith("smfree")))
# No destroy_process_group(), as Megatron-LM's pretrain ends: the engine lives to the end.
"""


def test_ranks_that_exit_without_destroying_the_group_exit_cleanly(tmp_path):
    # The engine's two threads must be stopped before UCX's teardown at exit, and the release
    # thread before Python finalizes; a thread still running then can crash the process. Three
    # pairs make a rare crash likelier to show.
    env = {**os.environ, "SMFREE_LOG_LEVEL": "error"}
    for attempt in range(3):
        store = str(tmp_path / f"store{attempt}")
        ranks = [subprocess.Popen([sys.executable, "-c", EXIT_WITHOUT_TEARDOWN, str(rank), store],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for rank in range(2)]
        try:
            outputs = [rank.communicate(timeout=60) for rank in ranks]
        finally:
            for rank in ranks:
                rank.kill()
        errors = [err.decode()[-2000:] for _, err in outputs]
        assert [rank.returncode for rank in ranks] == [0, 0], errors
        # The engine's threads and the release thread ran, under the names docs/design.md gives.
        # (UCX may print its warnings to stdout too.)
        threads = [[line.split()[2:] for line in out.decode().splitlines()
                    if line.startswith("engine threads:")] for out, _ in outputs]
        assert threads == [[["smfree-progress", "smfree-recv", "smfree-release"]]] * 2
