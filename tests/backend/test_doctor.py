"""`python -m smfree_pg.doctor` reports UCX, GPUs and settings."""

import json
import os
import subprocess
import sys

import torch

from smfree_pg.doctor import RDMA, shared_gpu


def doctor(*args, env=None):
    return subprocess.run([sys.executable, "-m", "smfree_pg.doctor", *args], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, **(env or {})))


def test_json_report_has_ucx_transports_and_gpus():
    result = doctor("--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ucx"]["version"].count(".") >= 2
    assert "tcp/lo" in report["ucx"]["resources"]  # loopback is always there
    if torch.cuda.is_available():
        assert len(report["cuda"]["devices"]) == torch.cuda.device_count()
        assert "flush remote writes" in report["cuda"]["devices"][0]["attributes"]
    else:
        assert "libcuda" in report["cuda"]["error"] or report["cuda"].get("devices") == []


def test_text_report_explains_shared_hardware_queues():
    result = doctor(env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", "SMFREE_LOG_LEVEL": "info"})
    assert result.returncode == 0, result.stderr
    assert ("CUDA_DEVICE_MAX_CONNECTIONS=1: streams share hardware queues; smfree's stream waits "
            "are only for work already submitted, so this is safe") in result.stdout
    assert "SMFREE_LOG_LEVEL=info" in result.stdout


def test_text_report_says_how_cuda_tensors_reach_other_hosts():
    ucx = json.loads(doctor("--json").stdout)["ucx"]
    result = doctor()
    assert result.returncode == 0, result.stderr
    line = next(text for text in result.stdout.splitlines()
                if text.startswith("CUDA tensors to other hosts: "))
    if any(r.split("/")[0].startswith(RDMA) for r in ucx["resources"]):
        assert "UCX over RDMA (" in line
    elif tuple(int(part) for part in ucx["version"].split(".")[:2]) < (1, 14):
        assert "UCX has only TCP here" in line and "unstaged" in line
    else:
        assert "UCX has only TCP here, so smfree stages them through pinned host memory" in line


def test_text_report_says_whether_a_cut_link_is_noticed_after_the_link_timeout():
    # The wheel's UCX (1.22) has a TCP user timeout; Debian's 1.13 (CI's system UCX) has not.
    ucx = json.loads(doctor("--json").stdout)["ucx"]
    version = tuple(int(part) for part in ucx["version"].split(".")[:2])
    if version >= (1, 22):
        assert ucx["tcp_user_timeout"] is True
    if version <= (1, 13):
        assert ucx["tcp_user_timeout"] is False
    said = "this UCX has no TCP user timeout" in doctor().stdout
    assert said == (not ucx["tcp_user_timeout"])


def test_reports_which_collectives_run_on_the_copy_engines():
    report = json.loads(doctor("--json", env={"SMFREE_COLLECTIVES": "all_to_all,all_gather"})
                        .stdout)
    assert report["collectives_on_copy_engines"] == ["all_gather", "all_to_all"]
    result = doctor(env={"SMFREE_COLLECTIVE_MIN_BYTES": "4096"})
    assert ("collectives on the copy engines, for CUDA tensors of ranks of one host: all_gather "
            "(SMFREE_COLLECTIVES), from pieces of 4096 B") in result.stdout
    result = doctor(env={"SMFREE_COLLECTIVES": "off"})
    assert "collectives: all go to NCCL (SMFREE_COLLECTIVES=off)" in result.stdout
    result = doctor(env={"SMFREE_COLLECTIVES": "reduce"})
    assert "collectives: smfree: SMFREE_COLLECTIVES='reduce': 'reduce' is not one of" in \
        result.stdout


def test_says_how_ranks_sharing_one_gpu_copy_and_what_is_faster():
    lines = shared_gpu(1, False, None, None)
    assert lines[0].startswith("ranks sharing a GPU (one GPU): a copy between two of them stays "
                               "within that GPU; NCCL refuses two ranks on one GPU")
    assert ("SMFREE_LOCAL_COPIES=peer_gpu: no other GPU is reachable, so bounced through pinned "
            "host memory (two copy-engine hops over PCIe, no SM)") in lines[1]
    assert "faster: SMFREE_LOCAL_COPIES=driver" in lines[2] and "on SMs" in lines[2]
    assert "SMFREE_LOCAL_COPIES=host: bounced through pinned host memory" in \
        shared_gpu(1, False, "2", "host")[1]
    driver = shared_gpu(1, False, "2", "driver")
    assert "one copy within the GPU, which the driver runs on SMs" in driver[1]
    assert "SMFREE_LOCAL_COPIES=peer_gpu (the default) keeps these copies off the SMs" in driver[2]
    assert "is not one of driver, peer_gpu, host" in shared_gpu(1, False, None, "sm")[1]


def test_says_ranks_share_a_gpu_only_with_fewer_gpus_than_local_ranks():
    assert shared_gpu(0, False, "2", None) == []  # no GPU: nothing shared
    assert shared_gpu(2, True, "2", None) == []
    assert shared_gpu(2, True, None, None) == []
    more = shared_gpu(2, True, "4", None)
    assert "(4 ranks (LOCAL_WORLD_SIZE) on 2 GPUs)" in more[0]
    assert "bounced through a peer GPU's memory (two copy-engine hops over NVLink" in more[1]


def test_text_report_says_how_ranks_share_a_gpu_where_they_would():
    result = doctor(env={"LOCAL_WORLD_SIZE": "2"})
    assert result.returncode == 0, result.stderr
    said = "ranks sharing a GPU (" in result.stdout
    gpus = torch.cuda.device_count()
    assert said == (gpus == 1), result.stdout
