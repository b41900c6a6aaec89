"""The bench where ranks share a GPU: which ranks go where (cli.plan_ranks), and the shared_gpu
section's figures and table."""

import pytest

from smfree_pg.bench.cli import parse_args, plan_ranks
from smfree_pg.bench.floors import FLOORS
from smfree_pg.bench.sections import SECTIONS
from smfree_pg.bench.shared_gpu import print_section, summarize_row


def plan(argv, gpus, ranks=None):
    args = parse_args(SECTIONS, "bench", argv)
    nproc, shared = plan_ranks(args, SECTIONS, gpus, ranks)
    return nproc, shared, args.only


def test_one_gpu_runs_the_sections_that_share_it_by_default():
    assert plan([], gpus=1) == (2, True, ["shared_gpu"])


def test_a_gpu_per_rank_leaves_the_shared_gpu_section_out_by_default():
    nproc, shared, only = plan([], gpus=4)
    assert (nproc, shared) == (4, False)
    assert "shared_gpu" not in only and "bandwidth" in only and "starvation" in only


def test_the_shared_gpu_section_puts_two_ranks_on_one_gpu_of_many():
    assert plan(["--only", "shared_gpu"], gpus=8) == (2, True, ["shared_gpu"])


def test_more_ranks_than_gpus_share_them():
    assert plan(["--only", "shared_gpu"], gpus=2, ranks=3) == (3, True, ["shared_gpu"])


def test_sections_that_need_a_gpu_per_rank_are_refused_on_one_gpu_naming_what_runs(capsys):
    with pytest.raises(SystemExit, match=r"bandwidth, starvation need a GPU per rank; with 1 "
                                         r"GPU\(s\) for 2 ranks run --only shared_gpu"):
        plan(["--only", "bandwidth,starvation"], gpus=1)


def test_the_shared_gpu_section_with_one_that_needs_a_gpu_per_rank_is_refused():
    with pytest.raises(SystemExit, match="shared_gpu put every rank on one GPU and roundtrip "
                                         "need a GPU per rank: run them apart"):
        plan(["--only", "roundtrip,shared_gpu"], gpus=2)


def test_no_gpu_is_refused():
    with pytest.raises(SystemExit, match="needs a CUDA GPU, found none"):
        plan(["--only", "shared_gpu"], gpus=0)


def test_shared_gpu_options_are_checked(capsys):
    args = parse_args(SECTIONS, "bench", ["--shared-gpu-sizes", "4K,1M", "--shared-gpu-reps",
                                          "3"])
    assert (args.shared_gpu_sizes, args.shared_gpu_reps) == ([4096, 1 << 20], 3)
    for bad in (["--shared-gpu-reps", "0"], ["--shared-gpu-iters", "0"],
                ["--shared-gpu-warmup", "-1"], ["--shared-gpu-sizes", "3"]):
        with pytest.raises(SystemExit):
            parse_args(SECTIONS, "bench", bad)
    assert "--shared-gpu-reps must be at least 1" in capsys.readouterr().err


def row():
    # Loop by loop the slower rank counts: 30, 40, 20 µs; the floors 10, 20 and 5 µs.
    per_rank = [[30e-6, 10e-6, 20e-6], [10e-6, 40e-6, 15e-6]]
    floors = {"d2h_h2d": [10e-6, 12e-6, 8e-6], "d2h_h2d_overlapped": [20e-6, 20e-6, 20e-6],
              "device_local": [5e-6, 4e-6, 6e-6]}
    return summarize_row(1 << 20, 7, per_rank, floors)


def test_a_row_takes_the_slower_rank_per_loop_and_divides_by_each_floor():
    figures = row()
    assert figures["bytes"] == 1 << 20 and figures["iters"] == 7
    assert figures["exchange_us"]["median"] == pytest.approx(30.0)
    assert figures["exchange_us"]["min"] == pytest.approx(20.0)
    assert figures["exchange_us"]["max"] == pytest.approx(40.0)
    assert {name: f["median"] for name, f in figures["floors_us"].items()} == pytest.approx(
        {"d2h_h2d": 10.0, "d2h_h2d_overlapped": 20.0, "device_local": 5.0})
    assert figures["over_floor"] == pytest.approx(
        {"d2h_h2d": 3.0, "d2h_h2d_overlapped": 1.5, "device_local": 6.0})


def test_the_table_shows_each_size_beside_every_floor_and_the_settings(capsys):
    print_section({"device": 0, "settings": {"SMFREE_LOCAL_COPIES": "driver"},
                   "floors": FLOORS, "rows": [row()]})
    out = capsys.readouterr().out
    assert "SMFREE_LOCAL_COPIES=driver" in out and "NCCL refuses two ranks on one GPU" in out
    line = next(text for text in out.splitlines() if text.strip().startswith("1 MiB"))
    cells = [cell.strip() for cell in line.split("|")]
    assert cells == ["1 MiB", "30.0 (25.0-35.0)", "10.0", "3.00", "20.0", "1.50", "5.0", "6.00"]
    assert all(what in out for what in FLOORS.values())


def test_the_table_says_defaults_where_no_setting_is_given(capsys):
    print_section({"device": 0, "settings": {}, "floors": FLOORS, "rows": [row()]})
    assert "smfree under the defaults" in capsys.readouterr().out
