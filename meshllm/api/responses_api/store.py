"""Responses kept for `previous_response_id` and GET /v1/responses/{id}: in this API server's
memory, the newest first to stay, within a count and a size (a conversation's text is kept
whole with each of its responses, so the size bound is what holds memory down).

Kept only where the response was made: another node's API server answers 404 for it, and a
restart forgets every one (clients then send the whole input, as with store false).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from meshllm.errors import NotFound

MAX_RESPONSES = 1024
MAX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict  # as it was answered
    conversation: list[dict]  # chat messages up to and including its output, without instructions
    num_bytes: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the event loop and worker threads both use it

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return  # larger than the whole store: kept nowhere, found nowhere (404 later)
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = StoredResponse(response, conversation, size)
            self._bytes += size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                raise NotFound(f"response {response_id!r} is not stored here: it was made with store false, on "
                               f"another node's API server, before a restart, or was dropped as the store filled "
                               f"(it keeps the newest {self.max_responses}); send the whole conversation as input")
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)  # 404 when absent
        with self._lock:
            self._drop(response_id)

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.num_bytes
