"""From a validated request to the sequences the leader runs: prompt token ids and
per-choice sampling parameters.

Runs in a worker thread (chat templates and tokenizing a long prompt take time
the event loop should not spend).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from meshllm.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from meshllm.engine.sampler import SamplingParams
from meshllm.errors import BadRequest, ContextOverflow
from meshllm.model.tokenizer import Tokenizer

_SEED_RANGE = 1 << 63  # seeds travel as uint64 on the wire; keep them non-negative


@dataclass(frozen=True, slots=True)
class ChoiceRequest:
    """One sequence of a request: choice `index` continues prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


def chat_choices(tokenizer: Tokenizer, max_context: int, body: ChatCompletionRequest) -> list[ChoiceRequest]:
    text = tokenizer.apply_chat_template([m.as_template_input() for m in body.messages])
    # A model's own template writes BOS itself where it wants one (transformers encodes the
    # rendered text without special tokens); the plain fallback template does not.
    ids = tokenizer.encode(text, add_special_tokens=tokenizer.chat_template is None)
    return _expand([ids], body, body.completion_limit, body.num_logprobs, max_context)


def completion_choices(tokenizer: Tokenizer, max_context: int, body: CompletionRequest) -> list[ChoiceRequest]:
    prompts = body.prompts
    if not prompts:
        raise BadRequest("prompt is empty: give a string, a list of strings, or token ids")
    vocab = tokenizer.vocab_size
    all_ids = []
    for prompt in prompts:
        if isinstance(prompt, str):
            all_ids.append(tokenizer.encode(prompt))
            continue
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} in the prompt is outside this model's vocabulary [0, {vocab})")
        all_ids.append(list(prompt))
    return _expand(all_ids, body, body.max_tokens, body.logprobs, max_context)


def _expand(prompts: list[list[int]], body: SamplingFields, max_tokens: int | None, logprobs: int | None,
            max_context: int) -> list[ChoiceRequest]:
    """n choices per prompt, OpenAI's order (prompt-major). Choice j gets seed base + j, so a
    request with a seed is reproducible and its choices still differ from one another."""
    base_seed = body.seed if body.seed is not None else secrets.randbits(63)
    choices = []
    for prompt_index, ids in enumerate(prompts):
        if not ids:
            raise BadRequest(f"prompt {prompt_index} is empty: at least one token is needed")
        limit = max_tokens if max_tokens is not None else max_context - len(ids)
        if limit < 1:
            raise ContextOverflow(f"the prompt has {len(ids)} tokens, the whole context of {max_context} "
                                  f"tokens leaves no room for a completion; shorten the prompt")
        for j in range(body.n):
            params = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k_or_none,
                seed=(base_seed + j) % _SEED_RANGE, max_tokens=limit, stop=body.stop_strings,
                logprobs=logprobs, ignore_eos=body.ignore_eos)
            choices.append(ChoiceRequest(len(choices), prompt_index, ids, params))
    return choices
