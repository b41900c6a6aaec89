"""What arrives is what was sent: every dtype, sizes from 0 B up, views at storage offsets."""

import torch
import torch.distributed as dist

from harness import rank_device
from payloads import DTYPES, exchange_every_dtype, exchange_sizes


def test_every_dtype_roundtrips(channel):
    assert channel.run(exchange_every_dtype, 2) == [len(DTYPES)] * 2


def test_sizes_from_zero_bytes_up(channel):
    # To 256 MiB in host memory, to 1 GiB in GPU memory.
    sizes = [0, 1, 7, 4096, 4097, 65537, 1 << 20, 16 << 20, 256 << 20]
    if channel.cuda:
        sizes.append(1 << 30)
    timeout = 300 if channel.cuda else 180
    assert channel.run(exchange_sizes, 2, sizes, timeout=timeout) == [sizes, sizes]


def _views(rank, world):
    dev = rank_device(rank)
    peer = 1 - rank
    base = torch.arange(100, dtype=torch.float32, device=dev) + 1000 * rank
    target = torch.full((50,), -1.0, device=dev)
    target_view = target[5:15]
    assert target_view.storage_offset() == 5
    if rank == 0:
        dist.send(base[10:20], peer)
        dist.recv(target_view, peer)
    else:
        dist.recv(target_view, peer)
        dist.send(base[10:20], peer)
    expected = torch.full((50,), -1.0, device=dev)
    expected[5:15] = torch.arange(10, 20, dtype=torch.float32, device=dev) + 1000 * peer
    assert torch.equal(target, expected), "view recv wrote outside its window or got wrong data"
    # A 2-D row (offset view) into a flat buffer: shapes may differ when bytes and dtype agree.
    grid = (torch.arange(12, dtype=torch.int32, device=dev) + 100 * rank).reshape(3, 4)
    flat = torch.zeros(4, dtype=torch.int32, device=dev)
    ops = [dist.P2POp(dist.isend, grid[1], peer), dist.P2POp(dist.irecv, flat, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert flat.tolist() == [4 + 100 * peer, 5 + 100 * peer, 6 + 100 * peer, 7 + 100 * peer]
    return True


def test_views_with_storage_offsets(channel):
    assert channel.run(_views, 2) == [True, True]
