"""One rank of a multi-host test, started by hosts.Hosts.launch inside a namespace host.

Argument: a JSON spec naming a function of a module in this folder. The rank joins the
process group from torchrun's environment variables, calls `fn(rank, world_size, *args)`, and
writes `{"value": ...}` or `{"error": traceback}` to `result.<rank>` in the spec's folder, then ends the group (unless the
spec says not to) and exits at once.
SIGUSR1 dumps its Python stacks to its log (a test that times out asks for them).
"""

import datetime
import faulthandler
import importlib
import json
import os
import signal
import sys
import traceback


def main() -> int:
    spec = json.loads(sys.argv[1])
    faulthandler.enable(all_threads=True)  # a crash shows where
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ["MULTIHOST_WORKDIR"] = spec["workdir"]
    rank = int(os.environ["RANK"])
    out = os.path.join(spec["workdir"], f"result.{rank}")
    import torch.distributed as dist

    import smfree_pg  # noqa: F401  (registers the backend)

    try:
        fn = getattr(importlib.import_module(spec["module"]), spec["function"])
        dist.init_process_group(
            "smfree", timeout=datetime.timedelta(seconds=spec["group_timeout_s"]))
        value = fn(rank, dist.get_world_size(), *spec["args"])
        saved = {"value": value}
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        saved = {"error": traceback.format_exc()}
    with open(out + ".tmp", "w") as f:
        json.dump(saved, f)
    os.replace(out + ".tmp", out)
    if "error" in saved:
        return 1
    if spec["destroy_group"]:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
