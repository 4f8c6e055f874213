"""The single-process generate loop: one Decoder holding the whole model, no scheduler.

`meshllm generate` without --peer and the benchmarks use it. Prompts are prefilled
in chunks (so a long prompt never builds an O(n^2) attention buffer), then every
unfinished sequence decodes in the same flat batch, one token each per step.
Sampling uses the per-position draw seeds of the pipeline's last stage, so a
seeded request gives the same text here and through a cluster.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from meshllm.engine.kv_cache import SequenceKV
from meshllm.engine.sampler import SamplingParams, TokenLogprobs, position_generator, sample
from meshllm.engine.stopping import FinishReason, StopChecker
from meshllm.errors import BadRequest, ContextOverflow
from meshllm.model.decoder import Decoder, SeqSlice
from meshllm.model.tokenizer import Tokenizer

DEFAULT_PREFILL_CHUNK = 512  # tokens per prefill forward: big enough to keep matmuls efficient


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New text of prompt `index`; the last delta of a sequence carries its finish_reason."""

    index: int
    text: str
    token_id: int
    logprobs: TokenLogprobs | None = None
    finish_reason: FinishReason | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    logprobs: tuple[TokenLogprobs, ...] | None  # one per token when params.logprobs is set


def check_fits(num_prompt_tokens: int, params: SamplingParams, max_context: int) -> None:
    """Raise ContextOverflow when the prompt plus max_tokens exceed the model's context."""
    if num_prompt_tokens == 0:
        raise BadRequest("the prompt is empty: give at least one token of text")
    if num_prompt_tokens >= max_context:
        raise ContextOverflow(
            f"the prompt has {num_prompt_tokens} tokens but the model's context holds {max_context} "
            f"(prompt and generated tokens together). Shorten the prompt to under {max_context} tokens.")
    total = num_prompt_tokens + params.max_tokens
    if total > max_context:
        raise ContextOverflow(
            f"the prompt has {num_prompt_tokens} tokens and max_tokens is {params.max_tokens}: "
            f"{total} tokens do not fit the model's {max_context}-token context. Shorten the prompt "
            f"or lower max_tokens to at most {max_context - num_prompt_tokens}.")


class _Running:
    """One sequence inside the loop: its cache, stop state and seed."""

    def __init__(self, index: int, decoder: Decoder, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 params: SamplingParams):
        self.index = index
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = secrets.randbits(63) if params.seed is None else params.seed
        capacity = len(self.prompt_ids) + params.max_tokens  # allocated once, never regrown
        self.kv = SequenceKV(decoder.kv_layout(), capacity=capacity)
        self.checker = StopChecker(params, tokenizer.eos_token_ids, tokenizer.decode_stream().step)
        self.last_token: int | None = None

    def generator(self) -> torch.Generator | None:
        # Seed of the draw for the token at position kv.length, as the pipeline's last stage does.
        if self.params.greedy:
            return None
        return position_generator(self.seed, self.kv.length)


def stream_many(decoder: Decoder, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
                params: Sequence[SamplingParams], prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> Iterator[TextDelta]:
    """Generate for every prompt at once; yields deltas as tokens are sampled.

    Single-threaded: call from one thread. Closing the iterator early drops all caches.
    """
    assert decoder.has_embedding and decoder.has_head, "the local loop needs the whole model"
    assert len(prompts) == len(params), (len(prompts), len(params))
    for prompt, p in zip(prompts, params):
        check_fits(len(prompt), p, decoder.config.max_position_embeddings)
    running = [_Running(i, decoder, tokenizer, prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))]
    for seq in running:
        logits = _prefill(decoder, seq, prefill_chunk)
        yield from _accept(logits, [seq])
    running = [s for s in running if not s.checker.finished]
    while running:
        tokens = torch.tensor([s.last_token for s in running], dtype=torch.long)
        positions = torch.tensor([s.kv.length for s in running], dtype=torch.long)
        slices = [SeqSlice(s.kv, row, 1) for row, s in enumerate(running)]
        logits = decoder(tokens, positions, slices)
        yield from _accept(logits, running)
        running = [s for s in running if not s.checker.finished]


def _prefill(decoder: Decoder, seq: _Running, chunk: int) -> torch.Tensor:
    ids = torch.tensor(seq.prompt_ids, dtype=torch.long)
    n = ids.numel()
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        last = torch.tensor([end - start - 1]) if end == n else torch.tensor([], dtype=torch.long)
        logits = decoder(ids[start:end], torch.arange(start, end), [SeqSlice(seq.kv, 0, end - start)], last)
    return logits


def _accept(logits: torch.Tensor, seqs: list[_Running]) -> Iterator[TextDelta]:
    result = sample(logits, [s.params for s in seqs], [s.generator() for s in seqs])
    for s, token_id, logprobs in zip(seqs, result.token_ids.tolist(), result.logprobs):
        s.last_token = token_id
        text = s.checker.feed(token_id)
        yield TextDelta(s.index, text, token_id, logprobs, s.checker.finish_reason)


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
    reasons: list[FinishReason | None] = [None] * len(prompts)
    for d in stream_many(decoder, tokenizer, prompts, per_prompt):
        texts[d.index].append(d.text)
        ids[d.index].append(d.token_id)
        if d.logprobs is not None:
            logprobs[d.index].append(d.logprobs)
        reasons[d.index] = d.finish_reason
    return [Completion("".join(texts[i]), tuple(ids[i]), reasons[i],
                       tuple(logprobs[i]) if per_prompt[i].logprobs is not None else None)
            for i in range(len(prompts))]
