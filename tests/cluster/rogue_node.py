"""A rogue on the LAN: knows the cluster id (it is public, in mDNS) and the model's
fingerprint (learned from gossip), but not the cluster key. Run by tests/cluster/test_rogue.py:

    python -m tests.cluster.rogue_node MODE CLUSTER_ID FINGERPRINT [HOST]   (then TARGET on stdin)

MODE "tls" serves with a self-made certificate, "plaintext" without TLS. It answers
Health.Check and Exchange with a forged card (huge free memory, the model, stamped
50 s ahead), pushes that card to TARGET (host:port read from stdin once it is ready)
every half second, advertises itself over mDNS
with the cluster id, and prints one line per call it receives ("called Exchange").
"""

from __future__ import annotations

import datetime
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc
from meshllm.transport.tls import NODE_TLS_NAME

ROGUE_ID = "rogue"


def forged_card(address: str, fingerprint: str) -> cluster_pb2.Card:
    return cluster_pb2.Card(
        node_id=ROGUE_ID, grpc_address=address, platform="linux-x86_64", device="cpu",
        memory_total_bytes=1 << 45, memory_free_bytes=1 << 45, memory_bandwidth_gbps=9999.0, matmul_gflops=1e6,
        models=[cluster_pb2.ModelOnDisk(model_id="aidreams-260k", fingerprint=fingerprint, num_layers=4)],
        roles=[cluster_pb2.ROLE_STAGE], announced_at=time.time() + 50, ttl_seconds=300.0)


def self_signed() -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NODE_TLS_NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(NODE_TLS_NAME)]), critical=False)
            .sign(key, hashes.SHA256()))
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()), cert.public_bytes(serialization.Encoding.PEM))


class Rogue(cluster_pb2_grpc.ClusterServicer, cluster_pb2_grpc.HealthServicer):
    def __init__(self, card: cluster_pb2.Card):
        self.card = card

    def Exchange(self, request, context):
        print("called Exchange", flush=True)
        return cluster_pb2.ExchangeResponse(cards=[self.card])

    def Check(self, request, context):
        print("called Check", flush=True)
        return cluster_pb2.HealthResponse(node_id=ROGUE_ID, serving=True)


def main(mode: str, cluster_id: str, fingerprint: str, host: str = "127.0.0.1") -> None:
    server = grpc.server(ThreadPoolExecutor(4))
    if mode == "tls":
        key_pem, cert_pem = self_signed()
        credentials = grpc.ssl_server_credentials([(key_pem, cert_pem)])
        port = server.add_secure_port(f"{host}:0", credentials)
    else:
        port = server.add_insecure_port(f"{host}:0")
    address = f"{host}:{port}"
    rogue = Rogue(forged_card(address, fingerprint))
    cluster_pb2_grpc.add_ClusterServicer_to_server(rogue, server)
    cluster_pb2_grpc.add_HealthServicer_to_server(rogue, server)
    server.start()
    threading.Thread(target=advertise, args=(host, port, cluster_id), daemon=True).start()
    print(f"rogue ready {address}", flush=True)
    target = sys.stdin.readline().strip()
    while True:  # push the forged card at the node, signed with nothing (a new channel: no backoff)
        if mode == "tls":
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(cert_pem, key_pem, cert_pem),
                                          options=[("grpc.ssl_target_name_override", NODE_TLS_NAME)])
        else:
            channel = grpc.insecure_channel(target)
        try:
            cluster_pb2_grpc.ClusterStub(channel).Exchange(cluster_pb2.ExchangeRequest(cards=[rogue.card]), timeout=2)
            print("push accepted", flush=True)
        except grpc.RpcError as e:
            print(f"push refused: {e.code().name}", flush=True)
        channel.close()
        time.sleep(0.5)


def advertise(host: str, port: int, cluster_id: str) -> None:
    from zeroconf import IPVersion, ServiceInfo, Zeroconf

    from meshllm.cluster.discovery import SERVICE_TYPE

    try:
        zc = Zeroconf(interfaces=[host], ip_version=IPVersion.V4Only)
        zc.register_service(ServiceInfo(SERVICE_TYPE, f"{ROGUE_ID}.{SERVICE_TYPE}", port=port,
                                        addresses=[socket.inet_aton(host)], server=f"{ROGUE_ID}.local.",
                                        properties={"node_id": ROGUE_ID, "cluster": cluster_id}))
        print("rogue advertised over mDNS", flush=True)
    except OSError as e:  # loopback has no multicast: the seed-peer tests do without
        print(f"rogue not advertised: {e}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
