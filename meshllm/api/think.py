"""Replies of models that think in a `<think>...</think>` block first (Qwen3, SmolLM3, QwQ, the
DeepSeek-R1 distills): the block's text is the reasoning (`reasoning_content`), the rest the
content, read for tool calls as any reply is.

The block counts only where a reply opens with it (after whitespace), or where the prompt
already opened it (DeepSeek-R1's templates end the prompt with `<think>\\n`): a tag later in a
reply is text the model wrote. Text that may be the start of a tag is held until the next text
decides, so the split is the same however the reply is chunked.
"""

from __future__ import annotations

import json
import re

from meshllm.api.tool_parser import CallDelta, ParsedCall, ToolCallParser

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside a reasoning block (the template opened it)."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def after_reasoning(lark: str, close: str, opening: str | None = None) -> str:
    """`lark` (a grammar whose first rule is `start`) past a reasoning block, as vLLM applies
    structured output only past the reasoning: a forced call or a JSON answer written inside the
    block would be read as reasoning and never reach the client, and a model that reasons first
    (Qwen3, GLM-4.5) would be made to skip it. The reasoning is free text up to the block's end,
    `close` (its lark: the `</think>` token where the vocabulary has one), then the newlines the
    templates write after it (one or two: unbounded whitespace let a weak model pad forever),
    then what `lark` constrains. `opening`: the prompt did not open the block (MiniMax-M2's and
    DeepSeek-R1's do), so the reply may open one with this (`<think>`'s lark), or not."""
    body = re.sub(r"^start:", "constrained:", lark, count=1, flags=re.MULTILINE)
    if close.startswith("<["):  # a token of its own: the reasoning ends where it comes
        rules = [f'REASONING: /(?s:.+)/ & ~(/(?s:.*)/ {json.dumps(CLOSE)} /(?s:.*)/)']
        block = f"REASONING? {close} SPACE?"
    else:  # a lazy lexeme up to the tag, which it consumes
        rules = [f"reasoning[suffix={close}]: /(?s:.*)/"]
        block = "reasoning SPACE?"
    # a reply may open its block after a newline (GLM-4.5's templates write "\n<think>")
    head = f"start: {block} constrained" if opening is None else f'start: ("\\n"? {opening} {block})? constrained'
    return "\n".join([head, *rules, "SPACE: /\\n{1,2}/", body])


class ThinkReader:
    """One choice's reply; ToolCallParser's interface (`inner` reads the content for tool calls,
    or None), plus `reasoning`."""

    def __init__(self, inner: ToolCallParser | None, in_reasoning: bool = False):
        self.inner = inner
        self.reasoning: list[str] = []
        self.reasoning_delta = ""
        self._own_content: list[str] = []  # the content, when no inner parser reads it
        self._state = "reasoning" if in_reasoning else "start"  # start -> reasoning -> content
        self._held = ""
        self._after_block = False  # the whitespace right after </think> is no content

    @property
    def calls(self) -> list[ParsedCall]:
        return self.inner.calls if self.inner is not None else []

    @property
    def content(self) -> list[str]:
        return self.inner.content if self.inner is not None else self._own_content

    @property
    def text(self) -> str:
        return "".join(self.content)

    def feed(self, text: str, token_id: int | None = None) -> tuple[str, list[CallDelta]]:
        self.reasoning_delta = ""
        self._held += text
        content, deltas = "", []
        while True:
            if self._state == "start":
                head = self._held.lstrip()
                if head.startswith(OPEN):
                    self._held, self._state = head[len(OPEN):], "reasoning"
                    continue
                if OPEN.startswith(head) and not (token_id is not None and not text):
                    break  # nothing yet, or part of the tag: wait for more
                # (a token with no text, a special one, shows the reply began otherwise)
                self._state = "content"
                continue
            if self._state == "reasoning":
                at = self._held.find(CLOSE)
                if at >= 0:
                    self._think(self._held[:at])
                    self._held, self._state, self._after_block = self._held[at + len(CLOSE):], "content", True
                    continue
                keep = next((n for n in range(min(len(CLOSE) - 1, len(self._held)), 0, -1)
                             if self._held.endswith(CLOSE[:n])), 0)
                self._think(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            # content
            if self._after_block:
                self._held = self._held.lstrip()
                if not self._held:
                    break
                self._after_block = False
            more, new = self._content(self._held, token_id)
            content, deltas, self._held = content + more, deltas + new, ""
            break
        return content, deltas

    def finish(self, cut: bool = False) -> str:
        held, self._held = self._held, ""
        content = ""
        if self._state == "reasoning":
            self._think(held)  # a reply cut inside its reasoning: all of it reasoning
        elif held.strip() or (held and not self._after_block):  # a partial tag that stayed text, or content
            content = self._content(held, None)[0]
        if self.inner is not None:
            content += self.inner.finish(cut)
        return content

    def _think(self, text: str) -> None:
        if text:
            self.reasoning.append(text)
            self.reasoning_delta += text

    def _content(self, text: str, token_id: int | None) -> tuple[str, list[CallDelta]]:
        if self.inner is not None:
            return self.inner.feed(text, token_id)
        if text:
            self._own_content.append(text)
        return text, []
