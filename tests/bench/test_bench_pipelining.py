"""The pipelining and round-trip sections: their arithmetic, and one short run on CPU."""

import json
import os
import subprocess
import sys

import pytest

from smfree_pg.bench.pipelining import SCHEDULES, compare, stage_indices, summarize
from smfree_pg.bench.provenance import FIELDS
from smfree_pg.bench.stats import paired_ratios, slowest, spread
from smfree_pg.bench.waits import summarize_waits


def test_spread_reports_median_quartiles_and_percentages():
    summary = spread([10.0, 11.0, 9.0, 10.0, 14.0])
    assert summary["median"] == 10.0
    assert (summary["p25"], summary["p75"]) == (10.0, 11.0)
    assert (summary["min"], summary["max"]) == (9.0, 14.0)
    assert summary["iqr_pct"] == pytest.approx(10.0)
    assert summary["range_pct"] == pytest.approx(50.0)
    assert spread([2.0])["iqr_pct"] == 0.0
    with pytest.raises(ValueError):
        spread([])


def test_paired_ratios_cancel_drift_between_rounds():
    # The machine slows by 20 % per round; smfree is 10 % faster than the reference in each.
    reference = [1.0, 1.2, 1.44]
    ours = [0.9 * r for r in reference]
    paired = paired_ratios(ours, reference)
    assert paired["ratios"] == pytest.approx([0.9, 0.9, 0.9])
    assert paired["median"] == pytest.approx(0.9)
    assert paired["iqr_pct"] == pytest.approx(0.0, abs=1e-9)


def test_slowest_takes_each_steps_last_rank():
    assert slowest([[1.0, 5.0, 2.0], [3.0, 4.0, 2.5]]) == [3.0, 5.0, 2.5]


def test_wait_summary_per_kind_and_step():
    summary = summarize_waits({"send": [1e-6, 3e-6], "recv": [2e-3]}, steps=2)
    assert summary["send"]["median_us"] == pytest.approx(2.0)
    assert summary["send"]["per_step"] == 1.0
    assert summary["recv"]["max_us"] == pytest.approx(2000.0)
    assert "send+recv" not in summary


def test_stage_placement_loops_and_v_shapes():
    assert [stage_indices(r, 2, 1, "loop") for r in range(2)] == [[0], [1]]
    assert [stage_indices(r, 4, 2, "loop") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_indices(r, 2, 2, "v") for r in range(2)] == [[0, 3], [1, 2]]


def test_compare_tells_identical_from_close():
    assert compare([1.0, 2.0], [1.0, 2.0]) == {"identical": True, "max_abs_diff": 0.0}
    assert compare([1.0, 2.0], [1.0, 2.5]) == {"identical": False, "max_abs_diff": 0.5}
    with pytest.raises(ValueError):
        compare([1.0], [1.0, 2.0])


def rank_samples(steps, waits, losses, gradients, posts=(5e-6,)):
    return {"step_s": steps, "wait_step_s": [sum(waits)] * len(steps),
            "post_step_s": [sum(posts)] * len(steps), "waits": {"recv": waits},
            "posts": {"send": list(posts)}, "losses": losses, "gradients": gradients}


def test_pipelining_row_from_two_ranks():
    # Two rounds of two steps; rank 1 is the slower in every step and holds the losses.
    smfree = [rank_samples([1.0, 1.0, 1.2, 1.2], [1e-4], None, [0.5], posts=[1e-5, 2e-5]),
              rank_samples([2.0, 2.0, 2.4, 2.4], [3e-4], [[1.0, 2.0]], [0.25], posts=[4e-5])]
    gloo = [rank_samples([4.0, 4.0, 4.8, 4.8], [1e-5], None, [0.5]),
            rank_samples([4.0, 4.0, 4.8, 4.8], [1e-5], [[1.0, 2.5]], [0.25])]
    per_rank = [{"smfree": s, "gloo": g} for s, g in zip(smfree, gloo)]
    row = summarize(per_rank, ("smfree", "gloo"), steps_per_round=2)
    assert row["smfree"]["step_ms"]["median"] == pytest.approx(2200.0)
    assert row["paired"]["ratios"] == pytest.approx([0.5, 0.5])
    assert row["ratio"] == pytest.approx(0.5)
    assert row["smfree"]["wait_us"]["recv"]["median_us"] == pytest.approx(200.0)
    assert row["smfree"]["wait_us"]["all"]["per_step"] == pytest.approx(2 / 8)
    # Posts are kept apart from waits: 1, 2 and 4 (x 10 µs) over 8 rank-steps.
    assert row["smfree"]["post_us"]["send"]["median_us"] == pytest.approx(20.0)
    assert row["smfree"]["post_us"]["all"]["per_step"] == pytest.approx(3 / 8)
    assert row["smfree"]["post_ms_per_step"]["median"] == pytest.approx(0.04)
    assert "recv" not in row["smfree"]["post_us"]
    assert row["losses"]["identical"] is False
    assert row["losses"]["max_abs_diff"] == pytest.approx(0.5)
    assert row["gradients"]["identical"] is True


def test_cpu_run_covers_every_schedule_and_backend(tmp_path):
    report_path = tmp_path / "bench.json"
    command = [sys.executable, "-m", "smfree_pg.bench", "--device", "cpu", "--nproc", "2",
               "--only", "pipelining,roundtrip", "--json", str(report_path),
               "--timeout-min", "1",
               "--pipelining-sizes", "1K", "--pipelining-hidden", "16",
               "--pipelining-microbatches", "4", "--pipelining-warmup", "1",
               "--pipelining-rounds", "2", "--pipelining-steps", "1",
               "--roundtrip-sizes", "4K,64K", "--roundtrip-iters", "3", "--roundtrip-reps", "2"]
    env = {**os.environ, "SMFREE_LOG_LEVEL": "info"}
    env.pop("SMFREE_SPIN_US", None)
    env.pop("LOCAL_WORLD_SIZE", None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    # The spawned ranks know, as torchrun's would, that two share the host: where their four
    # polling threads outnumber the CPUs, they do not spin.
    crowded = 2 * 2 > len(os.sched_getaffinity(0))
    assert ("2 ranks on this host (LOCAL_WORLD_SIZE)" in done.stderr) == crowded, done.stderr
    assert "Pipelining: torch.distributed.pipelining" in done.stdout
    assert "Round trip" in done.stdout
    report = json.loads(report_path.read_text())
    assert report["meta"]["device"] == "cpu"
    # How it was made: every field, or why it is absent (CPU torch: no NCCL, no driver).
    record = report["provenance"]
    assert record["settings"]["SMFREE_LOG_LEVEL"] == "info"
    assert all(name.startswith("SMFREE_") for name in record["settings"])
    assert "--only" in record["command"] and str(report_path) in record["command"]
    assert set(record.get("absent", {})) >= {"nccl", "driver"}
    for field in FIELDS:
        assert (field in record) != (field in record.get("absent", {})), field
    section = report["pipelining"]
    assert section["reference"] == "gloo"
    cells = {(row["stages"], row["schedule"], row["bytes"]) for row in section["rows"]}
    assert cells == {(2, name, 1024) for name in SCHEDULES}
    for row in section["rows"]:
        for backend in ("smfree", "gloo"):
            assert row[backend]["step_ms"]["n"] == 2
            assert row[backend]["step_ms"]["min"] > 0
            assert row[backend]["wait_us"]["all"]["waits"] > 0
            # Every kind of post the schedule made was timed posting and waiting.
            assert set(row[backend]["post_us"]) == set(row[backend]["wait_us"])
            assert row[backend]["post_us"]["all"]["waits"] > 0
        assert row["losses"]["identical"], row["losses"]
        assert row["gradients"]["identical"], row["gradients"]
        assert row["paired"]["median"] > 0
    rows = report["roundtrip"]["rows"]
    assert [row["bytes"] for row in rows] == [4096, 65536]
    for row in rows:
        for backend in ("smfree", "gloo"):
            assert row[backend]["us"]["min"] > 0
            assert set(row[backend]["wait_us"]) == {"send", "recv"}
            assert row[backend]["wait_us"]["send"]["waits"] == 2 * 3 * 2  # 2 ranks x 3 x 2 loops


def test_cpu_run_of_two_pipelines_side_by_side_counts_every_rank(tmp_path):
    report_path = tmp_path / "bench.json"
    command = [sys.executable, "-m", "smfree_pg.bench", "--device", "cpu", "--nproc", "4",
               "--only", "pipelining", "--json", str(report_path), "--timeout-min", "1",
               "--pipelining-stages", "2", "--pipelining-pipelines", "2",
               "--pipelining-schedules", "GPipe", "--pipelining-sizes", "1K",
               "--pipelining-hidden", "16", "--pipelining-microbatches", "4",
               "--pipelining-warmup", "1", "--pipelining-rounds", "2", "--pipelining-steps", "1"]
    env = {**os.environ}
    env.pop("LOCAL_WORLD_SIZE", None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 2 x 2 |    GPipe |" in done.stdout, done.stdout
    section = json.loads(report_path.read_text())["pipelining"]
    assert section["pipelines"] == 2
    [row] = section["rows"]
    assert (row["stages"], row["pipelines"]) == (2, 2)
    for backend in ("smfree", "gloo"):
        waits = row[backend]["wait_us"]["all"]
        # GPipe: each rank waits on 4 forward and 4 backward ops per step; all four ranks count.
        assert waits["per_step"] == 8
        assert waits["waits"] == 8 * row[backend]["step_ms"]["n"] * 4
    assert row["losses"]["identical"] and row["gradients"]["identical"]


def test_pipelines_side_by_side_must_fit_the_world():
    from types import SimpleNamespace

    from smfree_pg.bench.pipelining import stage_counts

    args = SimpleNamespace(pipelining_stages=None, pipelining_pipelines=2)
    assert stage_counts(args, world=8) == [2, 4]
    assert stage_counts(args, world=4) == [2]
    args.pipelining_stages = [4]
    with pytest.raises(ValueError, match=r"\[4\] x --pipelining-pipelines 2 need more ranks"):
        stage_counts(args, world=4)
