"""The multi-process harness itself: a hung rank fails fast and says where it hung, after the
error of a rank that failed first."""

import pytest

from harness import run_ranks


def _fail_in_rank_zero_then_hang_in_rank_one(rank, world):
    import time

    if rank == 0:
        raise ValueError("rank 0 gave up before rank 1's wait")
    while True:
        time.sleep(0.1)


# Long enough for both ranks to start (import torch, join the group) on a loaded 2-core machine:
# only rank 1 may be reported as not finished.
TIMEOUT_S = 30


def test_hung_rank_is_killed_with_its_stack_after_the_error_of_a_rank_that_failed_first():
    with pytest.raises(AssertionError) as failure:
        run_ranks(_fail_in_rank_zero_then_hang_in_rank_one, 2, timeout=TIMEOUT_S)
    message = str(failure.value)
    assert f"ranks [1] did not finish within {TIMEOUT_S} s" in message
    assert "--- rank 1 stacks:" in message
    assert "_fail_in_rank_zero_then_hang_in_rank_one" in message
    assert "--- rank 0 failed first:" in message
    assert "rank 0 gave up before rank 1's wait" in message
    assert message.index("failed first") < message.index("--- rank 1 stacks:")
