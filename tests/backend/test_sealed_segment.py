"""A rank's flag segment is sealed: another process of the same user that opens it through
/proc/<pid>/fd can neither shrink it (which killed the rank with SIGBUS at its next touch of a
lost page) nor grow it, and the rank goes on exchanging. Every engine has the segment, CPU-only
ones too."""

import mmap
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from harness import run_ranks

# What a careless (or stale) process of the user does: open the segment by path and resize it.
_RESIZE = """
import errno, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
size = os.fstat(fd).st_size
tried = []
for length in (size + 4096, 0, size - 4096):  # ends short: a touch of the end would SIGBUS
    try:
        os.ftruncate(fd, length)
        tried.append("resized")
    except OSError as error:
        tried.append(errno.errorcode[error.errno])
print(" ".join(tried))
"""


def _segment_fd():
    prefix = f"/memfd:smfree-flags-{os.getpid()}-"
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith(prefix):
                return int(name)
        except OSError:
            continue  # the listing's own fd, closed by now
    raise AssertionError("the rank holds no flag segment")


def _exchange(rank, value):
    got = torch.empty(1 << 16)
    works = [dist.isend(torch.full((1 << 16,), value), 1 - rank), dist.irecv(got, 1 - rank)]
    for work in works:
        work.wait()
    return got.min().item(), got.max().item()


def _resize_my_segment(rank, world):
    before = _exchange(rank, float(rank))
    fd = _segment_fd()
    size = os.fstat(fd).st_size
    tried = None
    if rank == 0:
        tried = subprocess.run([sys.executable, "-c", _RESIZE, f"/proc/{os.getpid()}/fd/{fd}"],
                               capture_output=True, text=True, timeout=60,
                               check=True).stdout.split()
    dist.barrier()
    # The rank touches the segment's last page: had the file shrunk, this read would kill it.
    with mmap.mmap(fd, size) as mapped:
        last = mapped[size - 1]
    after = _exchange(rank, 10.0 + rank)
    return tried, os.fstat(fd).st_size == size, last, before, after


def test_another_process_cannot_resize_a_ranks_flag_segment():
    results = run_ranks(_resize_my_segment, 2)
    tried, same_size, last, before, after = results[0]
    assert tried == ["EPERM", "EPERM", "EPERM"]
    assert same_size and last == 0
    assert before == (1.0, 1.0) and after == (11.0, 11.0)
    assert results[1][3:] == ((0.0, 0.0), (10.0, 10.0))
