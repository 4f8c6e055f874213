"""`meshllm serve`: a node that also answers OpenAI-compatible HTTP requests.

Takes every `meshllm node` flag, plus the model to serve and the HTTP API's
settings. With --peer, --stages or --tp the model is planned across the fleet's
stage nodes (this node is one of them); otherwise it runs whole in this process.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from meshllm.api.app import create_app
from meshllm.api.cluster_backend import build_cluster_backend
from meshllm.api.backend import Backend, build_local_backend
from meshllm.api.config import MIB, APIConfig, add_api_guard_arguments, api_key_from
from meshllm.api.server import APIServer, listen
from meshllm.cluster.discovery import is_wildcard
from meshllm.commands import node as node_command
from meshllm.commands.cluster_key import resolve_key
from meshllm.commands.plan import add_tp_argument
from meshllm.commands.threads import apply_threads
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.engine.dtypes import add_dtype_argument
from meshllm.engine.stage_weights import QUANTIZE_TYPES
from meshllm.model.source import default_model_path, open_model
from meshllm.node import Node, NodeConfig, default_state_dir, run_until_signalled
from meshllm.pipeline.cluster import ServingOptions, wait_for_fleet
from meshllm.pipeline.failover import FailoverConfig
from meshllm.pipeline.node_stage import attach_stage_service
from meshllm.spec.factory import SPECULATIVE_HELP, SpeculativeChoice
from meshllm.spec.node_proposer import attach_proposer_service
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.server import join_host_port

_API = APIConfig()
_SERVING = ServingOptions()
_SCHEDULER = SchedulerConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    node_command.add_arguments(parser)
    parser.add_argument("--model", type=Path, default=None,
                        help="model folder or .gguf file to serve (default: the SmolLM2-135M-Instruct demo GGUF)")
    add_dtype_argument(parser)
    parser.add_argument("--quantize", choices=sorted(QUANTIZE_TYPES), default=None,
                        help="quantize a 16/32-bit model's linear weights at load: int8 (ggml Q8_0 blocks), int4 (Q4_0); "
                             "GGUF files stay in their own quantization without it (default: none)")
    parser.add_argument("--max-context", type=int, default=_SERVING.context_length,
                        help=f"tokens (prompt + completion) per request, capped by the model's own context "
                             f"(default {_SERVING.context_length})")
    parser.add_argument("--max-batch", type=int, default=_SERVING.max_batch,
                        help=f"sequences decoding at once (default {_SERVING.max_batch})")
    parser.add_argument("--max-queue", type=int, default=_SCHEDULER.max_waiting,
                        help=f"requests waiting beyond --max-batch before new ones get HTTP 429 "
                             f"(default {_SCHEDULER.max_waiting})")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="make each request's output independent of what shares its batch (slower)")
    parser.add_argument("--stages", type=int, default=None,
                        help="plan the model across this many stage nodes of the fleet (default: in this "
                             "process alone, or the fewest nodes that fit when --peer is given)")
    add_tp_argument(parser)
    parser.add_argument("--step-timeout", type=float, default=_SERVING.step_timeout_s,
                        help=f"seconds without any reply from the pipeline before it counts as stalled even "
                             f"though every stage answers health checks (default {_SERVING.step_timeout_s:g}; a "
                             f"stage that stops answering is detected in ~1-2 s from measured step times)")
    parser.add_argument("--max-failovers", type=int, default=_SERVING.failover.max_failovers,
                        help=f"failovers one request may go through before it ends with pipeline_stalled "
                             f"(default {_SERVING.failover.max_failovers})")
    parser.add_argument("--fallback-local", action="store_true",
                        help="when no plan fits the fleet, run the model on this node alone if it fits here")
    parser.add_argument("--fleet-timeout", type=float, default=120.0,
                        help="seconds to wait for enough nodes to advertise the model (default 120)")
    parser.add_argument("--speculative", default=None, metavar="ngram|draft:MODEL|remote[:NODE]",
                        help=SPECULATIVE_HELP + "; a request may opt out with {\"speculative\": false} in its "
                             "body (default: off)")
    parser.add_argument("--api-host", default=_API.host,
                        help=f"address the HTTP API listens on (default {_API.host}; 0.0.0.0 for the LAN)")
    parser.add_argument("--api-port", type=int, default=_API.port,
                        help=f"HTTP API port (default {_API.port}; 0 picks a free one)")
    add_api_guard_arguments(parser)
    parser.add_argument("--request-timeout", type=float, default=_API.request_timeout_s,
                        help=f"seconds before a running request is cancelled (default {_API.request_timeout_s:g})")


def api_config(args: argparse.Namespace) -> APIConfig:
    return APIConfig(host=args.api_host, port=args.api_port, api_key=api_key_from(args.api_key),
                     request_timeout_s=args.request_timeout, max_body_bytes=int(args.max_body_mib * MIB),
                     chat_template_kwargs=args.chat_template_kwargs)


def serving_options(args: argparse.Namespace) -> ServingOptions:
    if args.max_context < 2 or args.max_batch < 1:
        raise ValueError(f"--max-context must be at least 2 and --max-batch at least 1, got {args.max_context} "
                         f"and {args.max_batch}")
    if args.step_timeout <= 0 or args.max_failovers < 0:
        raise ValueError(f"--step-timeout must be positive and --max-failovers at least 0, got "
                         f"{args.step_timeout} and {args.max_failovers}")
    scheduler = SchedulerConfig(max_waiting=args.max_queue)
    if args.speculative is not None:
        SpeculativeChoice.parse(args.speculative)
    return ServingOptions(context_length=args.max_context, max_batch=args.max_batch, dtype=args.dtype,
                          batch_invariant=args.batch_invariant, quantization=args.quantize,
                          scheduler=scheduler, step_timeout_s=args.step_timeout,
                          failover=FailoverConfig(max_failovers=args.max_failovers),
                          fallback_local=args.fallback_local, speculative=args.speculative,
                          tensor_parallel=args.tp)


def node_config(args: argparse.Namespace, model_path: Path) -> NodeConfig:
    # Mirrors `meshllm node`; the served model is advertised with the others.
    return NodeConfig(
        host=args.host, port=args.port, advertise_host=args.advertise_host, peers=tuple(args.peer),
        model_paths=(*args.models, model_path), node_id=args.node_id, gossip_interval_s=args.gossip_interval,
        ttl_s=args.ttl, discovery=not args.no_discovery, state_dir=args.state_dir or default_state_dir(),
        tls=node_command.tls_from_args(args), device=args.device, max_memory_bytes=args.max_memory,
        collective_port=args.collective_port, plan_lease_s=args.plan_lease)


def build_backend(args: argparse.Namespace, node: Node, key: bytes) -> Backend:
    """The model this node serves: across the fleet (cluster mode) or whole in this process."""
    options = serving_options(args)
    if not args.peer and args.stages is None and (args.tp or 1) == 1:
        return build_local_backend(args.model, options, fleet_view=node.registry.snapshot)
    files = open_model(args.model)
    wait_for_fleet(node.registry.snapshot, files.source.fingerprint(), (args.stages or 1) * (args.tp or 1),
                   args.fleet_timeout)
    channels = ChannelPool(ChannelConfig(node.node_id, key, node.config.tls))
    backend, owner = build_cluster_backend(files, node.registry.snapshot, channels,
                                           replace(options, num_stages=args.stages))
    plan = owner.plan
    if plan is None:
        print(f"meshllm serve: no plan fits yet ({backend.health.report().reason}); retrying as nodes join",
              flush=True)
    else:
        for i, s in enumerate(plan.stages):
            group = f" with {', '.join(w.node_id for w in s.workers)} (tensor-parallel)" if s.workers else ""
            print(f"meshllm serve: stage {i} on {s.node_id} ({s.address}){group} holds layers "
                  f"{s.first_layer}-{s.last_layer - 1}", flush=True)
    return backend


def run(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    try:
        api = api_config(args)
        serving_options(args)  # reject bad flags before anything loads
        config = node_config(args, args.model or default_model_path())
    except ValueError as e:
        raise SystemExit(f"meshllm serve: {e}") from None
    sock = listen(api.host, api.port)  # a taken port fails before a key, a node or a plan's weights
    key = resolve_key(args.key_file, config.state_dir, create=True)
    node = Node(config, key)
    attach_stage_service(node, key)
    attach_proposer_service(node, list(args.draft_model), node_command.draft_options(args))
    running: dict = {}

    def on_ready(n: Node) -> None:
        # The node gossips first: cluster mode plans over the fleet it sees.
        backend = running["backend"] = build_backend(args, n, key)
        server = running["server"] = APIServer(create_app(backend, api), api.host, api.port, sock)
        server.start()
        api_host = n.address.rpartition(":")[0] if is_wildcard(api.host) else api.host
        n.card.set_api_address(join_host_port(api_host.strip("[]"), server.port))
        n.registry.update_own(n.card.build())  # advertise the API now, not at the next gossip round
        print(f"meshllm serve: node {n.node_id} on {n.address}; serving {backend.model_id} at {server.url}/v1",
              flush=True)

    def on_stopping() -> None:
        # The leader first: it ends every running request with a "shutting down" error, which
        # open streams send as their last event; then the HTTP server, whose connections are done
        # (the other way round, uvicorn cut the streams off after its grace period, mid-reply).
        if "backend" in running:
            running["backend"].close()
        if "server" in running:
            running["server"].stop()

    run_until_signalled(node, on_ready=on_ready, on_stopping=on_stopping)
    return 0
