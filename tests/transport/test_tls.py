"""Mutual TLS with the user's own PKI (--tls-*): only holders of a CA-signed cert (and the key) get in."""

import shutil
import subprocess

import grpc
import pytest

from meshllm.errors import KeyFileError
from meshllm.transport import auth
from meshllm.transport.channels import ChannelConfig, open_channel
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig
from meshllm.transport.tls import TlsFiles

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make test certificates")


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_ca(folder, name):
    folder.mkdir(exist_ok=True)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=folder)


def make_cert(folder, ca, name) -> TlsFiles:
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", cwd=folder)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-days", "1", "-extfile", "san.cnf", "-out", f"{name}.pem", cwd=folder)
    return TlsFiles(cert=folder / f"{name}.pem", key=folder / f"{name}.key", ca=folder / f"{ca}.pem")


class Health(cluster_pb2_grpc.HealthServicer):
    def Check(self, request, context):
        return cluster_pb2.HealthResponse(node_id="tls-node", serving=True)


def test_mutual_tls(tmp_path):
    make_ca(tmp_path, "ca")
    make_ca(tmp_path / "other", "otherca")
    server_tls = make_cert(tmp_path, "ca", "server")
    client_tls = make_cert(tmp_path, "ca", "client")
    stranger_tls = make_cert(tmp_path / "other", "otherca", "stranger")
    stranger_tls = TlsFiles(stranger_tls.cert, stranger_tls.key, ca=server_tls.ca)  # trusts us, but we don't trust it
    key = auth.generate_key()
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, tls=server_tls))
    server.add(cluster_pb2_grpc.add_HealthServicer_to_server, Health())
    server.start()
    try:
        with open_channel(server.address, ChannelConfig("c", key, tls=client_tls)) as channel:
            assert cluster_pb2_grpc.HealthStub(channel).Check(cluster_pb2.HealthRequest(), timeout=10).serving
        # Neither certificates derived from the cluster key nor another CA's are admitted.
        for config in (ChannelConfig("c", key), ChannelConfig("c", key, tls=stranger_tls)):
            with open_channel(server.address, config) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    cluster_pb2_grpc.HealthStub(channel).Check(cluster_pb2.HealthRequest(), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # The cluster key is still required on top of TLS.
        with open_channel(server.address, ChannelConfig("c", auth.generate_key(), tls=client_tls)) as channel:
            with pytest.raises(grpc.RpcError) as info:
                cluster_pb2_grpc.HealthStub(channel).Check(cluster_pb2.HealthRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)


def test_missing_tls_file_is_a_named_error(tmp_path):
    with pytest.raises(KeyFileError, match="--tls-cert"):
        TlsFiles(tmp_path / "a", tmp_path / "b", tmp_path / "c").server_credentials()
