"""What smfree finds on this machine: `python -m smfree_pg.doctor [--json]`.

UCX's version and the transports it sees, each GPU's capabilities that the copy-engine path
relies on (stream memory operations, remote-write flush, IPC handle types, peer access), how
copies run where ranks share a GPU, and the settings that change smfree's behaviour. It first checks that the extension loads the
libstdc++ torch uses (linkage.py), since one that carries its own crashes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

import smfree_pg
from smfree_pg.linkage import static_libstdcxx_problem

SETTINGS_PREFIXES = ("SMFREE_", "UCX_TLS", "UCX_NET_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS",
                     "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")
# UCX's RDMA transports (InfiniBand, RoCE); everything else across hosts is TCP.
RDMA = ("rc", "dc", "ud")


def collect() -> dict:
    from smfree_pg import _C

    report = _C._doctor()
    report["smfree"] = smfree_pg.__version__
    report["torch"] = torch.__version__
    report["settings"] = {key: value for key, value in sorted(os.environ.items())
                          if key.startswith(SETTINGS_PREFIXES)}
    report["ptrace_scope"] = _read("/proc/sys/kernel/yama/ptrace_scope")
    try:
        report["collectives_on_copy_engines"] = _C._collectives_on_copy_engines()
        report["collective_min_bytes"] = _C._collective_min_bytes()
    except ValueError as error:
        report["collectives_on_copy_engines"] = {"error": str(error)}
    return report


def _linkage_problem() -> str | None:
    """Checked before the extension runs: one linked with its own libstdc++ would crash here."""
    spec = importlib.util.find_spec("smfree_pg._C")
    if spec is None:
        return None  # collect()'s import says it is not built
    try:
        return static_libstdcxx_problem(spec.origin)
    except RuntimeError as error:
        print(f"smfree_pg._C's linkage was not checked: {error}", file=sys.stderr)
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def render(report: dict) -> str:
    lines = [f"smfree {report['smfree']}, torch {report['torch']}"]
    ucx = report["ucx"]
    if "error" in ucx:
        lines.append(f"UCX: unusable: {ucx['error']}")
    else:
        lines.append(f"UCX {ucx['version']}: {len(ucx['resources'])} transports")
        lines += [f"  {resource}" for resource in ucx["resources"]]
        lines.append(_other_hosts(ucx))
        if not ucx["tcp_user_timeout"]:
            lines.append("this UCX has no TCP user timeout: a link to another host cut during a "
                         "transfer fails its ops at the group timeout, not after "
                         "SMFREE_LINK_TIMEOUT_MS (the libucx-cu13 wheel's UCX has it)")
    scope = report["ptrace_scope"]
    if scope not in (None, "0"):
        lines.append(f"kernel.yama.ptrace_scope = {scope}: UCX's CMA and smfree's flag segments "
                     "need processes of one user to read each other's memory and descriptors")
    cuda = report["cuda"]
    if "error" in cuda:
        lines.append(f"CUDA: {cuda['error']}")
    else:
        lines.append(f"CUDA: {len(cuda['devices'])} devices")
        for device in cuda["devices"]:
            lines.append(f"  cuda:{device['index']} {device['name']}")
            lines += [f"    {name}: {value}" for name, value in device["attributes"].items()]
            peers = [str(j) for j, ok in enumerate(device["peer_access"]) if ok]
            lines.append(f"    peer access to: {', '.join(peers) if peers else 'none'}")
        has_peer = any(ok for device in cuda["devices"]
                       for j, ok in enumerate(device["peer_access"]) if j != device["index"])
        lines += shared_gpu(len(cuda["devices"]), has_peer,
                            os.environ.get("LOCAL_WORLD_SIZE"),
                            report["settings"].get("SMFREE_LOCAL_COPIES"))
    lines.append(_collectives(report["collectives_on_copy_engines"],
                              report.get("collective_min_bytes")))
    connections = report["settings"].get("CUDA_DEVICE_MAX_CONNECTIONS")
    if connections is not None:
        lines.append(f"CUDA_DEVICE_MAX_CONNECTIONS={connections}: streams share hardware queues; "
                     "smfree's stream waits are only for work already submitted, so this is safe "
                     "(docs/design.md, \"No stream waits for the future\")")
    lines.append("settings: " + (", ".join(f"{k}={v}" for k, v in report["settings"].items())
                                 or "none"))
    return "\n".join(lines)


def shared_gpu(gpus: int, has_peer: bool, local_ranks: str | None,
               local_copies: str | None) -> list[str]:
    """Where ranks would share a GPU (one GPU, or fewer than torchrun's LOCAL_WORLD_SIZE): how
    their copies to each other run, under SMFREE_LOCAL_COPIES, and which setting is faster."""
    ranks = int(local_ranks) if local_ranks and local_ranks.isdigit() else None
    if gpus < 1 or (gpus > 1 and (ranks is None or ranks <= gpus)):
        return []
    why = (f"{ranks} ranks (LOCAL_WORLD_SIZE) on {gpus} GPUs" if ranks and ranks > gpus
           else "one GPU")
    lines = [f"ranks sharing a GPU ({why}): a copy between two of them stays within that GPU; "
             "NCCL refuses two ranks on one GPU, so what smfree hands to NCCL (reductions, "
             "collectives off the copy engines) fails there"]
    way = local_copies or "peer_gpu"
    if way == "peer_gpu" and has_peer:
        lines.append("  SMFREE_LOCAL_COPIES=peer_gpu: bounced through a peer GPU's memory (two "
                     "copy-engine hops over NVLink, no SM)")
    elif way in ("peer_gpu", "host"):
        through = ("no other GPU is reachable, so " if way == "peer_gpu" else "")
        lines.append(f"  SMFREE_LOCAL_COPIES={way}: {through}bounced through pinned host memory "
                     "(two copy-engine hops over PCIe, no SM)")
    elif way == "driver":
        lines.append("  SMFREE_LOCAL_COPIES=driver: one copy within the GPU, which the driver "
                     "runs on SMs: it waits for compute kernels that hold them")
    else:
        lines.append(f"  SMFREE_LOCAL_COPIES={way} is not one of driver, peer_gpu, host")
        return lines
    if way == "driver":
        lines.append("  the fastest for large messages; SMFREE_LOCAL_COPIES=peer_gpu (the "
                     "default) keeps these copies off the SMs, at two hops each")
    else:
        lines.append("  faster: SMFREE_LOCAL_COPIES=driver (one copy at the GPU's own "
                     "bandwidth, but on SMs); measure both with python -m smfree_pg.bench "
                     "--only shared_gpu")
    return lines


def _collectives(names, min_bytes: int | None) -> str:
    if isinstance(names, dict):
        return f"collectives: {names['error']}"
    if not names:
        return "collectives: all go to NCCL (SMFREE_COLLECTIVES=off)"
    return (f"collectives on the copy engines, for CUDA tensors of ranks of one host: "
            f"{', '.join(names)} (SMFREE_COLLECTIVES), from pieces of {min_bytes} B "
            "(SMFREE_COLLECTIVE_MIN_BYTES); smaller ones, reductions and the rest go to NCCL")


def _other_hosts(ucx: dict) -> str:
    """How CUDA tensors would reach ranks on other hosts, from the network transports here."""
    transports = {resource.split("/")[0] for resource in ucx["resources"]}
    rdma = sorted(t for t in transports if t.startswith(RDMA))
    if rdma:
        return (f"CUDA tensors to other hosts: UCX over RDMA ({', '.join(rdma)}); it reads GPU "
                "memory directly where nvidia-peermem or DMA-BUF is available")
    version = tuple(int(part) for part in ucx["version"].split(".")[:2])
    if version < (1, 14):
        return ("CUDA tensors to other hosts: UCX has only TCP here, and UCX before 1.14 cannot "
                "list an endpoint's transports, so smfree hands them to UCX unstaged (slower; "
                "docs/design.md, \"CUDA over TCP\")")
    return ("CUDA tensors to other hosts: UCX has only TCP here, so smfree stages them through "
            "pinned host memory (docs/design.md, \"CUDA over TCP\")")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    problem = _linkage_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if "error" not in report["ucx"] else 1


if __name__ == "__main__":
    sys.exit(main())
