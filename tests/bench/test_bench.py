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


def test_alltoall_schedule_pairs_every_rank_with_every_other_once_per_step():
    from smfree_pg.bench.alltoall import schedule

    world = 5
    steps = [schedule(rank, world) for rank in range(world)]
    for rank, plan in enumerate(steps):
        assert sorted(to for to, _ in plan) == [r for r in range(world) if r != rank]
        assert sorted(source for _, source in plan) == [r for r in range(world) if r != rank]
    for step in range(world - 1):
        # Each rank is sent to by one rank in a step, and that rank receives from it then.
        receivers = [steps[rank][step][0] for rank in range(world)]
        assert sorted(receivers) == list(range(world))
        assert all(steps[to][step][1] == rank for rank, to in enumerate(receivers))


def test_alltoall_figures_count_every_message_once():
    from smfree_pg.bench.alltoall import figure

    # 4 ranks, 1e6 B to each of 3 peers in 1 ms: 12 messages of 1e6 B.
    fig = figure([2e-3, 1e-3, 1e-3], size=10**6, world=4)
    assert fig["us"] == pytest.approx(1000.0)
    assert fig["GBps_aggregate"] == pytest.approx(12.0)
    assert fig["GBps_out_per_rank"] == pytest.approx(3.0)
    assert fig["us_reps"] == pytest.approx([2000.0, 1000.0, 1000.0])


def test_alltoall_traffic_sends_about_the_bytes_asked_for():
    from smfree_pg.bench.alltoall import traffic_chunks

    mib = 1 << 20
    assert traffic_chunks(192 * mib, 64 * mib, world=4) == 1
    assert traffic_chunks(193 * mib, 64 * mib, world=4) == 2  # rounds up: never fewer bytes
    assert traffic_chunks(32 << 30, 64 * mib, world=8) == 74


def test_alltoall_shows_the_counters_of_memory_and_mappings():
    from smfree_pg.bench.alltoall import memory_stats

    stats = {"live_ops": 0, "ipc_mappings": 7, "ring_bytes": 1 << 26, "staging_rings": 3,
             "eager_sends": 5, "ucx_relay_cached_bytes": 0}
    assert memory_stats(stats) == {"ipc_mappings": 7, "ring_bytes": 1 << 26, "staging_rings": 3,
                                   "ucx_relay_cached_bytes": 0}


def test_collectives_options_parse_and_are_checked(capsys):
    from smfree_pg.bench.cli import parse_args
    from smfree_pg.bench.sections import SECTIONS

    args = parse_args(SECTIONS, "bench", ["--only", "collectives", "--collectives-sizes", "64K,1M",
                                          "--collectives-overlap-size", "16M"])
    assert args.only == ["collectives"]
    assert args.collectives_sizes == [64 << 10, 1 << 20]
    assert args.collectives_overlap_size == 16 << 20
    assert (args.collectives_iters, args.collectives_reps) == (10, 3)
    with pytest.raises(SystemExit):
        parse_args(SECTIONS, "bench", ["--only", "collectives", "--collectives-iters", "0"])
    assert "--collectives-iters must be at least 1" in capsys.readouterr().err


def _outputs_by_hand(op, layout, inputs, n):
    """What each rank's output holds after `op`, from every rank's input, by the op's meaning."""
    import torch

    world = len(inputs)
    if op == "all_gather_into_tensor":
        return [torch.cat(inputs) for _ in range(world)]
    if op == "broadcast":
        return [inputs[0].clone() for _ in range(world)]
    if op == "gather":
        return [torch.cat(inputs) if r == 0 else inputs[r][:0] for r in range(world)]
    if op == "scatter":
        return [inputs[0].split(n)[r].clone() for r in range(world)]
    cut = [inp.split(layout.splits(rank)[1] or n) for rank, inp in enumerate(inputs)]
    return [torch.cat([pieces[r] for pieces in cut]) for r in range(world)]


@pytest.mark.parametrize("op", ["all_gather_into_tensor", "all_to_all_single",
                                "all_to_all_single uneven", "broadcast", "gather", "scatter"])
def test_collectives_check_finds_a_misplaced_piece(op):
    import torch

    from smfree_pg.bench.pieces import Layout, make_input, wrong_piece

    world, n, cpu = 3, 8, torch.device("cpu")
    layout = Layout(op, world, n)
    inputs = [make_input(layout, rank, cpu) for rank in range(world)]
    outs = _outputs_by_hand(op, layout, inputs, n)
    for rank, out in enumerate(outs):
        assert out.numel() == layout.out_numel(rank)
        assert wrong_piece(layout, out, rank, range(world), "test") is None
    # The receiver's first piece from rank 0 with one int32 of another sender's (or a wrong one).
    receiver = 2 if op != "gather" else 0
    other = 1 if op not in ("broadcast", "scatter") else None
    wrong = outs[receiver][layout.out_offset(other, receiver)] if other else 12345
    outs[receiver][layout.out_offset(0, receiver)] = wrong
    assert "piece from rank 0" in wrong_piece(layout, outs[receiver], receiver, range(world), "t")
    assert wrong_piece(layout, outs[receiver], receiver, range(1, world), "test") is None
    if op not in ("all_gather_into_tensor", "broadcast", "gather"):
        # Pieces differ by destination: rank 0's output does not pass as rank 1's.
        assert wrong_piece(layout, outs[0][:outs[1].numel()], 1, range(world), "t") is not None


def test_collectives_ops_option_takes_short_names(capsys):
    from smfree_pg.bench.cli import parse_args
    from smfree_pg.bench.pieces import OPS
    from smfree_pg.bench.sections import SECTIONS

    args = parse_args(SECTIONS, "bench", ["--only", "collectives"])
    assert args.collectives_ops == list(OPS)
    args = parse_args(SECTIONS, "bench", ["--collectives-ops", "all_to_all_uneven, scatter"])
    assert args.collectives_ops == ["all_to_all_single uneven", "scatter"]
    with pytest.raises(SystemExit):
        parse_args(SECTIONS, "bench", ["--collectives-ops", "all_gather,reduce"])
    assert "unknown op(s) reduce" in capsys.readouterr().err


def test_uneven_all_to_all_pieces_as_an_moe_layer_sends_them():
    import torch

    from smfree_pg.bench.pieces import UNEVEN, Layout, make_input
    from smfree_pg.bench.data import pattern

    layout = Layout(UNEVEN, 2, 300)
    assert layout.counts == [[200, 400], [400, 200]]  # 2/3 and 4/3 of the mean
    assert layout.splits(0) == ([200, 400], [200, 400])
    assert layout.splits(1) == ([400, 200], [400, 200])
    assert layout.piece_bytes() == 4 * 400
    layout = Layout(UNEVEN, 4, 1000)
    for rank in range(4):
        assert sorted(layout.counts[rank]) == [400, 800, 1200, 1600]
        assert layout.in_numel(rank) == layout.out_numel(rank) == 4000
    # Without distinct pieces, each piece is its sender's pattern from the start (the overlap
    # check's expectation).
    inp = make_input(layout, 1, torch.device("cpu"), distinct=False)
    start, count = layout.in_offset(1, 3), layout.counts[1][3]
    assert torch.equal(inp[start:start + count], pattern(1, count, torch.device("cpu")))
    assert Layout("all_to_all_single", 4, 1000).splits(1) == (None, None)


def _every_op_as_the_bench_calls_it(rank, world):
    import torch

    from smfree_pg.bench.collectives import call, input_of
    from smfree_pg.bench.pieces import OPS, Layout, make_input, wrong_piece

    errors = []
    for op in OPS:
        layout = Layout(op, world, 6)
        out = torch.full((layout.out_numel(rank),), -1, dtype=torch.int32)
        call(layout, rank, torch.distributed.group.WORLD, out,
             input_of(op, out, make_input(layout, rank, torch.device("cpu")), rank))
        errors.append(wrong_piece(layout, out, rank, range(world), op))
    return errors


def test_the_bench_calls_each_collective_as_its_layout_says():
    """Over smfree on CPU tensors (Gloo underneath): each op's call, with its split sizes and
    lists, leaves what the bench's check expects."""
    from harness import run_ranks

    assert run_ranks(_every_op_as_the_bench_calls_it, 3) == [[None] * 7] * 3


def test_nccl_copy_engine_child_reports_its_line_or_why_it_failed():
    import json
    import sys

    from smfree_pg.bench.nccl_copy_engines import MARKER, run_child

    rows = [{"op": "all_gather_into_tensor", "bytes": 1 << 20, "us": 12.5}]
    said = f"print('noise'); print({MARKER + json.dumps({'rows': rows, 'error': None})!r})"
    assert run_child([sys.executable, "-c", said], {}) == {"rows": rows, "error": None}
    # A child that dies without its line: NCCL's last warning says why, not the traceback.
    died = ("import sys; sys.stderr.write('x.cc:1 NCCL WARN first\\n"
            "ce_coll.cc:341 NCCL WARN Cuda failure invalid argument\\nTraceback: boom\\n'); "
            "sys.exit(3)")
    failed = run_child([sys.executable, "-c", died], {})
    assert failed == {"rows": [], "error": "exited with 3: ce_coll.cc:341 NCCL WARN Cuda "
                                           "failure invalid argument"}
    # A child that caught torch's error: NCCL's warning is added to it.
    caught = {"rows": [], "error": "all_gather_into_tensor, 1 MiB: unhandled cuda error"}
    warned = (f"import sys; sys.stderr.write('ce_coll.cc:341 NCCL WARN Cuda failure\\n'); "
              f"print({MARKER + json.dumps(caught)!r})")
    assert run_child([sys.executable, "-c", warned], {})["error"] == (
        "all_gather_into_tensor, 1 MiB: unhandled cuda error; NCCL: ce_coll.cc:341 NCCL WARN "
        "Cuda failure")


def test_collectives_report_names_where_nccl_copy_engines_failed(capsys):
    from smfree_pg.bench.collectives import print_nccl_copy_engines

    figures = {"us": 100.0, "GBps_aggregate": 1.0}
    section = {"rows": [{"op": "all_gather_into_tensor", "bytes": 1 << 20, "smfree": figures,
                         "nccl": {**figures, "us": 80.0}}],
               "nccl_copy_engines": {
                   "rows": [{"op": "all_gather_into_tensor", "bytes": 1 << 20, "us": 90.0}],
                   "error": "rank 1: all_to_all_single, 1 MiB: DistBackendError: unhandled"}}
    print_nccl_copy_engines(section)
    out = capsys.readouterr().out
    assert "NCCL's copy-engine path failed: rank 1: all_to_all_single, 1 MiB" in out
    line = next(line for line in out.splitlines() if line.startswith("all_gather_into_tensor"))
    assert [cell.strip() for cell in line.split("|")][2:5] == ["90.0", "80.0", "100.0"], line
