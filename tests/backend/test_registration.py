"""How the backend becomes available: import, torch's autoload entry point, device maps."""

import os
import subprocess
import sys

import torch
import torch.distributed as dist

import smfree_pg
from harness import run_ranks, swap


def test_import_registers_backend_for_cpu_and_cuda():
    assert "smfree" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["smfree"] == ["cpu", "cuda"]
    smfree_pg.register()  # idempotent
    assert dist.Backend.backend_list.count("smfree") == 1


def _autoloaded(env_value):
    code = ("import torch.distributed as dist, sys; "
            "print('smfree' in dist.Backend.backend_list, 'smfree_pg' in sys.modules)")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD=env_value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.split()


def test_entry_point_registers_without_import():
    # torch >= 2.5 loads "torch.backends" entry points at `import torch`.
    assert _autoloaded("1") == ["True", "True"]
    assert _autoloaded("0") == ["False", "False"]


def _exchange(rank):
    return swap(1 - rank, torch.full((2,), float(rank)))[0].item()


def _device_map(rank, world):
    backend = dist.group.WORLD._get_backend(torch.device("cuda"))
    assert type(backend).__name__ == "SmFreeBackend"
    cpu = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert type(cpu).__name__ == "ProcessGroupGloo"
    return _exchange(rank)


def test_cpu_gloo_cuda_smfree_device_map():
    assert run_ranks(_device_map, 2, backend="cpu:gloo,cuda:smfree") == [1.0, 0.0]


def _cpu_smfree(rank, world):
    assert type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__ == "SmFreeBackend"
    return _exchange(rank)


def test_cpu_smfree_device_map():
    assert run_ranks(_cpu_smfree, 2, backend="cpu:smfree") == [1.0, 0.0]
