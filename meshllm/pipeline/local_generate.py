"""Generation with the whole model in this process, through the cluster's own leader loop.

There is one decode loop in meshllm: the leader's (scheduler, chunked prefill, batching,
speculation, sampling on the last stage). `meshllm generate` without --peer, the benchmarks and
the tests' single-process references run it over one in-process stage (LocalPipeline), so every
speed-up and every feature lands once and a cluster's output is compared with the same loop
running the same arithmetic in one process.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence

from meshllm.engine.generate import DEFAULT_PREFILL_CHUNK, Completion, TextDelta, check_fits
from meshllm.engine.sampler import SamplingParams, TokenLogprobs
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.engine.stage_runner import StageRunner
from meshllm.model.decoder import Decoder
from meshllm.model.tokenizer import Tokenizer
from meshllm.pipeline.leader import Leader
from meshllm.pipeline.transport import LocalPipeline

_EVENT_TIMEOUT_S = 600.0  # one token slower than this: the local stage is wedged, fail loudly


def decoder_leader(decoder: Decoder, tokenizer: Tokenizer, max_num_seqs: int, kv_budget_tokens: int,
                   prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> Leader:
    """A leader over `decoder` (the whole model) as the one stage of an in-process pipeline."""
    assert decoder.has_embedding and decoder.has_head, "local generation needs the whole model"
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_batched_tokens=max(prefill_chunk, 512),
                             prefill_chunk=prefill_chunk, kv_budget_tokens=max(kv_budget_tokens, 1),
                             prefix_block_size=prefill_chunk, prefix_cache_blocks=0)
    eos = set(tokenizer.eos_token_ids) | set(decoder.config.eos_token_ids)
    return Leader(LocalPipeline([StageRunner(decoder)]), eos_token_ids=eos,
                  new_detokenizer=lambda context: tokenizer.decode_stream(context=context).step,
                  max_context=decoder.config.max_position_embeddings, config=config,
                  vocab_size=decoder.config.vocab_size)


def stream_many(decoder: Decoder, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
                params: Sequence[SamplingParams], prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> Iterator[TextDelta]:
    """Generate for every prompt at once; yields deltas as tokens are sampled (the last delta of a
    prompt carries its finish_reason). Closing the iterator early cancels what is left."""
    assert len(prompts) == len(params), (len(prompts), len(params))
    if not prompts:
        return
    for prompt, p in zip(prompts, params):
        check_fits(len(prompt), p, decoder.config.max_position_embeddings)
    budget = sum(len(prompt) + p.max_tokens for prompt, p in zip(prompts, params))
    leader = decoder_leader(decoder, tokenizer, len(prompts), budget, prefill_chunk)
    events: queue.Queue = queue.Queue()
    try:
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            leader.submit(list(prompt), p, lambda event, i=index: events.put((i, event)))
        unfinished = len(prompts)
        while unfinished:
            index, event = events.get(timeout=_EVENT_TIMEOUT_S)
            if event.error is not None:
                raise event.error
            if event.finish_reason is not None:
                unfinished -= 1
            if event.token_id is not None:
                yield TextDelta(index, event.text, event.token_id, event.logprobs, event.finish_reason)
    finally:
        leader.close()


def generate(decoder: Decoder, tokenizer: Tokenizer, prompt_ids: Sequence[int],
             params: SamplingParams) -> Iterator[str]:
    """Text deltas for one prompt, as they become safe to show (stop strings held back)."""
    for delta in stream_many(decoder, tokenizer, [prompt_ids], [params]):
        if delta.text:
            yield delta.text


def generate_many(decoder: Decoder, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
                  params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
    """Complete several prompts in one batch; same results as completing each alone."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    texts: list[list[str]] = [[] for _ in prompts]
    ids: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[TokenLogprobs]] = [[] for _ in prompts]
    reasons = [None] * len(prompts)
    for d in stream_many(decoder, tokenizer, prompts, per_prompt):
        texts[d.index].append(d.text)
        ids[d.index].append(d.token_id)
        if d.logprobs is not None:
            logprobs[d.index].append(d.logprobs)
        reasons[d.index] = d.finish_reason
    return [Completion("".join(texts[i]), tuple(ids[i]), reasons[i],
                       tuple(logprobs[i]) if per_prompt[i].logprobs is not None else None)
            for i in range(len(prompts))]
