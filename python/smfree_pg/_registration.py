"""Registers the "smfree" backend with torch.distributed and builds it for each group."""

from __future__ import annotations

import atexit
import threading

import torch.distributed as dist
from torch.distributed import Backend, PrefixStore

BACKEND_NAME = "smfree"

_lock = threading.Lock()
_atexit_registered = False


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


def _inner_factory(store, rank: int, size: int, timeout, group_name: str, global_ranks):
    """Builds the collective backend for a device type when a group first needs it."""

    def create(device_type: str):
        if device_type == "cpu":
            return dist.ProcessGroupGloo(PrefixStore("smfree/gloo/", store), rank, size, timeout)
        if device_type == "cuda":
            if not dist.is_nccl_available():
                raise RuntimeError("smfree: CUDA collectives need NCCL, which this torch lacks")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            options.group_name = group_name
            options.global_ranks_in_group = list(global_ranks)
            return dist.ProcessGroupNCCL(PrefixStore("smfree/nccl/", store), rank, size, options)
        raise ValueError(f"smfree: no collective backend for device type {device_type!r}")

    return create


def _create_backend(dist_options, backend_options):
    from smfree_pg import _C

    global _atexit_registered
    with _lock:
        if not _atexit_registered:
            # Stop the progress thread before the interpreter tears down the libraries it uses.
            atexit.register(_C._stop_engine)
            _atexit_registered = True

    store = dist_options.store
    rank, size, timeout = dist_options.group_rank, dist_options.group_size, dist_options.timeout
    group_name = dist_options.group_id
    factory = _inner_factory(
        store, rank, size, timeout, group_name, dist_options.global_ranks_in_group
    )
    return _C.SmFreeBackend(store, rank, size, timeout, group_name, factory)
