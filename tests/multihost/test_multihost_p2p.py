"""Point-to-point semantics of CPU tensors between emulated hosts (network namespaces with their
own hostnames, UCX over TCP between them): sizes, tags, any source, batches, mismatches, and
groups within one host and across hosts in one job. Every received byte is checked."""

import socket

import torch
import torch.distributed as dist

from exchange import intact, payload
from hosts import Hosts

RANKS_PER_HOST = 2
TIMEOUT_S = 120
SIZES = [0, 1, 4099, (1 << 20) + 3, 16 << 20]  # int32 elements: up to 64 MiB


def host_of(rank):
    return rank // RANKS_PER_HOST


def _sizes_tags_batches(rank, world):
    peer = (rank + RANKS_PER_HOST) % world  # same local rank, next host
    partner = (rank - RANKS_PER_HOST) % world  # who sends to this rank
    # Sizes: to the next host, from the previous one.
    for index, numel in enumerate(SIZES):
        got = torch.empty(numel, dtype=torch.int32)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, payload(rank, index, numel), peer),
                                        dist.P2POp(dist.irecv, got, partner)])
        for work in works:
            work.wait()
        assert intact(got, partner, index), f"{numel} elements from rank {partner} differ"
    # Tags: sends under tags 7, 3, 7, 3; recvs posted tag 3 first match per tag in order.
    if host_of(rank) == 0:
        works = [dist.isend(payload(rank, 100 + i, 1000), peer, tag=tag)
                 for i, tag in enumerate([7, 3, 7, 3])]
    elif host_of(rank) == 1:
        source = rank - RANKS_PER_HOST
        bufs = {i: torch.empty(1000, dtype=torch.int32) for i in range(4)}
        works = [dist.irecv(bufs[1], source, tag=3), dist.irecv(bufs[3], source, tag=3),
                 dist.irecv(bufs[0], source, tag=7), dist.irecv(bufs[2], source, tag=7)]
    else:
        works = []
    for work in works:
        work.wait()
    if host_of(rank) == 1:
        for i, buf in bufs.items():
            assert intact(buf, rank - RANKS_PER_HOST, 100 + i), f"tagged message {i} misplaced"
    # Batches: a ring through every rank (same-host and cross-host hops), three rounds.
    right, left = (rank + 1) % world, (rank - 1) % world
    for round_ in range(3):
        got = torch.empty(50_000, dtype=torch.int32)
        for work in dist.batch_isend_irecv([
            dist.P2POp(dist.isend, payload(rank, 200 + round_, 50_000), right),
            dist.P2POp(dist.irecv, got, left),
        ]):
            work.wait()
        assert intact(got, left, 200 + round_), f"ring round {round_} from {left} differs"
    return {"hostname": socket.gethostname()}


def test_sizes_tags_and_batches_between_two_hosts():
    with Hosts(2) as hosts:
        values = hosts.launch(_sizes_tags_batches, RANKS_PER_HOST).values(TIMEOUT_S)
        assert [v["hostname"] for v in values] == [hosts.hostnames[host_of(r)] for r in range(4)]
        assert hosts.leftover_processes() == []


def test_ring_through_three_hosts():
    with Hosts(3) as hosts:
        values = hosts.launch(_sizes_tags_batches, RANKS_PER_HOST).values(TIMEOUT_S)
        assert len({v["hostname"] for v in values}) == 3
        assert hosts.leftover_processes() == []


def _any_source(rank, world):
    if rank != 0:
        dist.send(payload(rank, 0, 4096), 0, tag=5)
        return None
    senders = []
    for _ in range(world - 1):
        buf = torch.empty(4096, dtype=torch.int32)
        source = dist.recv(buf, tag=5)  # no src: any rank, on this host or another
        assert intact(buf, source, 0), f"data did not come from rank {source}"
        senders.append(source)
    return sorted(senders)


def test_recv_from_any_source_on_this_host_and_others():
    with Hosts(2) as hosts:
        assert hosts.launch(_any_source, RANKS_PER_HOST).values(TIMEOUT_S)[0] == [1, 2, 3]


def _mismatch(rank, world):
    # Rank 0 (host 0) sends 16 B to rank 2 (host 1), which receives into 32 B: both fail.
    errors = []
    if rank in (0, 2):
        for _ in range(2):  # twice: the pair stays in step after a mismatch
            try:
                if rank == 0:
                    dist.send(torch.zeros(4), 2)
                else:
                    dist.recv(torch.zeros(8), 0)
                errors.append(None)
            except dist.DistBackendError as error:
                errors.append(str(error))
        got = torch.empty(1000, dtype=torch.int32)
        if rank == 0:
            dist.send(payload(0, 1, 1000), 2)
        else:
            dist.recv(got, 0)
            assert intact(got, 0, 1), "the exchange after the mismatches differs"
    return errors


def test_mismatch_between_hosts_fails_on_both_sides():
    with Hosts(2) as hosts:
        results = hosts.launch(_mismatch, RANKS_PER_HOST).values(TIMEOUT_S)
    for rank in (0, 2):
        assert len(results[rank]) == 2
        for error in results[rank]:
            assert error is not None, f"rank {rank}: a mismatched pair must fail on both sides"
            assert "size or dtype mismatch" in error
            assert "rank 0 sends float32[4] (16 B)" in error
            assert "receives into float32[8] (32 B)" in error


def _same_host_and_cross_host_groups(rank, world):
    # Every rank makes every group, in one order; each rank uses the two it is in.
    same = [dist.new_group([h * 2, h * 2 + 1]) for h in range(2)]
    cross = [dist.new_group([i, i + 2]) for i in range(2)]
    mine = {"same": same[host_of(rank)], "cross": cross[rank % 2]}
    for round_ in range(4):
        for name, group in mine.items():
            peers = [r for r in dist.get_process_group_ranks(group) if r != rank]
            peer = peers[0]
            got = torch.empty(100_000, dtype=torch.int32)
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, payload(rank, round_, 100_000), peer, group),
                dist.P2POp(dist.irecv, got, peer, group),
            ])
            for work in works:
                work.wait()
            assert intact(got, peer, round_), f"group {name}, round {round_}: differs"
    for group in same + cross:
        dist.destroy_process_group(group)
    return True


def test_a_same_host_group_and_a_cross_host_group_in_one_job():
    with Hosts(2) as hosts:
        assert hosts.launch(_same_host_and_cross_host_groups, 2).values(TIMEOUT_S) == [True] * 4
        assert hosts.leftover_processes() == []
