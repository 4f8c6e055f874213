"""Who a step whose stream ended under it blames (stage_relay.py): the stage that failed, which the
stream's trailing metadata names, not the healthy stage that ended the stream after it.

The race this pins down: the last of three stages dies; stage 1 gives up on the chain and ends its
stream from stage 0 while a step is on its way to it. That step is answered by nobody, so stage 0
fails it, and before this it named stage 1. A real gRPC server on loopback plays "stage 1" with a
fake Stage service that ends the stream exactly so: a real stage cannot be made to lose that race
on demand (tests/pipeline/test_stage_resources.py covers the whole chain, racing as it may).
"""

from __future__ import annotations

import queue
import threading
from concurrent import futures

import grpc
import pytest
import torch

from meshllm.engine.step import Step
from meshllm.pipeline.stage_relay import ChainBroken, Downstream, chain_end_metadata
from meshllm.pipeline.transport import RemotePipeline
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc


class EndsTheStream(stage_pb2_grpc.StageServicer):
    """Reads one step, answers none, and ends the stream, naming `failed` (if any) as the cause."""

    def __init__(self, failed: int | None):
        self.failed = failed
        self.received = threading.Event()

    def Forward(self, request_iterator, context):
        next(request_iterator)
        self.received.set()
        if self.failed is not None:
            context.set_trailing_metadata(chain_end_metadata(self.failed, "UNAVAILABLE: the test's stage died"))
        return iter(())


@pytest.fixture
def serve():
    servers = []

    def start(servicer) -> grpc.Channel:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        stage_pb2_grpc.add_StageServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        servers.append(channel)
        return channel

    yield start
    for s in servers:
        if isinstance(s, grpc.Channel):
            s.close()
        else:
            s.stop(grace=None)


def _relay_one_step(channel: grpc.Channel) -> tuple[stage_pb2.StepReply, Downstream]:
    replies: queue.Queue = queue.Queue()
    downstream = Downstream(channel, replies, next_index=1)
    downstream.send(stage_pb2.StepRequest(plan_id="p", step_id=7))
    reply = replies.get(timeout=10)
    end = replies.get(timeout=10)  # and the upstream stream ends too, naming the same stage
    assert isinstance(end, ChainBroken) and end.failed_stage == reply.failed_stage
    return reply, downstream


def test_a_step_the_next_stage_dropped_is_blamed_on_the_stage_it_names(serve):
    reply, downstream = _relay_one_step(serve(EndsTheStream(failed=2)))
    assert reply.step_id == 7 and reply.error_code == "stage_unreachable"
    assert reply.failed_stage == 2 and "stage 2" in reply.error_message
    assert "the test's stage died" in reply.error_message
    assert downstream.broken and downstream.failed_stage == 2


def test_a_stream_ended_without_naming_a_stage_blames_the_next_stage(serve):
    reply, _ = _relay_one_step(serve(EndsTheStream(failed=None)))
    assert reply.failed_stage == 1 and "stage 1" in reply.error_message


def test_a_stage_cannot_blame_one_before_itself(serve):
    """Stage 1 naming stage 0 (a bug or a lie): stage 0 blames stage 1, never itself."""
    reply, _ = _relay_one_step(serve(EndsTheStream(failed=0)))
    assert reply.failed_stage == 1


def test_the_leader_blames_the_stage_that_stage_0_names(serve):
    pipeline = RemotePipeline(serve(EndsTheStream(failed=2)), "p", num_stages=3)
    result = pipeline.submit(Step(step_id=5, seqs=(), input=torch.zeros(0, dtype=torch.long))).result(timeout=10)
    assert result.error_code == "stage_unreachable" and result.failed_stage == 2
    assert "stage 2" in result.error_message


def test_the_leader_blames_stage_0_when_it_names_nobody_or_a_stage_not_in_the_plan(serve):
    for failed in (None, 3):
        pipeline = RemotePipeline(serve(EndsTheStream(failed=failed)), "p", num_stages=3)
        result = pipeline.submit(Step(step_id=5, seqs=(), input=torch.zeros(0, dtype=torch.long))).result(timeout=10)
        assert result.error_code == "stage_unreachable" and result.failed_stage == 0
