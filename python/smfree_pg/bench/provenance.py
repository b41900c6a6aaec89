"""How a report was made: the record every JSON report of the bench and the examples carries.

`provenance(command)` returns an object with the fields docs/benchmarks.md's reports must have
(tests/test_docs.py checks them): the package version and commit, the SMFREE_* settings in
effect, torch, NCCL, UCX, the GPU driver and the command. A field that cannot be known here is
left out and named in "absent" with the reason, never guessed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

import smfree_pg

FIELDS = ("smfree", "commit", "settings", "torch", "nccl", "ucx", "driver", "command")


def ucx_version() -> str | None:
    """Where smfree's UCX comes from: the libucx wheel's version, or UCX_HOME."""
    wheels = sorted(f"{d.metadata['Name']} {d.version}" for d in metadata.distributions()
                    if (d.metadata["Name"] or "").lower().startswith("libucx"))
    if wheels:
        return ", ".join(wheels)
    return f"UCX_HOME={os.environ['UCX_HOME']}" if "UCX_HOME" in os.environ else None


def nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def git_commit() -> tuple[str | None, bool | None]:
    """The commit of the checkout the package runs from, and whether its tree had changes."""
    package = Path(smfree_pg.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(package), *args], capture_output=True,
                                  text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    # Only smfree's own checkout: a wheel installed in a venv inside another repository is not.
    top = git("rev-parse", "--show-toplevel")
    if top is None or (Path(top) / "python" / "smfree_pg").resolve() != package:
        return None, None
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else status == ""


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version (580.159, say), not CUDA's API number."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        text = ""
    found = re.search(r"Kernel Module(?: for [\w-]+)?\s+([\d.]+)", text)
    if found:
        return found.group(1)
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


def launch_command() -> str:
    """This process's command line; under torchrun, torchrun's with its ranks per node."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        ranks = os.environ.get("LOCAL_WORLD_SIZE", "?")
        return shlex.join(["torchrun", f"--nproc-per-node={ranks}", *sys.argv])
    return shlex.join([Path(sys.executable).name, *sys.argv])


def provenance(command: str | None = None) -> dict:
    """The record for a report written now; `command` defaults to this process's argv."""
    commit, clean = git_commit()
    record = {
        "smfree": smfree_pg.__version__,
        "commit": commit,
        "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SMFREE_")},
        "torch": torch.__version__,
        "nccl": nccl_version(),
        "ucx": ucx_version(),
        "driver": driver_version(),
        "command": command or launch_command(),
    }
    reasons = {
        "commit": "the package does not run from a git checkout of smfree",
        "nccl": "torch has no CUDA here",
        "ucx": "no libucx wheel and no UCX_HOME",
        "driver": "no NVIDIA driver here",
    }
    absent = {field: reasons[field] for field in reasons if record[field] is None}
    record = {k: v for k, v in record.items() if v is not None}
    if clean is not None:
        record["worktree_clean"] = clean
    if absent:
        record["absent"] = absent
    return record
