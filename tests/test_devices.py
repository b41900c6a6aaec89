"""Which GPU a test's rank uses (tests/devices.py), and which GPU tests skip with the GPUs
present."""

import pytest

import devices


@pytest.mark.parametrize("gpus, expected", [(1, [0, 0, 0, 0]), (2, [0, 1, 0, 1]),
                                            (4, [0, 1, 2, 3]), (8, [0, 1, 2, 3])])
def test_a_rank_uses_its_rank_modulo_the_gpus(monkeypatch, gpus, expected):
    monkeypatch.setattr(devices, "gpu_count", lambda: gpus)
    assert [devices.rank_gpu(rank) for rank in range(4)] == expected
    assert devices.ranks_share_a_gpu(4) == (gpus < 4)


def test_a_rank_given_a_gpu_where_there_is_none_is_refused(monkeypatch):
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    with pytest.raises(RuntimeError, match="rank 1 was given a GPU, but none is present"):
        devices.rank_gpu(1)


def test_gpu_tests_skip_only_without_a_gpu():
    assert devices.skip_reason(True, None, 0, "t") == "needs a CUDA GPU"
    assert devices.skip_reason(True, None, 1, "t") is None
    assert devices.skip_reason(False, None, 0, "t") is None


def test_tests_that_need_a_gpu_per_rank_skip_with_fewer_saying_why():
    two = pytest.mark.distinct_gpus("peer copies").mark
    three = pytest.mark.distinct_gpus("NCCL", gpus=3).mark
    assert devices.skip_reason(True, two, 1, "t") == \
        "needs 2 GPUs, one per rank (1 here): peer copies"
    assert devices.skip_reason(True, two, 2, "t") is None
    assert devices.skip_reason(True, three, 2, "t") == "needs 3 GPUs, one per rank (2 here): NCCL"
    assert devices.skip_reason(True, three, 3, "t") is None
    assert devices.skip_reason(True, two, 0, "t") == "needs a CUDA GPU"


@pytest.mark.parametrize("mark", [pytest.mark.distinct_gpus, pytest.mark.distinct_gpus(""),
                                  pytest.mark.distinct_gpus("why", gpus=1),
                                  pytest.mark.distinct_gpus("why", count=2)])
def test_a_distinct_gpus_marker_without_its_reason_or_a_count_is_refused(mark):
    with pytest.raises(pytest.UsageError, match="tests/x.py::t: distinct_gpus"):
        devices.skip_reason(True, mark.mark, 1, "tests/x.py::t")
