"""TLS from the cluster key, checked on the wire rather than in the config: the handshake a
node offers (inspected with Python's own ssl module), and the bytes that cross a TCP relay
between a leader and a stage: token ids in the clear under --insecure-plaintext, never by
default."""

from __future__ import annotations

import socket
import ssl
import threading

import pytest
import torch
from cryptography import x509

from meshllm.engine.sampler import SamplingParams
from meshllm.engine.step import SeqWork, Step
from meshllm.pipeline.transport import RemotePipeline, next_step_id
from meshllm.transport import auth
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc, stage_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig
from meshllm.transport.tls import NODE_TLS_NAME, PLAINTEXT, cluster_ca, node_certificate
from tests.transport.test_keepalive import CountingStage

pytestmark = pytest.mark.timeout(120)


class Health(cluster_pb2_grpc.HealthServicer):
    def Check(self, request, context):
        return cluster_pb2.HealthResponse(node_id="n", serving=True)


@pytest.fixture
def node():
    key = auth.generate_key()
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id="n"))
    server.add(cluster_pb2_grpc.add_HealthServicer_to_server, Health())
    server.start()
    try:
        yield key, server
    finally:
        server.stop(0)


def client_context(key: bytes, tmp_path) -> ssl.SSLContext:
    cert = node_certificate(key, "probe")
    (tmp_path / "c.pem").write_bytes(cert.cert_pem)
    (tmp_path / "c.key").write_bytes(cert.key_pem)
    context = ssl.create_default_context(cadata=cert.ca_pem.decode())
    context.load_cert_chain(tmp_path / "c.pem", tmp_path / "c.key")
    context.set_alpn_protocols(["h2"])
    return context


def test_a_node_speaks_tls13_with_a_certificate_from_the_cluster_ca(node, tmp_path):
    key, server = node
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        with client_context(key, tmp_path).wrap_socket(raw, server_hostname=NODE_TLS_NAME) as tls:
            assert tls.version() == "TLSv1.3" and tls.selected_alpn_protocol() == "h2"
            peer = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
    ca = cluster_ca(key).cert
    assert peer.issuer == ca.subject
    peer.verify_directly_issued_by(ca)
    assert peer.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == [NODE_TLS_NAME]
    assert cluster_ca(key).cert_pem == cluster_ca(bytes(key)).cert_pem  # every key holder derives the same CA


def answers_http2(port: int, context: ssl.SSLContext | None) -> bool:
    """Whether the server answers an HTTP/2 preface (with its SETTINGS frame) over this
    context (None: in clear), rather than failing the handshake or hanging up."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            conn = raw if context is None else context.wrap_socket(raw, server_hostname=NODE_TLS_NAME)
            with conn:
                conn.sendall(preface)
                reply = conn.recv(4096)  # TLS 1.3 reports a refused client certificate here
                return len(reply) >= 9 and reply[3] == 0x4  # an HTTP/2 frame header of type SETTINGS
    except (ssl.SSLError, ConnectionError):
        return False


def test_a_node_refuses_plaintext_and_strangers(node, tmp_path):
    key, server = node
    assert answers_http2(server.port, client_context(key, tmp_path))  # the probe itself works
    assert not answers_http2(server.port, None)  # HTTP/2 in clear
    no_client_cert = ssl.create_default_context(cadata=cluster_ca(key).cert_pem.decode())
    other_cluster = client_context(auth.generate_key(), tmp_path)
    for context in (no_client_cert, other_cluster):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # we would talk to anyone: the server must not
        context.set_alpn_protocols(["h2"])
        assert not answers_http2(server.port, context)


class Tap:
    """A TCP relay on loopback that keeps a copy of every byte it forwards."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.captured = bytearray()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                with self.lock:
                    self.captured += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("tls, in_clear", [(None, False), (PLAINTEXT, True)], ids=["default-tls", "plaintext"])
def test_prompt_tokens_cross_the_wire_only_as_ciphertext(aidreams_path, tls, in_clear):
    """A leader feeds a prompt to a real stage through the tap: the prompt's token ids (as
    the int64 bytes that travel) are readable on the wire only with --insecure-plaintext.
    The stage is dialled at the tap's address, not its own: the certificate name does not
    depend on the address a node is reached under."""
    from meshllm.cluster.placement import Plan, StageAssignment
    from meshllm.model.source import open_model
    from meshllm.pipeline.deploy import deploy
    from tests.pipeline.conftest import OPTIONS

    key = auth.generate_key()
    channels = ChannelPool(ChannelConfig("leader", key, tls=tls))
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id="stage", tls=tls))
    server.add(stage_pb2_grpc.add_StageServicer_to_server, CountingStage(aidreams_path, channels))
    server.start()
    tap = Tap(server.port)
    files = open_model(aidreams_path)
    n = files.config.num_hidden_layers
    address = f"127.0.0.1:{tap.port}"
    plan = Plan(files.model_id, files.source.fingerprint(), n, OPTIONS.context_length, OPTIONS.max_batch, 4, 4,
                (StageAssignment("stage", address, 0, n, 0, 0, 0),), 0.0, False)
    try:
        plan_id = deploy(plan, channels, OPTIONS.dtype, OPTIONS.batch_invariant)
        pipeline = RemotePipeline(channels.get(address, "stage"), plan_id, 1)
        prompt = files.tokenizer.encode("the secret plans of the quiet lab are hidden under the old oak")
        greedy = SamplingParams(temperature=0.0, seed=0)
        work = SeqWork(1, 0, len(prompt), num_scored=1, sampling=greedy)
        result = pipeline.submit(Step(next_step_id(), (work,), torch.tensor(prompt, dtype=torch.int64))).result(
            timeout=60)
        assert result.error_code is None and len(result.tokens) == 1
        pipeline.close()
    finally:
        channels.close()
        tap.close()
        server.stop(0)
    marker = torch.tensor(prompt, dtype=torch.int64).numpy().tobytes()
    assert len(tap.captured) > len(marker)
    assert (marker in bytes(tap.captured)) == in_clear
