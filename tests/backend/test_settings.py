"""Defaults the engine chooses from its environment, seen in its info log."""

import os
import subprocess
import sys

import pytest

ONE_RANK = """
import tempfile, torch.distributed as dist, smfree_pg
with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("smfree", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    dist.destroy_process_group()
"""
# Two ranks on two CPUs (each pinned to the same two), without a launcher's LOCAL_WORLD_SIZE, as
# under torch.multiprocessing.spawn: each alone has a CPU per polling thread, and learns of the
# other when they connect.
PINNED_PAIR = """
import os, sys, torch, torch.distributed as dist, smfree_pg
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("smfree", init_method=f"file://{store}", rank=rank, world_size=2)
tensor = torch.full((4,), float(rank))
if rank == 0:
    dist.send(tensor, 1)
else:
    dist.recv(tensor, 0)
    assert tensor.tolist() == [0.0] * 4, tensor
dist.destroy_process_group()
"""
SPIN_NOTE = "the engine's threads sleep between events instead of spinning"


def engine_log(**env):
    result = subprocess.run([sys.executable, "-c", ONE_RANK], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, SMFREE_LOG_LEVEL="info", **env))
    assert result.returncode == 0, result.stderr
    assert "engine started" in result.stderr, result.stderr
    return result.stderr


def refused(**env):
    """A one-rank init under `env` that must fail; its completed process."""
    result = subprocess.run([sys.executable, "-c", ONE_RANK], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, **env))
    assert result.returncode != 0, result.stderr
    return result


def test_no_spinning_where_the_ranks_polling_threads_outnumber_the_cpus():
    cpus = len(os.sched_getaffinity(0))
    ranks = cpus // 2 + 1
    log = engine_log(LOCAL_WORLD_SIZE=str(ranks))
    assert (f"SMFREE_SPIN_US unset and {ranks} ranks on this host (LOCAL_WORLD_SIZE), two "
            f"polling threads each, share {cpus} CPUs: {SPIN_NOTE}") in log, log


def pinned_pair_logs(tmp_path, **env):
    env = dict(os.environ, SMFREE_LOG_LEVEL="info", **env)
    env.pop("LOCAL_WORLD_SIZE", None)
    ranks = [subprocess.Popen([sys.executable, "-c", PINNED_PAIR, str(rank), str(tmp_path / "store")],
                              stderr=subprocess.PIPE, text=True, env=env) for rank in range(2)]
    logs = []
    for rank in ranks:
        try:
            _, log = rank.communicate(timeout=120)
        finally:
            rank.kill()
        assert rank.returncode == 0, log
        logs.append(log)
    return logs


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins each rank to 2 CPUs")
def test_no_spinning_once_connected_peers_show_the_cpus_outnumbered(tmp_path):
    for log in pinned_pair_logs(tmp_path, SMFREE_SPIN_US=""):
        assert ("SMFREE_SPIN_US unset and 2 ranks on this host (LOCAL_WORLD_SIZE unset; counted "
                f"from the peers connected), two polling threads each, share 2 CPUs: {SPIN_NOTE}"
                ) in log, log
        assert "1 rank on this host" not in log, log


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins each rank to 2 CPUs")
def test_spinning_on_a_crowded_host_where_the_user_chose(tmp_path):
    for log in pinned_pair_logs(tmp_path, SMFREE_SPIN_US="10000"):
        assert "engine started" in log and SPIN_NOTE not in log, log


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one rank's two threads need 2 CPUs")
@pytest.mark.parametrize("env", [{"LOCAL_WORLD_SIZE": "1"},
                                 {"LOCAL_WORLD_SIZE": "100000", "SMFREE_SPIN_US": "10000"}])
def test_spinning_where_each_polling_thread_has_a_cpu_or_the_user_chose(env):
    assert SPIN_NOTE not in engine_log(**env)


@pytest.mark.parametrize("name", ["SMFREE_RELAY_PIECE_BYTES", "SMFREE_STAGING_BYTES",
                                  "SMFREE_EAGER_BYTES", "SMFREE_SPIN_US",
                                  "SMFREE_EXIT_TIMEOUT_MS", "SMFREE_RING_MEMORY_BYTES"])
@pytest.mark.parametrize("value", ["4M", "-1"])
def test_a_size_that_is_not_a_count_of_bytes_is_refused_by_name(name, value):
    result = refused(**{name: value})
    assert f"{name}='{value}' is not a non-negative integer" in result.stderr, result.stderr


def test_local_copies_other_than_the_three_ways_are_refused():
    result = refused(SMFREE_LOCAL_COPIES="sm")
    assert "SMFREE_LOCAL_COPIES='sm' is not one of driver, peer_gpu, host" in result.stderr, \
        result.stderr


@pytest.mark.parametrize("value,way", [("", "two copy-engine hops through a peer GPU's memory"),
                                       ("driver", "the driver's copies"),
                                       ("host", "two copy-engine hops through pinned host memory")])
def test_the_way_copies_within_one_gpu_run_is_logged(value, way):
    assert f"copies within one GPU: {way}" in engine_log(SMFREE_LOCAL_COPIES=value)


@pytest.mark.parametrize("value", ["0", "3841"])
def test_cuda_ops_in_flight_outside_their_range_are_refused(value):
    result = refused(SMFREE_MAX_CUDA_OPS=value)
    assert "SMFREE_MAX_CUDA_OPS must be between 1 and 3840" in result.stderr, result.stderr


@pytest.mark.parametrize("value,why", [("2", "must be 0 (off) or 1 (on)"),
                                       ("on", "is not a non-negative integer")])
def test_collective_lanes_other_than_0_or_1_are_refused(value, why):
    result = refused(SMFREE_COLLECTIVE_LANES=value)
    assert "SMFREE_COLLECTIVE_LANES" in result.stderr and why in result.stderr, result.stderr
