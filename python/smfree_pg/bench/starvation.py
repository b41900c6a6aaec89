"""Starvation (docs/benchmarks.md, "Zero SMs"): every same-host path of a pair's P2P runs while a
kernel holds every SM of both GPUs (starve.Hold), per backend in one run; when each op ended,
beside the hold's end. An op that ended during the hold needed no SM. The paths: exchanges
(batch_isend_irecv) at eager and rendezvous sizes, ops to the rank itself, exchanges captured in
CUDA graphs (batched, and unbatched: both ranks send before they receive), recvs from any
source, the collectives smfree runs on the copy engines (where the group is the pair); and two
yardsticks, a bare copy to host memory (a copy engine: during) and a kernel
queued the same way (after, or the GPU was not held). Every op's bytes are checked.

Copies within one GPU (eager copies out of a slot, a captured send's copy into its slot, ops to
the rank itself) run as SMFREE_LOCAL_COPIES says: by default in two copy-engine hops through a
peer GPU; run with driver to see the paths that take the driver's copies, which CUDA 13.0
drivers run on SMs, end only after the hold.

`held_paths` is also what tests/cuda/test_zero_sm.py asserts on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from smfree_pg.bench import starve
from smfree_pg.bench.cli import at_least
from smfree_pg.bench.context import Ctx, barrier, gather, log
from smfree_pg.bench.report import format_table, num
from smfree_pg.bench.sizes import format_size, parse_sizes

NAME = "starvation"
DEVICES = ("cuda",)
# A GPU per rank: processes sharing a GPU are time-sliced (without MPS), so one's kernel never
# holds the SMs against another's work (on one H200 the control kernel ended during the hold).
PLACEMENTS = ("own",)


def add_arguments(parser) -> None:
    group = parser.add_argument_group("starvation")
    group.add_argument("--starvation-sizes", type=parse_sizes, default="4K,1M,16M,64M",
                       help="bytes each way of the exchanges (default: %(default)s)")
    group.add_argument("--starvation-captured-sizes", type=parse_sizes,
                       default="4K,1M,64M,256M",
                       help="bytes each way of the captured exchanges (default: %(default)s)")
    group.add_argument("--starvation-hold-ms", type=float, default=500,
                       help="how long the kernel holds every SM (default: %(default)s)")


def check_arguments(args, parser) -> None:
    at_least(parser, args, 50, "starvation_hold_ms")


def exchange(group, src, dst, peer) -> None:
    ops = [dist.P2POp(dist.isend, src, peer, group), dist.P2POp(dist.irecv, dst, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def unbatched(group, src, dst, peer) -> None:
    # Both ranks send, each waiting for its send, before either receives.
    dist.send(src, peer, group=group)
    dist.recv(dst, peer, group=group)


class StoreSync:
    """A barrier of `ranks` through the default group's store: nothing on the GPUs, and no
    collective that other ranks would have to join."""

    def __init__(self, ranks: list[int], rank: int, prefix: str) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.ranks, self.rank, self.prefix, self.count = ranks, rank, prefix, 0

    def __call__(self) -> None:
        self.count += 1
        key = f"smfree-bench/{self.prefix}/{self.count}"
        self.store.set(f"{key}/{self.rank}", "1")
        self.store.wait([f"{key}/{r}" for r in self.ranks])


class Paths:
    """One rank's run of the paths over one group. `sync()` must be a barrier of both ranks that
    puts nothing on the GPUs."""

    def __init__(self, group, rank: int, peer: int, device: torch.device, sync: Callable,
                 hold_ms: float) -> None:
        self.group, self.rank, self.peer, self.device = group, rank, peer, device
        self.sync, self.hold_ms = sync, hold_ms
        self.seen: dict[str, dict] = {}

    def held(self, name: str, queue_ops: Callable) -> None:
        """Runs `queue_ops()` (posts ops and waits on them) once both ranks hold every SM."""
        torch.cuda.synchronize(self.device)
        self.sync()
        hold = starve.Hold(self.device, self.hold_ms)
        queue_ops()
        hold.mark("ops")
        hold.control(torch.cuda.Stream(device=self.device))
        result = hold.finish()
        self.sync()
        self.seen[name] = {"ops_ms": result.ends["ops"], "control_ms": result.ends["control"],
                           "held_ms": result.held_ms, "during": result.during("ops"),
                           "control_during": result.during("control")}

    def pair(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.full((size // 4,), float(self.rank + 1), device=self.device),
                torch.zeros(size // 4, device=self.device))

    def check(self, dst: torch.Tensor, sender: int, name: str) -> None:
        torch.cuda.synchronize(self.device)
        if not bool((dst == float(sender + 1)).all()):
            raise RuntimeError(f"smfree bench: rank {self.rank}, {name}: wrong bytes")

    def bare_copy(self) -> None:
        host = torch.empty(16 << 20, dtype=torch.uint8).pin_memory()
        mine = torch.ones(16 << 20, dtype=torch.uint8, device=self.device)
        self.held("bare copy to host, 16 MiB", lambda: host.copy_(mine, non_blocking=True))

    def exchanges(self, sizes: list[int]) -> None:
        for size in sizes:
            src, dst = self.pair(size)
            for _ in range(2):  # warm-up: eager lanes open, buffers mapped
                exchange(self.group, src, dst, self.peer)
            dst.zero_()
            name = f"exchange {format_size(size)}"
            self.held(name, lambda: exchange(self.group, src, dst, self.peer))
            self.check(dst, self.peer, name)

    def to_itself(self, sizes: list[int]) -> None:
        for size in sizes:
            src, dst = self.pair(size)
            exchange(self.group, src, dst, self.rank)
            dst.zero_()
            name = f"to the rank itself {format_size(size)}"
            self.held(name, lambda: exchange(self.group, src, dst, self.rank))
            self.check(dst, self.rank, name)
            graph = self.capture(lambda: exchange(self.group, src, dst, self.rank))
            dst.zero_()
            name = f"captured, to the rank itself {format_size(size)}"
            self.held(name, graph.replay)
            self.check(dst, self.rank, name)

    def capture(self, ops: Callable) -> torch.cuda.CUDAGraph:
        """`ops` captured in a graph, replayed once."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops()
        graph.replay()
        torch.cuda.synchronize(self.device)
        return graph

    def captured(self, sizes: list[int], orders=(("batched", exchange),)) -> None:
        for order, ops in orders:
            for size in sizes:
                src, dst = self.pair(size)
                exchange(self.group, src, dst, self.peer)  # warm-up (unbatched: eager sizes only)
                graph = self.capture(lambda: ops(self.group, src, dst, self.peer))
                dst.zero_()
                name = f"captured {order} {format_size(size)}"
                self.held(name, graph.replay)
                self.check(dst, self.peer, name)

    def collectives(self, sizes: list[int]) -> None:
        """The collectives smfree runs on the copy engines, between the pair (a group of the two),
        uncaptured and captured: all-gather out of place (its own piece a copy within the GPU)
        and in place, all-to-all, broadcast."""
        for size in sizes:
            numel = size // 4
            mine = torch.full((numel,), float(self.rank + 1), device=self.device)
            flat = torch.zeros(2 * numel, device=self.device)
            inplace = torch.zeros(2 * numel, device=self.device)
            piece = inplace.narrow(0, self.rank * numel, numel)
            send = torch.full((2 * numel,), float(self.rank + 1), device=self.device)
            got = torch.zeros(2 * numel, device=self.device)
            bcast = torch.zeros(numel, device=self.device)

            def ops():  # no kernel of its own: it would wait for the hold
                dist.all_gather_into_tensor(flat, mine, group=self.group)
                dist.all_gather_into_tensor(inplace, piece, group=self.group)
                dist.all_to_all_single(got, send, group=self.group)
                dist.broadcast(bcast, src=0, group=self.group)

            def reset():
                for t in (flat, inplace, got):
                    t.zero_()
                piece.fill_(float(self.rank + 1))
                bcast.fill_(1.0 if self.rank == 0 else 0.0)

            def check(name):
                self.check_all(name, {"all_gather": (flat, [1.0, 2.0]),
                                      "in place": (inplace, [1.0, 2.0]),
                                      "all_to_all": (got, [1.0, 2.0]),
                                      "broadcast": (bcast, [1.0])})

            reset()
            ops()  # warm-up: buffers mapped
            reset()
            name = f"collectives {format_size(size)}"
            self.held(name, ops)
            check(name)
            graph = self.capture(ops)
            reset()
            name = f"captured collectives {format_size(size)}"
            self.held(name, graph.replay)
            check(name)

    def check_all(self, name: str, expected: dict) -> None:
        """Each tensor's halves (or whole) hold the values listed, one per piece."""
        torch.cuda.synchronize(self.device)
        for what, (tensor, values) in expected.items():
            pieces = tensor.view(len(values), -1)
            for value, part in zip(values, pieces):
                if not bool((part == value).all()):
                    raise RuntimeError(f"smfree bench: rank {self.rank}, {name}: {what} holds "
                                       "wrong bytes")

    def any_source(self, size: int) -> None:
        """Each rank in turn receives from any source. Last: once such a recv is posted, the
        group's recvs no longer know their place in their line (docs/design.md)."""
        src, dst = self.pair(size)
        for receiver in (0, 1):
            def once(receiver=receiver):
                if self.rank == receiver:
                    dist.irecv(dst, group=self.group).wait()
                else:
                    dist.isend(src, receiver, group=self.group).wait()
            once()
            dst.zero_()
            name = f"recv from any source by rank {receiver} {format_size(size)}"
            self.held(name, once)
            if self.rank == receiver:
                self.check(dst, self.peer, name)


def held_paths(group, rank: int, peer: int, device: torch.device, sync: Callable, *,
               sizes: list[int], captured_sizes: list[int], hold_ms: float,
               smfree: bool = True) -> dict[str, dict]:
    """When each path's ops ended under a hold, on this rank (ranks `rank` and `peer` both run
    it). Ops to the rank itself, unbatched captures and recvs from any source only where
    `smfree`."""
    paths = Paths(group, rank, peer, device, sync, hold_ms)
    paths.bare_copy()
    paths.exchanges(sizes)
    if smfree:
        paths.to_itself([1 << 20, max(sizes)])
    # Unbatched, large messages complete only where a send need not wait for its recv (NCCL's
    # hang).
    orders = [("batched", exchange)] + ([("unbatched", unbatched)] if smfree else [])
    paths.captured(captured_sizes, orders)
    if dist.get_world_size(group) == 2:  # collectives need the group to be the pair
        paths.collectives([1 << 20, 64 << 20])
    if smfree:
        paths.any_source(1 << 20)
    return paths.seen


def run(ctx: Ctx, args) -> dict:
    results = {}
    for backend in ctx.backends:
        log(ctx, f"starvation: {backend}")
        seen = None
        if ctx.peer is not None and ctx.rank < 2:
            seen = held_paths(ctx.groups[backend], ctx.rank, ctx.peer, ctx.device,
                              StoreSync([0, 1], ctx.rank, f"starvation/{backend}"),
                              sizes=args.starvation_sizes,
                              captured_sizes=args.starvation_captured_sizes,
                              hold_ms=args.starvation_hold_ms, smfree=backend == "smfree")
        results[backend] = gather(ctx, seen)[:2]
        barrier(ctx)
    return {"pair": [0, 1], "reference": ctx.reference, "hold_ms": args.starvation_hold_ms,
            "units": {"ops_ms": "when the path's ops ended on the rank's stream, ms after its "
                                "hold began", "held_ms": "when the hold ended",
                      "during": "ended before 0.9 x the hold's end: needed no SM"},
            "ranks": results}


def print_section(section: dict) -> None:
    reference = section["reference"]
    print(f"\nStarvation: a kernel holds every SM of both GPUs for {section['hold_ms']:.0f} ms; "
          "when each path's ops ended (ms after the hold began, the later of the pair's two "
          "ranks); 'during' = needed no SM")
    ours, theirs = section["ranks"]["smfree"], section["ranks"][reference]
    names = list(ours[0])
    rows = []
    for name in names:
        row = [name]
        for ranks in (ours, theirs):
            if name not in ranks[0]:
                row += ["-", ""]
                continue
            ended = max(r[name]["ops_ms"] for r in ranks)
            during = all(r[name]["during"] for r in ranks)
            row += [num(ended), "during" if during else "after"]
        row.append(num(max(r[name]["held_ms"] for r in ours)))
        rows.append(row)
    print(format_table(["path", "smfree ms", "", f"{reference} ms", "", "hold ms"], rows),
          flush=True)
