"""What a generation request is checked against, and what local generation yields.

The loop itself is the leader's (pipeline/leader.py); pipeline/local_generate.py runs it over
the whole model in this process.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshllm.engine.sampler import SamplingParams, TokenLogprobs
from meshllm.engine.stopping import FinishReason
from meshllm.errors import BadRequest, ContextOverflow

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
