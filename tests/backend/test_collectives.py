"""Collectives go through the wrapped Gloo backend for CPU tensors."""

import torch
import torch.distributed as dist

from harness import run_ranks


def _collectives(rank, world):
    out = {}
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()

    t = torch.full((3,), float(rank))
    dist.broadcast(t, src=world - 1)
    out["broadcast"] = t.tolist()

    gathered = [torch.empty(2) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    out["all_gather"] = [g[0].item() for g in gathered]

    flat = torch.empty(2 * world)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    out["all_gather_into_tensor"] = flat.tolist()

    shard = torch.empty(1)
    dist.reduce_scatter_tensor(shard, torch.arange(world, dtype=torch.float32) * (rank + 1))
    out["reduce_scatter_tensor"] = shard.item()

    a2a = torch.empty(world)
    dist.all_to_all_single(a2a, torch.arange(world, dtype=torch.float32) + 10 * rank)
    out["all_to_all_single"] = a2a.tolist()

    t = torch.full((1,), float(rank))
    dist.reduce(t, dst=0)
    out["reduce"] = t.item() if rank == 0 else None

    gather_list = [torch.empty(1) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank)]), gather_list, dst=0)
    out["gather"] = [g.item() for g in gather_list] if rank == 0 else None

    got = torch.empty(1)
    dist.scatter(got, [torch.tensor([float(100 + r)]) for r in range(world)] if rank == 0 else None,
                 src=0)
    out["scatter"] = got.item()

    dist.barrier()
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    out["all_gather_object"] = objects
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=1)
    out["broadcast_object_list"] = box[0]
    return out


def test_collectives_through_the_wrapped_backend():
    world = 3
    results = run_ranks(_collectives, world)
    total = float(sum(range(1, world + 1)))
    for rank, out in enumerate(results):
        assert out["all_reduce"] == [total] * 4
        assert out["broadcast"] == [float(world - 1)] * 3
        assert out["all_gather"] == [float(r) for r in range(world)]
        assert out["all_gather_into_tensor"] == [float(r) for r in range(world) for _ in (0, 1)]
        assert out["reduce_scatter_tensor"] == float(rank * sum(r + 1 for r in range(world)))
        assert out["all_to_all_single"] == [float(rank + 10 * src) for src in range(world)]
        assert out["scatter"] == float(100 + rank)
        assert out["all_gather_object"] == [{"rank": r} for r in range(world)]
        assert out["broadcast_object_list"] == "from 1"
    assert results[0]["reduce"] == float(sum(range(world)))
    assert results[0]["gather"] == [float(r) for r in range(world)]


def _destroy_after_async_collectives(rank, world):
    # Gloo's work loop frees the finished works' tensors, which needs the GIL, while the
    # destroy below tears the wrapped Gloo down and joins that loop.
    for i in range(200):
        dist.broadcast(torch.full((1024,), float(i)), src=0, async_op=True)
    dist.destroy_process_group()
    return "destroyed"


def test_destroy_right_after_async_collectives_returns():
    assert run_ranks(_destroy_after_async_collectives, 3, timeout=60) == ["destroyed"] * 3
