"""NCCL's own copy-engine collectives, as torch offers them (NCCL 2.28: a communicator under the
zero-CTA policy, tensors in NCCL's symmetric memory): µs per call, or where they fail.

The collectives section runs this module in processes of its own, one per rank (`measure`): a
failing NCCL communicator may end or hang its process, and symmetric memory's backend is a
setting of the whole process. Each process prints one line, MARKER and JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from smfree_pg.bench.bandwidth import seconds_per_op
from smfree_pg.bench.context import Ctx, free_port, gather
from smfree_pg.bench.pieces import ALL_GATHER, ALL_TO_ALL, Layout, make_input, wrong_piece
from smfree_pg.bench.sizes import format_size

MARKER = "SMFREE_NCCL_COPY_ENGINES"
OPS = (ALL_GATHER, ALL_TO_ALL)  # the even ones NCCL 2.28 runs on copy engines and torch reaches
TIMEOUT_S = 150


def measure(ctx: Ctx, ops: list[str], sizes: list[int], iters: int, reps: int) -> dict:
    """Every rank runs this module in a child process; {"rows": [{op, bytes, us}], "error"}:
    us is the slowest rank's, error the first rank's failure (then rows stop there)."""
    ops = [op for op in ops if op in OPS]
    if not ops:
        return {"rows": [], "error": None}
    port = gather(ctx, free_port() if ctx.rank == 0 else None)[0]
    env = {**os.environ, "RANK": str(ctx.rank), "WORLD_SIZE": str(ctx.world),
           "LOCAL_RANK": str(ctx.device.index), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "NCCL_DEBUG": "WARN"}
    command = [sys.executable, "-m", "smfree_pg.bench.nccl_copy_engines", "--ops", ",".join(ops),
               "--sizes", ",".join(map(str, sizes)), "--iters", str(iters), "--reps", str(reps)]
    results = gather(ctx, run_child(command, env))
    rows = []
    for index, row in enumerate(results[0]["rows"]):
        times = [result["rows"][index]["us"] for result in results
                 if index < len(result["rows"])]
        rows.append({**row, "us": max(times) if len(times) == ctx.world else None})
    errors = [f"rank {rank}: {result['error']}" for rank, result in enumerate(results)
              if result["error"]]
    return {"rows": [row for row in rows if row["us"] is not None],
            "error": errors[0] if errors else None}


def run_child(command: list[str], env: dict) -> dict:
    """This rank's child: its JSON line, or what it said before it failed."""
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"rows": [], "error": f"no answer within {TIMEOUT_S} s"}
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    warnings = [line for line in lines if "NCCL WARN" in line]
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARKER):
            result = json.loads(line[len(MARKER):])
            # torch's error says "unhandled cuda error"; NCCL's own warning says where.
            if result["error"] and warnings:
                result["error"] += f"; NCCL: {warnings[-1]}"
            return result
    said = (warnings or lines or ["(nothing on stderr)"])[-1]
    return {"rows": [], "error": f"exited with {done.returncode}: {said}"}


def child(args: argparse.Namespace) -> dict:
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    options = dist.ProcessGroupNCCL.Options()
    if not hasattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO"):
        return {"rows": [], "error": f"torch {torch.__version__} has no NCCL_CTA_POLICY_ZERO"}
    options.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
    dist.init_process_group("nccl", pg_options=options, device_id=device,
                            timeout=timedelta(seconds=60))
    symm_mem.set_backend("NCCL")
    name = dist.group.WORLD.group_name
    rows = []
    for op in args.ops.split(","):
        for size in map(int, args.sizes.split(",")):
            layout = Layout(op, world, size // 4)
            where = f"{op}, {format_size(size)}"
            try:
                inp = symm_mem.empty(layout.in_numel(rank), dtype=torch.int32, device=device)
                out = symm_mem.empty(layout.out_numel(rank), dtype=torch.int32, device=device)
                symm_mem.rendezvous(inp, group=name)
                symm_mem.rendezvous(out, group=name)
                inp.copy_(make_input(layout, rank, device))
                out.zero_()
                collective = (dist.all_gather_into_tensor if op == ALL_GATHER
                              else dist.all_to_all_single)
                call = functools.partial(collective, out, inp)
                call()
                torch.cuda.synchronize()
                wrong = wrong_piece(layout, out, rank, range(world), f"rank {rank}, {where}")
                if wrong:
                    return {"rows": rows, "error": wrong}
                seconds = []
                for _ in range(args.reps):
                    dist.barrier(device_ids=[device.index])
                    seconds.append(seconds_per_op(call, args.iters))
            except Exception as error:  # NCCL's failure is the figure here
                first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
                return {"rows": rows, "error": f"{where}: {type(error).__name__}: {first}"}
            rows.append({"op": op, "bytes": size, "us": 1e6 * statistics.median(seconds)})
    dist.destroy_process_group()
    return {"rows": rows, "error": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--reps", type=int, required=True)
    try:
        result = child(parser.parse_args())
    except Exception:
        result = {"rows": [], "error": traceback.format_exc().strip().splitlines()[-1]}
    print(MARKER + json.dumps(result), flush=True)
    # A failed communicator may hang at exit in NCCL's teardown: leave at once.
    os._exit(0)


if __name__ == "__main__":
    main()
