"""torch.distributed.pipelining over smfree (examples/pipelining.py): GPipe, 1F1B and
Interleaved1F1B on 2 CPU ranks give the losses and gradients of the same model run in one
process."""

import os
import sys

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)  # spawned ranks inherit the path
import pipelining  # noqa: E402

WORLD = 2


def _steps(rank, world):
    assert dist.get_backend() == "smfree"
    steps = {}
    for name in pipelining.SCHEDULES:
        losses, grads = pipelining.pipeline_step(name, rank, world, torch.device("cpu"))
        # As lists: tensors would go back to the test through file descriptors of a process
        # that has exited by then.
        steps[name] = losses, {key: grad.tolist() for key, grad in grads.items()}
    return steps


@pytest.fixture(scope="module")
def steps():
    # One spawn for the three schedules: the ranks' start-up is most of the time.
    return run_ranks(_steps, WORLD, timeout=120)


@pytest.mark.parametrize("schedule", list(pipelining.SCHEDULES))
def test_a_pipelined_step_matches_one_process(steps, schedule):
    want_losses, want_grads = pipelining.reference_step(schedule, WORLD)
    # The losses are on the rank of the last stage only.
    assert steps[0][schedule][0] is None
    assert steps[WORLD - 1][schedule][0] == pytest.approx(want_losses, rel=0,
                                                         abs=pipelining.TOLERANCE)
    grads = {}
    for rank in range(WORLD):
        rank_grads = steps[rank][schedule][1]
        assert not set(grads) & set(rank_grads), "a parameter on two ranks"
        grads.update(rank_grads)
    assert set(grads) == set(want_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64), want_grads[name], rtol=0, atol=pipelining.TOLERANCE,
                                   msg=lambda text, name=name: f"{schedule}, {name}: {text}")
