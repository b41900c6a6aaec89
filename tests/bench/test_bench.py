"""The benchmark's arithmetic (what it reports from the samples it took) and its command line."""

import argparse

import pytest

from smfree_pg.bench.overlap import summarize_overlap


def loops(*gemm_ms):
    return [{"gemm_ms": ms, "transfer_ms": 10.0, "covered": True} for ms in gemm_ms]


def test_paired_slowdown_cancels_drift_between_rounds():
    # The GPU slows by 10 % from round to round; traffic costs each loop 1 % of its own round.
    alone = [1.0, 1.1, 1.21]
    samples = {"alone": loops(*alone),
               "smfree": loops(*(ms * 1.01 for ms in alone)),
               "nccl": loops(*(ms * 1.05 for ms in alone))}
    summary = summarize_overlap(samples, n=1024, bytes_each_way=10**9)
    assert summary["smfree"]["paired_slowdown_pct"] == pytest.approx(1.0)
    assert summary["nccl"]["paired_slowdown_pct"] == pytest.approx(5.0)
    # The median-of-medians figure keeps its meaning: 1.111 ms against 1.1 ms.
    assert summary["smfree"]["slowdown_pct"] == pytest.approx(1.0)
    assert summary["smfree"]["transfer_GBps"] == pytest.approx(100.0)


def test_paired_slowdown_is_the_median_over_rounds():
    samples = {"alone": loops(1.0, 1.0, 1.0),
               "smfree": loops(1.02, 1.50, 1.00),  # one round disturbed
               "nccl": loops(1.1, 1.1, 1.1)}
    summary = summarize_overlap(samples, n=1024, bytes_each_way=10**9)
    assert summary["smfree"]["paired_slowdown_pct"] == pytest.approx(2.0)
    assert summary["nccl"]["paired_slowdown_pct"] == pytest.approx(10.0)


def test_cpu_runs_only_the_sections_that_run_there(capsys):
    from smfree_pg.bench.cli import parse_args
    from smfree_pg.bench.sections import SECTIONS

    description = "bench"
    assert parse_args(SECTIONS, description, ["--device", "cpu"]).only == ["pipelining",
                                                                          "roundtrip"]
    assert parse_args(SECTIONS, description, ["--only", "overlap,bandwidth"]).only == [
        "bandwidth", "overlap"]
    with pytest.raises(SystemExit):
        parse_args(SECTIONS, description, ["--device", "cpu", "--only", "bandwidth"])
    assert "do not run on cpu" in capsys.readouterr().err


def test_connections_settings_are_checked():
    from smfree_pg.bench.cli import parse_connections

    assert parse_connections("default,1") == ["default", "1"]
    for bad in ("0", "one", "1,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_connections(bad)
