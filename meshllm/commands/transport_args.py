"""The flags that say how a command's gRPC connections are protected (no heavy imports:
`status` and `plan` start fast). Every command that serves or dials nodes takes them."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshllm.transport.tls import PLAINTEXT, TlsFiles, TlsMode


def add_transport_arguments(parser: argparse.ArgumentParser) -> None:
    """How this command's connections to nodes are protected: every command that serves
    or dials a node takes these, and must match the cluster's."""
    parser.add_argument("--tls-cert", type=Path,
                        help="PEM certificate from your own CA, with --tls-key and --tls-ca (default: TLS "
                             "certificates derived from the cluster key)")
    parser.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    parser.add_argument("--tls-ca", type=Path, help="PEM of the CA that signed every node's --tls-cert")
    parser.add_argument("--insecure-plaintext", action="store_true",
                        help="no TLS between nodes: prompts, activations and tokens cross the network in clear "
                             "(calls stay signed); every node and client of the cluster must pass it")


def tls_from_args(args: argparse.Namespace) -> TlsMode:
    files = (args.tls_cert, args.tls_key, args.tls_ca)
    if args.insecure_plaintext:
        if any(files):
            raise SystemExit("meshllm: --insecure-plaintext and --tls-cert/--tls-key/--tls-ca exclude each other")
        return PLAINTEXT
    if not any(files):
        return None
    if not all(files):
        raise SystemExit("meshllm: mTLS needs all of --tls-cert, --tls-key and --tls-ca")
    return TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)
