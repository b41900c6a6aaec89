"""The bytes the benchmark moves: a pattern per sending rank, checked where it lands."""

from __future__ import annotations

import torch


def pattern(rank: int, numel: int, device: torch.device) -> torch.Tensor:
    """int32s that differ per sending rank and per position, to catch stale or misplaced bytes."""
    salt = 0x5BD1E995 ^ rank
    return torch.arange(numel, dtype=torch.int32, device=device).bitwise_xor_(salt)


def mismatch(received: torch.Tensor, sender: int, what: str) -> str | None:
    """None if `received` holds `sender`'s pattern, else where it first differs."""
    expected = pattern(sender, received.numel(), received.device)
    if torch.equal(received, expected):
        return None
    index = int((received != expected).nonzero()[0])
    return (f"{what}: data from rank {sender} differ first at int32 {index} of "
            f"{received.numel()}: got {int(received[index])}, expected {int(expected[index])}")
