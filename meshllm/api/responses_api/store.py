"""Responses kept for `previous_response_id` and GET /v1/responses/{id}: in this API server's
memory, the least recently used dropped first, within a count and a size.

Each response keeps only what it added to its conversation (its input's messages and its
output) and the id of the response it continued: a conversation is rebuilt by following those
links, so a long one costs its text once, not once per turn. Reading a conversation refreshes
every response in it, so a live one is not dropped from the middle.

Kept only where the response was made: another node's API server answers 404 for it, and a
restart forgets every one (clients then send the whole input, as with store false).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from meshllm.errors import BadRequest, NotFound

MAX_RESPONSES = 1024
MAX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict  # as it was answered
    parent_id: str | None  # the response it continued (its previous_response_id)
    messages: list[dict]  # chat messages it added: its input's, then its output (no instructions)
    input_items: list[dict]  # its input as items, with ids (GET .../input_items)
    num_bytes: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the event loop and worker threads both use it

    def put(self, response: dict, parent_id: str | None, messages: list[dict], input_items: list[dict] = ()) -> None:
        input_items = list(input_items)
        size = len(json.dumps(response)) + len(json.dumps(messages)) + len(json.dumps(input_items))
        if size > self.max_bytes:
            return  # larger than the whole store: kept nowhere, found nowhere (404 later)
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = StoredResponse(response, parent_id, messages, input_items, size)
            self._bytes += size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse:
        with self._lock:
            return self._use(response_id, response_id)

    def conversation(self, response_id: str) -> list[dict]:
        """The chat messages of the conversation up to and including `response_id`'s output."""
        chain = []
        with self._lock:
            entry = self._find(response_id, response_id)
            chain.append((response_id, entry))
            while entry.parent_id is not None and len(chain) <= len(self._entries):
                entry = self._find(entry.parent_id, response_id)
                chain.append((chain[-1][1].parent_id, entry))
            chain.reverse()
            for key, _ in chain:  # oldest first, so the response asked for ends the newest
                self._entries.move_to_end(key)
        return [m for _, entry in chain for m in entry.messages]

    def delete(self, response_id: str) -> None:
        with self._lock:
            self._use(response_id, response_id)  # 404 when absent
            self._drop(response_id)

    def __len__(self) -> int:
        return len(self._entries)

    def _use(self, response_id: str, asked: str) -> StoredResponse:
        entry = self._find(response_id, asked)
        self._entries.move_to_end(response_id)
        return entry

    def _find(self, response_id: str, asked: str) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            if response_id != asked:
                raise NotFound(f"response {asked!r} continues {response_id!r}, which is no longer stored here "
                               f"(deleted, or dropped as the store filled); send the whole conversation as input")
            raise NotFound(f"response {asked!r} is not stored here: it was made with store false, on another "
                           f"node's API server, before a restart, or was dropped as the store filled (it keeps "
                           f"the newest {self.max_responses}); send the whole conversation as input")
        return entry

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.num_bytes


def input_items_page(items: list[dict], limit: int, order: str, after: str | None, before: str | None) -> dict:
    """One page of a stored response's input items, as OpenAI lists them (newest first by default;
    `after` / `before`: item ids the page starts after / ends before, in that order)."""
    if not 1 <= limit <= 100 or order not in ("asc", "desc"):
        raise BadRequest(f"limit must be in [1, 100] and order asc or desc, got {limit} and {order!r}")
    ordered = items[::-1] if order == "desc" else list(items)
    ids = [item["id"] for item in ordered]
    for cursor in (after, before):
        if cursor is not None and cursor not in ids:
            raise BadRequest(f"item {cursor!r} is not among this response's input items")
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(ordered)
    page = ordered[start:end][:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end}
