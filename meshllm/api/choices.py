"""What one request's events add up to: per-choice text, finish reason and logprobs
(in the chat or the legacy-completions shape), and the usage of the whole request."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

from meshllm.api.harmony import HarmonyReader
from meshllm.api.tag_calls import TagCallReader
from meshllm.api.prompts import ChoiceRequest
from meshllm.api.think import ThinkReader
from meshllm.api.responses import ChatLogprobs, CompletionLogprobs, PromptTokensDetails, TokenLogprob, TopLogprob, Usage
from meshllm.api.tool_parser import CallDelta, ParsedCall, ToolCallParser
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
    """Everything a choice produced so far. Touched only on the event loop.

    With `tool_parser`, the text is read for tool calls: `text` then holds only the content,
    and `delta` is what the last event added (content, call deltas) for streaming."""

    request: ChoiceRequest
    tool_parser: ToolCallParser | TagCallReader | HarmonyReader | ThinkReader | None = None
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    delta: tuple[str, list[CallDelta]] = ("", [])
    reasoning_delta: str = ""  # what the last event added to a reasoning model's reasoning

    def add(self, event: GenerationEvent) -> MeshError | None:
        """Account for `event`; returns the error when the sequence failed."""
        if self.tool_parser is None:
            self.delta = (event.text, [])
        else:
            content, calls = self.tool_parser.feed(event.text, event.token_id)
            self.reasoning_delta = getattr(self.tool_parser, "reasoning_delta", "")  # reasoning readers
            if event.finish_reason is not None:
                content += self.tool_parser.finish(cut=event.finish_reason == "length")
            self.delta = (content, calls)
        self.text.append(self.delta[0])
        if event.token_id is not None:
            self.num_tokens += 1
        if event.logprobs is not None:
            self.logprobs.append(event.logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        error = failure_of(event)
        if error is not None:
            return error
        self.finish_reason = event.finish_reason or self.finish_reason
        if self.finish_reason == "stop" and self.tool_calls:
            self.finish_reason = "tool_calls"
        return None

    @property
    def tool_calls(self) -> list[ParsedCall]:
        return self.tool_parser.calls if self.tool_parser is not None else []

    @property
    def reasoning(self) -> str | None:
        """A reasoning model's reasoning (GPT-OSS's analysis channel, a <think> block), or None."""
        return "".join(getattr(self.tool_parser, "reasoning", ())) or None


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


class TextCursor:
    """Where one choice's text stands, for its logprob entries: whether any byte of text has come
    out yet (sentencepiece decoding drops the text's leading space) and how many characters."""

    def __init__(self, strips_leading_space: bool):
        self._strip = strips_leading_space
        self._started = False
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_chars = 0

    def adjusted(self, data: bytes) -> bytes:
        """The bytes a token of raw bytes `data` would add to the text here."""
        return data[1:] if self._strip and not self._started and data.startswith(b" ") else data

    def advance(self, data: bytes) -> bytes:
        """Account for a token of raw bytes `data`; returns the bytes it adds to the text."""
        data = self.adjusted(data)
        self._started = True  # the decoder strips at most the first token's space
        self.num_chars += len(self._utf8.decode(data))
        return data


def shown(data: bytes) -> str:
    """A token's bytes as text. Bytes that are only part of a UTF-8 character are escaped as OpenAI
    shows them: the byte 0xf0 becomes the four characters \\xf0."""
    return data.decode("utf-8", errors="backslashreplace")


class LogprobFormatter:
    """Token ids -> what OpenAI's logprob shapes carry. Each entry's `bytes` are the bytes its
    token adds to the text, so joining them gives the text's UTF-8 bytes exactly: raw token
    bytes (part of a character for some byte-level tokens), none for special tokens (the text
    skips them), and without the leading space a sentencepiece decode drops."""

    def __init__(self, tokenizer: Tokenizer):
        self._bytes = tokenizer.token_bytes
        self._strip = tokenizer.strips_leading_space
        self._special = frozenset(i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special)

    def cursor(self, continues_prompt: bool = False) -> TextCursor:
        """One per choice, fed every entry of that choice in order. `continues_prompt`: the choice's
        text goes on from the prompt's (legacy completions), so its first token keeps its space."""
        return TextCursor(self._strip and not continues_prompt)

    def _raw(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def _in_text(self, token_id: int, cursor: TextCursor, commit: bool) -> tuple[str, bytes]:
        """(token as shown, bytes it adds to the text) at the cursor; `commit` moves the cursor."""
        raw = self._raw(token_id)
        if token_id in self._special:
            return shown(raw), b""
        data = cursor.advance(raw) if commit else cursor.adjusted(raw)
        return shown(data), data

    def _alternatives(self, e: TokenLogprobs, cursor: TextCursor) -> list[tuple[str, bytes, float]]:
        # Shown as they would have added to the text at this point, like the chosen token.
        return [(*self._in_text(i, cursor, commit=False), lp) for i, lp in zip(e.top_ids, e.top_logprobs)]

    def chat(self, entries: list[TokenLogprobs], cursor: TextCursor) -> ChatLogprobs:
        content = []
        for e in entries:
            tops = [TopLogprob(token=t, logprob=lp, bytes=list(b)) for t, b, lp in self._alternatives(e, cursor)]
            token, data = self._in_text(e.token_id, cursor, commit=True)
            content.append(TokenLogprob(token=token, logprob=e.logprob, bytes=list(data), top_logprobs=tops))
        return ChatLogprobs(content=content)

    def completion(self, entries: list[TokenLogprobs], cursor: TextCursor) -> CompletionLogprobs:
        """`text_offset` of each token: characters of the choice's text before it."""
        out = CompletionLogprobs()
        for e in entries:
            out.text_offset.append(cursor.num_chars)
            out.top_logprobs.append({t: lp for t, _, lp in self._alternatives(e, cursor)})
            token, _ = self._in_text(e.token_id, cursor, commit=True)
            out.tokens.append(token)
            out.token_logprobs.append(e.logprob)
        return out
