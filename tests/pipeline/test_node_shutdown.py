"""A stopping node leaves nothing behind: its Stage service refuses Loads once it closed (one
that came in between the close and the gRPC server's stop used to load and stay, freed by nobody),
a Load under way keeps nothing, and one service failing to stop does not keep the others or the
gRPC server running. Real StageControl on the tiny Llama; the node's services in the last test are
stand-ins that record their stop (building a whole node in this process would test the same loop)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from meshllm.engine.step_limits import StepLimits
from meshllm.errors import ShardUnavailable
from meshllm.model.source import open_model
from meshllm.node import Node
from meshllm.pipeline.loaded_stages import LoadedStages
from meshllm.pipeline.stage_control import StageControl
from meshllm.transport import stage_convert
from meshllm.transport.protos import stage_pb2


@pytest.fixture
def files(aidreams_path):
    return open_model(aidreams_path)


def _request(files, plan_id: str):
    request = stage_pb2.LoadRequest(plan_id=plan_id, model_id=files.model_id, fingerprint=files.source.fingerprint(),
                                    num_layers=files.config.num_hidden_layers, first_layer=0, last_layer=2,
                                    dtype="float32", leader_id="leader")
    stage_convert.limits_to_pb(StepLimits(64, 2, 32, None, 0), request)
    return request


def test_a_closed_stage_service_refuses_loads_and_keeps_none_under_way(files):
    reading, go_on = threading.Event(), threading.Event()

    def after_load():  # the Load has read its weights: hold it there until the node has closed
        reading.set()
        go_on.wait(10)

    stages = LoadedStages()
    control = StageControl(stages, lambda model_id, fingerprint: files.path,
                           faults=SimpleNamespace(after_load=after_load))
    outcome: dict = {}

    def load():
        try:
            outcome["reply"] = control.load(_request(files, "under-way"))
        except Exception as e:  # noqa: BLE001 - the test reads it
            outcome["error"] = e

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    assert reading.wait(10)
    control.close()
    go_on.set()
    thread.join(10)
    assert isinstance(outcome.get("error"), ShardUnavailable), outcome
    with pytest.raises(ShardUnavailable, match="this node is stopping"):
        control.load(_request(files, "after-close"))
    assert stages.items() == [] and stages.memory().held == 0


def test_a_service_failing_to_stop_leaves_the_others_and_the_server_to_stop():
    stopped = []

    class Service:
        def __init__(self, name: str, fails: bool = False):
            self.name, self.fails = name, fails

        def stop(self):
            stopped.append(self.name)
            if self.fails:
                raise RuntimeError(f"{self.name} failed to stop")

    node = SimpleNamespace(_started=[Service("gossip"), Service("stages", fails=True), Service("api")],
                           server=SimpleNamespace(stop=lambda: stopped.append("server")))
    Node.stop(node)
    assert stopped == ["api", "stages", "gossip", "server"] and node._started == []
