"""Clients and servers share one keepalive policy: an idle pipeline Forward stream to a
real stage survives many keepalive intervals and is then used, without GOAWAY. With the
server left at gRPC's default ping policy (the old mismatch), the same idle stream draws
GOAWAY ENHANCE_YOUR_CALM too_many_pings (which, in a slow Load call, fails the call),
so these tests can tell the two apart (gRPC's C core logs the GOAWAY on stderr).

Intervals are shortened through the config (1 s) so "many intervals" takes seconds.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from meshllm.cluster.placement import Plan, StageAssignment
from meshllm.engine.sampler import SamplingParams
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import new_leader
from meshllm.pipeline.deploy import deploy
from meshllm.pipeline.stage_service import StageService
from meshllm.pipeline.transport import RemotePipeline
from meshllm.transport import auth
from meshllm.transport.channels import ChannelConfig, ChannelPool, KeepalivePolicy
from meshllm.transport.protos import stage_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig
from tests.pipeline.conftest import OPTIONS

pytestmark = pytest.mark.timeout(120)

FAST = KeepalivePolicy(interval_ms=1_000, timeout_ms=5_000)
# Ten client pings while the stream carries nothing. (gRPC spaces a client's pings by at
# least about a second whatever keepalive_time says, so shorter intervals buy nothing.)
IDLE_S = 10.0


class CountingStage(StageService):
    """The real stage service, counting the Forward streams opened to it."""

    def __init__(self, model: Path, channels: ChannelPool):
        super().__init__(lambda model_id, fingerprint: model, channels, plan_lease_s=300.0)
        self.num_streams = 0

    def Forward(self, request_iterator, context):
        self.num_streams += 1
        yield from super().Forward(request_iterator, context)


def generate_twice_with_an_idle_gap(aidreams_path: Path, server_keepalive: KeepalivePolicy) -> CountingStage:
    key = auth.generate_key()
    channels = ChannelPool(ChannelConfig("leader", key, keepalive=FAST))
    stage = CountingStage(aidreams_path, channels)
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id="stage", keepalive=server_keepalive))
    server.add(stage_pb2_grpc.add_StageServicer_to_server, stage)
    server.start()
    files = open_model(aidreams_path)
    n = files.config.num_hidden_layers
    plan = Plan(files.model_id, files.source.fingerprint(), n, OPTIONS.context_length, OPTIONS.max_batch, 4, 4,
                (StageAssignment("stage", server.address, 0, n, 0, 0, 0),), 0.0, False)
    leader = None
    try:
        plan_id = deploy(plan, channels, OPTIONS.dtype, OPTIONS.batch_invariant)
        leader = new_leader(files, RemotePipeline(channels.get(server.address, "stage"), plan_id, 1), OPTIONS)
        prompt = files.tokenizer.encode("Once upon a time")
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        first = [e.token_id for e in leader.generate(prompt, params) if e.token_id is not None]
        time.sleep(IDLE_S)
        second = [e.token_id for e in leader.generate(prompt, params) if e.token_id is not None]
        assert first == second and len(first) == 4
        return stage
    finally:
        if leader is not None:
            leader.close()
        channels.close()
        server.stop(0)


def test_an_idle_forward_stream_outlives_many_keepalive_intervals(aidreams_path, capfd):
    stage = generate_twice_with_an_idle_gap(aidreams_path, server_keepalive=FAST)
    assert stage.num_streams == 1  # the same stream carried both generations
    assert "too_many_pings" not in capfd.readouterr().err


IDLE_STREAM = textwrap.dedent("""
    import queue, sys, time, grpc
    from meshllm.transport import auth
    from meshllm.transport.channels import ChannelConfig, KeepalivePolicy, open_channel
    from meshllm.transport.server import NodeServer, ServerConfig
    key = auth.generate_key()
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id="s",
                                     keepalive=KeepalivePolicy(interval_ms=int(sys.argv[1]))))
    echo = grpc.stream_stream_rpc_method_handler(lambda requests, context: (r for r in requests))
    handler = grpc.method_handlers_generic_handler("test.Echo", {"Chat": echo})
    server.add(lambda _servicer, s: s.add_generic_rpc_handlers((handler,)), None)
    server.start()
    requests = queue.Queue()
    config = ChannelConfig("c", key, keepalive=KeepalivePolicy(interval_ms=1000, timeout_ms=5000))
    channel = open_channel(server.address, config, receiver="s")
    call = channel.stream_stream("/test.Echo/Chat")(iter(requests.get, None))
    requests.put(b"a"); assert next(call) == b"a"
    time.sleep(10)
    requests.put(b"b")
    try:
        assert next(call) == b"b"
        print("stream used after the idle gap", flush=True)
    except grpc.RpcError as e:
        print("stream torn down:", e.code().name, flush=True)
    requests.put(None)
    call.cancel()
    server.stop(0)
""")


def test_a_server_left_at_grpc_defaults_answers_the_same_pings_with_goaway():
    # The control: the same client policy against a server with gRPC's default ping policy
    # (one ping per 5 minutes without data), in a process of its own so the C core's log is
    # all about this one connection.
    result = subprocess.run([sys.executable, "-c", IDLE_STREAM, "600000"], capture_output=True,
                            text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ENHANCE_YOUR_CALM" in result.stderr and "too_many_pings" in result.stderr, result.stderr[-2000:]
    assert "stream torn down: UNAVAILABLE" in result.stdout, result.stdout
