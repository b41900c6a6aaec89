"""`python -m smfree_pg.doctor` reports UCX, GPUs and settings."""

import json
import os
import subprocess
import sys

import torch

from smfree_pg.doctor import RDMA


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
