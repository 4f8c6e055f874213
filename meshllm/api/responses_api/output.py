"""A response's output items, built as its choice's content and call deltas arrive, and the
Responses stream's events for each step (stream.py sends them; a whole reply keeps the items).

Content opens a message item (one output_text part), each call a function_call item, and a
reasoning model's reasoning (GPT-OSS's analysis channel) a reasoning item (one reasoning_text
part, streamed as response.reasoning_text.delta); an item is closed when the next one opens or
the reply ends. Content that is only whitespace is
held until something visible follows, so the spacing around a tool call never becomes a
message of its own (chat completions drop it the same way).

Logprobs belong to the text: a text delta carries the entries of the tokens that wrote it (the
newest entries whose bytes make up its bytes; the tool parser may hold text back a few tokens),
and the entries of tokens that went into a call's markup or arguments are dropped, so an
output_text's entries always join to its text.
"""

from __future__ import annotations

from meshllm.api.responses import new_id
from meshllm.api.tool_parser import CallDelta


class OutputItems:
    def __init__(self):
        self.items: list[dict] = []
        self._open: dict | None = None  # the item receiving deltas
        self._call_items: dict[int, dict] = {}  # by the parser's call index
        self._held = ""  # whitespace not yet known to belong to a message
        self._logprobs: list[dict] = []  # of tokens not yet sent with a text delta

    def feed(self, content: str, calls: list[CallDelta], logprobs: list[dict], reasoning: str = "") -> list[dict]:
        """The events `content`, `calls` and `reasoning` (what one token added) make; `logprobs`:
        that token's entries."""
        events: list[dict] = []
        if reasoning:
            events += self._reasoning(reasoning)
            logprobs = []  # the tokens of the reasoning wrote no message text
        self._logprobs += logprobs
        if content:
            text = self._held + content
            if text.strip() or (self._open is not None and self._open["type"] == "message"):
                self._held = ""
                events += self._text(text)
            else:
                self._held = text
        if calls:
            self._logprobs = []  # the call's tokens: none of them wrote message text
        for delta in calls:
            item = self._call_items.get(delta.index)
            if item is None:
                self._held = ""
                item = self._call_items[delta.index] = {"type": "function_call", "id": new_id("fc", "_"),
                                                        "call_id": delta.id, "name": delta.name, "arguments": "",
                                                        "status": "in_progress"}
                events += self._add(item)
            if delta.arguments:
                item["arguments"] += delta.arguments
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": self.items.index(item), "delta": delta.arguments})
        return events

    def finish(self, status: str, whole_calls: frozenset[str] = frozenset()) -> list[dict]:
        """Close the item still open as `status`: completed, or incomplete when the reply was cut short
        (a call among `whole_calls`, by call id, was not: its arguments are all there)."""
        if self._open is not None and self._open.get("call_id") in whole_calls:
            status = "completed"
        return self._close(status)

    def _text(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != "message":
            item = {"type": "message", "id": new_id("msg", "_"), "status": "in_progress", "role": "assistant",
                    "content": []}
            events += self._add(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0,
                           "part": {**part, "logprobs": []}})
        item = self._open
        part = item["content"][0]
        part["text"] += text
        logprobs, self._logprobs = _writers(self._logprobs, text.encode()), []
        part["logprobs"] += logprobs
        events.append({"type": "response.output_text.delta", "item_id": item["id"],
                       "output_index": len(self.items) - 1, "content_index": 0, "delta": text,
                       "logprobs": logprobs})
        return events

    def _reasoning(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != "reasoning":
            item = {"type": "reasoning", "id": new_id("rs", "_"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            events += self._add(item)
        self._open["content"][0]["text"] += text
        events.append({"type": "response.reasoning_text.delta", "item_id": self._open["id"],
                       "output_index": len(self.items) - 1, "content_index": 0, "delta": text})
        return events

    def _add(self, item: dict) -> list[dict]:
        events = self._close("completed")
        self.items.append(item)
        self._open = item
        return events + [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                          "item": _copy(item)}]

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += [e for e in self._logprobs if not e.get("bytes")]  # EOS and the like: no text
            self._logprobs = []
            events += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "text": part["text"], "logprobs": part["logprobs"]},
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": dict(part)}]
        elif item["type"] == "reasoning":
            events.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "text": item["content"][0]["text"]})
        else:
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": index, "item": _copy(item)})
        return events


def _writers(entries: list[dict], data: bytes) -> list[dict]:
    """The newest of `entries` whose bytes join to `data` (the tokens that wrote it; older ones wrote
    markup that was not text). All of them where no such run exists (a token whose text was split
    between markup and text)."""
    size = 0
    for i in range(len(entries) - 1, -1, -1):
        size += len(entries[i].get("bytes") or ())
        if size == len(data):
            return entries[i:]
        if size > len(data):
            break
    return entries


def _copy(item: dict) -> dict:
    """The item as it stands now (events carry snapshots; the item itself keeps growing)."""
    return {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)


def as_chat_message(items: list[dict]) -> dict | None:
    """The assistant message the items amount to, for the stored conversation (None: no output)."""
    text = "".join(p["text"] for item in items if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    reasoning = reasoning_text(items)
    if not text and not calls and not reasoning:
        return None
    message = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:  # back to the template with the conversation (GPT-OSS's reasoning before a call)
        message["reasoning_content"] = reasoning
    return message


def reasoning_text(items: list[dict]) -> str:
    """The text of reasoning items (their reasoning_text parts, else their summaries)."""
    out = []
    for item in items:
        if item.get("type") == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            out += [p.get("text", "") for p in parts if isinstance(p, dict)]
    return "".join(out)
