"""Registers the "smfree" backend with torch.distributed and builds it for each group."""

from __future__ import annotations

import atexit
import threading

import torch
import torch.distributed as dist
from torch.distributed import Backend, PrefixStore

BACKEND_NAME = "smfree"

_lock = threading.Lock()
_atexit_registered = False

REBUILD = "`pip install --no-build-isolation -e .` (or `make install`) in smfree's source folder"


def check_torch_version(built: str | None, running: str) -> str | None:
    """Why an extension built against torch `built` cannot run in torch `running`; None if it can.

    The extension binds torch's C++ classes (c10d::Backend), whose layout is that of the torch it
    was compiled against; under another torch it fails to load with a message naming neither.
    """
    if built == running:
        return None
    if built is None:
        return (f"smfree: smfree_pg._C records no torch version (it was built before smfree "
                f"recorded one); this process runs torch {running}. Rebuild it: {REBUILD}")
    return (f"smfree: smfree_pg._C was built against torch {built}, but this process runs torch "
            f"{running}; an extension binds the torch it was compiled against. Rebuild it "
            f"against this torch: {REBUILD}")


def extension():
    """smfree_pg._C, once it is known to be built against the running torch."""
    try:
        from smfree_pg._built_with import TORCH_VERSION as built
    except ImportError:
        built = None
    problem = check_torch_version(built, torch.__version__)
    if problem:
        raise ImportError(problem)
    from smfree_pg import _C

    return _C


def register() -> None:
    """Makes backend="smfree" available; safe to call more than once."""
    with _lock:
        if BACKEND_NAME in Backend.backend_list:
            return
        Backend.register_backend(
            BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
        )


def autoload() -> None:
    """Entry point of the "torch.backends" group, which torch calls at import (torch >= 2.5)."""
    if dist.is_available():
        register()


def _nccl(store, rank: int, size: int, timeout, group_name: str, global_ranks, split=None):
    if not dist.is_nccl_available():
        raise RuntimeError("smfree: CUDA collectives need NCCL, which this torch lacks")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.group_name = group_name
    options.global_ranks_in_group = list(global_ranks)
    if split is not None:
        options.split_from = split.source
        # Any color the members share: the ranks outside the group split with NOCOLOR.
        options.split_color = hash(tuple(global_ranks)) % (1 << 31)
    return dist.ProcessGroupNCCL(PrefixStore("smfree/nccl/", store), rank, size, options)


class _Split:
    """The default group's NCCL communicator, where torch splits every new group from it.

    With the default group on NCCL and bound to a GPU (init_process_group(device_id=...)), torch
    makes each rank *outside* a new group join an ncclCommSplit of the default communicator as
    the group is made. Its members must split at the same point, or the default communicator's
    ranks fall out of step and the next NCCL group hangs or crashes; so a smfree subgroup makes
    its NCCL communicator at once, split from the default one, as an NCCL group's members do.
    """

    def __init__(self, source, device) -> None:
        self.source, self.device = source, device

    @staticmethod
    def of_new_group(global_ranks) -> "_Split | None":
        if not dist.is_initialized() or not global_ranks:
            return None  # this is the default group
        c10d = dist.distributed_c10d
        default = c10d._get_default_group()
        if len(global_ranks) == default.size() or default.bound_device_id is None:
            return None  # no rank is left out, or torch splits nothing
        source = c10d._get_split_source(default)
        return _Split(source, default.bound_device_id) if source is not None else None


def _inner_factory(store, rank: int, size: int, timeout, group_name: str, global_ranks):
    """Builds the collective backend for a device type when a group first needs it (the CUDA
    one at once where the group must take part in a split: _Split)."""
    split = _Split.of_new_group(global_ranks)
    made = {}
    if split is not None:
        made["cuda"] = _nccl(store, rank, size, timeout, group_name, global_ranks, split)
        made["cuda"].eager_connect_single_device(split.device)

    def create(device_type: str):
        if device_type in made:
            return made[device_type]
        if device_type == "cpu":
            return dist.ProcessGroupGloo(PrefixStore("smfree/gloo/", store), rank, size, timeout)
        if device_type == "cuda":
            return _nccl(store, rank, size, timeout, group_name, global_ranks)
        raise ValueError(f"smfree: no collective backend for device type {device_type!r}")

    return create


def _create_backend(dist_options, backend_options):
    _C = extension()

    global _atexit_registered
    with _lock:
        if not _atexit_registered:
            # Stop the progress thread before the interpreter tears down the libraries it uses,
            # then the thread that drops what ended ops hand back (it may take the GIL).
            atexit.register(_C._stop_caller_release)
            atexit.register(_C._stop_engine)
            _atexit_registered = True

    store = dist_options.store
    rank, size, timeout = dist_options.group_rank, dist_options.group_size, dist_options.timeout
    group_name = dist_options.group_id
    factory = _inner_factory(
        store, rank, size, timeout, group_name, dist_options.global_ranks_in_group
    )
    return _C.SmFreeBackend(store, rank, size, timeout, group_name, factory)
