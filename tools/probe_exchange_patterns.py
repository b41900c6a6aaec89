# How long a batched exchange of one pipeline's traffic pattern takes on smfree and on the
# reference backend (NCCL for CUDA tensors, Gloo for CPU ones), every rank at once. Launch with
# torchrun, one rank per GPU (or CPU ranks where there is none), e.g. for stages on different
# hosts emulated on one:
#   SMFREE_CHANNEL=ucx UCX_TLS=tcp,cuda_copy NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
#     torchrun --nproc-per-node=4 tools/probe_exchange_patterns.py --sizes 16 --gemms 0,20
# pairs: ranks 2i and 2i+1 swap a message; chain: rank r sends to r+1 (activations only);
# both: every rank swaps a message with each neighbour (steady-state 1F1B with two directions).
# --gemms G puts G bf16 GEMMs of 4096^3 on the stream before each exchange (CUDA only), as a
# stage's compute before its P2P. Prints each rank's median ms per exchange, per trial.
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import smfree_pg  # noqa: F401  (registers backend "smfree")


def neighbour_ops(pattern, rank, world, send, recv, group):
    ops = []
    if pattern == "pairs" and (rank ^ 1) < world:
        ops += [dist.P2POp(dist.irecv, recv[0], rank ^ 1, group),
                dist.P2POp(dist.isend, send[0], rank ^ 1, group)]
    if pattern in ("chain", "both") and rank > 0:
        ops.append(dist.P2POp(dist.irecv, recv[0], rank - 1, group))
        if pattern == "both":
            ops.append(dist.P2POp(dist.isend, send[1], rank - 1, group))
    if pattern in ("chain", "both") and rank < world - 1:
        ops.append(dist.P2POp(dist.isend, send[0], rank + 1, group))
        if pattern == "both":
            ops.append(dist.P2POp(dist.irecv, recv[1], rank + 1, group))
    return ops


def timed_exchanges(args, pattern, group, send, recv, gemms, matrix):
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = []
    for _ in range(args.warmup + args.reps):
        dist.barrier()
        if matrix is not None:
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(gemms):
            matrix @ matrix
        ops = neighbour_ops(pattern, rank, world, send, recv, group)
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        if matrix is not None:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples[args.warmup:]) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="16", help="message sizes in MiB, comma-separated")
    parser.add_argument("--patterns", default="pairs,chain,both")
    parser.add_argument("--gemms", default="0", help="GEMMs before each exchange, comma-separated")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trials", type=int, default=2, help="alternations of the two backends")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    reference = "nccl" if cuda else "gloo"
    dist.init_process_group(reference)
    ranks = list(range(dist.get_world_size()))
    # Every rank takes part in every exchange call, so NCCL's communicators initialize.
    groups = {reference: dist.new_group(ranks), "smfree": dist.new_group(ranks, backend="smfree")}
    device = "cuda" if cuda else "cpu"
    matrix = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) if cuda else None
    for mib in (int(s) for s in args.sizes.split(",")):
        numel = (mib << 20) // 2
        send = [torch.full((numel,), dist.get_rank(), dtype=torch.bfloat16, device=device)
                for _ in range(2)]
        recv = [torch.empty(numel, dtype=torch.bfloat16, device=device) for _ in range(2)]
        for gemms in (int(g) for g in args.gemms.split(",")):
            if gemms and not cuda:
                continue
            for pattern in args.patterns.split(","):
                results = {name: [] for name in groups}
                for _ in range(args.trials):
                    for name, group in groups.items():
                        results[name].append(
                            timed_exchanges(args, pattern, group, send, recv, gemms, matrix))
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, results)
                if dist.get_rank() == 0:
                    print(f"{mib} MiB, {pattern}, {gemms} GEMMs first: ms per exchange, "
                          "rank: backend trials")
                    for rank, per_rank in enumerate(gathered):
                        shown = "  ".join(f"{name} " + " ".join(f"{ms:.2f}" for ms in values)
                                          for name, values in per_rank.items())
                        print(f"  r{rank}: {shown}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
