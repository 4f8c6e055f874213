"""From a validated request to the sequences the leader runs: prompt token ids and
per-choice sampling parameters.

Runs in a worker thread (chat templates and tokenizing a long prompt take time
the event loop should not spend). Text is checked before it is tokenized: a lone
UTF-16 surrogate is a 400, and a text too long for the context whatever its
tokens is refused by its length alone, so no request tokenizes megabytes.
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
    speculative: bool | None = None  # the request's override of the server's speculative decoding


# Normalizers may fold a few characters into one (composed accents): allow for it, so
# the length check never refuses a prompt that would fit.
_NORMALIZER_SLACK = 2


def checked_text(tokenizer: Tokenizer, text: str, max_context: int, what: str) -> str:
    """`text`, once it is known to be valid Unicode and not certainly over the context."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{what} is not valid Unicode: it holds a lone UTF-16 surrogate "
                         f"(U+{ord(e.object[e.start]):04X}) at character {e.start}, as a client that splits an "
                         f"emoji or other character in two sends; send whole characters") from None
    at_least = len(text) // (tokenizer.max_token_chars * _NORMALIZER_SLACK)
    if at_least > max_context:
        raise ContextOverflow(f"{what} has {len(text)} characters, so at least {at_least} tokens; the context "
                              f"holds {max_context} tokens. Shorten the prompt")
    return text


def chat_choices(tokenizer: Tokenizer, max_context: int, body: ChatCompletionRequest) -> list[ChoiceRequest]:
    messages = [m.as_template_input() for m in body.messages]
    for i, message in enumerate(messages):
        for field in ("content", "name"):
            if field in message:
                checked_text(tokenizer, message[field], max_context, f"messages[{i}].{field}")
    text = checked_text(tokenizer, tokenizer.apply_chat_template(messages), max_context, "the rendered chat")
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
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            all_ids.append(tokenizer.encode(checked_text(tokenizer, prompt, max_context, f"prompt {i}")))
            continue
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} in the prompt is outside this model's vocabulary [0, {vocab})")
        all_ids.append(list(prompt))
    return _expand(all_ids, body, body.max_tokens, body.logprobs, max_context)


def _expand(prompts: list[list[int]], body: SamplingFields, max_tokens: int | None, logprobs: int | None,
            max_context: int) -> list[ChoiceRequest]:
    """n choices per prompt, OpenAI's order (prompt-major). Choice j gets seed base + j, so a
    request with a seed is reproducible and its choices still differ from one another. Without a
    seed each choice draws its own at the leader, which may then verify sampled drafts with
    min(1, p/q) (not bit-reproducible, exactly distributed)."""
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
                seed=None if body.seed is None else (base_seed + j) % _SEED_RANGE, max_tokens=limit, stop=body.stop_strings,
                logprobs=logprobs, ignore_eos=body.ignore_eos)
            choices.append(ChoiceRequest(len(choices), prompt_index, ids, params, body.speculative))
    return choices
