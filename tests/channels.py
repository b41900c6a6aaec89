"""The data channels a P2P test runs over, as pytest parameters.

CPU tensors always go over UCX; CUDA tensors go over the copy engines or over UCX
(SMFREE_CHANNEL), and over UCX also with TCP alone (UCX_TLS=tcp,cuda_copy, as between hosts
without GPUDirect RDMA: smfree then stages through pinned host memory). Each channel sets its
ranks' environment itself, so one pytest run covers them all; the CUDA ones need a GPU (marked
gpu, skipped elsewhere), which ranks share where there are fewer GPUs than ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from harness import run_ranks


@dataclass(frozen=True)
class Channel:
    name: str
    cuda: bool  # rank r moves tensors on its GPU (devices.cuda_device), else on the CPU
    env: dict = field(default_factory=dict)

    @property
    def over_ucx(self) -> bool:
        return self.env.get("SMFREE_CHANNEL") != "copy_engine"

    @property
    def host_relayed(self) -> bool:
        """CUDA tensors cross pinned host memory: UCX reaches the peer over TCP only."""
        return self.cuda and "tcp" in self.env.get("UCX_TLS", "").split(",")

    def run(self, fn, world_size, *args, env=None, **kwargs):
        """run_ranks on this channel; `env` adds to the channel's."""
        return run_ranks(fn, world_size, *args, cuda=self.cuda, env={**self.env, **(env or {})},
                         **kwargs)


CPU_UCX = Channel("cpu-ucx", cuda=False)
COPY_ENGINE = Channel("cuda-copy_engine", cuda=True, env={"SMFREE_CHANNEL": "copy_engine"})
CUDA_UCX = Channel("cuda-ucx", cuda=True, env={"SMFREE_CHANNEL": "ucx"})
CUDA_UCX_TCP = Channel("cuda-ucx-tcp", cuda=True,
                       env={"SMFREE_CHANNEL": "ucx", "UCX_TLS": "tcp,cuda_copy"})


def params(*channels):
    """pytest parameters for `channels`, the CUDA ones marked gpu."""
    return [pytest.param(c, id=c.name, marks=[pytest.mark.gpu] if c.cuda else [])
            for c in channels]


ALL = params(CPU_UCX, COPY_ENGINE, CUDA_UCX, CUDA_UCX_TCP)
CUDA = params(COPY_ENGINE, CUDA_UCX, CUDA_UCX_TCP)
CUDA_OVER_UCX = params(CUDA_UCX, CUDA_UCX_TCP)
