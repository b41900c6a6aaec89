"""What a rank publishes in the store is checked before use: a value that is garbage, from
another version, damaged, with a bad pid, a length out of bounds or trailing bytes fails the
peer's connect with an error naming the rank and the store key, before UCX reads the worker
address in it; no rank dies, and once the value is good again the two ranks exchange."""

import re
import struct

import pytest
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from harness import run_ranks

_VERSION_AT = 4  # after the magic


def _fnv1a(data):
    value = 0xcbf29ce484222325
    for byte in data:
        value = ((value ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return value


def _resealed(body):
    """`body` with a good checksum: what passes for intact."""
    return bytes(body) + struct.pack("=Q", _fnv1a(body))


def _field_at(address, strings):
    """Where the field after the first `strings` length-prefixed strings starts."""
    at = 8  # after the magic and the version
    for _ in range(strings):
        (length,) = struct.unpack_from("=I", address, at)
        at += 4 + length
    return at


def _with_pid(address, pid):
    body = bytearray(address[:-8])
    struct.pack_into("=i", body, _field_at(address, 3), pid)  # after the keys and hostname
    return _resealed(body)


def _with_hostname_length(address, length):
    body = bytearray(address[:-8])
    struct.pack_into("=I", body, _field_at(address, 2), length)
    return _resealed(body)


# What each tampered value below must be refused for, in order.
_REASONS = [
    r"the value is not an smfree peer address \(it starts with 0x20746f6e, not 0x50464d53\)",
    r"the peer address has version 99, this build reads version 1: the ranks run different "
    r"smfree versions",
    r"the peer address's checksum does not match its \d+ bytes",
    r"the peer address's pid is -5, not a process id",
    r"the peer address's pid is 0, not a process id",
    r"the peer address's hostname has 1073741824 bytes, outside 0..1024",
    r"the peer address has 2 bytes past its fields",
]


def _tampered(original):
    wrong_version = bytearray(original)
    struct.pack_into("=I", wrong_version, _VERSION_AT, 99)
    return [b"not an address at all", bytes(wrong_version), original[:-3],
            _with_pid(original, -5), _with_pid(original, 0),
            _with_hostname_length(original, 1 << 30), _resealed(original[:-8] + b"xx")]


def _published_at(group, rank):
    """The group's stores (torch gives each device's backend its own prefix) that hold what
    `rank` published under its key."""
    default = dist.distributed_c10d._get_default_store()
    stores = [PrefixStore(f"{device}/", PrefixStore(f"{group.group_name}/", default))
              for device in ("cpu", "cuda")]
    return [store for store in stores if store.check([_key(rank)])]


def _key(rank):
    return f"smfree/peer/{rank}"


def _tamper_with_rank_1(rank, world):
    # The default group (gloo) only synchronises: rank 1 rewrites what it published for the
    # smfree group before rank 0 first reaches it there.
    group = dist.new_group([0, 1], backend="smfree")
    dist.barrier()  # rank 1 has published
    stores = _published_at(group, 1)
    assert stores, "rank 1 published no address under either device's prefix"
    originals = [store.get(_key(1)) for store in stores]
    dist.barrier()  # both have read them
    errors = []
    for value in _tampered(originals[0]):
        if rank == 1:
            for store in stores:
                store.set(_key(1), value)
        dist.barrier()
        if rank == 0:
            with pytest.raises(dist.DistBackendError) as raised:
                dist.send(torch.ones(4), 1, group=group)
            errors.append(str(raised.value))
        dist.barrier()
    if rank == 1:
        for store, original in zip(stores, originals):
            store.set(_key(1), original)
    dist.barrier()
    got = torch.empty(4)
    if rank == 0:
        dist.send(torch.full((4,), 7.0), 1, group=group)
        dist.recv(got, 1, group=group)
    else:
        dist.recv(got, 0, group=group)
        dist.send(got + 1, 0, group=group)
    return errors, got.tolist()


def test_a_tampered_address_fails_the_connect_by_rank_and_key():
    results = run_ranks(_tamper_with_rank_1, 2, backend="gloo")
    errors, got = results[0]
    assert len(errors) == len(_REASONS)
    for error, reason in zip(errors, _REASONS):
        assert re.search(r"send on rank 0 to rank 1 \(group '.*', tag 0, 16 B\) cannot connect: "
                         r"cannot reach rank 1 of group '.*': the address it published in the "
                         r"group's store under 'smfree/peer/1' is unusable: " + reason, error), \
            error
    assert got == [8.0] * 4 and results[1] == ([], [7.0] * 4)
