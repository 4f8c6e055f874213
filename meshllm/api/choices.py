"""What one request's events add up to: per-choice text, finish reason and logprobs
(in the chat or the legacy-completions shape), and the usage of the whole request."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshllm.api.prompts import ChoiceRequest
from meshllm.api.responses import ChatLogprobs, CompletionLogprobs, PromptTokensDetails, TokenLogprob, TopLogprob, Usage
from meshllm.engine.sampler import TokenLogprobs
from meshllm.errors import MeshError, SequenceFailed
from meshllm.model.tokenizer import Tokenizer
from meshllm.pipeline.events import GenerationEvent


def failure_of(event: GenerationEvent) -> MeshError | None:
    """The error of an event that ends its sequence without a result, else None."""
    if event.finish_reason in ("error", "cancelled"):
        return event.error or SequenceFailed(f"sequence {event.seq_id} ended: {event.finish_reason}; retry")
    return None


@dataclass
class ChoiceState:
    """Everything a choice produced so far. Touched only on the event loop."""

    request: ChoiceRequest
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0

    def add(self, event: GenerationEvent) -> MeshError | None:
        """Account for `event`; returns the error when the sequence failed."""
        self.text.append(event.text)
        if event.token_id is not None:
            self.num_tokens += 1
        if event.logprobs is not None:
            self.logprobs.append(event.logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        error = failure_of(event)
        if error is not None:
            return error
        self.finish_reason = event.finish_reason or self.finish_reason
        return None


def usage(states: list[ChoiceState]) -> Usage:
    """Prompt tokens count once per prompt (not per choice), as OpenAI counts them."""
    prompts: dict[int, ChoiceState] = {}
    for s in states:
        prompts.setdefault(s.request.prompt_index, s)
    prompt_tokens = sum(len(s.request.prompt_ids) for s in prompts.values())
    completion_tokens = sum(s.num_tokens for s in states)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=sum(s.num_cached_tokens for s in prompts.values())))


class LogprobFormatter:
    """Token ids -> the token strings OpenAI's logprob shapes carry. Thread-safe enough: the
    cache is a dict written with whole values."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        # Decoding a token alone drops the leading space sentencepiece marks with U+2581; decoding
        # it after an anchor character and removing the anchor keeps it, for every tokenizer kind.
        self._anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        self._anchor_text = tokenizer.decode(self._anchor, skip_special_tokens=False)
        self._texts: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        # A token that is part of a UTF-8 character decodes to U+FFFD; OpenAI has the same
        # limitation, and `bytes` in the chat shape is what clients use to reassemble it.
        text = self._texts.get(token_id)
        if text is None:
            joined = self.tokenizer.decode(self._anchor + [token_id], skip_special_tokens=False)
            text = joined[len(self._anchor_text):] if joined.startswith(self._anchor_text) else \
                self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def chat(self, entries: list[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for e in entries:
            text = self.token(e.token_id)
            tops = [TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                    for t, lp in zip(map(self.token, e.top_ids), e.top_logprobs)]
            content.append(TokenLogprob(token=text, logprob=e.logprob, bytes=list(text.encode()), top_logprobs=tops))
        return ChatLogprobs(content=content)

    def completion(self, entries: list[TokenLogprobs], text_offset: int = 0) -> CompletionLogprobs:
        """`text_offset`: characters of completion text before the first of `entries` (streaming)."""
        out = CompletionLogprobs()
        for e in entries:
            text = self.token(e.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(e.logprob)
            out.top_logprobs.append({self.token(i): lp for i, lp in zip(e.top_ids, e.top_logprobs)})
            out.text_offset.append(text_offset)
            text_offset += len(text)
        return out
