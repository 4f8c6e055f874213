"""The sequences of one HTTP request, as the event loop sees them.

Bridges the leader's thread to asyncio: the leader calls `on_event` on its loop
thread, which only hands the event to the request's asyncio queue. `events()`
yields them until every choice has finished, and enforces the request's
deadline and notices a client that went away; in both cases it cancels the
sequences so every stage frees their KV.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from meshllm.api.prompts import ChoiceRequest
from meshllm.engine.grammar import GrammarCompiler
from meshllm.engine.kv_cache import SeqId
from meshllm.errors import BadRequest, MeshError, RequestTimeout
from meshllm.pipeline.events import GenerationEvent
from meshllm.pipeline.leader import Leader

# How often a request whose client may have left asks the server whether it has.
DISCONNECT_POLL_S = 0.25


class ClientDisconnected(Exception):
    """The HTTP client closed the connection; its sequences have been cancelled. Not a user error:
    nobody is left to answer."""


class Generation:
    """Create on the event loop; `submit` from a worker thread; `events` on the event loop."""

    def __init__(self, leader: Leader, choices: list[ChoiceRequest], timeout_s: float,
                 is_disconnected: Callable[[], Awaitable[bool]], grammars: GrammarCompiler | None = None):
        self.leader = leader
        self.grammars = grammars  # makes each constrained choice its own matcher
        self.choices = choices
        self.timeout_s = timeout_s
        self.is_disconnected = is_disconnected
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + timeout_s
        self._queue: asyncio.Queue[tuple[int, GenerationEvent]] = asyncio.Queue()
        self._seq_ids: dict[int, SeqId] = {}
        self._open: set[int] = {c.index for c in choices}

    def submit(self) -> None:
        """Queue every choice at the leader (blocks briefly). If one is refused (queue full,
        context overflow), the ones already queued are cancelled and the error propagates."""
        if len(self.choices) > self.leader.max_sequences:
            # Refused with a 400, not queue_full's 429: no retry can make room for it.
            raise BadRequest(f"this request asks for {len(self.choices)} sequences (n choices of each prompt); "
                             f"this server holds at most {self.leader.max_sequences} at once (--max-batch "
                             f"running plus --max-queue waiting). Ask for fewer.")
        try:
            for choice in self.choices:
                matcher = None if choice.grammar is None else self.grammars.matcher(choice.grammar)
                self._seq_ids[choice.index] = self.leader.submit(
                    choice.prompt_ids, choice.params, self._callback(choice.index), grammar=matcher,
                    speculative=choice.speculative, continues_prompt=choice.continues_prompt)
        except MeshError:
            self.cancel()
            raise

    def _callback(self, index: int) -> Callable[[GenerationEvent], None]:
        def on_event(event: GenerationEvent) -> None:  # leader loop thread: never block, never raise
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, event))
            except RuntimeError:
                pass  # the event loop has shut down: nobody is waiting for this request any more
        return on_event

    async def events(self) -> AsyncIterator[tuple[int, GenerationEvent]]:
        """(choice index, event) until every choice has finished (its last event carries
        finish_reason). Raises RequestTimeout past the deadline and ClientDisconnected when the
        client is gone, after cancelling what is still running."""
        next_poll = self._loop.time() + DISCONNECT_POLL_S
        while self._open:
            now = self._loop.time()
            if now >= self._deadline:
                self.cancel()
                raise RequestTimeout(f"the request ran past the server's --request-timeout of "
                                     f"{self.timeout_s:g} s and was cancelled; ask for fewer tokens or retry")
            if now >= next_poll:
                next_poll = now + DISCONNECT_POLL_S
                if await self.is_disconnected():
                    self.cancel()
                    raise ClientDisconnected()
            try:
                index, event = await asyncio.wait_for(self._queue.get(), min(self._deadline, next_poll) - now)
            except TimeoutError:
                continue
            if event.finish_reason is not None:
                self._open.discard(index)
            yield index, event

    def cancel(self) -> None:
        """Cancel every choice that has not finished (the leader then frees it on every stage)."""
        for index in self._open:
            seq_id = self._seq_ids.get(index)
            if seq_id is not None:
                self.leader.cancel(seq_id)
