"""GPT-OSS's replies (OpenAI's harmony format): read into reasoning, content and tool calls, and
the grammars that constrain them.

A reply is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>

The markers are special tokens (seen by id; decoding skips their text); the header's text says
the channel and, for a tool call, the recipient (`to=functions.NAME`, in the channel part or
after the role). Bodies go by channel: analysis is reasoning (`reasoning_content`), final and
commentary without a recipient are content, a body addressed to `functions.NAME` is that call's
arguments. A reply with no header at all (a model that ignores the format) is content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from meshllm.api.tool_parser import CallDelta, ParsedCall
from meshllm.engine.grammar import schema_text

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<|$)")
_CHANNEL = re.compile(r"^\s*(\w+)")


@dataclass(frozen=True, slots=True)
class HarmonyTokens:
    """The ids of the format's markers in the served vocabulary."""

    ids: dict[str, int]

    @classmethod
    def of(cls, added: dict[str, int]) -> "HarmonyTokens | None":
        """From the vocabulary's added tokens (text -> id); None unless it has every marker."""
        return cls({m: added[m] for m in MARKERS}) if all(m in added for m in MARKERS) else None

    def lark(self, marker: str) -> str:
        return f"<[{self.ids[marker]}]>"


class HarmonyReader:
    """One choice's reply, read as it streams; ToolCallParser's interface, plus `reasoning`.

    `calls_tools`: the request offers tools (else a message to functions.NAME is content, as
    other families' call text is without tools). `in_final`: the prompt ends inside a final
    message (continue_final_message), so the reply goes on with its content."""

    def __init__(self, tokens: HarmonyTokens, new_call_id, parallel: bool = True, calls_tools: bool = True,
                 in_final: bool = False):
        self._ids = {token_id: marker for marker, token_id in tokens.ids.items()}
        self._new_call_id = new_call_id
        self.parallel, self.calls_tools = parallel, calls_tools
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ParsedCall] = []
        self.reasoning_delta = ""  # what the last feed added to the reasoning
        self._header = ""  # text since the last message's start, until its <|message|>
        self._channel = ""  # the header's part after <|channel|>
        self._in_channel = False
        # where the body goes: "content", "reasoning", "call", "drop"; None in a header
        self._body: str | None = "content" if in_final else None
        self._call: ParsedCall | None = None
        self._formatted = in_final  # a marker of the format's own (not just an end) has come

    @property
    def text(self) -> str:
        return "".join(self.content)

    def feed(self, text: str, token_id: int | None = None) -> tuple[str, list[CallDelta]]:
        # A marker's event may carry text held back before it (a stop string's prefix, part of
        # a character): that text comes first.
        self.reasoning_delta = ""
        content, deltas = self._add_text(text)
        marker = self._ids.get(token_id) if token_id is not None else None
        if marker is not None:
            more, new = self._marker(marker)
            content, deltas = content + more, deltas + new
        return content, deltas

    def finish(self, cut: bool = False) -> str:
        """A reply without the format's markers (a model ignoring it) is content as written, cut
        or not; a header cut short is no content."""
        return self._unformatted()

    def _unformatted(self) -> str:
        if self._formatted or self._body is not None or not self._header:
            return ""
        text, self._header = self._header, ""
        self.content.append(text)
        return text

    def _add_text(self, text: str) -> tuple[str, list[CallDelta]]:
        if not text:
            return "", []
        if self._body is None:  # a header's text
            self._header += text
            if self._in_channel:
                self._channel += text
            return "", []
        return self._add_body(text)

    def _marker(self, marker: str) -> tuple[str, list[CallDelta]]:
        if marker in ("<|end|>", "<|return|>", "<|call|>"):  # the message ends
            content = self._unformatted()
            if self._call is not None:
                self._call.complete = True
            self._body, self._call, self._header, self._channel, self._in_channel = None, None, "", "", False
            return content, []
        self._formatted = True
        self._header += " "  # a marker ends the word before it (a recipient written up to <|channel|>)
        if marker == "<|channel|>":
            self._in_channel, self._channel = True, ""
        elif marker == "<|constrain|>":
            self._in_channel = False  # what follows (json) is the body's format, not the channel
        elif marker == "<|message|>":
            return "", self._open_body()
        else:  # <|start|>: a new message's header
            self._header, self._channel, self._in_channel, self._body = "", "", False, None
        return "", []

    def _open_body(self) -> list[CallDelta]:
        match = _RECIPIENT.search(self._header)
        recipient = match.group(1) if match else None
        channel_match = _CHANNEL.match(self._channel)
        channel = channel_match.group(1) if channel_match else ""
        self._in_channel = False
        if recipient is not None and recipient.startswith("functions.") and self.calls_tools:
            self._body = "call"
            name = recipient[len("functions."):]
            if not self.parallel and self.calls:
                self._call = ParsedCall("", name)  # one call allowed: later ones are read and dropped
                return []
            self._call = ParsedCall(self._new_call_id(), name)
            self.calls.append(self._call)
            return [CallDelta(len(self.calls) - 1, self._call.id, name)]
        if recipient is not None and not recipient.startswith("functions."):
            self._body = "drop"  # a built-in tool of OpenAI's (browser, python): not the client's
        elif channel == "analysis":
            self._body = "reasoning"
        else:  # final, commentary to the user (a preamble), a call when no tools are offered
            self._body = "content"
        return []

    def _add_body(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._body == "content":
            self.content.append(text)
            return text, []
        if self._body == "reasoning":
            self.reasoning.append(text)
            self.reasoning_delta += text
            return "", []
        if self._body == "call" and self._call is not None:
            self._call.arguments += text
            if self._call.id:
                return "", [CallDelta(self.calls.index(self._call), arguments=text)]
        return "", []


# --- grammars ---------------------------------------------------------------------------------
# The reply may reason first (GPT-OSS answers worse without), then must write what is asked: a
# final message holding the JSON, or a call whose arguments match its function's schema. A call
# ends the turn (<|call|>), so a turn holds one call; a parallel request makes them turn by turn.

def _reasoning(t: HarmonyTokens) -> str:
    return (f'analysis: {t.lark("<|channel|>")} "analysis" {t.lark("<|message|>")} REASONING '
            f'{t.lark("<|end|>")} {t.lark("<|start|>")} "assistant"\nREASONING: /(?s:.*)/\n')


def _final(t: HarmonyTokens, answer: dict | None) -> str:
    """The final message: a JSON document matching `answer`, or (None) any text."""
    opening = f'{t.lark("<|channel|>")} "final" {t.lark("<|message|>")}'
    if answer is not None:
        return f"final: {opening} %json {schema_text(answer)}\n"
    return f"final: {opening} ANSWER\nANSWER: /(?s:.*)/\n"


def answer_grammar(t: HarmonyTokens, schema: dict) -> str:
    return f"start: analysis? final\n{_final(t, schema)}{_reasoning(t)}"


def call_grammar(t: HarmonyTokens, tools: list[dict], answer: dict | None = None, free_text: bool = False) -> str:
    """One call to any of `tools` (arguments matching its schema), or, with `answer`, either that
    or a final message matching it; `free_text`: or a final message of any text."""
    rules = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        schema = fn.get("parameters") or {"type": "object"}
        rules.append(f'call{i}: {json.dumps(fn["name"])} " " {t.lark("<|constrain|>")} "json" '
                     f'{t.lark("<|message|>")} %json {schema_text(schema)}')
    calls = f'call: {t.lark("<|channel|>")} "commentary to=functions." ({" | ".join(f"call{i}" for i in range(len(tools)))})'
    final = _final(t, answer) if answer is not None or free_text else ""
    body = "call | final" if final else "call"
    return f"start: analysis? ({body})\n{calls}\n" + "\n".join(rules) + f"\n{final}{_reasoning(t)}"


def text_or_call_grammar(t: HarmonyTokens, tools: list[dict]) -> str:
    """A final answer in free text, or one call whose arguments match its schema (strict tools)."""
    return call_grammar(t, tools, free_text=True)
