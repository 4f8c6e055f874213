"""`meshllm node`: run one node until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshllm.pipeline.node_stage import attach_stage_service
from meshllm.spec.factory import DraftOptions
from meshllm.spec.node_proposer import attach_proposer_service
from meshllm.node import KEY_FILE_NAME, Node, NodeConfig, default_state_dir, run_until_signalled
from meshllm.commands.cluster_key import resolve_key
from meshllm.commands.threads import add_threads_argument, apply_threads
from meshllm.commands.transport_args import add_transport_arguments, tls_from_args

_DEFAULTS = NodeConfig(state_dir=Path("unused"))  # each default lives in NodeConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    parser.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host}; 0.0.0.0 for the LAN)")
    parser.add_argument("--port", type=int, default=d.port, help=f"gRPC port (default {d.port}; 0 picks a free one)")
    parser.add_argument("--advertise-host", default=None,
                        help="address other nodes dial (default: --host, or a LAN address when --host is 0.0.0.0)")
    parser.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                        help="seed peer to gossip with (repeatable)")
    parser.add_argument("--models", action="append", default=[], type=Path, metavar="PATH",
                        help="model folder, .gguf file, or folder of them to advertise (repeatable)")
    parser.add_argument("--key-file", type=Path, default=None,
                        help=f"cluster key file (default <state-dir>/{KEY_FILE_NAME}, generated on first start)")
    parser.add_argument("--node-id", default=None, help="unique id of this node (default <hostname>-<port>)")
    parser.add_argument("--gossip-interval", type=float, default=d.gossip_interval_s,
                        help=f"seconds between gossip rounds (default {d.gossip_interval_s})")
    parser.add_argument("--ttl", type=float, default=d.ttl_s,
                        help=f"seconds this node's card stays valid without a refresh (default {d.ttl_s})")
    parser.add_argument("--no-discovery", action="store_true", help="turn off mDNS/DNS-SD discovery on the LAN")
    parser.add_argument("--parent-pid", type=int, default=None, metavar="PID",
                        help="stop when process PID, which started this node, ends (launchers such as "
                             "`meshllm demo` pass their own, so a killed launcher leaves no nodes behind)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help=f"folder for the cluster key and probe cache (default {default_state_dir()})")
    add_transport_arguments(parser)
    parser.add_argument("--device", default=d.device, help=f"compute device: cpu, cuda:0, mps (default {d.device})")
    parser.add_argument("--draft-model", action="append", default=[], type=Path, metavar="PATH",
                        help="serve this model as a draft-model proposer for other nodes' speculative decoding "
                             "(repeatable; loaded at start). Every node also serves an n-gram proposer")
    parser.add_argument("--draft-quantize", choices=["int8", "int4", "none"], default="int8",
                        help="what a 16/32-bit draft model's linear weights become at load (GGUF blocks of 4-5 bits "
                             "stay as they are): int8 (Q8_0, default), int4 (Q4_0: ggml's fastest CPU kernels, for "
                             "a draft that must outpace a verifier as big as itself; costs acceptance) or none")
    parser.add_argument("--max-memory", type=parse_size, default=None, metavar="SIZE",
                        help="the most memory this node offers to plans, e.g. 6GiB or 512MiB (default: all that "
                             "is free); leaves the rest to other programs")
    parser.add_argument("--plan-lease", type=float, default=d.plan_lease_s, metavar="SECONDS",
                        help=f"drop a plan's layers, KV and prefix blocks (and a proposer's state of a sequence) "
                             f"when no leader has used them this long: its leader is gone. Live leaders renew "
                             f"every few seconds (default {d.plan_lease_s:g})")
    parser.add_argument("--collective-port", type=int, default=None, metavar="PORT",
                        help="take part in tensor-parallel groups: host their rendezvous store on PORT (0 picks a "
                             "free one), advertise it, and measure links to peers that do too. Its traffic (gloo) "
                             "is not encrypted: use it on a trusted link (Thunderbolt, a switch you own). "
                             "Default: off")
    add_threads_argument(parser)


_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 1000, "MB": 1000**2, "GB": 1000**3}


def draft_options(args: argparse.Namespace) -> DraftOptions:
    return DraftOptions(quantization=None if args.draft_quantize == "none" else args.draft_quantize)


def parse_size(text: str) -> int:
    """'6GiB', '512MiB', '4.5MB', '1000000' -> bytes."""
    number = text.rstrip("KMGiBkmgib")
    unit = text[len(number):].upper()
    try:
        return int(float(number) * _UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 6GiB, 512MiB or 4.5MB") from None


def run(args: argparse.Namespace) -> int:
    state_dir = args.state_dir or default_state_dir()
    apply_threads(args.threads)
    try:
        config = NodeConfig(
            host=args.host, port=args.port, advertise_host=args.advertise_host, peers=tuple(args.peer),
            model_paths=tuple(args.models), node_id=args.node_id, gossip_interval_s=args.gossip_interval,
            ttl_s=args.ttl, discovery=not args.no_discovery, state_dir=state_dir, tls=tls_from_args(args),
            device=args.device, max_memory_bytes=args.max_memory,
            collective_port=args.collective_port, plan_lease_s=args.plan_lease)
    except ValueError as e:
        raise SystemExit(f"meshllm node: {e}") from None
    key = resolve_key(args.key_file, state_dir, create=True)
    node = Node(config, key)
    attach_stage_service(node, key)
    attach_proposer_service(node, list(args.draft_model), draft_options(args))
    run_until_signalled(node, on_ready=lambda n: print(f"meshllm node {n.node_id} listening on {n.address}",
                                                       flush=True), parent_pid=args.parent_pid)
    return 0
