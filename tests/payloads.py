"""Payloads that show misplaced bytes, and rank functions that exchange them (any device)."""

import torch
import torch.distributed as dist

from harness import rank_device, synchronize

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
]


def byte_pattern(nbytes, seed, device):
    """Bytes that differ per rank; a prime period shows any block landing at a wrong offset."""
    block = ((torch.arange(4099, dtype=torch.int32, device=device) * 7 + seed * 13) % 251)
    return block.to(torch.uint8).repeat(nbytes // 4099 + 1)[:nbytes]


def pattern(numel, dtype, seed, device):
    """Contents that differ per rank and per position, for any dtype."""
    if dtype == torch.uint8:
        return byte_pattern(numel, seed, device)
    values = torch.arange(numel, dtype=torch.int64, device=device) * 7 + seed * 1_000_003
    if dtype == torch.bool:
        return (values % 3 == 0)
    if dtype.is_complex:
        return torch.complex((values % 1000).float(), (values % 777).float()).to(dtype)
    if dtype.is_floating_point:
        return (values % 2039).to(dtype)
    info = torch.iinfo(dtype)
    return (values % (info.max - max(info.min, 0) + 1) + max(info.min, 0)).to(dtype)


def exchange_every_dtype(rank, world):
    dev = rank_device(rank)
    peer = 1 - rank
    for dtype in DTYPES:
        mine = pattern(1000, dtype, rank, dev)
        got = torch.zeros(1000, dtype=dtype, device=dev)
        if rank == 0:
            dist.send(mine, peer)
            dist.recv(got, peer)
        else:
            dist.recv(got, peer)
            dist.send(mine, peer)
        assert torch.equal(got, pattern(1000, dtype, peer, dev)), f"{dtype} contents differ"
    synchronize(dev)
    return len(DTYPES)


def exchange_sizes(rank, world, sizes):
    dev = rank_device(rank)
    peer = 1 - rank
    for nbytes in sizes:
        mine = pattern(nbytes, torch.uint8, rank, dev)
        got = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, got, peer)]
        )
        for work in works:
            work.wait()
        assert torch.equal(got, pattern(nbytes, torch.uint8, peer, dev)), f"{nbytes} B differ"
        del mine, got
    synchronize(dev)
    return sizes


def numbered(i, numel, device):
    """int32 contents that differ per message `i` and per position."""
    return (torch.arange(numel, dtype=torch.int64, device=device) * 7 + i * 1_000_003).to(torch.int32)


def exchange(mine, got, peer, batched=True):
    """In a rank: sends `mine` to `peer` and receives into `got`, batched or not, and waits."""
    if batched:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer),
                                        dist.P2POp(dist.irecv, got, peer)])
    else:
        works = [dist.isend(mine, peer), dist.irecv(got, peer)]
    for work in works:
        work.wait()


def connect(rank, device):
    """In a rank of two: one small exchange, so that later timings leave out connecting."""
    exchange(torch.ones(4, device=device), torch.empty(4, device=device), 1 - rank)
    synchronize(device)


def sends_then_recvs(rank, peer, numels, device, once_posted=None):
    """Posts a send of each size (float32 elements) to `peer`, then, after `once_posted()`, a
    recv of each, and waits for the recvs last first and then for the sends. Returns the
    indices of the recvs whose contents are wrong."""
    sends = [dist.isend(torch.full((n,), float(1000 * rank + i), device=device), peer)
             for i, n in enumerate(numels)]
    if once_posted:
        once_posted()
    got = [torch.empty(n, device=device) for n in numels]
    recvs = [dist.irecv(buf, peer) for buf in got]
    for work in reversed(recvs):
        work.wait()
    for work in sends:
        work.wait()
    synchronize(device)
    return [i for i, buf in enumerate(got) if not torch.all(buf == float(1000 * peer + i))]
