"""examples/fsdp2.py on CPU: FSDP2 trains over smfree's group as over Gloo's, bit for bit."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "fsdp2.py")


def test_fsdp2_over_smfree_matches_gloo_bitwise_and_times_its_all_gathers(tmp_path):
    out = tmp_path / "fsdp2.json"
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
         EXAMPLE, "--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4",
         "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "CPU" and report["world_size"] == 2
    (result,) = report["rounds"]
    assert result["losses_equal"] and result["params_equal"], result
    smfree, gloo = result["smfree"], result["gloo"]
    assert len(smfree["losses_by_rank"]) == 2 and len(smfree["losses_by_rank"][0]) == 3
    # CPU tensors: every collective of smfree's group goes to the Gloo it wraps.
    assert smfree["collectives_on_copy_engines"] == 0
    # Forward gathers the root and both blocks, backward the blocks again (the root stays).
    assert smfree["all_gathers_per_step"] == gloo["all_gathers_per_step"] == 5
    assert smfree["all_gather_cpu_ms_per_step"] > 0 and gloo["all_gather_cpu_ms_per_step"] > 0
    assert "smfree/gloo" in run.stdout and "their CPU ms" in run.stdout
