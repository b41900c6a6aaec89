"""Emulated hosts on one machine, for tests of smfree between hosts.

Each host is a network namespace with an interface `eth0` joined to a bridge in a switch
namespace; its ranks run in their own UTS namespace under the host's hostname, so smfree sees
another host (another hostname) that it reaches over TCP only. Ranks get torchrun's environment
(MASTER_ADDR is host 0's address; rank 0 serves the store). Faults are injected from outside:
the host's interface or its port on the switch goes down (link flap, cut), is shaped with `tc tbf` (slow
link), or the host's ranks are killed. Everything is torn down on exit, also after a failure
or a timeout: the ranks (every process left in the namespaces is killed), the namespaces and
with them their interfaces.

Addresses are from 10.77.0.0/24 and exist only inside these namespaces. Names start with
`smf` and the test process's pid, so that concurrent runs do not collide.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

SUBNET = "10.77.0"
STORE_PORT = 29500
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank.py")
_runs = itertools.count()
_unavailable: list[str | None] = []


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None where they can (checked once)."""
    if not _unavailable:
        _unavailable.append(_probe())
    return _unavailable[0]


def _probe() -> str | None:
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    name = f"smf{os.getpid()}probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        pair = _ip("-n", name, "link", "add", "a0", "type", "veth", "peer", "name", "b0",
                   check=False)
        if pair.returncode != 0:
            return f"cannot make a veth pair: {pair.stderr.strip()}"
        uts = subprocess.run(["ip", "netns", "exec", name, "unshare", "--uts", "hostname", "x"],
                             capture_output=True, text=True)
        if uts.returncode != 0:
            return f"cannot set a hostname in a UTS namespace: {uts.stderr.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


@dataclass
class RankResult:
    rank: int
    host: int
    value: object = None
    error: str | None = None
    exit_code: int | None = None
    log: str = ""


@dataclass
class Job:
    """The ranks of one launch, spread over the hosts."""

    hosts: Hosts
    procs: dict[int, subprocess.Popen]
    host_of: dict[int, int]
    workdir: str

    def progress(self, rank: int) -> int:
        """The count a rank last reported with `report_progress` (0 before the first)."""
        try:
            with open(os.path.join(self.workdir, f"progress.{rank}")) as f:
                return int(f.read() or 0)
        except (OSError, ValueError):
            return 0

    def wait_progress(self, rank: int, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.progress(rank) < count:
            if self.procs[rank].poll() is not None:
                raise AssertionError(f"rank {rank} exited before reporting {count}:\n"
                                     f"{self._log(rank)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"rank {rank} did not report {count} within {timeout} s "
                                     f"(at {self.progress(rank)})")
            time.sleep(0.02)

    def wait_all_progress(self, count: int, timeout: float = 60) -> None:
        """Every rank has reported `count`: all have joined and reached their peers, so a fault
        injected now meets every pair mid-stream."""
        for rank in self.procs:
            self.wait_progress(rank, count, timeout)

    def kill_host(self, host: int) -> float:
        """SIGKILLs every rank of `host`; returns when (time.time())."""
        when = time.time()
        for rank, proc in self.procs.items():
            if self.host_of[rank] == host:
                proc.kill()
        return when

    def results(self, timeout: float) -> list[RankResult]:
        """Each rank's result, in rank order, once every rank has exited. Ranks still running
        after `timeout` dump their Python stacks into their logs, are killed, and fail the test
        with those logs."""
        deadline = time.monotonic() + timeout
        hung = []
        for rank, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(rank)
        if hung:
            for rank in hung:
                self.procs[rank].send_signal(signal.SIGUSR1)
            time.sleep(1)
            for rank in hung:
                self.procs[rank].kill()
                self.procs[rank].wait()
            logs = "\n".join(f"--- rank {r} log:\n{self._log(r)}" for r in hung)
            raise AssertionError(f"ranks {hung} did not exit within {timeout} s (killed)\n{logs}")
        return [self._result(rank) for rank in sorted(self.procs)]

    def values(self, timeout: float) -> list:
        """Each rank's return value; any rank that raised or died fails the test."""
        results = self.results(timeout)
        failed = [r for r in results if r.error or r.exit_code != 0]
        if failed:
            raise AssertionError("\n".join(
                f"--- rank {r.rank} (host {r.host}, exit {r.exit_code}):\n{r.error or ''}\n"
                f"{r.log}" for r in failed))
        return [r.value for r in results]

    def _result(self, rank: int) -> RankResult:
        result = RankResult(rank, self.host_of[rank], exit_code=self.procs[rank].returncode,
                            log=self._log(rank))
        try:
            with open(os.path.join(self.workdir, f"result.{rank}")) as f:
                saved = json.load(f)
            result.value, result.error = saved.get("value"), saved.get("error")
        except (OSError, ValueError):
            result.error = result.error or "no result (the rank died)"
        return result

    def _log(self, rank: int) -> str:
        try:
            with open(os.path.join(self.workdir, f"log.{rank}")) as f:
                return f.read()[-6000:]
        except OSError:
            return ""


class Hosts:
    """`count` emulated hosts; a context manager that tears everything down on exit."""

    def __init__(self, count: int):
        self.count = count
        self.prefix = f"smf{os.getpid()}r{next(_runs)}"
        self.switch = f"{self.prefix}sw"
        self.namespaces = [f"{self.prefix}h{i}" for i in range(count)]
        self.hostnames = [f"{self.prefix}-host{i}" for i in range(count)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]
        self.workdir = tempfile.mkdtemp(prefix=f"{self.prefix}-")
        self.jobs: list[Job] = []
        self._made: list[str] = []

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        for ns in [self.switch, *self.namespaces]:
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            port = self.port(i)
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    @staticmethod
    def port(host: int) -> str:
        """The switch's side of the host's link."""
        return f"p{host}"

    def close(self) -> None:
        for job in self.jobs:
            for proc in job.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for ns in self._made:
            for pid in self.pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    @staticmethod
    def pids(ns: str) -> list[int]:
        """Processes running in a namespace (`ip netns pids`)."""
        out = _ip("netns", "pids", ns, check=False).stdout
        return [int(p) for p in out.split()]

    def leftover_processes(self) -> list[int]:
        return [pid for ns in self.namespaces for pid in self.pids(ns)]

    # ------------------------------------------------------------------ faults

    LINK_ENDS = ("host", "switch", "both")

    def link_down(self, host: int, end: str = "both") -> float:
        """Takes the host's link down at `end`: the host's own interface (a NIC failing on one
        side), the switch's port, or both; returns when (time.time())."""
        assert end in self.LINK_ENDS, end
        when = time.time()
        if end in ("switch", "both"):
            _ip("-n", self.switch, "link", "set", self.port(host), "down")
        if end in ("host", "both"):
            _ip("-n", self.namespaces[host], "link", "set", "eth0", "down")
        return when

    def link_up(self, host: int) -> None:
        _ip("-n", self.namespaces[host], "link", "set", "eth0", "up")
        _ip("-n", self.switch, "link", "set", self.port(host), "up")

    def slow_link(self, host: int, rate: str) -> None:
        """Shapes both directions of the host's link to `rate` (as `tc` spells it: 200mbit)."""
        for ns, dev in ((self.switch, self.port(host)), (self.namespaces[host], "eth0")):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                            "tbf", "rate", rate, "burst", "256kb", "latency", "400ms"],
                           check=True, capture_output=True, text=True)

    # ------------------------------------------------------------------ ranks

    def launch(self, fn, ranks_per_host: int | list[int], *args, group_timeout_s: float = 30,
               env: dict | None = None, host_env: dict[int, dict] | None = None,
               destroy_group: bool = True) -> Job:
        """Starts `fn(rank, world_size, *args)` (a function of a module in this folder) on
        each rank. Ranks are numbered host by host: host 0 has ranks 0..k-1. Each runs
        `init_process_group("smfree")` from torchrun's environment variables first, and
        `destroy_process_group()` after `fn` returns (unless not `destroy_group`: then the
        interpreter exits with the group open)."""
        per_host = (ranks_per_host if isinstance(ranks_per_host, list)
                    else [ranks_per_host] * self.count)
        world = sum(per_host)
        workdir = tempfile.mkdtemp(dir=self.workdir)
        procs, host_of = {}, {}
        # smfree chooses each peer's transport itself, as between real hosts.
        inherited = {k: v for k, v in os.environ.items() if k != "SMFREE_CHANNEL"}
        rank = 0
        for host, local_count in enumerate(per_host):
            for local_rank in range(local_count):
                rank_env = {
                    **inherited,
                    "MASTER_ADDR": self.addresses[0],
                    "MASTER_PORT": str(STORE_PORT),
                    "WORLD_SIZE": str(world),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local_rank),
                    "LOCAL_WORLD_SIZE": str(local_count),
                    "GROUP_RANK": str(host),
                    "ROLE_RANK": str(rank),
                    "ROLE_WORLD_SIZE": str(world),
                    "SMFREE_LOG_LEVEL": "warn",
                    **(env or {}),
                    **(host_env or {}).get(host, {}),
                }
                spec = json.dumps({"module": fn.__module__, "function": fn.__name__,
                                   "args": list(args), "group_timeout_s": group_timeout_s,
                                   "workdir": workdir, "destroy_group": destroy_group})
                log = open(os.path.join(workdir, f"log.{rank}"), "w")  # noqa: SIM115
                procs[rank] = subprocess.Popen(
                    ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts",
                     "sh", "-c", 'hostname "$0" && exec "$@"', self.hostnames[host],
                     sys.executable, RANK_SCRIPT, spec],
                    env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)
                log.close()
                host_of[rank] = host
                rank += 1
        job = Job(self, procs, host_of, workdir)
        self.jobs.append(job)
        return job
