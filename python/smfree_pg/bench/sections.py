"""The benchmark's sections, in the order they run and list their options.

Each is a module with NAME, DEVICES (where it runs), PLACEMENTS (on CUDA: "own", a GPU per rank,
and/or "shared", every rank on one GPU), add_arguments(parser),
check_arguments(args, parser), run(ctx, args) -> its JSON section (called on every rank) and
print_section(section) (rank 0's table).
"""

from smfree_pg.bench import (alltoall, bandwidth, captured, collectives, overlap, pipeline,
                             pipelining, profile, roundtrip, shared_gpu, starvation)

SECTIONS = {module.NAME: module
            for module in (bandwidth, overlap, profile, pipeline, pipelining, roundtrip, captured,
                           alltoall, collectives, starvation, shared_gpu)}
