"""TLS between nodes, by default with certificates derived from the cluster key.

Every holder of the cluster key derives the same CA key pair from it (HKDF, then
a P-256 scalar), so the key file stays the only thing users copy. Each process
makes its own P-256 key pair and has the CA sign a certificate for it; servers
require client certificates (mutual TLS) and both sides trust that CA alone. A
peer without the key can neither complete a handshake nor read the traffic.

Peers are dialled by address, and one node may be reached under several
(loopback, LAN, a NAT's), so certificates do not name addresses: every node
certificate carries the one DNS name NODE_TLS_NAME and clients check for it
(grpc.ssl_target_name_override). The CA, not the name, is what admits a peer;
which node answered is proven by the signed replies (transport/call_auth.py).

Users with their own PKI pass --tls-cert/--tls-key/--tls-ca (TlsFiles); those
are checked against the dialled address as usual. Plaintext exists only for
--insecure-plaintext.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshllm.errors import KeyFileError

NODE_TLS_NAME = "node.meshllm.invalid"  # .invalid (RFC 6761): a name, never an address to resolve
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
# Fixed, so every node derives a byte-identical CA certificate (with RFC 6979 signatures).
_CA_NOT_BEFORE = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
_CA_NOT_AFTER = datetime.datetime(9999, 12, 31, tzinfo=datetime.timezone.utc)
_NODE_CERT_DAYS = 3650  # one per process, made at start: its life is the process's
_CLOCK_SKEW = datetime.timedelta(days=1)  # peers' clocks may be behind ours


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for mutual TLS from the user's own PKI: this node's certificate and
    key, and the CA that signed every node's certificate."""

    cert: Path
    key: Path
    ca: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()
        except OSError as e:
            raise KeyFileError(f"cannot read TLS file: {e}. Check --tls-cert/--tls-key/--tls-ca.") from e

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


@dataclass(frozen=True, slots=True)
class Plaintext:
    """No TLS at all (--insecure-plaintext): anyone on the network path reads prompts,
    activations and tokens, and can alter streamed messages. Calls stay signed."""


PLAINTEXT = Plaintext()
# How a node protects its connections: None (the default) derives certificates from the
# cluster key; TlsFiles uses the user's own; PLAINTEXT none.
TlsMode = TlsFiles | Plaintext | None


@dataclass(frozen=True, slots=True)
class ClusterCA:
    key: ec.EllipticCurvePrivateKey
    cert_pem: bytes
    cert: x509.Certificate


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshllm"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


@functools.lru_cache(maxsize=8)
def cluster_ca(cluster_key: bytes) -> ClusterCA:
    """The CA every holder of `cluster_key` derives, byte for byte the same."""
    secret = HKDF(hashes.SHA256(), length=48, salt=None, info=b"meshllm tls ca v1").derive(cluster_key)
    scalar = int.from_bytes(secret, "big") % (_P256_ORDER - 1) + 1  # 384 bits mod a 256-bit order: no bias
    key = ec.derive_private_key(scalar, ec.SECP256R1())
    tag = hashlib.sha256(b"meshllm ca name" + secret).hexdigest()[:16]  # public; reveals nothing of the key
    name = _name(f"meshllm cluster CA {tag}")
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(int(tag, 16) | 1)
            .not_valid_before(_CA_NOT_BEFORE).not_valid_after(_CA_NOT_AFTER)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256(), ecdsa_deterministic=True))
    return ClusterCA(key, cert.public_bytes(serialization.Encoding.PEM), cert)


@dataclass(frozen=True, slots=True)
class NodeCertificate:
    key_pem: bytes
    cert_pem: bytes
    ca_pem: bytes


@functools.lru_cache(maxsize=32)
def node_certificate(cluster_key: bytes, common_name: str) -> NodeCertificate:
    """A fresh key pair for this process, certified by the cluster CA (made once per
    name and process). `common_name` is informational (the node id): peers admit the
    certificate for its issuer, and check NODE_TLS_NAME."""
    ca = cluster_ca(cluster_key)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(common_name[:64] or "meshllm node")).issuer_name(ca.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW).not_valid_after(now + datetime.timedelta(days=_NODE_CERT_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(NODE_TLS_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
            .sign(ca.key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return NodeCertificate(key_pem, cert.public_bytes(serialization.Encoding.PEM), ca.cert_pem)


def server_credentials(cluster_key: bytes, tls: TlsMode, node_id: str) -> grpc.ServerCredentials | None:
    """What NodeServer binds with; None means plaintext."""
    if isinstance(tls, Plaintext):
        return None
    if isinstance(tls, TlsFiles):
        return tls.server_credentials()
    cert = node_certificate(cluster_key, node_id)
    return grpc.ssl_server_credentials([(cert.key_pem, cert.cert_pem)], root_certificates=cert.ca_pem,
                                       require_client_auth=True)


def channel_credentials(cluster_key: bytes, tls: TlsMode, node_id: str
                        ) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """(credentials or None for plaintext, extra channel options) for dialling peers."""
    if isinstance(tls, Plaintext):
        return None, []
    if isinstance(tls, TlsFiles):
        return tls.channel_credentials(), []
    cert = node_certificate(cluster_key, node_id)
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.ca_pem, private_key=cert.key_pem,
                                               certificate_chain=cert.cert_pem)
    return credentials, [("grpc.ssl_target_name_override", NODE_TLS_NAME), ("grpc.default_authority", NODE_TLS_NAME)]
