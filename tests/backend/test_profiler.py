"""smfree's point-to-point ops in torch.profiler traces, as a user reads them: ranges named
smfree:send and smfree:recv whose inputs are the tensor, the peer and the bytes, and the
record_param_comms metadata that ProcessGroupNCCL records for its send and recv (op, peer,
elements, dtype)."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from harness import run_ranks

ELEMENTS = 1000  # of float32: 4000 bytes


def _traced_exchange(rank, world, trace_dir):
    peer = 1 - rank
    send = torch.full((ELEMENTS,), float(rank))
    recv = torch.empty(ELEMENTS)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for work in (dist.isend(send, peer), dist.irecv(recv, peer)):
            work.wait()
    assert torch.equal(recv, torch.full((ELEMENTS,), float(peer)))
    path = os.path.join(trace_dir, f"trace.{rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as trace:
        events = json.load(trace)["traceEvents"]
    return [event for event in events
            if event.get("name", "").startswith("smfree:") or event.get("name") == "record_param_comms"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return run_ranks(_traced_exchange, 2, str(tmp_path_factory.mktemp("traces")))


def named(events, name):
    return [event for event in events if event["name"] == name]


@pytest.mark.parametrize("rank", [0, 1])
def test_send_and_recv_are_ranges_with_their_peer_and_bytes(traces, rank):
    peer = 1 - rank
    for name in ("smfree:send", "smfree:recv"):
        (event,) = named(traces[rank], name)
        args = event["args"]
        assert args["Input Dims"][0] == [ELEMENTS], args
        assert args["Input type"][0] == "float", args
        assert args["Concrete Inputs"][1:] == [str(peer), str(4 * ELEMENTS)], args
        assert event["dur"] > 0


@pytest.mark.parametrize("rank", [0, 1])
def test_the_comms_metadata_names_the_op_the_peer_and_the_elements(traces, rank):
    peer = 1 - rank
    comms = {event["args"]["Collective name"]: event["args"]
             for event in named(traces[rank], "record_param_comms")}
    assert set(comms) == {"send", "recv"}, comms
    for args in comms.values():
        # As for NCCL's send and recv, "Rank" is the peer's.
        assert args["Rank"] == peer, args
        assert args["In msg nelems"] == ELEMENTS, args
        assert args["dtype"] == "Float", args
