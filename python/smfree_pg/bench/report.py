"""The report: the JSON every rank's figures go to, the header above the tables, the tables."""

from __future__ import annotations

import json
import os
import platform
import socket
from datetime import datetime, timezone
from pathlib import Path

import torch

import smfree_pg
from smfree_pg.bench.context import Ctx
from smfree_pg.bench.provenance import nccl_version, provenance, ucx_version

SCHEMA = "smfree-bench/1"
ENV_PREFIXES = ("SMFREE_", "NCCL_", "UCX_", "TORCH_NCCL_", "TORCH_SYMM_MEM_",
                "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF")


def new_report(ctx: Ctx, args) -> dict:
    """The JSON report before any section ran.

    Top level: "schema", "provenance" (package version and commit, SMFREE_* settings, torch,
    NCCL, UCX, driver, command: bench/provenance.py), "meta" (device, versions, command,
    options), then one key per section
    run: "bandwidth" (rows per size: "smfree"/"nccl"/"copy_engine" -> "oneway"/"bidir" ->
    {"us", "GBps", ...}), "overlap" (per rank: GEMM alone and under each backend's traffic),
    "profile" (per backend, per rank: kernel and memcpy counts by name, trace path), "pipeline"
    (per backend: step time), "pipelining" (rows per stage count, schedule and activation size:
    per backend the step time's spread and the CPU time in wait(), the paired ratio, the loss
    and gradient comparison), "roundtrip" (rows per size: per backend µs per round trip, its
    spread and the CPU time in wait(); the paired ratio) and "shared_gpu" (rows per size:
    smfree's exchange beside the copy floors, µs, where ranks share a GPU). Idle ranks appear as
    null.
    """
    cuda = ctx.device.type == "cuda"
    a, b = ctx.devices[:2]
    options = {k: v for k, v in vars(args).items()
               if k not in ("command", "launcher", "run_suffix")}
    meta = {
        "command": args.command,
        "launcher": args.launcher,
        "world_size": ctx.world,
        "pairs": [[r, r + 1] for r in range(0, ctx.world - 1, 2)],
        "devices": ctx.devices,
        "device": ctx.device.type,
        # Every rank on one GPU: smfree alone (NCCL refuses two ranks on one GPU).
        "shared_gpu": ctx.shared_gpu,
        "reference": ctx.reference,
        "gpu": torch.cuda.get_device_name(ctx.device) if cuda else None,
        "gpus_visible": torch.cuda.device_count(),
        "peer_access_0_1": torch.cuda.can_device_access_peer(a, b)
        if cuda and a != b and b < torch.cuda.device_count() else None,
        # The GPU's hardware queues per process: "default" where the variable is unset.
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version() if cuda else None,
        "smfree": smfree_pg.__version__,
        "ucx": ucx_version(),
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "options": options,
    }
    return {"schema": SCHEMA, "provenance": provenance(args.command), "meta": meta}


def write_report(path: str, report: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(title)] + [len(row[i]) for row in rows]) for i, title in enumerate(header)]
    lines = [" | ".join(t.rjust(w) for t, w in zip(header, widths, strict=True)),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_header(meta: dict) -> None:
    shared = ", every rank on it" if meta["shared_gpu"] else ""
    print(f"smfree bench: {meta['gpu'] or 'CPU tensors, against Gloo'}{shared} (world size {meta['world_size']}, pairs "
          f"{', '.join(f'{a}<->{b}' for a, b in meta['pairs'])}; figures are rank 0's pair)")
    print(f"torch {meta['torch']} (CUDA {meta['cuda']}), NCCL {meta['nccl']}, "
          f"smfree {meta['smfree']}, UCX {meta['ucx'] or 'unknown'}, Python {meta['python']}, "
          f"peer access 0<->1: {meta['peer_access_0_1']}")
    print(f"command ({meta['launcher']}): {meta['command']}")
    settings = ", ".join(f"{k}={v}" for k, v in meta["env"].items())
    print(f"environment: {settings or 'no SMFREE_/UCX_/NCCL_ settings'}", flush=True)

