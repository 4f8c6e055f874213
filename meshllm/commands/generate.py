"""`meshllm generate`: complete one prompt and stream the text to the terminal.

Runs the whole model in this process (engine/generate.py), or with --peer
through a pipeline planned over the cluster's nodes. The prompt is checked
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

import torch
from tqdm import tqdm

from meshllm.commands.plan import add_tp_argument
from meshllm.commands.transport_args import add_transport_arguments, tls_from_args
from meshllm.engine.generate import TextDelta, check_fits, stream_many
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.weight_forms import prepare_for_cpu
from meshllm.errors import BadRequest, PeerUnreachable, ShardUnavailable
from meshllm.model.loader import load_decoder
from meshllm.model.source import ModelFiles, open_model
from meshllm.pipeline.events import GenerationEvent
from meshllm.spec.factory import SPECULATIVE_HELP, SpeculativeChoice
from meshllm.transport.channels import ChannelConfig, ChannelPool

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Measured with torch 2.13 on an AVX-512 (Sapphire Rapids) CPU, 2 threads (bench/decode.py):
# fp16 prefills fastest (as fast as fp32, at half its memory; bf16 GEMMs run ~0.6x without
# AMX) and decodes as fast as fp32. Prepacked bf16 (--dtype bf16) decodes faster, 1.1x on
# SmolLM2-135M and 1.6x on a 1.1B model, at that prefill cost; --int8 is faster still.
AUTO_DTYPE = {"cpu": "fp16"}
LEADER_ID = "meshllm-generate"  # who `generate --peer` is to the nodes it calls


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
                        help=f"nucleus sampling mass in (0, 1] (default {_DEFAULTS['top_p']}: off)")
    parser.add_argument("--top-k", type=int, default=_DEFAULTS["top_k"],
                        help="sample among the k most likely tokens (default: all)")
    parser.add_argument("--seed", type=int, default=_DEFAULTS["seed"],
                        help="random seed; the same seed gives the same text (default: random)")
    parser.add_argument("--stop", action="append", default=[],
                        help="stop before this text; repeat for several (default: none)")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="weight and activation dtype (default auto: "
                             f"{AUTO_DTYPE['cpu']} on CPU, the fastest measured); on CPU bf16 weights are "
                             "prepacked for oneDNN: faster decode, slower prefill than fp16")
    parser.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                        help="run through the cluster this node belongs to (repeatable; the first that "
                             "answers gives the fleet view); default: the whole model in this process")
    parser.add_argument("--key-file", type=Path, default=None,
                        help="cluster key file (with --peer; default the node's state-dir key)")
    parser.add_argument("--stages", type=int, default=None,
                        help="with --peer: split the model over this many nodes (default: fewest that fit)")
    add_tp_argument(parser)
    add_transport_arguments(parser)
    parser.add_argument("--int8", action="store_true",
                        help="keep linear weights as int8 with one scale per row: decodes "
                             "~1.5x faster on CPU, output close to but not identical with 16-bit weights")
    parser.add_argument("--speculative", default=None, metavar="ngram|draft:MODEL|remote[:NODE]",
                        help=SPECULATIVE_HELP + " (default: off)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice, one per core)")


def run(args: argparse.Namespace) -> int:
    requested = args.max_tokens
    _sampling_params(args, _DEFAULTS["max_tokens"] if requested is None else requested)  # bad flags fail early
    files = open_model(args.model)
    prompt_ids = _prompt_ids(files, args.prompt, args.raw)
    room = files.config.max_position_embeddings - len(prompt_ids)
    params = _sampling_params(args, max(min(_DEFAULTS["max_tokens"], room), 1) if requested is None else requested)
    check_fits(len(prompt_ids), params, files.config.max_position_embeddings)  # before loading weights
    if args.threads is not None:
        if args.threads < 1:
            raise BadRequest(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if (args.tp or 1) > 1 and not args.peer:
        raise BadRequest(f"--tp {args.tp} splits stages over nodes of a cluster: give --peer HOST:PORT of one")
    started = time.perf_counter()
    if args.speculative is not None:
        SpeculativeChoice.parse(args.speculative)  # a bad value fails before any weight loads
    if args.peer:
        deltas = _cluster_stream(files, prompt_ids, params, args)
    elif args.speculative is not None:
        deltas = _local_leader_stream(files, prompt_ids, params, args)
    else:
        deltas = _local_stream(files, prompt_ids, params, resolve_dtype(args.dtype), args.int8)
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
                  dtype: torch.dtype, int8: bool = False) -> Iterator[TextDelta]:
    # The whole model in this process; a --peer branch (cluster) would return the same deltas.
    with tqdm(total=1, desc=f"loading {files.model_id}", unit="tensor", file=sys.stderr, leave=False) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        decoder = load_decoder(files.source, files.config, dtype=dtype, progress=progress)
    prepare_for_cpu(decoder, "int8" if int8 else None, batch_invariant=False)
    return stream_many(decoder, files.tokenizer, [prompt_ids], [params])


def _local_leader_stream(files: ModelFiles, prompt_ids: list[int], params: SamplingParams,
                         args: argparse.Namespace) -> Iterator[GenerationEvent]:
    """The whole model in this process behind a leader, which drafts with the chosen proposer."""
    from meshllm.pipeline.cluster import ServingOptions, local_leader

    options = ServingOptions(context_length=files.config.max_position_embeddings, max_batch=1,
                             dtype=_option_dtype(args.dtype), quantization="int8" if args.int8 else None,
                             speculative=args.speculative)
    leader = local_leader(files, options)
    try:
        for event in leader.generate(prompt_ids, params):
            if event.error is not None:
                raise event.error
            yield event
    finally:
        leader.close()


def _option_dtype(name: str) -> str:
    return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[AUTO_DTYPE["cpu"] if name == "auto" else name]


def _cluster_stream(files: ModelFiles, prompt_ids: list[int], params: SamplingParams,
                    args: argparse.Namespace) -> Iterator[GenerationEvent]:
    """Plan the model over the fleet the peers see, load the stages, and stream through them."""
    from meshllm.cluster.gossip import fetch_view
    from meshllm.commands.node import resolve_key
    from meshllm.node import default_state_dir
    from meshllm.pipeline.cluster import ServingOptions
    from meshllm.pipeline.plan_owner import PlanOwner

    key = resolve_key(args.key_file, default_state_dir(), create=False)
    tls = tls_from_args(args)

    def fleet_view() -> list:
        # Asked again at each re-plan: the first peer that answers (one may be the node that failed).
        failures = []
        for peer in args.peer:
            try:
                return fetch_view(peer, key, tls=tls, node_id=LEADER_ID)
            except PeerUnreachable as e:
                failures.append(str(e))
        raise PeerUnreachable("no peer answered: " + "; ".join(failures))

    fleet_view()  # no peer answers: fail now, with that message
    options = ServingOptions(context_length=files.config.max_position_embeddings, max_batch=1,
                             num_stages=args.stages, dtype=_option_dtype(args.dtype),
                             quantization="int8" if args.int8 else None, speculative=args.speculative,
                             tensor_parallel=args.tp)
    owner = PlanOwner(files, fleet_view, ChannelPool(ChannelConfig(LEADER_ID, key, tls)), options)
    leader = owner.start()
    plan = owner.plan
    if plan is None:
        leader.close()
        report = owner.health.report()
        raise ShardUnavailable(report.reason or "no plan fits the fleet", missing_bytes=report.missing_bytes,
                               part=report.missing)
    print("[" + ", ".join(f"{'+'.join(s.node_ids)}: layers {s.first_layer}-{s.last_layer - 1}"
                          for s in plan.stages) + "]", file=sys.stderr)
    try:
        for event in leader.generate(prompt_ids, params):
            if event.error is not None:
                raise event.error
            yield event
    finally:
        leader.close()


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


def resolve_dtype(name: str) -> torch.dtype:
    return DTYPES[AUTO_DTYPE["cpu"] if name == "auto" else name]
