"""The README's demo (examples/p2p_demo.py): where its ranks run, and one short run."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "examples", "p2p_demo.py")


def load_demo():
    spec = importlib.util.spec_from_file_location("p2p_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gpus, local_rank, local_ranks, expected", [
    (2, 1, 2, torch.device("cuda", 1)),
    (8, 3, 4, torch.device("cuda", 3)),
    (1, 0, 1, torch.device("cuda", 0)),
    (0, 1, 2, torch.device("cpu")),
])
def test_a_rank_gets_its_own_gpu_or_the_cpu_without_a_note(gpus, local_rank, local_ranks,
                                                            expected):
    assert load_demo().choose_device(gpus, local_rank, local_ranks) == (expected, "")


def test_one_gpu_for_two_ranks_runs_on_cpu_and_says_why():
    device, note = load_demo().choose_device(1, 1, 2)
    assert device == torch.device("cpu")
    assert "1 GPU for 2 ranks" in note and "CPU" in note


def test_more_ranks_than_gpus_is_refused_with_the_count_to_use():
    with pytest.raises(SystemExit, match="4 ranks on this host but 2 GPUs.*--nproc-per-node=2"):
        load_demo().choose_device(2, 0, 4)


def test_a_start_without_torchrun_is_refused_with_the_command_to_use():
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    run = subprocess.run([sys.executable, DEMO], capture_output=True, text=True, timeout=60,
                         env=dict(env, TORCH_DEVICE_BACKEND_AUTOLOAD="0"), cwd=ROOT)
    assert run.returncode == 1
    assert "start it with torchrun, e.g. torchrun --nproc-per-node=2" in run.stderr, run.stderr


def test_two_rank_run_prints_both_backends_on_checked_data(tmp_path):
    out = tmp_path / "demo.json"
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--standalone", DEMO, "--sizes", "4K,1M", "--iters", "2", "--warmup", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=180, env=env, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    reference = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    report = json.loads(out.read_text())
    assert report["reference"] == reference
    assert [row["bytes"] for row in report["rows"]] == [4096, 1 << 20]
    for row in report["rows"]:
        for backend in (reference, "smfree"):
            assert row[backend]["us"] > 0
            assert row[backend]["GBps"] == pytest.approx(row["bytes"] / row[backend]["us"] / 1e3)
    assert f"smfree GB/s / {reference} GB/s" in run.stdout
