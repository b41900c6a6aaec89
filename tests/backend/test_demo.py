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


def test_one_gpu_is_shared_by_the_ranks_and_says_there_is_no_nccl_reference():
    for local_rank in (0, 1):
        device, note = load_demo().choose_device(1, local_rank, 2)
        assert device == torch.device("cuda", 0)
        assert "1 GPU for 2 ranks on this host: they share it" in note
        assert "NCCL refuses two ranks on one GPU" in note and "copy floors" in note


FLOOR_NAMES = {"d2h_h2d", "d2h_h2d_overlapped", "device_local"}


def test_without_a_reference_each_size_stands_beside_the_copy_floors(capsys):
    demo = load_demo()
    smfree = demo.figures(1 << 20, [30e-6, 20e-6, 40e-6])
    assert smfree["us"] == pytest.approx(30.0) and smfree["GBps"] == pytest.approx(
        (1 << 20) / 30e-6 / 1e9)
    samples = {"d2h_h2d": [10e-6, 12e-6, 8e-6], "d2h_h2d_overlapped": [20e-6] * 3,
               "device_local": [5e-6, 4e-6, 6e-6]}
    row = {"bytes": 1 << 20, "iters": 2, "repeats": 3, "smfree": smfree,
           **demo.floors_row(smfree, samples)}
    assert row["over_floor"] == pytest.approx(
        {"d2h_h2d": 3.0, "d2h_h2d_overlapped": 1.5, "device_local": 6.0})
    assert row["floors"]["d2h_h2d"] == pytest.approx({"us": 10.0, "us_min": 8.0, "us_max": 12.0})
    assert demo.floors_row(smfree, None) == {"floors": None, "over_floor": None}  # rank != 0
    demo.print_table([row], None, "header")
    out = capsys.readouterr().out
    line = next(text for text in out.splitlines() if text.strip().startswith("1 MiB"))
    assert [cell.strip() for cell in line.split("|")] == [
        "1 MiB", "30.0 (20.0-40.0)", f"{smfree['GBps']:.3f}", "10.0 (8.0-12.0)", "3.00",
        "20.0 (20.0-20.0)", "1.50", "5.0 (4.0-6.0)", "6.00"]
    assert "No NCCL reference: NCCL refuses two ranks on one GPU" in out


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
    gpus = torch.cuda.device_count()
    # One GPU: both ranks on it, smfree beside the copy floors (NCCL refuses to share a GPU).
    reference = None if gpus == 1 else "nccl" if gpus >= 2 else "gloo"
    report = json.loads(out.read_text())
    assert report["reference"] == reference
    assert [row["bytes"] for row in report["rows"]] == [4096, 1 << 20]
    for row in report["rows"]:
        for backend in ["smfree"] + ([reference] if reference else []):
            assert row[backend]["us"] > 0
            assert row[backend]["GBps"] == pytest.approx(row["bytes"] / row[backend]["us"] / 1e3)
        if reference is None:
            assert set(row["floors"]) == FLOOR_NAMES and all(
                floor["us"] > 0 for floor in row["floors"].values())
    if reference is None:
        assert "every rank on this one GPU" in run.stdout
        assert "No NCCL reference: NCCL refuses two ranks on one GPU" in run.stdout
    else:
        assert f"smfree GB/s / {reference} GB/s" in run.stdout
