"""Byte counts as the command line and the tables write them: '64K' <-> 65536."""

from __future__ import annotations

import argparse

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'64K' -> 65536: bytes, with an optional K, M or G (powers of 1024), a multiple of 4."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (text[:-1], text[-1]) if text[-1:] in UNITS else (text, "")
    try:
        size = int(number) * UNITS.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    # Buffers hold an int32 pattern, so every size must be whole int32s.
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return size


def parse_sizes(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",")]


def format_size(size: int) -> str:
    for unit in ("G", "M", "K"):
        if size and size % UNITS[unit] == 0:
            return f"{size // UNITS[unit]} {unit}iB"
    return f"{size} B"
