"""A collective's pieces, as the collectives section and NCCL's copy-engine path call them: the
ops, where each piece of one call lies, inputs that tell every piece apart, and the check of an
output."""

from __future__ import annotations

import torch

from smfree_pg.bench.data import pattern

ALL_GATHER, ALL_TO_ALL = "all_gather_into_tensor", "all_to_all_single"
# As FSDP2 calls it: the input is this rank's piece of the output, so no copy stays on a GPU.
IN_PLACE = "all_gather_into_tensor in place"
# As an MoE layer's token exchange calls it: pieces of different sizes per pair of ranks.
UNEVEN = "all_to_all_single uneven"
# Rooted at rank 0; gather's and scatter's lists are views of one tensor.
BROADCAST, GATHER, SCATTER = "broadcast", "gather", "scatter"
OPS = (ALL_GATHER, IN_PLACE, ALL_TO_ALL, UNEVEN, BROADCAST, GATHER, SCATTER)
GATHERS = (ALL_GATHER, IN_PLACE)
# A sender's input goes whole to every receiver.
WHOLE_INPUT = (ALL_GATHER, IN_PLACE, BROADCAST)
# The sender's own piece is where it belongs already: nothing copies it.
NO_OWN_COPY = (IN_PLACE, BROADCAST)
ROOT = 0


def piece_count(op: str, n: int, world: int, s: int, d: int) -> int:
    """int32s rank `s` sends rank `d` in one call of `op` with pieces of `n`."""
    if op == UNEVEN:
        return 2 * n * (1 + (s + d) % world) // (world + 1)
    if op in (BROADCAST, SCATTER):
        return n if s == ROOT else 0
    if op == GATHER:
        return n if d == ROOT else 0
    return n


class Layout:
    """Where each piece of one call of `op` lies, for pieces of `n` int32s (on average, uneven):
    counts[s][d] int32s from rank s to rank d, at in_offset(s, d) in s's input and at
    out_offset(s, d) in d's output."""

    def __init__(self, op: str, world: int, n: int) -> None:
        self.op, self.world, self.n = op, world, n
        self.counts = [[piece_count(op, n, world, s, d) for d in range(world)]
                       for s in range(world)]

    def in_offset(self, s: int, d: int) -> int:
        return 0 if self.op in WHOLE_INPUT else sum(self.counts[s][:d])

    def out_offset(self, s: int, d: int) -> int:
        return sum(self.counts[x][d] for x in range(s))

    def sent(self, inp: torch.Tensor, s: int, d: int) -> torch.Tensor:
        """The piece of rank s's input `inp` that goes to rank d."""
        start = self.in_offset(s, d)
        return inp[start:start + self.counts[s][d]]

    def received(self, out: torch.Tensor, s: int, d: int) -> torch.Tensor:
        """The piece of rank d's output `out` that comes from rank s."""
        start = self.out_offset(s, d)
        return out[start:start + self.counts[s][d]]

    def in_numel(self, s: int) -> int:
        return self.n if self.op in WHOLE_INPUT else sum(self.counts[s])

    def out_numel(self, d: int) -> int:
        return sum(self.counts[s][d] for s in range(self.world))

    def splits(self, rank: int):
        """all_to_all_single's (output_split_sizes, input_split_sizes) for `rank`, or Nones."""
        if self.op != UNEVEN:
            return None, None
        return ([self.counts[s][rank] for s in range(self.world)],
                [self.counts[rank][d] for d in range(self.world)])

    def piece_bytes(self) -> float:
        """The mean bytes of a piece between two ranks (not a rank's own): figure()'s `size`."""
        world = self.world
        cross = sum(self.counts[s][d] for s in range(world) for d in range(world) if s != d)
        return 4 * cross / (world * (world - 1))


def make_input(layout: Layout, rank: int, device, distinct: bool = True) -> torch.Tensor:
    """`rank`'s input. All-to-all's pieces differ by destination (`distinct`), so a piece sent to
    the wrong rank shows; without, each piece is pattern(rank) of its length, what
    overlap_trial's check expects."""
    if layout.op in GATHERS or distinct:
        return pattern(rank, layout.in_numel(rank), device)
    return torch.cat([pattern(rank, count, device) for count in layout.counts[rank]])


def expected_piece(layout: Layout, sender: int, receiver: int, device) -> torch.Tensor:
    """What `receiver`'s output holds from `sender` (make_input's distinct inputs)."""
    return layout.sent(pattern(sender, layout.in_numel(sender), device), sender, receiver)


def wrong_piece(layout: Layout, out: torch.Tensor, receiver: int, senders, what: str):
    """None if `out`'s pieces from `senders` are right, else where the first one differs."""
    for sender in senders:
        got = layout.received(out, sender, receiver)
        want = expected_piece(layout, sender, receiver, out.device)
        if not torch.equal(got, want):
            index = int((got != want).nonzero()[0])
            return (f"{what}: piece from rank {sender} differs first at int32 {index} of "
                    f"{got.numel()}: got {int(got[index])}, expected {int(want[index])}")
    return None
