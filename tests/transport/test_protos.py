"""The committed stubs are exactly what generate.py makes from the .proto files."""

import importlib

from meshllm.transport.protos import generate


def test_committed_stubs_match_the_protos(tmp_path):
    fresh = generate.generate(tmp_path)
    assert {p.name for p in fresh} >= {"common_pb2.py", "cluster_pb2.py", "cluster_pb2_grpc.py"}
    for path in fresh:
        committed = generate.PROTOS_DIR / path.name
        assert committed.exists(), f"{committed.name} is not committed; run python -m meshllm.transport.protos.generate"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.name} differs from its .proto; run python -m meshllm.transport.protos.generate")


def test_stubs_import_each_other_inside_the_package():
    grpc_stub = importlib.import_module("meshllm.transport.protos.cluster_pb2_grpc")
    assert grpc_stub.cluster__pb2.__name__ == "meshllm.transport.protos.cluster_pb2"
