"""smfree: a torch.distributed backend whose point-to-point ops run on the GPU's copy engines.

Importing this package registers backend "smfree"; with torch >= 2.5 the installed entry point
does it at `import torch` already.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smfree_pg._registration import BACKEND_NAME, extension, register

__version__ = "0.1.0"
__all__ = ["BACKEND_NAME", "register", "dump_pending"]

register()


def dump_pending(group: dist.ProcessGroup | None = None) -> str:
    """The point-to-point ops of `group` (default: WORLD) that have not finished, one per line."""
    _C = extension()
    group = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except RuntimeError:
            continue
        if isinstance(backend, _C.SmFreeBackend):
            return backend.dump_pending()
    raise ValueError("smfree: this group does not use the smfree backend")
