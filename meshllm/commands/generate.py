"""`meshllm generate`: complete one prompt and stream the text to the terminal.

Runs the whole model in this process, or with --peer through a pipeline planned
over the cluster's nodes; either way through the same leader loop (one in-process
stage locally). The prompt is checked
against the model's context before any weight is loaded, so a bad request fails
in a second with one line. Chat models get their chat template unless --raw.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from meshllm.commands.leader_slot import leader_slot
from meshllm.commands.plan import add_tp_argument
from meshllm.commands.threads import add_threads_argument, apply_threads
from meshllm.commands.transport_args import add_transport_arguments, tls_from_args
from meshllm.engine.dtypes import add_dtype_argument
from meshllm.engine.generate import check_fits
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_weights import QUANTIZE_TYPES
from meshllm.errors import BadRequest, PeerUnreachable, ShardUnavailable
from meshllm.model.source import ModelFiles, open_model
from meshllm.pipeline.events import GenerationEvent
from meshllm.spec.factory import SPECULATIVE_HELP, SpeculativeChoice
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.tls import TlsMode

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face model folder, .gguf file or Hub id (default: the demo model, "
                             "SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--prompt", required=True, help="the prompt text (a user message for chat models)")
    parser.add_argument("--raw", action="store_true",
                        help="send the prompt as is, without the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"most tokens to generate (default {_DEFAULTS['max_tokens']}, or what is left "
                             f"of the model's context after the prompt if less)")
    parser.add_argument("--temperature", type=float, default=_DEFAULTS["temperature"],
                        help=f"sampling temperature; 0 is greedy (default {_DEFAULTS['temperature']})")
    parser.add_argument("--top-p", type=float, default=_DEFAULTS["top_p"],
                        help=f"nucleus sampling mass in [0, 1] (default {_DEFAULTS['top_p']}: off)")
    parser.add_argument("--top-k", type=int, default=_DEFAULTS["top_k"],
                        help="sample among the k most likely tokens (default: all)")
    parser.add_argument("--seed", type=int, default=_DEFAULTS["seed"],
                        help="random seed; the same seed gives the same text (default: random)")
    parser.add_argument("--stop", action="append", default=[],
                        help="stop before this text; repeat for several (default: none)")
    add_dtype_argument(parser)
    parser.add_argument("--device", default="cpu",
                        help="without --peer: where weights, KV cache and compute go: cpu, cuda, cuda:N or mps "
                             "(default cpu; on a GPU, GGUF block-quantized weights stay blocks there and dense ones "
                             "are held in --dtype)")
    parser.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                        help="run through the cluster this node belongs to (repeatable; the first that "
                             "answers gives the fleet view); default: the whole model in this process")
    parser.add_argument("--key-file", type=Path, default=None,
                        help="cluster key file (with --peer; default the node's state-dir key)")
    parser.add_argument("--stages", type=int, default=None,
                        help="with --peer: split the model over this many nodes (default: fewest that fit)")
    add_tp_argument(parser)
    add_transport_arguments(parser)
    parser.add_argument("--quantize", choices=sorted(QUANTIZE_TYPES), default=None,
                        help="quantize a 16/32-bit model's linear weights at load: int8 (ggml Q8_0 blocks), int4 (Q4_0); "
                             "GGUF files stay in their own quantization without it (default: none)")
    parser.add_argument("--int8", dest="quantize", action="store_const", const="int8",
                        help="same as --quantize int8 (kept for old scripts)")
    parser.add_argument("--speculative", default=None, metavar="ngram|draft:MODEL|remote[:NODE]",
                        help=SPECULATIVE_HELP + " (default: off)")
    add_threads_argument(parser)


def run(args: argparse.Namespace) -> int:
    requested = args.max_tokens
    _sampling_params(args, _DEFAULTS["max_tokens"] if requested is None else requested)  # bad flags fail early
    files = open_model(args.model)
    prompt_ids = _prompt_ids(files, args.prompt, args.raw)
    # Without a chat turn the text goes on from the prompt's: printed after it, it keeps the space
    # before its first word (sentencepiece tokenizers fold that space into the word's token).
    continues = args.raw or files.tokenizer.chat_template is None
    room = files.config.max_position_embeddings - len(prompt_ids)
    params = _sampling_params(args, max(min(_DEFAULTS["max_tokens"], room), 1) if requested is None else requested)
    check_fits(len(prompt_ids), params, files.config.max_position_embeddings)  # before loading weights
    apply_threads(args.threads)
    if (args.tp or 1) > 1 and not args.peer:
        raise BadRequest(f"--tp {args.tp} splits stages over nodes of a cluster: give --peer HOST:PORT of one")
    started = time.perf_counter()
    if args.speculative is not None:
        SpeculativeChoice.parse(args.speculative)  # a bad value fails before any weight loads
    if args.peer:
        deltas = _cluster_stream(files, prompt_ids, params, args, continues)
    else:
        deltas = _local_stream(files, prompt_ids, params, args, continues)
    num_tokens, finish_reason, first_token_at = 0, None, None
    for delta in deltas:
        first_token_at = first_token_at or time.perf_counter()
        num_tokens += 1
        finish_reason = delta.finish_reason
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - (first_token_at or started)
    rate = f", {(num_tokens - 1) / elapsed:.1f} tok/s after the first" if num_tokens > 1 and elapsed > 0 else ""
    print(f"[{num_tokens} tokens, finish_reason {finish_reason}{rate}]", file=sys.stderr)
    return 0


def _local_stream(files: ModelFiles, prompt_ids: list[int], params: SamplingParams,
                  args: argparse.Namespace, continues: bool) -> Iterator[GenerationEvent]:
    """The whole model in this process as the one stage of the cluster's leader loop (which
    drafts with the chosen proposer, if any)."""
    from meshllm.pipeline.cluster import ServingOptions, local_leader

    options = ServingOptions(context_length=files.config.max_position_embeddings, max_batch=1,
                             dtype=args.dtype, quantization=args.quantize,
                             speculative=args.speculative, device=args.device)
    return _events(local_leader(files, options), prompt_ids, params, continues)


def _cluster_stream(files: ModelFiles, prompt_ids: list[int], params: SamplingParams,
                    args: argparse.Namespace, continues: bool) -> Iterator[GenerationEvent]:
    """Plan the model over the fleet the peers see, load the stages, and stream through them."""
    from meshllm.commands.cluster_key import resolve_key
    from meshllm.node import default_state_dir

    key = resolve_key(args.key_file, default_state_dir(), create=False)
    tls = tls_from_args(args)
    leader_id, slot_lock = leader_slot(default_state_dir())  # held until the stream ends (_events)
    try:
        return _events(_cluster_leader(files, args, key, tls, leader_id), prompt_ids, params, continues, slot_lock)
    except BaseException:
        if slot_lock is not None:
            slot_lock.close()
        raise


def _cluster_leader(files: ModelFiles, args: argparse.Namespace, key: bytes, tls: TlsMode, leader_id: str):
    """A leader of a plan over the fleet the peers see, its stages loaded, named `leader_id`."""
    from meshllm.cluster.gossip import fetch_view
    from meshllm.pipeline.cluster import ServingOptions
    from meshllm.pipeline.plan_owner import PlanOwner

    def fleet_view() -> list:
        # Asked again at each re-plan: the first peer that answers (one may be the node that failed).
        failures = []
        for peer in args.peer:
            try:
                return fetch_view(peer, key, tls=tls, node_id=leader_id)
            except PeerUnreachable as e:
                failures.append(str(e))
        raise PeerUnreachable("no peer answered: " + "; ".join(failures))

    fleet_view()  # no peer answers: fail now, with that message
    options = ServingOptions(context_length=files.config.max_position_embeddings, max_batch=1,
                             num_stages=args.stages, dtype=args.dtype,
                             quantization=args.quantize, speculative=args.speculative,
                             tensor_parallel=args.tp)
    owner = PlanOwner(files, fleet_view, ChannelPool(ChannelConfig(leader_id, key, tls)), options)
    leader = owner.start()
    plan = owner.plan
    if plan is None:
        leader.close()
        report = owner.health.report()
        raise ShardUnavailable(report.reason or "no plan fits the fleet", missing_bytes=report.missing_bytes,
                               part=report.missing)
    print("[" + ", ".join(f"{'+'.join(s.node_ids)}: layers {s.first_layer}-{s.last_layer - 1}"
                          for s in plan.stages) + "]", file=sys.stderr)
    return leader


def _events(leader, prompt_ids: list[int], params: SamplingParams, continues: bool,
            slot_lock: IO[str] | None = None) -> Iterator[GenerationEvent]:
    """The request's events, its error raised; the leader is closed when the stream ends (and its
    leader slot let go: the next run may be this leader again)."""
    try:
        for event in leader.generate(prompt_ids, params, continues_prompt=continues):
            if event.error is not None:
                raise event.error
            yield event
    finally:
        try:
            leader.close()
        finally:
            if slot_lock is not None:
                slot_lock.close()


def _sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          max_tokens=max_tokens, stop=tuple(args.stop))


def _prompt_ids(files: ModelFiles, prompt: str, raw: bool) -> list[int]:
    tokenizer = files.tokenizer
    if raw or tokenizer.chat_template is None:
        return tokenizer.encode(prompt)
    # The template writes BOS itself where the model wants one (as transformers encodes it).
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(text, add_special_tokens=False)
